# SPDX-License-Identifier: Apache-2.0
"""CUDA-graph buffers of the hook (fixed addresses and launch shapes across
replays), the patched FlashInfer MLA and MHA backends, and the verify-backend
policy."""

from types import SimpleNamespace

import pytest
import torch

from _setup import (
    Pool,
    Verify,
    dense_reference,
    flashinfer_backend,
    flashinfer_mla_backend,
    layer_for,
    mla_forward_extend,
    model_runner,
    qkv,
    triton_backend,
)
from sglang.srt.layers.attention.tree_verify.backends import verify_capture_dense_mask
from sglang.srt.layers.attention.tree_verify.hook import (
    BLOCK,
    CHAIN,
    TREE,
    TreeVerifyUnavailable,
    check_runtime_tree_verify,
)
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm


def _padded(verify: Verify, bs: int):
    """The replay view of a padded graph batch: padded req slots 0, seq_len 1,
    the real (unpadded) out_cache_loc and spec_info, as build_replay_fb_view."""
    pad = bs - verify.bs
    return verify.forward_batch(
        batch_size=bs,
        req_pool_indices=torch.cat([verify.req_pool_indices, torch.zeros(pad, dtype=torch.int64)]),
        seq_lens=torch.cat([verify.prefix, torch.ones(pad, dtype=torch.int64)]),
    )


def test_graph_buffers_are_static_and_replays_match():
    gen = torch.Generator().manual_seed(9)
    h, hkv, dqk, dv = 4, 2, 64, 64
    n, graph_bs = 6, 4
    first = Verify([7, 0, 12], n, "DDTREE", gen)
    pool = Pool(hkv, dqk, dv, torch.float16, mla=False)
    be = triton_backend(model_runner("DDTREE"), pool, first, mla=False)
    be.tree_verify.init_graph_state(max_bs=8, max_num_tokens=8 * n)
    layer = layer_for("mha", h, hkv, dqk, dv)

    ptrs = None
    for step, prefix in enumerate(([7, 0, 12], [30, 2], [1, 1, 1, 40])):
        verify = Verify(prefix, n, "DDTREE", gen)
        # One req_to_token table for the whole run, as in the server.
        first.req_to_token.copy_(verify.req_to_token)
        verify.req_to_token = first.req_to_token
        fb = _padded(verify, graph_bs)
        be.kv_indptr[1 : graph_bs + 1] = torch.cumsum(fb.seq_lens, 0)  # upstream's fill
        meta = be.tree_verify.prepare(fb, be.kv_indptr, graph=True)
        now = [
            t.data_ptr()
            for t in (meta.prefix_kv_indptr, meta.prefix_kv_indices, meta.tree_kv_indices, meta.tree_mask)
        ]
        shapes = [tuple(t.shape) for t in (meta.prefix_kv_indices, meta.tree_kv_indices, meta.tree_mask)]
        if ptrs is None:
            ptrs, first_shapes = now, shapes
        assert now == ptrs, "graph buffers must keep their addresses across replays"
        assert shapes == first_shapes, "launch shapes must not depend on the batch"
        assert meta.kind == TREE
        assert meta.prefix_kv_indices.numel() == graph_bs * 64  # capacity, not sum(P)

        q, k, v = qkv(verify, h, hkv, dqk, dv, torch.float16, False, gen)
        pool.set_kv_buffer(layer, verify.out_cache_loc, k, v)
        q_pad = torch.cat([q.view(-1, h, dqk), torch.zeros((graph_bs - verify.bs) * n, h, dqk, dtype=q.dtype)])
        o = be.tree_verify.run(q_pad, pool.k, pool.v, layer, fb)
        ref = dense_reference(verify, q.view(-1, h, dqk), pool, layer.scaling)
        torch.testing.assert_close(o[: verify.bs * n].float(), ref, atol=2e-3, rtol=2e-3)


def test_graph_capture_without_a_tree_uses_the_static_kind():
    """At capture the spec_info is the runner's dummy (no tree_mask_bits):
    the captured graph still records the tree path."""
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    gen = torch.Generator().manual_seed(3)
    verify = Verify([2, 2], 5, "DDTREE", gen)
    be = triton_backend(model_runner("DDTREE"), Pool(2, 64, 64, torch.float16, False), verify, False)
    be.tree_verify.init_graph_state(max_bs=4, max_num_tokens=20)
    dummy = DFlashVerifyInput(draft_token=None, positions=None, draft_token_num=5, custom_mask=None)
    meta = be.tree_verify.prepare(verify.forward_batch(spec_info=dummy), be.kv_indptr, graph=True)
    assert meta is not None and meta.kind == TREE
    # Eagerly, the same dummy is not a tree: upstream's path runs.
    assert be.tree_verify.prepare(verify.forward_batch(spec_info=dummy)) is None


@pytest.mark.parametrize("split_rope", [True, False])
def test_flashinfer_mla_ddtree_through_the_hook(split_rope):
    gen = torch.Generator().manual_seed(21)
    h, dqk, dv = 4, 576, 512
    verify = Verify([9, 0, 14], 7, "DDTREE", gen)
    pool = Pool(1, dqk, dv, torch.float16, mla=True)
    be = flashinfer_mla_backend(model_runner("DDTREE"), pool, verify)
    assert be.consumes_tree_mask_bits
    layer = layer_for("mla", h, 1, dqk, dv)
    fb = verify.forward_batch()
    be.tree_verify.prepare(fb)  # what the patched init_forward_metadata calls last
    q, k, _ = qkv(verify, h, 1, dqk, dv, torch.float16, True, gen)
    o = mla_forward_extend(be, q, k, layer, fb, h, dv, split_rope)
    ref = dense_reference(verify, q.view(-1, h, dqk), pool, layer.scaling)
    torch.testing.assert_close(o.view(-1, h, dv).float(), ref, atol=2e-3, rtol=2e-3)


def test_flashinfer_mla_keeps_dflash_chains_on_flashinfer():
    gen = torch.Generator().manual_seed(0)
    verify = Verify([3], 4, "DFLASH", gen)
    be = flashinfer_mla_backend(model_runner("DFLASH"), Pool(1, 576, 512, torch.float16, True), verify)
    assert be.tree_verify.kind is None


def test_flashinfer_mla_refuses_ddtree_without_the_hook(monkeypatch):
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", "upstream_extend")
    gen = torch.Generator().manual_seed(0)
    verify = Verify([3], 4, "DDTREE", gen)
    with pytest.raises(TreeVerifyUnavailable, match="triton"):
        flashinfer_mla_backend(model_runner("DDTREE"), Pool(1, 576, 512, torch.float16, True), verify)


def test_mask_policy_and_runtime_check_on_patched_backends(monkeypatch):
    """One decision says whether captured verify graphs carry upstream's dense mask
    (patch 0053): none where the hook serves the verify, a tree's mask otherwise,
    upstream's choice for chains. The runtime check accepts exactly the backends
    that apply a tree mask."""
    from sglang.srt.speculative.ddtree.info import backend_reads_tree_mask_bits

    ddtree = SpeculativeAlgorithm.from_string("DDTREE")
    dflash = SpeculativeAlgorithm.from_string("DFLASH")
    gen = torch.Generator().manual_seed(0)
    verify = Verify([3], 4, "DDTREE", gen)
    pool = Pool(2, 64, 64, torch.float16, False)
    tri = triton_backend(model_runner("DDTREE"), pool, verify, False)
    assert backend_reads_tree_mask_bits(tri)
    assert verify_capture_dense_mask(tri, ddtree, upstream_choice=False) is False
    check_runtime_tree_verify(tri)

    class Hybrid:  # upstream's HybridAttnBackend exposes full_attn_backend
        full_attn_backend = tri

    assert backend_reads_tree_mask_bits(Hybrid())
    assert verify_capture_dense_mask(Hybrid(), ddtree, upstream_choice=True) is False
    check_runtime_tree_verify(Hybrid())

    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", "upstream_extend")  # hooks off
    off = triton_backend(model_runner("DDTREE"), pool, verify, False)
    assert verify_capture_dense_mask(off, ddtree, upstream_choice=False) is True  # a tree needs it
    check_runtime_tree_verify(off)  # upstream's extend path applies the dense mask
    chain = triton_backend(model_runner("DFLASH"), pool, Verify([3], 4, "DFLASH", gen), False)
    for upstream in (False, True):
        assert verify_capture_dense_mask(chain, dflash, upstream_choice=upstream) is upstream
    monkeypatch.delenv("SGLANG_DDTREE_VERIFY_STRATEGY")

    fi = flashinfer_mla_backend(
        model_runner("DDTREE"), Pool(1, 576, 512, torch.float16, True), verify
    )
    check_runtime_tree_verify(fi)
    fi.tree_verify.kind = None  # as if the hook were off: FA2 MLA would run causal
    with pytest.raises(TreeVerifyUnavailable):
        check_runtime_tree_verify(fi)


def test_startup_check_matches_what_is_integrated():
    from sglang.srt.layers.attention import backend_support as bs
    from sglang.srt.layers.attention.tree_verify import support

    for cap in ((8, 0), (9, 0), (10, 0), (12, 0)):
        support.check_tree_verify_backend("triton", bs.MLA, cap)
        support.check_tree_verify_backend("triton", bs.MHA, cap)
        support.check_tree_verify_backend("flashinfer", bs.MLA, cap)
        support.check_tree_verify_backend("flashinfer", bs.MHA, cap)
        for backend in ("fa3", "flashmla", "trtllm_mla", "cutlass_mla", "fa4", None):
            with pytest.raises(bs.UnsupportedAttentionBackendError, match="triton"):
                support.check_tree_verify_backend(backend, bs.MLA, cap)
    support.check_tree_verify_backend("flashinfer", bs.MLA)  # cap unknown: any arch
    with pytest.raises(ValueError):
        support.check_tree_verify_backend("triton", bs.MHA, (7, 5))


def _must_not_plan(*args, **kwargs):
    raise AssertionError("FlashInfer planned a verify the tree-verify hook serves")


@pytest.mark.parametrize("h,hkv,d", [(4, 2, 64), (6, 1, 128)])
def test_flashinfer_mha_ddtree_through_the_hook(h, hkv, d):
    """The patched forward_extend writes this step's K/V, then the hook serves the
    tree from the bits: equal to dense attention over the visible tokens."""
    from sglang.srt.speculative.dflash_utils import resolve_dflash_verify_mask_policy

    gen = torch.Generator().manual_seed(23)
    verify = Verify([9, 0, 14], 7, "DDTREE", gen)
    pool = Pool(hkv, d, d, torch.float16, mla=False)
    be = flashinfer_backend(model_runner("DDTREE"), pool, verify)
    assert be.consumes_tree_mask_bits and be.tree_verify.kind == TREE
    # The worker then builds no dense mask for it, and the runtime check passes.
    assert resolve_dflash_verify_mask_policy(be) == ("FlashInferAttnBackend", False)
    check_runtime_tree_verify(be)
    layer = layer_for("mha", h, hkv, d, d, logit_cap=30.0)
    fb = verify.forward_batch()
    # The patched init_forward_metadata: the hook's metadata instead of FlashInfer's
    # verify plan, whose host copies of the index pointers would sync every step.
    be.indices_updater_prefill = SimpleNamespace(update=_must_not_plan)
    be.init_forward_metadata(fb)
    assert be.tree_verify.metadata is not None and not be.forward_metadata.use_ragged
    q, k, v = qkv(verify, h, hkv, d, d, torch.float16, False, gen)
    o = be.forward_extend(q, k, v, layer, fb)
    assert o.shape == (verify.bs * verify.n, h * d)
    ref = dense_reference(verify, q.view(-1, h, d), pool, layer.scaling, logit_cap=30.0)
    torch.testing.assert_close(o.view(-1, h, d).float(), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("h,hkv,d", [(4, 2, 64), (6, 1, 128)])
def test_flashinfer_mha_dflash_chain_through_the_hook(h, hkv, d):
    """A DFLASH chain verify on the patched FlashInfer backend goes through the hook
    (a cached causal bitmask, no FlashInfer verify plan), as on the Triton backend:
    equal to the causal attention over each request's prefix and block."""
    gen = torch.Generator().manual_seed(29)
    verify = Verify([9, 0, 14], 8, "DFLASH", gen)
    pool = Pool(hkv, d, d, torch.float16, mla=False)
    be = flashinfer_backend(model_runner("DFLASH"), pool, verify)
    assert be.tree_verify.kind == CHAIN and not be.consumes_tree_mask_bits
    layer = layer_for("mha", h, hkv, d, d)
    fb = verify.forward_batch()
    be.indices_updater_prefill = SimpleNamespace(update=_must_not_plan)
    be.init_forward_metadata(fb)
    assert be.tree_verify.metadata.kind == CHAIN
    q, k, v = qkv(verify, h, hkv, d, d, torch.float16, False, gen)
    o = be.forward_extend(q, k, v, layer, fb)
    ref = dense_reference(verify, q.view(-1, h, d), pool, layer.scaling)  # causal block
    torch.testing.assert_close(o.view(-1, h, d).float(), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("algorithm", ["DFLASH", "DDTREE"])
@pytest.mark.parametrize("attn_type", [AttentionType.ENCODER_ONLY, AttentionType.DECODER])
def test_flashinfer_mha_draft_block_through_the_hook(algorithm, attn_type):
    """The DFlash drafter's block on the draft worker's FlashInfer backend: its
    non-causal layers see the prefix and the whole block, causal ones the chain."""
    gen = torch.Generator().manual_seed(31)
    h, hkv, d, n = 4, 2, 64, 16
    verify = Verify([9, 0, 21], n, "DFLASH", gen)
    pool = Pool(hkv, d, d, torch.float16, mla=False)
    be = flashinfer_backend(model_runner(algorithm, is_draft=True), pool, verify)
    assert be.tree_verify.kind == BLOCK
    layer = layer_for("mha", h, hkv, d, d)
    layer.attn_type = attn_type
    fb = verify.forward_batch()
    be.indices_updater_prefill = SimpleNamespace(update=_must_not_plan)
    be.init_forward_metadata(fb)
    q, k, v = qkv(verify, h, hkv, d, d, torch.float16, False, gen)
    o = be.forward_extend(q, k, v, layer, fb).view(-1, h, d).float()
    if attn_type == AttentionType.ENCODER_ONLY:
        verify.visible = lambda b: torch.ones(n, int(verify.prefix[b]) + n, dtype=torch.bool)
    ref = dense_reference(verify, q.view(-1, h, d), pool, layer.scaling)
    torch.testing.assert_close(o, ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("algorithm,is_draft,attrs,env", [
    ("DFLASH", False, {}, "upstream_extend"),  # the A/B switch: upstream's own verify
    ("DDTREE", False, {"num_wrappers": 2}, None),  # sliding window / cross attention
    ("DDTREE", False, {"use_sliding_window_kv_pool": True,
                       "_swa_kv_pool": SimpleNamespace(translate_loc_from_full_to_swa=lambda loc: loc)}, None),
    ("DDTREE", False, {"prefill_uses_dequant_workspace": True}, None),
    ("DDTREE", False, {"page_size": 16}, None),
    ("DFLASH", False, {"page_size": 16}, None),
])
def test_flashinfer_mha_leaves_the_rest_to_upstream(monkeypatch, algorithm, is_draft, attrs, env):
    """Off at construction: upstream's path runs, and for a DDTREE target the
    worker keeps building the dense mask that path applies."""
    if env is not None:
        monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", env)
    gen = torch.Generator().manual_seed(1)
    verify = Verify([3], 4, algorithm, gen)
    runner = model_runner(algorithm, is_draft=is_draft)
    be = flashinfer_backend(runner, Pool(2, 64, 64, torch.float16, False), verify, **attrs)
    assert be.tree_verify.kind is None and not be.consumes_tree_mask_bits
    if algorithm == "DDTREE" and not is_draft:
        check_runtime_tree_verify(be)  # FlashInfer applies the dense mask itself
    planned = []
    be.indices_updater_prefill = SimpleNamespace(update=lambda *a, **kw: planned.append(kw))
    be.init_forward_metadata(verify.forward_batch())
    assert len(planned) == 1 and planned[0]["prefill_wrappers"] is be.prefill_wrappers_verify
