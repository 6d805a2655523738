# SPDX-License-Identifier: Apache-2.0
"""FlashInfer prefix pass + our masked tree tail, merged in the tail's epilogue.

The prefix is plain attention with no mask, which FlashInfer serves well
(MLA: ``BatchMLAPagedAttentionWrapper``, FA2 on sm_80/sm_120, FA3 on sm_90;
GQA/MHA: ``BatchPrefillWithPagedKVCacheWrapper``). Both return a base-2 LSE,
the base our combine kernel uses.

The wrapper's ``plan`` runs on the host over the prefix lengths, and the kernels
take each request's length from it, so the plan needs the exact lengths. A server
plans once per forward, outside any CUDA graph, where upstream's FlashInfer
backends plan (``init_forward_metadata``); a pass made for CUDA graphs
(:meth:`FlashInferPrefixPass.create`) keeps its index buffers at fixed addresses,
so a captured graph replays with each new plan. A call without a planned pass
plans one itself.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.layers.attention.tree_verify.configs import TreeVerifyConfig
from sglang.srt.layers.attention.tree_verify.prefix_split import merge_external_prefix
from sglang.srt.layers.attention.tree_verify.registry import MLA_DIMS, StrategyUnavailable

_WORKSPACE_BYTES = 128 * 1024 * 1024
#: FlashInfer's MLA kernels this module asks for: "auto" (FA3 on sm_90a, FA2
#: elsewhere) or "fa2", the kernel an sm_120 GPU runs.
MLA_BACKENDS = ("auto", "fa2")


def _flashinfer():
    try:
        import flashinfer
    except ImportError as e:
        raise StrategyUnavailable(f"flashinfer_split needs flashinfer: {e}") from e
    return flashinfer


def flashinfer_reason() -> Optional[str]:
    """Why FlashInfer cannot be loaded here (None: it can)."""
    try:
        _flashinfer()
    except StrategyUnavailable as e:
        return str(e)
    return None


@functools.lru_cache(maxsize=8)
def _workspace(device: str) -> torch.Tensor:
    return torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)


@dataclass(frozen=True)
class PrefixPassShape:
    """What a plan depends on besides the prefix lengths."""

    num_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    width: int  # tree nodes per request
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    sm_scale: float

    @property
    def mla(self) -> bool:
        return (self.head_dim_qk, self.head_dim_v, self.num_kv_heads) == MLA_DIMS

    def check(self) -> None:
        if not self.mla and self.head_dim_qk != self.head_dim_v:
            raise StrategyUnavailable(
                f"flashinfer_split supports absorbed MLA (576/512, 1 KV head) and "
                f"Dqk == Dv; got Dqk={self.head_dim_qk}, Dv={self.head_dim_v}, "
                f"Hkv={self.num_kv_heads}"
            )
        if self.kv_dtype != self.q_dtype:
            raise StrategyUnavailable(
                f"flashinfer_split needs the KV cache in q's dtype {self.q_dtype}, "
                f"got {self.kv_dtype} (fp8 KV: use the fused strategy)"
            )


class FlashInferPrefixPass:
    """FlashInfer attention of every tree query over its prefix only.

    Planning (host work over the prefix lengths) is separate from :meth:`run`,
    which launches device work only, so a planned pass can run inside a CUDA
    graph. ``FlashInferPrefixPass(q, k_buffer, v_buffer, indptr, indices, n,
    sm_scale)`` plans at once for those inputs."""

    def __init__(
        self, q, k_buffer, v_buffer, indptr, indices, n, sm_scale, *,
        backend: str = "auto", prefix_lens: Optional[torch.Tensor] = None,
    ):  # fmt: skip
        shape = PrefixPassShape(
            num_heads=q.shape[1], num_kv_heads=k_buffer.shape[1],
            head_dim_qk=q.shape[2], head_dim_v=v_buffer.shape[2], width=n,
            q_dtype=q.dtype, kv_dtype=k_buffer.dtype, sm_scale=float(sm_scale),
        )  # fmt: skip
        self._setup(shape, indptr.numel() - 1, q.device, backend, graph_buffers=None)
        self.plan(indptr, indices, prefix_lens)

    @classmethod
    def create(
        cls, shape: PrefixPassShape, bs: int, device, backend: str = "auto",
        graph_prefix_indices: Optional[torch.Tensor] = None,
    ) -> "FlashInferPrefixPass":  # fmt: skip
        """A pass for batches of ``bs`` requests, to :meth:`plan` before each run.
        With ``graph_prefix_indices`` (the caller's persistent prefix-slot buffer)
        it is made for CUDA graphs: its index buffers keep their addresses and
        each plan before a replay only refreshes them."""
        self = cls.__new__(cls)
        buffers = None
        if graph_prefix_indices is not None:
            buffers = dict(
                qo_indptr=torch.zeros(bs + 1, dtype=torch.int32, device=device),
                kv_indptr=torch.zeros(bs + 1, dtype=torch.int32, device=device),
                kv_indices=graph_prefix_indices,
                kv_len=torch.zeros(bs, dtype=torch.int32, device=device),
            )
        self._setup(shape, bs, device, backend, graph_buffers=buffers)
        return self

    def _setup(self, shape: PrefixPassShape, bs: int, device, backend: str, graph_buffers):
        if backend not in MLA_BACKENDS:
            raise ValueError(f"FlashInfer backend {backend!r}: choose from {MLA_BACKENDS}")
        shape.check()
        fi = _flashinfer()
        self.shape, self.bs, self.device = shape, bs, torch.device(device)
        self.graph_buffers = graph_buffers
        self.planned = False
        self._host = None  # pinned host arrays of a plan from host lengths
        ws = _workspace(str(self.device))
        graph = graph_buffers is not None
        if shape.mla:
            kw = {}
            if graph:
                kw = dict(
                    use_cuda_graph=True, qo_indptr=graph_buffers["qo_indptr"],
                    kv_indptr=graph_buffers["kv_indptr"], kv_indices=graph_buffers["kv_indices"],
                    kv_len_arr=graph_buffers["kv_len"],
                )  # fmt: skip
            self.wrapper = fi.mla.BatchMLAPagedAttentionWrapper(ws, backend=backend, **kw)
        else:
            kw = {}
            if graph:
                graph_buffers["last_page"] = torch.ones(bs, dtype=torch.int32, device=self.device)
                kw = dict(
                    use_cuda_graph=True, qo_indptr_buf=graph_buffers["qo_indptr"],
                    paged_kv_indptr_buf=graph_buffers["kv_indptr"],
                    paged_kv_indices_buf=graph_buffers["kv_indices"],
                    paged_kv_last_page_len_buf=graph_buffers["last_page"],
                )  # fmt: skip
            self.wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", **kw)

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        prefix_lens: Optional[torch.Tensor] = None,
    ) -> None:
        """Plan for this batch: ``indptr``/``indices`` the prefix CSR (int32, on the
        device). Without ``prefix_lens`` FlashInfer's planner copies the lengths to
        the host (a sync); ``prefix_lens``, the exact lengths already on the host
        (``[bs]``), spares it. A pass made for graphs reads the slots from its own
        buffer, which must hold them."""
        bs, n, s = self.bs, self.shape.width, self.shape
        if indptr.numel() - 1 != bs:
            raise ValueError(f"this pass is for batch size {bs}, got {indptr.numel() - 1} requests")
        if prefix_lens is not None:
            qo_indptr, kv_indptr, lens = self._host_arrays(prefix_lens)
        else:
            lens = (indptr[1:] - indptr[:-1]).to(torch.int32)
            kv_indptr = indptr
            qo_indptr = torch.arange(0, (bs + 1) * n, n, dtype=torch.int32, device=indptr.device)
        # A graph pass already reads the slots from its buffer: hand none to copy.
        slots = indices[:0] if self.graph_buffers is not None else indices
        if s.mla:
            self.wrapper.plan(
                qo_indptr, kv_indptr, slots, lens, s.num_heads, MLA_DIMS[1],
                MLA_DIMS[0] - MLA_DIMS[1], 1, False, s.sm_scale, s.q_dtype, s.kv_dtype,
            )  # fmt: skip
        else:
            last_page = (
                self._host["last_page"] if prefix_lens is not None
                else torch.ones(bs, dtype=torch.int32, device=kv_indptr.device)
            )  # fmt: skip
            self.wrapper.plan(
                qo_indptr, kv_indptr, slots, last_page, s.num_heads, s.num_kv_heads,
                s.head_dim_qk, 1, causal=False, sm_scale=s.sm_scale, q_data_type=s.q_dtype,
                kv_data_type=s.kv_dtype,
            )  # fmt: skip
        self.planned = True

    def _host_arrays(self, prefix_lens: torch.Tensor):
        """``(qo_indptr, kv_indptr, lens)`` on the host from the exact lengths, in
        pinned memory that this pass keeps, so FlashInfer's copies of them to the
        device do not wait for the stream. A plan rewrites them only once the
        previous forward's copies ran: the caller has waited for that forward."""
        bs, n = self.bs, self.shape.width
        if self._host is None:
            pin = torch.cuda.is_available() and self.device.type == "cuda"
            host = lambda size: torch.zeros(size, dtype=torch.int32, pin_memory=pin)  # noqa: E731
            self._host = dict(qo_indptr=host(bs + 1), kv_indptr=host(bs + 1), lens=host(bs),
                              last_page=host(bs))  # fmt: skip
            torch.arange(0, (bs + 1) * n, n, dtype=torch.int32, out=self._host["qo_indptr"])
            self._host["last_page"].fill_(1)
        lens, kv_indptr = self._host["lens"], self._host["kv_indptr"]
        lens.copy_(prefix_lens[:bs])
        torch.cumsum(lens, 0, out=kv_indptr[1:])
        return self._host["qo_indptr"], kv_indptr, lens

    def run(self, q, k_buffer, v_buffer):
        """``(o [bs, N, H, Dv], lse [bs, N, H])``, the LSE base 2."""
        if not self.planned:
            raise RuntimeError("FlashInferPrefixPass.run before plan")
        if self.shape.mla:
            o, lse = self.wrapper.run(
                q[..., :512], q[..., 512:], k_buffer[:, :, :512], k_buffer[:, :, 512:],
                return_lse=True,
            )  # fmt: skip
        else:
            o, lse = self.wrapper.run(
                q, (k_buffer.unsqueeze(1), v_buffer.unsqueeze(1)), return_lse=True
            )
        h = q.shape[1]
        return o.view(self.bs, self.shape.width, h, -1), lse.float().view(self.bs, self.shape.width, h)


def tree_verify_flashinfer_split(
    q, k_buffer, v_buffer, prefix_kv_indptr, prefix_kv_indices, tree_kv_indices,
    tree_mask, sm_scale, out, logit_cap, config: TreeVerifyConfig,
    prefix_pass: FlashInferPrefixPass | None = None,
):  # fmt: skip
    """Without ``prefix_pass`` the call plans one (a host sync)."""
    if logit_cap > 0:
        raise StrategyUnavailable("flashinfer_split does not apply a logit cap")
    n = tree_kv_indices.shape[1]
    if prefix_pass is None:
        prefix_pass = FlashInferPrefixPass(
            q, k_buffer, v_buffer, prefix_kv_indptr, prefix_kv_indices, n, sm_scale
        )
    o_pre, lse_pre = prefix_pass.run(q, k_buffer, v_buffer)
    return merge_external_prefix(
        q, k_buffer, v_buffer, prefix_kv_indptr, prefix_kv_indices, tree_kv_indices,
        tree_mask, sm_scale, config, o_pre, lse_pre, out,
    )  # fmt: skip
