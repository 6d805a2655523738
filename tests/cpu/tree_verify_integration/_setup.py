# SPDX-License-Identifier: Apache-2.0
"""Realistic TARGET_VERIFY inputs on CPU tensors for the patched backends.

The backends are the real (patched) classes, built with ``object.__new__``
and the attributes their TARGET_VERIFY paths read, because their ``__init__``
needs a GPU model runner. The KV pool is a minimal stand-in with the pool
interface those paths call; everything under test (the backends' patched
methods, the hook, the dispatcher, upstream's index/mask construction) is real.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from sglang.srt.layers.attention.tree_verify import tree_mask_from_parents
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.ddtree.info import DDTreeVerifyInput, dense_verify_mask
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

MAX_CTX = 64
MAX_REQS = 10
POOL = 512


class Pool:
    """KV pool stand-in: MHA keeps K and V, absorbed MLA keeps one 576-wide
    buffer whose first 512 columns are V (as MLATokenToKVPool)."""

    def __init__(self, hkv, dqk, dv, dtype, mla, size=POOL, device="cpu"):
        self.mla = mla
        gen = torch.Generator().manual_seed(size * 7 + dqk)
        self.k = torch.randn(size, hkv, dqk, generator=gen).to(device, dtype)
        self.v = None if mla else torch.randn(size, hkv, dv, generator=gen).to(device, dtype)
        self.dv = dv

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.k[..., : self.dv] if self.mla else self.v

    def get_kv_buffer(self, layer_id):
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer, loc, k, v, *args, **kwargs):
        loc = getattr(loc, "loc", loc)
        self.k[loc.long()] = k.view(-1, *self.k.shape[1:]).to(self.k.dtype)
        if not self.mla:
            self.v[loc.long()] = v.view(-1, *self.v.shape[1:]).to(self.v.dtype)

    def set_mla_kv_buffer(self, layer, loc, k_nope, k_rope):
        k = torch.cat([k_nope, k_rope], dim=-1)
        self.k[loc.long()] = k.view(-1, *self.k.shape[1:]).to(self.k.dtype)


def model_runner(
    algorithm: str, dtype=torch.float16, is_draft=False, max_ctx=MAX_CTX, device="cpu", attention=None
):
    """The fields of upstream's ModelRunner the hooks read. ``attention``: the
    target's (kind, H, Hkv, Dqk, Dv) for the model config, which lets the
    verify policy plan ahead; without it the config names no heads (the policy
    then decides per layer, as for a model whose config it cannot read)."""
    config = SimpleNamespace(context_len=max_ctx)
    mla = False
    if attention is not None:
        kind, h, hkv, dqk, dv = attention
        mla = kind == "mla"
        config = SimpleNamespace(
            context_len=max_ctx, num_attention_heads=h, head_dim=dqk, v_head_dim=dv,
            kv_lora_rank=dv if mla else None, qk_rope_head_dim=dqk - dv if mla else None,
            scaling=1.0 / math.sqrt(dqk), get_num_kv_heads=lambda tp: hkv,
        )  # fmt: skip
    return SimpleNamespace(
        spec_algorithm=SpeculativeAlgorithm.from_string(algorithm),
        is_draft_worker=is_draft,
        req_to_token_pool=SimpleNamespace(req_to_token=None),
        model_config=config,
        server_args=SimpleNamespace(speculative_num_draft_tokens=None),
        device=device,
        dtype=dtype,
        kv_cache_dtype=dtype,
        use_mla_backend=mla,
    )


class Verify:
    """One TARGET_VERIFY step: bs requests with ragged committed prefixes
    (``prefix_lens``) and N draft tokens each, laid out in a req_to_token
    table as the scheduler does (prefix then the tree window)."""

    def __init__(
        self, prefix_lens, n, algorithm, gen, dense_mask=False,
        max_ctx=MAX_CTX, pool_size=POOL, device="cpu",
    ):  # fmt: skip
        self.max_ctx = max_ctx
        self.device = device
        self.bs = len(prefix_lens)
        self.n = n
        self.algorithm = algorithm
        self.prefix = torch.tensor(prefix_lens, dtype=torch.int64)
        slots = torch.randperm(pool_size - 1, generator=gen)[: int(self.prefix.sum()) + self.bs * n] + 1
        self.req_to_token = torch.zeros(MAX_REQS, max_ctx + n, dtype=torch.int32)
        self.req_pool_indices = torch.arange(2, self.bs + 2, dtype=torch.int64).flip(0)
        out, at = [], 0
        for b, p in enumerate(prefix_lens):
            row = slots[at : at + p + n].to(torch.int32)
            at += p + n
            self.req_to_token[self.req_pool_indices[b], : p + n] = row
            out.append(row[p:])
        self.out_cache_loc = torch.cat(out).long()
        if algorithm == "DDTREE":
            parents = torch.full((self.bs, n), -1, dtype=torch.int64)
            for i in range(1, n):
                parents[:, i] = torch.randint(0, i, (self.bs,), generator=gen)
            self.tree_mask = tree_mask_from_parents(parents)
            custom = None
            if dense_mask:
                numel = n * int(self.prefix.sum() + self.bs * n)
                custom = dense_verify_mask(self.tree_mask, self.prefix, numel)
            if dense_mask:
                custom = custom.to(device)
            self.tree_mask = self.tree_mask.to(device)
            self.spec_info = DDTreeVerifyInput(
                draft_token=torch.zeros(self.bs * n, dtype=torch.int64),
                positions=torch.zeros(self.bs * n, dtype=torch.int64),
                draft_token_num=n,
                custom_mask=custom,
                capture_hidden_mode=CaptureHiddenMode.FULL,
                tree_mask_bits=self.tree_mask,
            )
        else:
            self.tree_mask = None
            self.spec_info = DFlashVerifyInput(
                draft_token=torch.zeros(self.bs * n, dtype=torch.int64),
                positions=torch.zeros(self.bs * n, dtype=torch.int64),
                draft_token_num=n,
                custom_mask=None,
                capture_hidden_mode=CaptureHiddenMode.FULL,
            )
        if device != "cpu":
            self.to_device()

    def to_device(self):
        d = self.device
        self.prefix = self.prefix.to(d)
        self.req_to_token = self.req_to_token.to(d)
        self.req_pool_indices = self.req_pool_indices.to(d)
        self.out_cache_loc = self.out_cache_loc.to(d)
        self.spec_info.draft_token = self.spec_info.draft_token.to(d)
        self.spec_info.positions = self.spec_info.positions.to(d)
        return self

    def forward_batch(self, **overrides):
        fb = SimpleNamespace(
            batch_size=self.bs,
            forward_mode=ForwardMode.TARGET_VERIFY,
            req_pool_indices=self.req_pool_indices,
            seq_lens=self.prefix.clone(),
            seq_lens_sum=int(self.prefix.sum()),  # host mirror
            seq_lens_cpu=self.prefix.clone(),
            out_cache_loc=self.out_cache_loc,
            spec_info=self.spec_info,
            encoder_lens=None,
            attn_attend_prefix_cache=None,
            attn_dcp_metadata=None,
            positions=None,
        )
        for k, v in overrides.items():
            setattr(fb, k, v)
        return fb

    def visible(self, b):
        """Dense ``[N, P + N]`` visibility of request b (the definition)."""
        p = int(self.prefix[b])
        vis = torch.ones(self.n, p + self.n, dtype=torch.bool, device=self.device)
        if self.tree_mask is None:
            vis[:, p:] = torch.ones(self.n, self.n, dtype=torch.bool, device=self.device).tril()
        else:
            words = self.tree_mask[b].long()
            j = torch.arange(self.n, device=self.device)
            vis[:, p:] = ((words[:, j // 32] >> (j % 32)) & 1).bool()
        return vis


def dense_reference(verify: Verify, q, pool: Pool, scaling, logit_cap=0.0):
    """fp32 attention of every verify token over its request's prefix and
    tree, with the dense mask (what upstream's masked extend path computes)."""
    h = q.shape[1]
    k_buf, v_buf = pool.get_key_buffer(0), pool.get_value_buffer(0)
    group = h // k_buf.shape[1]
    outs = []
    for b in range(verify.bs):
        p = int(verify.prefix[b])
        slots = verify.req_to_token[verify.req_pool_indices[b], : p + verify.n].long()
        k = k_buf[slots].float().repeat_interleave(group, 1)
        v = v_buf[slots].float().repeat_interleave(group, 1)
        qb = q[b * verify.n : (b + 1) * verify.n].float()
        s = torch.einsum("nhd,thd->hnt", qb, k) * scaling
        if logit_cap > 0:
            s = logit_cap * torch.tanh(s / logit_cap)
        s = s.masked_fill(~verify.visible(b), -math.inf)
        outs.append(torch.einsum("hnt,thd->nhd", torch.softmax(s, -1), v))
    return torch.cat(outs)


def layer_for(kind, h, hkv, dqk, dv, logit_cap=0.0):
    if kind == "mla":
        return RadixAttention(h, dqk, 1.0 / math.sqrt(dqk), 1, 0, logit_cap=logit_cap, v_head_dim=dv)
    return RadixAttention(h, dqk, 1.0 / math.sqrt(dqk), hkv, 0, logit_cap=logit_cap, v_head_dim=dv)


def triton_backend(runner, pool, verify: Verify, mla: bool):
    """A real (patched) TritonAttnBackend with the attributes its
    TARGET_VERIFY paths read, and the hook its patched __init__ installs."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from sglang.srt.layers.attention.tree_verify.backends import triton_hook
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    max_bs = 8
    dev = verify.device
    return hooked_backend(
        TritonAttnBackend, triton_hook, runner, verify,
        device=dev,
        req_to_token=verify.req_to_token,
        token_to_kv_pool=pool,
        num_draft_tokens=verify.n,
        kv_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
        qo_indptr=torch.zeros(max_bs + 1, dtype=torch.int64, device=dev),
        mask_indptr=torch.zeros(max_bs + 1, dtype=torch.int64, device=dev),
        sliding_window_size=None,
        window_kv_indptr=None,
        use_sliding_window_kv_pool=False,
        _translate_kv_loc=None,
        max_context_len=verify.max_ctx,
        dcp_size=1,
        enable_deterministic=False,
        page_size=1,
        skip_prefill=False,
        use_verify_splitkv=False,
        allow_bidirectional_attention_in_extend=False,
        use_mla=mla,
        extend_attention_fwd=extend_attention_fwd,
        _verify_mask=None,
    )  # fmt: skip


def flashinfer_backend(runner, pool, verify, **attrs):
    """The real (patched) FlashInferAttnBackend (MHA/GQA) with the attributes its
    TARGET_VERIFY path reads, and the hook its patched __init__ installs."""
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
    from sglang.srt.layers.attention.tree_verify.backends import flashinfer_hook

    state = dict(
        token_to_kv_pool=pool, page_size=1, skip_prefill=False, num_wrappers=1,
        dispatch_reason=None, use_sliding_window_kv_pool=False,
        prefill_uses_dequant_workspace=False, enable_deterministic=False,
        kv_cache_quant_method=SimpleNamespace(needs_global_scale=lambda: False),
        forward_metadata=SimpleNamespace(prefill_wrappers=[None], use_ragged=False, swa_out_cache_loc=None),
        prefill_wrappers_verify=[None],
    )  # fmt: skip
    return hooked_backend(FlashInferAttnBackend, flashinfer_hook, runner, verify, **{**state, **attrs})


def flashinfer_mla_backend(runner, pool, verify):
    """The real (patched) FlashInferMLAAttnBackend, as ``flashinfer_backend``."""
    from sglang.srt.layers.attention.flashinfer_mla_backend import FlashInferMLAAttnBackend
    from sglang.srt.layers.attention.tree_verify.backends import flashinfer_mla_hook

    return hooked_backend(
        FlashInferMLAAttnBackend, flashinfer_mla_hook, runner, verify,
        token_to_kv_pool=pool, page_size=1, skip_prefill=False, enable_chunk_kv=False,
        forward_metadata=SimpleNamespace(prefill_wrapper=None, use_ragged=False),
    )  # fmt: skip


def hooked_backend(cls, make_hook, runner, verify: Verify, **state):
    """``cls`` without its __init__ (no GPU, no FlashInfer workspace): ``state``
    as its attributes, then the hook its patched __init__ installs."""
    runner.req_to_token_pool.req_to_token = verify.req_to_token
    runner.server_args.speculative_num_draft_tokens = verify.n
    be = object.__new__(cls)
    be.__dict__.update(state)
    be.tree_verify = make_hook(be, runner)
    be.consumes_tree_mask_bits = be.tree_verify.consumes_tree_mask_bits
    return be


def mla_forward_extend(be, q, k, layer, fb, h, dv, split_rope):
    """An absorbed-MLA forward_extend, with q/k whole or as latent + rope parts
    (how DeepSeek's attention calls a FlashInfer MLA backend)."""
    if not split_rope:
        return be.forward_extend(q, k, k[..., :dv], layer, fb)
    qv = q.view(q.shape[0], h, -1)
    return be.forward_extend(
        qv[..., :dv].contiguous(), k[..., :dv].contiguous(), k[..., :dv], layer, fb,
        q_rope=qv[..., dv:].contiguous(), k_rope=k[..., dv:].contiguous(),
    )  # fmt: skip


def qkv(verify: Verify, h, hkv, dqk, dv, dtype, mla, gen):
    t = verify.bs * verify.n
    d = verify.device
    q = torch.randn(t, h * dqk, generator=gen).to(d, dtype)
    k = torch.randn(t, 1 if mla else hkv, dqk, generator=gen).to(d, dtype)
    v = k[..., :dv].clone() if mla else torch.randn(t, hkv, dv, generator=gen).to(d, dtype)
    return q, k, v
