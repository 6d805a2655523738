# SPDX-License-Identifier: Apache-2.0
"""The patched Triton backend serves DDTREE / DFLASH TARGET_VERIFY through the
tree-verify path and matches the dense-custom-mask attention."""

import pytest
import torch

from sglang.srt.layers.radix_attention import AttentionType

from _setup import MAX_CTX, MAX_REQS, Pool, Verify, dense_reference, layer_for, model_runner, qkv, triton_backend
from sglang.srt.layers.attention.tree_verify.hook import (
    BLOCK,
    CHAIN,
    FP8_KV_ENV,
    TREE,
    TreeVerifyUnavailable,
)

SHAPES = {
    # kind: (H, Hkv, Dqk, Dv)
    "mha": (4, 2, 64, 64),
    "mla": (3, 1, 576, 512),
}


def _run(algorithm, kind, prefix_lens, n, seed, strategy=None, monkeypatch=None, logit_cap=0.0):
    gen = torch.Generator().manual_seed(seed)
    h, hkv, dqk, dv = SHAPES[kind]
    dtype = torch.float16
    verify = Verify(prefix_lens, n, algorithm, gen)
    pool = Pool(hkv, dqk, dv, dtype, mla=kind == "mla")
    be = triton_backend(model_runner(algorithm), pool, verify, mla=kind == "mla")
    layer = layer_for(kind, h, hkv, dqk, dv, logit_cap=logit_cap)
    fb = verify.forward_batch()
    be.init_forward_metadata(fb)
    q, k, v = qkv(verify, h, hkv, dqk, dv, dtype, kind == "mla", gen)
    o = be.forward_extend(q, k, v, layer, fb)
    ref = dense_reference(verify, q.view(-1, h, dqk), pool, layer.scaling, logit_cap)
    return be, o.view(-1, h, dv), ref


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize(
    "prefix_lens,n",
    [([5], 4), ([0, 13, 7], 5), ([33, 1, 0, 20], 9), ([17, 40], 33)],
)
def test_ddtree_tree_matches_dense_mask(kind, prefix_lens, n):
    be, o, ref = _run("DDTREE", kind, prefix_lens, n, seed=len(prefix_lens) * 100 + n)
    assert be.consumes_tree_mask_bits
    assert be.tree_verify.metadata.kind == TREE
    torch.testing.assert_close(o.float(), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("prefix_lens,n", [([9], 8), ([0, 21, 6], 16)])
def test_dflash_chain_matches_causal(kind, prefix_lens, n):
    be, o, ref = _run("DFLASH", kind, prefix_lens, n, seed=7 + n)
    assert not be.consumes_tree_mask_bits  # DFLASH builds no tree mask at all
    assert be.tree_verify.metadata.kind == CHAIN
    torch.testing.assert_close(o.float(), ref, atol=2e-3, rtol=2e-3)


def test_logit_cap_is_applied():
    _, o, ref = _run("DDTREE", "mha", [11, 3], 6, seed=3, logit_cap=2.0)
    torch.testing.assert_close(o.float(), ref, atol=2e-3, rtol=2e-3)


def test_fused_kernel_interpreted_through_the_hook(monkeypatch):
    """The dispatcher's fused Triton kernels (interpreted) behind the hook."""
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", "fused")
    _, o, ref = _run("DDTREE", "mha", [0, 37], 7, seed=11)
    torch.testing.assert_close(o.float(), ref, atol=3e-3, rtol=3e-3)


def test_prefix_csr_reuses_the_backends_indptr():
    gen = torch.Generator().manual_seed(0)
    verify = Verify([4, 0, 9], 3, "DDTREE", gen)
    be = triton_backend(model_runner("DDTREE"), Pool(2, 64, 64, torch.float16, False), verify, False)
    be.init_forward_metadata(verify.forward_batch())
    meta = be.tree_verify.metadata
    assert meta.prefix_kv_indptr.data_ptr() == be.forward_metadata.kv_indptr.data_ptr()
    assert meta.prefix_kv_indptr.tolist() == [0, 4, 4, 13]
    upstream = be.forward_metadata.kv_indices[:13]
    assert meta.prefix_kv_indices.dtype == torch.int32
    assert meta.prefix_kv_indices[:13].tolist() == upstream.tolist()
    assert meta.tree_kv_indices.tolist() == verify.out_cache_loc.view(3, 3).tolist()
    assert meta.tree_mask is verify.spec_info.tree_mask_bits


def test_upstream_strategy_keeps_upstream_dense_path(monkeypatch):
    """SGLANG_DDTREE_VERIFY_STRATEGY=upstream_extend: the hook is off, the
    worker must build the dense mask, and upstream's extend kernel applies it."""
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", "upstream_extend")
    gen = torch.Generator().manual_seed(5)
    h, hkv, dqk, dv = SHAPES["mha"]
    verify = Verify([6, 2], 4, "DDTREE", gen, dense_mask=True)
    pool = Pool(hkv, dqk, dv, torch.float16, mla=False)
    be = triton_backend(model_runner("DDTREE"), pool, verify, mla=False)
    assert be.tree_verify.kind is None and not be.consumes_tree_mask_bits
    layer = layer_for("mha", h, hkv, dqk, dv)
    fb = verify.forward_batch()
    be.init_forward_metadata(fb)
    assert be.tree_verify.metadata is None
    q, k, v = qkv(verify, h, hkv, dqk, dv, torch.float16, False, gen)
    o = be.forward_extend(q, k, v, layer, fb)
    ref = dense_reference(verify, q.view(-1, h, dqk), pool, layer.scaling)
    torch.testing.assert_close(o.view(-1, h, dv).float(), ref, atol=3e-3, rtol=3e-3)


def test_draft_runner_serves_the_block_and_other_algorithms_keep_upstream():
    gen = torch.Generator().manual_seed(1)
    verify = Verify([3], 4, "DDTREE", gen)
    pool = Pool(2, 64, 64, torch.float16, False)
    for algo in ("DDTREE", "DFLASH"):
        assert triton_backend(model_runner(algo, is_draft=True), pool, verify, False).tree_verify.kind == BLOCK
    windowed = model_runner("DFLASH", is_draft=True)
    windowed.server_args.speculative_draft_window_size = 256  # compact draft cache: upstream
    assert triton_backend(windowed, pool, verify, False).tree_verify.kind is None
    assert triton_backend(model_runner("EAGLE"), pool, verify, False).tree_verify.kind is None
    assert triton_backend(model_runner("DSPARK"), pool, verify, False).tree_verify.kind is None


@pytest.mark.parametrize("algorithm", ["DFLASH", "DDTREE"])
@pytest.mark.parametrize("attn_type", [AttentionType.ENCODER_ONLY, AttentionType.DECODER])
@pytest.mark.parametrize("prefix_lens,n", [([9], 8), ([0, 21, 6], 16)])
def test_draft_block_matches_upstream_attention(algorithm, attn_type, prefix_lens, n):
    """The DFlash drafter's block forward (TARGET_VERIFY on the draft worker,
    a DFlash verify input whatever the algorithm): its non-causal layers see
    the prefix and the whole block, causal layers the chain; compared with
    upstream's extend path on the same inputs and with the dense definition."""
    gen = torch.Generator().manual_seed(n * 3 + len(prefix_lens))
    h, hkv, dqk, dv = SHAPES["mha"]
    verify = Verify(prefix_lens, n, "DFLASH", gen)
    pool = Pool(hkv, dqk, dv, torch.float16, mla=False)
    be = triton_backend(model_runner(algorithm, is_draft=True), pool, verify, mla=False)
    layer = layer_for("mha", h, hkv, dqk, dv)
    layer.attn_type = attn_type
    fb = verify.forward_batch()
    be.init_forward_metadata(fb)
    assert be.tree_verify.metadata.kind == BLOCK
    q, k, v = qkv(verify, h, hkv, dqk, dv, torch.float16, False, gen)
    o = be.forward_extend(q, k, v, layer, fb).view(-1, h, dv).float()
    if attn_type == AttentionType.ENCODER_ONLY:
        verify.visible = lambda b: torch.ones(n, int(verify.prefix[b]) + n, dtype=torch.bool)
    ref = dense_reference(verify, q.view(-1, h, dqk), pool, layer.scaling)
    torch.testing.assert_close(o, ref, atol=2e-3, rtol=2e-3)
    upstream = triton_backend(model_runner(algorithm, is_draft=True), pool, verify, mla=False)
    upstream.tree_verify.kind = None  # the path the drafter ran before
    upstream.init_forward_metadata(fb)
    o_up = upstream.forward_extend(q, k, v, layer, fb).view(-1, h, dv).float()
    torch.testing.assert_close(o, o_up, atol=3e-3, rtol=3e-3)


def test_unservable_layer_without_dense_mask_refuses():
    """A tree verify the hook cannot serve must not silently run causal."""
    gen = torch.Generator().manual_seed(2)
    h, hkv, dqk, dv = SHAPES["mha"]
    verify = Verify([5], 4, "DDTREE", gen)
    pool = Pool(hkv, dqk, dv, torch.float16, mla=False)
    be = triton_backend(model_runner("DDTREE"), pool, verify, mla=False)
    fb = verify.forward_batch()
    be.init_forward_metadata(fb)
    q, k, v = qkv(verify, h, hkv, dqk, dv, torch.float16, False, gen)
    with pytest.raises(TreeVerifyUnavailable, match="score_mod"):
        be.forward_extend(q, k, v, layer_for("mha", h, hkv, dqk, dv), fb, score_mod=lambda *a: a[0])


def test_static_refusals_leave_the_dense_path(monkeypatch):
    """An fp8 KV cache with the fused path turned off keeps upstream's path: the
    worker then builds the dense mask (consumes_tree_mask_bits is False).
    (Sliding-window models: tests/cpu/tree_verify_integration/test_window_sinks_hook.py.)"""
    from sglang.srt.layers.attention.tree_verify.backends import triton_hook

    monkeypatch.setenv(FP8_KV_ENV, "0")

    gen = torch.Generator().manual_seed(4)
    verify = Verify([3], 4, "DDTREE", gen)
    be = triton_backend(model_runner("DDTREE"), Pool(2, 64, 64, torch.float16, False), verify, False)
    runner = model_runner("DDTREE")
    runner.kv_cache_dtype = torch.float8_e4m3fn
    runner.req_to_token_pool.req_to_token = verify.req_to_token
    assert not triton_hook(be, runner).consumes_tree_mask_bits


@pytest.mark.parametrize("env", [None, "1", "0"])
def test_fp8_kv_cache_is_served_unless_turned_off(monkeypatch, env):
    """An fp8 KV cache is served through the hook by default (and with
    SGLANG_DDTREE_FP8_KV_VERIFY=1), equal to the dense attention over the
    dequantized cache; =0 leaves it to upstream's dense-mask path."""
    if env is None:
        monkeypatch.delenv(FP8_KV_ENV, raising=False)
    else:
        monkeypatch.setenv(FP8_KV_ENV, env)
    opt_in = env != "0"
    gen = torch.Generator().manual_seed(31)
    h, hkv, dqk, dv = SHAPES["mha"]
    verify = Verify([12, 0, 30], 7, "DDTREE", gen)
    pool = Pool(hkv, dqk, dv, torch.float16, mla=False)
    pool.k, pool.v = pool.k.to(torch.float8_e4m3fn), pool.v.to(torch.float8_e4m3fn)
    runner = model_runner("DDTREE")
    runner.kv_cache_dtype = torch.float8_e4m3fn
    be = triton_backend(runner, pool, verify, mla=False)
    if not opt_in:
        assert be.tree_verify.kind is None and not be.consumes_tree_mask_bits
        return
    assert be.tree_verify.kind == TREE
    layer = layer_for("mha", h, hkv, dqk, dv)
    fb = verify.forward_batch()
    be.init_forward_metadata(fb)
    q, k, v = qkv(verify, h, hkv, dqk, dv, torch.float16, False, gen)
    o = be.forward_extend(q, k, v, layer, fb).view(-1, h, dv).float()
    ref = dense_reference(verify, q.view(-1, h, dqk), pool, layer.scaling)  # reads the fp8 pool
    torch.testing.assert_close(o, ref, atol=2e-3, rtol=2e-3)



def _observe_flashmla_runner(monkeypatch):
    """flashmla_split's runner observed, computing the reference (FlashMLA itself runs
    on the GPU host only, tests/gpu/tree_verify); returns each call's options."""
    from sglang.srt.layers.attention.tree_verify.strategies import get_strategy

    calls = []

    def observed(*, arch, kv_scales, staging=None, plan=None, max_prefix_len=None, **call):
        calls.append(dict(staging=staging, plan=plan))
        return get_strategy("reference").run(arch=arch, kv_scales=kv_scales, **call)

    monkeypatch.setattr(get_strategy("flashmla_split"), "run", observed)
    return calls


def test_flashmla_strategy_routes_the_targets_verify_only(monkeypatch):
    """SGLANG_DDTREE_VERIFY_STRATEGY=flashmla_split: the target's tree verify goes to
    flashmla_split with one page staging for every layer (room for the whole pool) and
    one plan per forward (layout for the context-length bound, made by its first layer);
    the drafter's block keeps the default. FlashMLA runs on the GPU host only
    (tests/gpu/tree_verify), so here its scheduler returns placeholders and its runner
    is observed, computing the reference."""
    from sglang.srt.layers.attention.tree_verify import flashmla_split
    from sglang.srt.utils import gpu_arch

    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", "flashmla_split")
    monkeypatch.setattr(gpu_arch, "device_capability", lambda device=None: (9, 0))
    schedules = []
    monkeypatch.setattr(flashmla_split, "_flash_mla", lambda: (None, lambda *a: schedules.append(a) or ("s", "n")))
    calls = _observe_flashmla_runner(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    h, hkv, dqk, dv = SHAPES["mla"]
    verify = Verify([17, 40], 9, "DDTREE", gen)
    pool = Pool(hkv, dqk, dv, torch.float16, mla=True)
    be = triton_backend(model_runner("DDTREE"), pool, verify, mla=True)
    fb = verify.forward_batch()
    be.init_forward_metadata(fb)
    for layer_id in range(2):  # two layers of one forward
        layer = layer_for("mla", h, hkv, dqk, dv)
        layer.layer_id = layer_id
        q, k, v = qkv(verify, h, hkv, dqk, dv, torch.float16, True, gen)
        o = be.forward_extend(q, k, v, layer, fb)
        ref = dense_reference(verify, q.view(-1, h, dqk), pool, layer.scaling)
        torch.testing.assert_close(o.view(-1, h, dv).float(), ref, atol=2e-3, rtol=2e-3)
    assert len(calls) == 2 and calls[0]["staging"] is calls[1]["staging"]
    plan = calls[0]["plan"]
    assert calls[1]["plan"] is plan and len(schedules) == 1  # planned once per forward
    assert schedules[0][1:] == (9 * h, 1)  # query rows per KV head, one KV head
    assert plan.max_pages == flashmla_split.pages_for(MAX_CTX)
    assert plan.lengths.tolist() == [17, 40] and plan.page_start.tolist() == [0, 1]
    assert plan.page_table[1, :1].tolist() == [1]
    pool_rows = pool.get_key_buffer(0).shape[0]
    assert calls[0]["staging"].shape == (flashmla_split.staging_pages(MAX_REQS, pool_rows), 64, 1, 576)

    # The same batch's forward again (the graph runner's warm-ups, then its capture):
    # its first layer plans again, so a capture records the planning.
    layer.layer_id = 0
    be.forward_extend(*qkv(verify, h, hkv, dqk, dv, torch.float16, True, gen), layer, fb)
    assert calls[2]["plan"] is not plan and len(schedules) == 2
    be.init_forward_metadata(verify.forward_batch())  # the next forward plans anew
    be.forward_extend(*qkv(verify, h, hkv, dqk, dv, torch.float16, True, gen), layer, verify.forward_batch())
    assert calls[3]["plan"] is not calls[2]["plan"] and calls[3]["staging"] is calls[0]["staging"]

    # The drafter's block is not FlashMLA's: default kernels, the env ignored.
    draft = triton_backend(model_runner("DDTREE", is_draft=True), Pool(2, 64, 64, torch.float16, False),
                           Verify([3], 4, "DDTREE", gen), False)
    assert draft.tree_verify.kind == BLOCK and draft.tree_verify.routes is None


def test_flashmla_strategy_is_refused_at_startup_off_sm90_sm100(monkeypatch):
    from sglang.srt.utils import gpu_arch

    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", "flashmla_split")
    monkeypatch.setattr(gpu_arch, "device_capability", lambda device=None: (12, 0))
    verify = Verify([3], 4, "DDTREE", torch.Generator().manual_seed(0))
    with pytest.raises(TreeVerifyUnavailable, match="sm_90a/sm_100a only, not compute capability 12.0"):
        triton_backend(model_runner("DDTREE"), Pool(1, 576, 512, torch.float16, True), verify, True)


def _default_flashmla_backend(monkeypatch, cap, n, flash_mla_loads=True, draft=False, prefix_lens=(17, 40)):
    """A DDTREE Triton backend with the strategy variable unset on a GPU of
    capability ``cap``; FlashMLA's scheduler returns placeholders and its runner is
    observed computing the reference (FlashMLA itself runs in tests/gpu)."""
    from sglang.srt.layers.attention.tree_verify import StrategyUnavailable, flashmla_split, policy
    from sglang.srt.utils import gpu_arch

    monkeypatch.setattr(gpu_arch, "device_capability", lambda device=None: cap)

    def flash_mla():
        if not flash_mla_loads:
            raise StrategyUnavailable("flashmla_split needs sgl_kernel's FlashMLA: no module")
        return None, lambda *a: ("s", "n")

    monkeypatch.setattr(flashmla_split, "_flash_mla", flash_mla)
    # 3 MLA heads here: a 9-node tree is "wide" (27 rows), a 4-node one is not.
    monkeypatch.setattr(policy, "FLASHMLA_MIN_ROWS", 9 * SHAPES["mla"][0])
    calls = _observe_flashmla_runner(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    h, hkv, dqk, dv = SHAPES["mla"]
    verify = Verify(list(prefix_lens), n, "DDTREE", gen)
    pool = Pool(hkv, dqk, dv, torch.float16, mla=True)
    be = triton_backend(model_runner("DDTREE", is_draft=draft), pool, verify, mla=True)

    def forward():
        fb = verify.forward_batch()
        be.init_forward_metadata(fb)
        layer = layer_for("mla", h, hkv, dqk, dv)
        q, k, v = qkv(verify, h, hkv, dqk, dv, torch.float16, True, gen)
        o = be.forward_extend(q, k, v, layer, fb)
        ref = dense_reference(verify, q.view(-1, h, dqk), pool, layer.scaling)
        torch.testing.assert_close(o.view(-1, h, dv).float(), ref, atol=2e-3, rtol=2e-3)

    return be, forward, calls


def test_flashmla_is_the_default_for_wide_trees_on_sm90(monkeypatch):
    monkeypatch.delenv("SGLANG_DDTREE_VERIFY_STRATEGY", raising=False)
    be, forward, calls = _default_flashmla_backend(monkeypatch, (9, 0), n=9)
    routes = be.tree_verify.routes
    assert routes.forced is None and routes.strategy(2, 9, SHAPES["mla"][0]) == "flashmla_split"
    forward()
    forward()
    assert len(calls) == 2 and calls[0]["staging"] is calls[1]["staging"]
    assert calls[0]["plan"] is not calls[1]["plan"]  # one plan per forward

    _, forward, calls = _default_flashmla_backend(monkeypatch, (9, 0), n=4)  # narrow tree
    forward()
    assert calls == []


@pytest.mark.parametrize(
    "cap,env,loads,draft",
    [((12, 0), None, True, False),  # sm_120: no FlashMLA kernels
     ((10, 0), None, True, False),  # sm_100: FlashMLA ships kernels, but never measured here
     ((9, 0), "fused", True, False),  # the user keeps the fused kernel
     ((9, 0), None, False, False),  # sgl_kernel's FlashMLA does not load
     ((9, 0), None, True, True)],  # the drafter's block
)  # fmt: skip
def test_default_keeps_the_fused_kernel_where_flashmla_is_not_measured_or_not_wanted(
    monkeypatch, cap, env, loads, draft
):
    if env is None:
        monkeypatch.delenv("SGLANG_DDTREE_VERIFY_STRATEGY", raising=False)
    else:
        monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", env)
    prefix_lens = (3,) if draft else (17, 40)
    be, forward, calls = _default_flashmla_backend(
        monkeypatch, cap, n=9, flash_mla_loads=loads, draft=draft, prefix_lens=prefix_lens
    )
    routes = be.tree_verify.routes
    if draft:
        assert be.tree_verify.kind == BLOCK and routes is None
    else:
        assert routes.strategy(2, 9, SHAPES["mla"][0]) == "fused"
    if not draft:
        forward()
        assert calls == []


def test_default_flashmla_without_room_for_its_staging_falls_back_for_good(monkeypatch, caplog):
    """Out of memory for the page staging: a warning, the fused path, and no retry,
    so graphs captured later record the same path as eager forwards."""
    from sglang.srt.layers.attention.tree_verify import flashmla_split

    monkeypatch.delenv("SGLANG_DDTREE_VERIFY_STRATEGY", raising=False)
    be, forward, calls = _default_flashmla_backend(monkeypatch, (9, 0), n=9)
    tries = []

    def no_room(pages, like):
        tries.append(pages)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(flashmla_split, "new_staging", no_room)
    with caplog.at_level("WARNING"):
        forward()
        forward()
    assert calls == [] and len(tries) == 1 and be.tree_verify.routes.planners["flashmla_split"].off
    assert be.tree_verify.routes.strategy(2, 9, SHAPES["mla"][0]) == "fused"
    assert "FlashMLA verify off, the fused kernel serves it: no room for its page staging" in caplog.text


def test_forced_flashmla_without_room_for_its_staging_raises(monkeypatch):
    from sglang.srt.layers.attention.tree_verify import flashmla_split

    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", "flashmla_split")
    be, forward, calls = _default_flashmla_backend(monkeypatch, (9, 0), n=9)

    def no_room(pages, like):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(flashmla_split, "new_staging", no_room)
    with pytest.raises(RuntimeError, match="flashmla_split: no room for its page staging"):
        forward()
