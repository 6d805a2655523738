"""FlashInfer prefix pass + our masked tree tail, merged in the tail's epilogue.

The prefix is plain attention with no mask, which FlashInfer serves well
(MLA: ``BatchMLAPagedAttentionWrapper``, FA2 on sm_80/sm_120, FA3 on sm_90;
GQA/MHA: ``BatchPrefillWithPagedKVCacheWrapper``). Both return a base-2 LSE,
the base our combine kernel uses. The wrapper's ``plan`` reads prefix lengths
on the host, so this strategy syncs once per call unless the caller plans a
``FlashInferPrefixPass`` ahead, outside any CUDA graph, the way upstream's
FlashInfer backends plan before the forward.
"""

from __future__ import annotations

import functools

import torch

from sglang.srt.layers.attention.tree_verify.configs import TreeVerifyConfig
from sglang.srt.layers.attention.tree_verify.prefix_split import merge_external_prefix
from sglang.srt.layers.attention.tree_verify.upstream_extend import (
    StrategyUnavailable,
)

_WORKSPACE_BYTES = 128 * 1024 * 1024


def _flashinfer():
    try:
        import flashinfer
    except ImportError as e:
        raise StrategyUnavailable(f"flashinfer_split needs flashinfer: {e}") from e
    return flashinfer


@functools.lru_cache(maxsize=8)
def _workspace(device: str) -> torch.Tensor:
    return torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)


class FlashInferPrefixPass:
    """FlashInfer attention of every tree query over its prefix only.

    Construction plans the wrapper (host work: it reads the prefix lengths), the
    way upstream's FlashInfer backends plan in ``init_forward_metadata``; ``run``
    launches only device work, so it can be captured in a CUDA graph and replayed
    while the planned layout holds."""

    def __init__(self, q, k_buffer, v_buffer, indptr, indices, n, sm_scale):
        fi = _flashinfer()
        bs = indptr.numel() - 1
        h, dqk = q.shape[1], q.shape[2]
        hkv, dv = k_buffer.shape[1], v_buffer.shape[2]
        ws = _workspace(str(q.device))
        qo_indptr = torch.arange(0, (bs + 1) * n, n, dtype=torch.int32, device=q.device)
        self.mla = (dqk, dv, hkv) == (576, 512, 1)
        if self.mla:
            self.wrapper = fi.mla.BatchMLAPagedAttentionWrapper(ws)
            kv_len = (indptr[1:] - indptr[:-1]).to(torch.int32)
            self.wrapper.plan(
                qo_indptr, indptr, indices, kv_len, h, 512, 64, 1, False, sm_scale,
                q.dtype, k_buffer.dtype,
            )  # fmt: skip
        elif dqk == dv:
            self.wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            last_page = torch.ones(bs, dtype=torch.int32, device=q.device)
            self.wrapper.plan(
                qo_indptr, indptr, indices, last_page, h, hkv, dqk, 1,
                causal=False, sm_scale=sm_scale, q_data_type=q.dtype,
                kv_data_type=k_buffer.dtype,
            )  # fmt: skip
        else:
            raise StrategyUnavailable(
                f"flashinfer_split supports absorbed MLA (576/512, 1 KV head) and "
                f"Dqk == Dv; got Dqk={dqk}, Dv={dv}, Hkv={hkv}"
            )
        self.bs, self.n = bs, n

    def run(self, q, k_buffer, v_buffer):
        """``(o [bs, N, H, Dv], lse [bs, N, H])``, the LSE base 2."""
        if self.mla:
            o, lse = self.wrapper.run(
                q[..., :512], q[..., 512:], k_buffer[:, :, :512], k_buffer[:, :, 512:],
                return_lse=True,
            )  # fmt: skip
        else:
            o, lse = self.wrapper.run(
                q, (k_buffer.unsqueeze(1), v_buffer.unsqueeze(1)), return_lse=True
            )
        h = q.shape[1]
        return o.view(self.bs, self.n, h, -1), lse.float().view(self.bs, self.n, h)


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
