# SPDX-License-Identifier: Apache-2.0
"""A TARGET_VERIFY step on upstream's real hybrid SWA KV pool, for the patched Triton
backend (CPU tests here; GPU tests in tests/gpu/swa at real shapes).

The pool is ``SWAKVPool`` with its ``SWATokenToKVPoolAllocator``: the sliding layer's
KV lives in the SWA pool under translated slot ids, the full layer's in the full
pool, and the tokens that fell out of the window are evicted from the SWA pool as
upstream's scheduler evicts them (their slots map to SWA slot 0, which holds a
poison value, so reading one shows). :func:`reference` places a tree node at
``prefix_len + depth`` and applies the window and the sinks in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sglang.srt.layers.radix_attention import RadixAttention
from tests.cpu.tree_verify_integration._setup import MAX_CTX, POOL, Verify, hooked_backend, model_runner

SWA_LAYER, FULL_LAYER = 0, 1
POISON_K, POISON_V = 6.0, 300.0


@dataclass(frozen=True)
class Shape:
    h: int = 4  # query heads
    hkv: int = 2  # KV heads
    d: int = 64  # head dim
    window: int = 5  # layer.sliding_window_size (a config.sliding_window of 6)
    full_slots: int = 512
    swa_slots: int = 192
    max_ctx: int = MAX_CTX


class SWAVerify:
    """One TARGET_VERIFY step on a hybrid SWA pool: the requests' slots come from
    upstream's SWA allocator (its SWA free list shuffled, so SWA ids differ from
    full ids), the committed prefix's KV of both layers is written where upstream
    writes it, and the SWA slots of tokens older than the window are freed as
    ``free_swa_out_of_window_slots`` frees them."""

    def __init__(self, prefix_lens, n, algorithm, gen, shape=Shape(), evict=True, device="cpu",
                 dtype=torch.float16):  # fmt: skip
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        self.shape, self.device, self.dtype = shape, device, dtype
        self.window = shape.window
        self.pool = SWAKVPool(
            size=shape.full_slots, size_swa=shape.swa_slots, page_size=1, dtype=dtype, head_num=shape.hkv,
            head_dim=shape.d, swa_attention_layer_ids=[SWA_LAYER], full_attention_layer_ids=[FULL_LAYER],
            device=device, token_to_kv_pool_class=MHATokenToKVPool, enable_memory_saver=False,
        )  # fmt: skip
        self.alloc = SWATokenToKVPoolAllocator(
            shape.full_slots, shape.swa_slots, page_size=1, dtype=dtype, device=device,
            kvcache=self.pool, need_sort=False,
        )  # fmt: skip
        swa = self.alloc.swa_attn_allocator
        order = torch.randperm(swa.free_pages.numel(), generator=gen).to(device)
        swa.free_pages = swa.free_pages[order]
        for layer in (SWA_LAYER, FULL_LAYER):
            for buf in (self.pool.get_key_buffer(layer), self.pool.get_value_buffer(layer)):
                buf.copy_(torch.randn(buf.shape, generator=gen).to(device, buf.dtype))
        swa_k, swa_v = self.pool.get_key_buffer(SWA_LAYER), self.pool.get_value_buffer(SWA_LAYER)
        swa_k[0], swa_v[0] = POISON_K, POISON_V  # where every evicted token's id now points
        self.evict = evict
        self._slots = []
        self.step(prefix_lens, n, algorithm, gen)

    def step(self, prefix_lens, n, algorithm, gen):
        """A verify step on these pools; the previous step's requests are freed first."""
        for slots in self._slots:
            self.alloc.free(slots)
        shape, device, dtype = self.shape, self.device, self.dtype
        room = max(POOL, sum(prefix_lens) + len(prefix_lens) * n + 1)  # Verify's own slots, replaced below
        self.verify = v = Verify(prefix_lens, n, algorithm, gen, max_ctx=shape.max_ctx, pool_size=room)
        self.prefix_kv = []  # per request: {layer: (K, V)} of its committed tokens, [P, Hkv, D]
        self._slots, out = [], []
        for b, p in enumerate(prefix_lens):
            slots = self.alloc.alloc(p + n)
            self._slots.append(slots)
            row = v.req_pool_indices[b]
            v.req_to_token[row].zero_()
            v.req_to_token[row, : p + n] = slots.to("cpu", torch.int32)
            kv = {}
            for layer in (SWA_LAYER, FULL_LAYER):
                k = torch.randn(p, shape.hkv, shape.d, generator=gen).to(device, dtype)
                val = torch.randn(p, shape.hkv, shape.d, generator=gen).to(device, dtype)
                loc = slots[:p]
                if layer == SWA_LAYER:
                    loc = self.pool.translate_loc_from_full_to_swa(loc)
                self.pool.get_key_buffer(layer)[loc] = k
                self.pool.get_value_buffer(layer)[loc] = val
                kv[layer] = (k, val)
            self.prefix_kv.append(kv)
            if self.evict and p > self.window:
                self.alloc.free_swa(slots[: p - self.window])
            out.append(slots[p:].to("cpu"))
        v.out_cache_loc = torch.cat(out).long()
        if device != "cpu":
            v.device = device
            v.to_device()
            v.tree_mask = v.tree_mask.to(device) if v.tree_mask is not None else None
            if getattr(v.spec_info, "tree_mask_bits", None) is not None:
                v.spec_info.tree_mask_bits = v.tree_mask
        return self

    def backend(self, algorithm="DDTREE", is_draft=False, **attrs):
        runner = model_runner(algorithm, is_draft=is_draft, dtype=self.dtype, max_ctx=self.shape.max_ctx,
                              device=self.device)  # fmt: skip
        return swa_triton_backend(runner, self, **attrs)


def swa_triton_backend(runner, sv: SWAVerify, **attrs):
    """A real (patched) TritonAttnBackend on the hybrid SWA pool, with the
    attributes its TARGET_VERIFY paths read, as its __init__ sets them for a
    sliding-window model, and the hook its patched __init__ installs."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from sglang.srt.layers.attention.tree_verify.backends import triton_hook
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    max_bs, dev = 8, sv.device
    state = dict(
        device=dev, req_to_token=sv.verify.req_to_token, token_to_kv_pool=sv.pool,
        num_draft_tokens=sv.verify.n,
        kv_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
        qo_indptr=torch.zeros(max_bs + 1, dtype=torch.int64, device=dev),
        mask_indptr=torch.zeros(max_bs + 1, dtype=torch.int64, device=dev),
        sliding_window_size=sv.window,
        window_kv_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
        use_sliding_window_kv_pool=True, _translate_kv_loc=None, max_context_len=sv.shape.max_ctx,
        dcp_size=1, enable_deterministic=False, page_size=1, skip_prefill=False,
        use_verify_splitkv=False, allow_bidirectional_attention_in_extend=False, use_mla=False,
        extend_attention_fwd=extend_attention_fwd, _verify_mask=None,
    )  # fmt: skip
    state.update(attrs)
    return hooked_backend(TritonAttnBackend, triton_hook, runner, sv.verify, **state)


def layer(shape: Shape, layer_id, window=None):
    return RadixAttention(
        shape.h, shape.d, 1.0 / math.sqrt(shape.d), shape.hkv, layer_id,
        sliding_window_size=-1 if window is None else window,
    )  # fmt: skip


def node_depths(verify: Verify, b: int) -> torch.Tensor:
    """Each node's depth: its ancestors in its mask row (itself excluded)."""
    p = int(verify.prefix[b])
    return verify.visible(b)[:, p:].sum(-1) - 1


def reference(sv: SWAVerify, q, k_tree, v_tree, layer_id, window, sinks, by_index=False):
    """fp32 attention of every verify token over its request's committed prefix and
    its visible tree nodes: a tree node at ``prefix_len + depth`` (``by_index``:
    ``prefix_len + index``, what upstream's dense-mask path assumes), prefix token t
    at t, a key seen iff ``q_pos - k_pos <= window``; ``sinks`` join each softmax
    denominator."""
    verify, shape = sv.verify, sv.shape
    n, dev = verify.n, q.device
    outs = []
    for b in range(verify.bs):
        p = int(verify.prefix[b])
        kp, vp = sv.prefix_kv[b][layer_id]
        rows = slice(b * n, (b + 1) * n)
        group = shape.h // shape.hkv
        k = torch.cat([kp, k_tree[rows]]).float().repeat_interleave(group, 1)
        v = torch.cat([vp, v_tree[rows]]).float().repeat_interleave(group, 1)
        s = torch.einsum("nhd,thd->hnt", q[rows].float(), k) / math.sqrt(shape.d)
        allowed = verify.visible(b).to(dev)
        if window is not None:
            offset = (torch.arange(n) if by_index else node_depths(verify, b).cpu()).to(dev)
            q_pos = p + offset
            k_pos = torch.cat([torch.arange(p, device=dev), p + offset])
            allowed = allowed & ((q_pos[:, None] - k_pos[None, :]) <= window)
        s = s.masked_fill(~allowed, -math.inf)
        if sinks is not None:
            s = torch.cat([s, sinks.float().view(shape.h, 1, 1).expand(shape.h, n, 1)], -1)
            probs = torch.softmax(s, -1)[..., :-1]
        else:
            probs = torch.softmax(s, -1)
        outs.append(torch.einsum("hnt,thd->nhd", probs, v))
    return torch.cat(outs)


def prepared(be, sv: SWAVerify):
    """``be`` after ``init_forward_metadata`` of the step (its forward batch kept)."""
    fb = sv.verify.forward_batch()
    be.init_forward_metadata(fb)
    be.test_forward_batch = fb
    return be


def run_layer(be, sv: SWAVerify, layer_id, window, sinks, gen):
    """One forward_extend of a layer (after :func:`prepared`): its q and the tree's
    K/V, and the output ``[bs*N, H, D]`` in fp32."""
    shape = sv.shape
    t = sv.verify.bs * sv.verify.n
    q = torch.randn(t, shape.h * shape.d, generator=gen).to(sv.device, sv.dtype)
    k = torch.randn(t, shape.hkv, shape.d, generator=gen).to(sv.device, sv.dtype)
    v = torch.randn(t, shape.hkv, shape.d, generator=gen).to(sv.device, sv.dtype)
    o = be.forward_extend(q, k, v, layer(shape, layer_id, window), be.test_forward_batch, sinks=sinks)
    return q.view(t, shape.h, shape.d), k, v, o.view(t, shape.h, shape.d).float()
