# SPDX-License-Identifier: Apache-2.0
"""Sliding-window and attention-sink layers (gpt-oss, Gemma 4) through the patched
Triton backend's tree-verify hook, on upstream's real hybrid SWA KV pool.

The pool is ``SWAKVPool`` with its ``SWATokenToKVPoolAllocator`` (CPU tensors): the
sliding layer's KV lives in the SWA pool under translated slot ids, the full
layer's in the full pool, and the tokens that fell out of the window are evicted
from the SWA pool as upstream's scheduler evicts them (their slots map to SWA slot
0, which holds a poison value here, so reading one shows). The reference places a
tree node at ``prefix_len + depth`` and applies the window and the sinks in fp32;
upstream's own extend path is run on the same inputs, equal for a DFLASH chain and
different for a DDTREE tree (it counts a node's window by its index). The step and
the reference: ``_swa.py``.
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.attention.tree_verify.hook import (
    CHAIN,
    TREE,
    TreeVerifyUnavailable,
)
from tests.cpu.tree_verify_integration._setup import MAX_CTX, Verify, model_runner
from tests.cpu.tree_verify_integration._swa import (
    FULL_LAYER,
    SWA_LAYER,
    Shape,
    SWAVerify,
    prepared,
    reference,
)
from tests.cpu.tree_verify_integration._swa import layer as swa_layer
from tests.cpu.tree_verify_integration._swa import run_layer

SHAPE = Shape()
H, HKV, D, WINDOW = SHAPE.h, SHAPE.hkv, SHAPE.d, SHAPE.window


def layer(layer_id, window=None):
    return swa_layer(SHAPE, layer_id, window)


SINKS = torch.tensor([1.5, -0.5, 3.0, 0.0], dtype=torch.bfloat16)

CASES = [
    # prefix lengths (below, at and far beyond the window; an empty prefix), tree width
    ([3, 40, 0, 17], 9),
    ([60], 17),
    ([5, 6, 12], 33),
]


@pytest.mark.parametrize("prefix_lens,n", CASES)
@pytest.mark.parametrize("layer_id,window,with_sinks", [
    (SWA_LAYER, WINDOW, True),  # gpt-oss's sliding layer
    (SWA_LAYER, WINDOW, False),  # Gemma 4's
    (SWA_LAYER, WINDOW - 2, True),  # a window inside the pool's
    (FULL_LAYER, None, True),  # gpt-oss's full layer
])  # fmt: skip
def test_ddtree_tree_window_and_sinks_match_depth_positions(prefix_lens, n, layer_id, window, with_sinks):
    gen = torch.Generator().manual_seed(sum(prefix_lens) * 7 + n + layer_id)
    sv = SWAVerify(prefix_lens, n, "DDTREE", gen)
    be = prepared(sv.backend(), sv)
    assert be.tree_verify.kind == TREE and be.consumes_tree_mask_bits
    meta = be.tree_verify.metadata
    assert meta.swa is not None
    sinks = SINKS if with_sinks else None
    q, k, v, o = run_layer(be, sv, layer_id, window, sinks, gen)
    ref = reference(sv, q, k, v, layer_id, window, sinks)
    torch.testing.assert_close(o, ref, atol=3e-3, rtol=3e-3)
    if window is not None and n > 9:
        # The trees here are deep and wide enough that an index-based window
        # differs: the comparison above is sensitive to the positions.
        by_index = reference(sv, q, k, v, layer_id, window, sinks, by_index=True)
        assert (by_index - ref).abs().max() > 0.05


def test_swa_slots_are_the_windows_translated_ids():
    """The SWA indices the hook hands the kernel: each request's last
    min(P, window) committed tokens and its tree, in the SWA pool's ids (what
    upstream's update_sliding_window_buffer and swa_out_cache_loc hold)."""
    gen = torch.Generator().manual_seed(3)
    sv = SWAVerify([3, 40, 0, 17], 5, "DDTREE", gen)
    be = prepared(sv.backend(), sv)
    swa = be.tree_verify.metadata.swa
    v = sv.verify
    assert swa.prefix_kv_indptr.dtype == swa.prefix_kv_indices.dtype == swa.tree_kv_indices.dtype == torch.int32
    assert swa.prefix_kv_indptr.tolist() == [0, 3, 8, 8, 13]
    translate = sv.pool.translate_loc_from_full_to_swa
    for b, p in enumerate([3, 40, 0, 17]):
        lo, hi = swa.prefix_kv_indptr[b], swa.prefix_kv_indptr[b + 1]
        full = v.req_to_token[v.req_pool_indices[b], max(0, p - WINDOW) : p].long()
        assert swa.prefix_kv_indices[lo:hi].tolist() == translate(full).tolist()
        assert (swa.prefix_kv_indices[lo:hi] > 0).all()  # none of them evicted
    assert swa.tree_kv_indices.flatten().tolist() == translate(v.out_cache_loc).tolist()
    # Upstream's own window gather for the same step (int64) holds the same slots.
    up = be.forward_metadata
    assert up.window_kv_indptr[:5].tolist() == swa.prefix_kv_indptr.tolist()
    assert up.window_kv_indices[: int(up.window_kv_indptr[4])].tolist() == swa.prefix_kv_indices[:13].tolist()


def test_fused_kernel_interpreted_with_window_sinks_and_swa_slots(monkeypatch):
    """The fused Triton kernels (interpreted) behind the hook: the window CSR
    of SWA ids, positions by depth, the sinks in the combine."""
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", "fused")
    gen = torch.Generator().manual_seed(11)
    sv = SWAVerify([21, 2], 11, "DDTREE", gen)
    be = prepared(sv.backend(), sv)
    for layer_id, window in ((SWA_LAYER, WINDOW), (FULL_LAYER, None)):
        q, k, v, o = run_layer(be, sv, layer_id, window, SINKS, gen)
        torch.testing.assert_close(o, reference(sv, q, k, v, layer_id, window, SINKS), atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("with_sinks", [True, False])
def test_dflash_chain_equals_upstreams_path(with_sinks):
    """A DFLASH chain: the hook and upstream's own extend path (the hook off) give
    the same attention on the same pool and step, window, sinks and SWA slots
    included; both equal the reference."""
    gen = torch.Generator().manual_seed(5 + with_sinks)
    sv = SWAVerify([30, 4, 9], 8, "DFLASH", gen)
    hooked = prepared(sv.backend("DFLASH"), sv)
    assert hooked.tree_verify.metadata.kind == CHAIN
    upstream = sv.backend("DFLASH")
    upstream.tree_verify.kind = None  # upstream's path, as with the hook off
    upstream = prepared(upstream, sv)
    sinks = SINKS if with_sinks else None
    for layer_id, window in ((SWA_LAYER, WINDOW), (FULL_LAYER, None)):
        state = gen.get_state()
        q, k, v, o = run_layer(hooked, sv, layer_id, window, sinks, gen)
        gen.set_state(state)
        _, _, _, o_up = run_layer(upstream, sv, layer_id, window, sinks, gen)
        torch.testing.assert_close(o, o_up, atol=3e-3, rtol=3e-3)
        torch.testing.assert_close(o, reference(sv, q, k, v, layer_id, window, sinks), atol=3e-3, rtol=3e-3)


def test_upstreams_dense_mask_path_is_wrong_for_the_tree():
    """Why the hook must serve these layers: upstream's extend path with the dense
    tree mask (what ran before) counts a node's window by its index; on a tree it
    differs from the depth-positioned reference, and equals the index-positioned one."""
    from sglang.srt.speculative.ddtree.info import dense_verify_mask

    gen = torch.Generator().manual_seed(8)
    sv = SWAVerify([30, 12], 17, "DDTREE", gen)
    v = sv.verify
    v.spec_info.custom_mask = dense_verify_mask(v.tree_mask, v.prefix, v.n * int(v.prefix.sum() + v.bs * v.n))
    upstream = sv.backend()
    upstream.tree_verify.kind = None
    upstream = prepared(upstream, sv)
    q, k, val, o = run_layer(upstream, sv, SWA_LAYER, WINDOW, SINKS, gen)
    by_depth = reference(sv, q, k, val, SWA_LAYER, WINDOW, SINKS)
    by_index = reference(sv, q, k, val, SWA_LAYER, WINDOW, SINKS, by_index=True)
    torch.testing.assert_close(o, by_index, atol=3e-3, rtol=3e-3)
    assert (o - by_depth).abs().max() > 0.05


def _padded(verify: Verify, bs: int):
    pad = bs - verify.bs
    return verify.forward_batch(
        batch_size=bs,
        req_pool_indices=torch.cat([verify.req_pool_indices, torch.zeros(pad, dtype=torch.int64)]),
        seq_lens=torch.cat([verify.prefix, torch.ones(pad, dtype=torch.int64)]),
    )


def test_graph_buffers_hold_the_swa_slots_at_fixed_addresses():
    """Under CUDA graphs the SWA window CSR and tree slots sit in buffers made
    once (fixed addresses and launch shapes), refilled outside the graph for
    each replay's batch, padded requests included."""
    n, graph_bs = 7, 4
    gen = torch.Generator().manual_seed(12)
    sv = SWAVerify([9, 3, 30], n, "DDTREE", gen)
    be = sv.backend()
    be.tree_verify.init_graph_state(max_bs=8, max_num_tokens=8 * n)
    ptrs = None
    for prefix in ([9, 3, 30], [44, 1], [2, 2, 2, 15]):
        step = sv.step(prefix, n, "DDTREE", gen)  # new requests on the same pools
        be.tree_verify.req_to_token = step.verify.req_to_token
        fb = _padded(step.verify, graph_bs)
        be.kv_indptr[1 : graph_bs + 1] = torch.cumsum(fb.seq_lens, 0)
        meta = be.tree_verify.prepare(fb, be.kv_indptr, graph=True)
        swa = meta.swa
        now = [t.data_ptr() for t in (swa.prefix_kv_indptr, swa.prefix_kv_indices, swa.tree_kv_indices)]
        shapes = [tuple(t.shape) for t in (swa.prefix_kv_indices, swa.tree_kv_indices)]
        if ptrs is None:
            ptrs, first_shapes = now, shapes
        assert now == ptrs and shapes == first_shapes
        assert swa.prefix_kv_indices.numel() == graph_bs * WINDOW
        lens = [min(p, WINDOW) for p in prefix] + [1] * (graph_bs - len(prefix))
        assert swa.prefix_kv_indptr.tolist() == [0] + torch.tensor(lens).cumsum(0).tolist()
        translate = step.pool.translate_loc_from_full_to_swa
        rows = step.verify.out_cache_loc.numel()
        assert swa.tree_kv_indices.flatten()[:rows].tolist() == translate(step.verify.out_cache_loc).tolist()
        assert (swa.tree_kv_indices.flatten()[rows:] == 0).all()  # padded rows: the sink slot
        q = torch.randn(graph_bs * n, H, D, generator=gen).half()
        k = torch.randn(step.verify.bs * n, HKV, D, generator=gen).half()
        val = torch.randn(step.verify.bs * n, HKV, D, generator=gen).half()
        swa_k = step.pool.get_key_buffer(SWA_LAYER)
        swa_v = step.pool.get_value_buffer(SWA_LAYER)
        tree_swa = translate(step.verify.out_cache_loc)
        swa_k[tree_swa], swa_v[tree_swa] = k, val
        o = be.tree_verify.run(q, swa_k, swa_v, layer(SWA_LAYER, WINDOW), fb, sinks=SINKS)
        ref = reference(step, q[: step.verify.bs * n], k, val, SWA_LAYER, WINDOW, SINKS)
        torch.testing.assert_close(o[: step.verify.bs * n].float(), ref, atol=3e-3, rtol=3e-3)


def test_a_window_beyond_the_pools_is_refused_for_a_tree():
    """A layer in the SWA pool whose window the pool does not keep cannot be
    served; for a tree it is refused (never sent to the dense-mask path)."""
    gen = torch.Generator().manual_seed(4)
    sv = SWAVerify([20], 5, "DDTREE", gen)
    be = prepared(sv.backend(), sv)
    with pytest.raises(TreeVerifyUnavailable, match="window 9, which the pool's window 5 does not cover"):
        run_layer(be, sv, SWA_LAYER, WINDOW + 4, SINKS, gen)


@pytest.mark.parametrize("attrs,env,reason", [
    (dict(enable_deterministic=True), {}, "deterministic inference"),
    (dict(_translate_kv_loc=lambda x: x), {}, "unified KV pool"),
    ({}, {"SGLANG_DDTREE_VERIFY_STRATEGY": "upstream_extend"}, "upstream_extend keeps upstream's verify path"),
])  # fmt: skip
def test_ddtree_on_a_windowed_model_without_the_hook_is_refused_at_startup(monkeypatch, attrs, env, reason):
    """Whatever turns the hook off on a sliding-window model refuses DDTREE when
    the backend is built (model-runner start-up), naming the reason and the
    alternatives; DFLASH (a chain, exact on upstream's path) keeps upstream's path."""
    for k, val in env.items():
        monkeypatch.setenv(k, val)
    gen = torch.Generator().manual_seed(6)
    sv = SWAVerify([8], 4, "DDTREE", gen)
    with pytest.raises(TreeVerifyUnavailable) as err:
        sv.backend(**attrs)
    message = str(err.value)
    assert reason in message and "sliding-window layers" in message
    assert "--attention-backend triton" in message and "--speculative-algorithm DFLASH" in message
    assert sv.backend("DFLASH", **attrs).tree_verify.kind is None


def test_sliding_window_without_an_swa_pool():
    """A sliding-window model on an ordinary pool (--disable-hybrid-swa-memory):
    the whole prefix is in the pool, the kernel applies the window to it."""
    from tests.cpu.tree_verify_integration._setup import Pool, triton_backend

    gen = torch.Generator().manual_seed(9)
    verify = Verify([13, 40], 17, "DDTREE", gen)
    pool = Pool(HKV, D, D, torch.float16, mla=False)
    be = triton_backend(model_runner("DDTREE"), pool, verify, mla=False)
    assert be.tree_verify.kind == TREE and be.tree_verify.swa_pool is None
    fb = verify.forward_batch()
    be.init_forward_metadata(fb)
    assert be.tree_verify.metadata.swa is None
    t = verify.bs * verify.n
    q = torch.randn(t, H * D, generator=gen).half()
    k = torch.randn(t, HKV, D, generator=gen).half()
    v = torch.randn(t, HKV, D, generator=gen).half()
    o = be.forward_extend(q, k, v, layer(SWA_LAYER, WINDOW), fb, sinks=SINKS).view(t, H, D).float()
    # The same attention, as SWAVerify's reference sees it: the pool's prefix KV.
    sv = object.__new__(SWAVerify)
    sv.verify, sv.window, sv.shape = verify, WINDOW, SHAPE
    sv.prefix_kv = []
    for b, p in enumerate(verify.prefix.tolist()):
        slots = verify.req_to_token[verify.req_pool_indices[b], :p].long()
        sv.prefix_kv.append({SWA_LAYER: (pool.k[slots], pool.v[slots])})
    torch.testing.assert_close(o, reference(sv, q.view(t, H, D), k, v, SWA_LAYER, WINDOW, SINKS), atol=3e-3, rtol=3e-3)


def test_flashinfer_on_a_windowed_model_refuses_ddtree():
    """FlashInfer's verify (its sliding-window wrappers with the dense mask and
    ``window_left``) counts a node's window by its index too: DDTREE on a
    sliding-window model is refused when the backend is built, pointing to the
    Triton backend; a DFLASH chain keeps FlashInfer's own path."""
    from tests.cpu.tree_verify_integration._setup import Pool, flashinfer_backend

    gen = torch.Generator().manual_seed(2)
    verify = Verify([8], 4, "DDTREE", gen)
    pool = Pool(HKV, D, D, torch.float16, mla=False)
    runner = model_runner("DDTREE")
    runner.sliding_window_size = WINDOW
    with pytest.raises(TreeVerifyUnavailable, match="sliding-window or cross-attention wrappers") as err:
        flashinfer_backend(runner, pool, verify, num_wrappers=2)
    assert "--attention-backend triton" in str(err.value)
    chain = model_runner("DFLASH")
    chain.sliding_window_size = WINDOW
    assert flashinfer_backend(chain, pool, verify, num_wrappers=2).tree_verify.kind is None


def test_window_and_sink_layers_take_the_fused_kernel():
    """The routes' per-layer choice: a verify planned for a prefix pass
    (flashinfer_split, flashmla_split) serves its window and sink layers with the
    fused kernel, which is the only one that applies them."""
    from sglang.srt.layers.attention.tree_verify.routes import layer_strategy

    for strategy in ("flashinfer_split", "flashmla_split", "fused"):
        assert layer_strategy(strategy, True) == "fused"
        assert layer_strategy(strategy, False) == strategy
    assert layer_strategy("reference", True) == "reference"
    assert layer_strategy(None, True) is None  # the dispatcher's default


def test_forced_prefix_pass_routes_window_layers_to_fused(monkeypatch):
    """SGLANG_DDTREE_VERIFY_STRATEGY=flashinfer_split on a Gemma-4-like target (no
    sinks): its full layers take the forced pass, its sliding layers the fused
    kernel; on gpt-oss (sinks on every layer) forcing a prefix pass is refused when
    the backend is built, and the policy plans none."""
    from sglang.srt.layers.attention.tree_verify import flashinfer_split
    from sglang.srt.layers.attention.tree_verify.registry import TargetAttention
    from sglang.srt.layers.attention.tree_verify.routes import VerifyRoutes
    from sglang.srt.utils import gpu_arch

    monkeypatch.setattr(gpu_arch, "device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(flashinfer_split, "flashinfer_reason", lambda: None)
    target = TargetAttention(num_heads=H, head_dim_qk=D, head_dim_v=D, num_kv_heads=HKV,
                             sm_scale=D**-0.5, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)  # fmt: skip
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", "flashinfer_split")
    routes = VerifyRoutes(backend_name="TritonAttnBackend", device="cpu", target=target,
                          forced="flashinfer_split", pool_requests=8, max_context_len=MAX_CTX)  # fmt: skip
    meta = type("Meta", (), {"tree_kv_indices": torch.zeros(2, 9, dtype=torch.int32)})()
    q = torch.zeros(18, H, D, dtype=torch.bfloat16)
    assert routes.for_layer(meta, q, None, None, layer(FULL_LAYER), 0.0, window_or_sinks=True) == ("fused", None)
    import dataclasses

    with pytest.raises(TreeVerifyUnavailable, match="attention sinks, which only the fused kernel applies"):
        VerifyRoutes(backend_name="TritonAttnBackend", device="cpu", target=dataclasses.replace(target, sinks=True),
                     forced="flashinfer_split", pool_requests=8, max_context_len=MAX_CTX)  # fmt: skip
    monkeypatch.delenv("SGLANG_DDTREE_VERIFY_STRATEGY")
    gptoss = VerifyRoutes(backend_name="TritonAttnBackend", device="cpu", target=dataclasses.replace(target, sinks=True),
                          forced=None, pool_requests=8, max_context_len=MAX_CTX)  # fmt: skip
    assert gptoss.available == frozenset({"fused"})


@pytest.mark.parametrize("algorithm", ["DFLASH", "DDTREE"])
def test_draft_block_with_a_sliding_layer_equals_upstreams_path(algorithm):
    """A DFlash drafter may have sliding layers (upstream makes them causal, window
    ``config.sliding_window - 1``; its pool is an ordinary one): the drafter's block,
    a chain, through the hook on the draft worker equals upstream's path and the
    reference."""
    from types import SimpleNamespace

    from tests.cpu.tree_verify_integration._setup import Pool
    from tests.cpu.tree_verify_integration._swa import swa_triton_backend

    gen = torch.Generator().manual_seed(21)
    verify = Verify([30, 3, 12], 8, "DFLASH", gen)  # the block's spec info is DFlash's
    pool = Pool(HKV, D, D, torch.float16, mla=False)
    step = SimpleNamespace(verify=verify, window=WINDOW, shape=SHAPE, device="cpu", dtype=torch.float16, pool=pool)

    def backend(kind=None):
        be = swa_triton_backend(model_runner(algorithm, is_draft=True), step, use_sliding_window_kv_pool=False)
        if kind == "upstream":
            be.tree_verify.kind = None
        return prepared(be, step)

    hooked, upstream = backend(), backend("upstream")
    assert hooked.tree_verify.metadata.kind == "block" and hooked.tree_verify.metadata.swa is None
    state = gen.get_state()
    q, k, v, o = run_layer(hooked, step, SWA_LAYER, WINDOW, None, gen)
    gen.set_state(state)
    _, _, _, o_up = run_layer(upstream, step, SWA_LAYER, WINDOW, None, gen)
    torch.testing.assert_close(o, o_up, atol=3e-3, rtol=3e-3)
    step.prefix_kv = []
    for b, p in enumerate(verify.prefix.tolist()):
        slots = verify.req_to_token[verify.req_pool_indices[b], :p].long()
        step.prefix_kv.append({SWA_LAYER: (pool.k[slots], pool.v[slots])})
    torch.testing.assert_close(o, reference(step, q, k, v, SWA_LAYER, WINDOW, None), atol=3e-3, rtol=3e-3)


def test_a_flashinfer_plan_serves_only_the_layers_it_was_planned_for(monkeypatch):
    """Gemma 4's full layers (heads of 512, 4 KV heads) and sliding ones (heads of
    256, 16 KV heads) differ: a prefix pass planned for one shape is not handed to a
    layer of the other (the fused kernel serves it)."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention.tree_verify.flashinfer_split import PrefixPassShape
    from sglang.srt.layers.attention.tree_verify.strategies import get_strategy

    planner = get_strategy("flashinfer_split").planner(
        backend_name="TritonAttnBackend", target=None, forced=False, pool_requests=8, max_context_len=MAX_CTX
    )
    planned = PrefixPassShape(num_heads=32, num_kv_heads=4, head_dim_qk=512, head_dim_v=512, width=17,
                              q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, sm_scale=1.0)  # fmt: skip
    meta = SimpleNamespace()
    planner._planned = (meta, SimpleNamespace(shape=planned))
    full = SimpleNamespace(scaling=1.0)
    q_full, k_full = torch.zeros(17, 32, 512), torch.zeros(8, 4, 512)
    q_swa, k_swa = torch.zeros(17, 32, 256), torch.zeros(8, 16, 256)
    options = lambda q, k: planner.layer_options(meta, q, k, None, full, 0.0)  # noqa: E731
    assert options(q_full, k_full) == {"prefix_pass": planner._planned[1]}
    assert options(q_swa, k_swa) is None
    assert options(q_full, torch.zeros(8, 16, 512)) is None
