# SPDX-License-Identifier: Apache-2.0
"""GPU: the patched Triton backend's TARGET_VERIFY through the tree-verify hook
against upstream's own extend path with the dense custom mask, at real shapes,
eager and under CUDA-graph capture/replay; the patched FlashInfer MHA and MLA
backends' against dense attention.

Run on the GPU host (patched sglang installed, see docs/GPU_HOST.md):
    bash scripts/gpu_host/run_gpu_tier.sh --only tree_verify_integration
"""

import time

import pytest
import torch

from tests.gpu.tree_verify_integration._gpu_host import require_cuda, require_flashinfer, require_flashmla
from tests.cpu.tree_verify_integration._setup import (
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

from sglang.srt.layers.attention.tree_verify.backends import (  # noqa: E402
    triton_layer_unsupported as triton_tree_verify_layer_unsupported,
)
from sglang.srt.layers.attention.tree_verify.hook import BLOCK, TREE  # noqa: E402


@pytest.fixture(autouse=True)
def _cuda():
    require_cuda()

SHAPES = {
    "mla16": ("mla", 16, 1, 576, 512),
    "gqa": ("mha", 32, 8, 128, 128),
}
CTX = 16384 + 512
POOL_SIZE = 3 * CTX


def _setup(algorithm, shape, prefix, n, seed, dtype, dense_mask=False):
    kind, h, hkv, dqk, dv = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    verify = Verify(prefix, n, algorithm, gen, dense_mask=dense_mask, max_ctx=CTX,
                    pool_size=POOL_SIZE, device="cuda")  # fmt: skip
    pool = Pool(hkv, dqk, dv, dtype, mla=kind == "mla", size=POOL_SIZE, device="cuda")
    runner = model_runner(algorithm, dtype=dtype, max_ctx=CTX, device="cuda")
    be = triton_backend(runner, pool, verify, mla=kind == "mla")
    layer = layer_for(kind, h, hkv, dqk, dv)
    q, k, v = qkv(verify, h, hkv, dqk, dv, dtype, kind == "mla", gen)
    return verify, pool, be, layer, (q, k, v), (h, dqk, dv)


def _forward(be, verify, layer, qkv_, dims):
    h, dqk, dv = dims
    fb = verify.forward_batch()
    be.init_forward_metadata(fb)
    q, k, v = qkv_
    return be.forward_extend(q, k, v, layer, fb).view(-1, h, dv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("prefix,n", [([16384], 65), ([1000, 0, 4097, 77], 65), ([513, 2048], 17)])
def test_ddtree_hook_matches_upstream_dense_mask(monkeypatch, dtype, shape, prefix, n):
    verify, pool, be, layer, x, dims = _setup("DDTREE", shape, prefix, n, 1, dtype, dense_mask=True)
    assert be.consumes_tree_mask_bits
    hooked = _forward(be, verify, layer, x, dims)
    assert be.tree_verify.metadata.kind == TREE

    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", "upstream_extend")
    be_up = triton_backend(model_runner("DDTREE", dtype=dtype, max_ctx=CTX, device="cuda"), pool, verify,
                           mla=SHAPES[shape][0] == "mla")  # fmt: skip
    assert be_up.tree_verify.kind is None
    upstream = _forward(be_up, verify, layer, x, dims)
    ref = dense_reference(verify, x[0].view(-1, dims[0], dims[1]), pool, layer.scaling)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(upstream.float(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(hooked.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("prefix,n", [([16384], 65), ([1000, 0, 4097, 77], 17)])
def test_flashinfer_mha_hook_matches_dense_attention(prefix, n):
    """The patched FlashInferAttnBackend (GQA 32/8/128) serves a DDTREE verify
    through the hook at real shapes: this step's K/V written by its
    forward_extend, the tree read from the bits."""
    require_flashinfer()
    dtype = torch.bfloat16
    kind, h, hkv, dqk, dv = SHAPES["gqa"]
    gen = torch.Generator().manual_seed(5)
    verify = Verify(prefix, n, "DDTREE", gen, max_ctx=CTX, pool_size=POOL_SIZE, device="cuda")
    pool = Pool(hkv, dqk, dv, dtype, mla=False, size=POOL_SIZE, device="cuda")
    be = flashinfer_backend(model_runner("DDTREE", dtype=dtype, max_ctx=CTX, device="cuda"), pool, verify)
    assert be.consumes_tree_mask_bits
    layer = layer_for(kind, h, hkv, dqk, dv)
    q, k, v = qkv(verify, h, hkv, dqk, dv, dtype, False, gen)
    fb = verify.forward_batch()
    be.init_forward_metadata(fb)  # the hook's metadata, no FlashInfer plan
    o = be.forward_extend(q, k, v, layer, fb).view(-1, h, dv)
    ref = dense_reference(verify, q.view(-1, h, dqk), pool, layer.scaling)
    torch.testing.assert_close(o.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("split_rope", [True, False])
@pytest.mark.parametrize("prefix,n", [([16384], 65), ([1000, 0, 4097, 77], 17)])
def test_flashinfer_mla_hook_matches_dense_attention(prefix, n, split_rope):
    """The patched FlashInferMLAAttnBackend (absorbed MLA, 16 heads) serves a
    DDTREE verify through the hook at real shapes, with q/k given whole or as
    latent + rope parts (how DeepSeek's attention calls it)."""
    dtype = torch.bfloat16
    kind, h, hkv, dqk, dv = SHAPES["mla16"]
    gen = torch.Generator().manual_seed(6)
    verify = Verify(prefix, n, "DDTREE", gen, max_ctx=CTX, pool_size=POOL_SIZE, device="cuda")
    pool = Pool(hkv, dqk, dv, dtype, mla=True, size=POOL_SIZE, device="cuda")
    be = flashinfer_mla_backend(model_runner("DDTREE", dtype=dtype, max_ctx=CTX, device="cuda"), pool, verify)
    assert be.consumes_tree_mask_bits
    layer = layer_for(kind, h, hkv, dqk, dv)
    q, k, _ = qkv(verify, h, hkv, dqk, dv, dtype, True, gen)
    fb = verify.forward_batch()
    be.tree_verify.prepare(fb)  # what the patched init_forward_metadata calls last
    o = mla_forward_extend(be, q, k, layer, fb, h, dv, split_rope)
    ref = dense_reference(verify, q.view(-1, h, dqk), pool, layer.scaling)
    torch.testing.assert_close(o.view(-1, h, dv).float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_dflash_chain_hook_matches_upstream_causal(monkeypatch, shape):
    dtype = torch.bfloat16
    verify, pool, be, layer, x, dims = _setup("DFLASH", shape, [16384, 3000], 16, 2, dtype)
    hooked = _forward(be, verify, layer, x, dims)
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", "upstream_extend")
    be_up = triton_backend(model_runner("DFLASH", dtype=dtype, max_ctx=CTX, device="cuda"), pool, verify,
                           mla=SHAPES[shape][0] == "mla")  # fmt: skip
    upstream = _forward(be_up, verify, layer, x, dims)  # upstream: causal, no mask
    torch.testing.assert_close(hooked.float(), upstream.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("attn_type", ["ENCODER_ONLY", "DECODER"])
@pytest.mark.parametrize("algorithm", ["DFLASH", "DDTREE"])
def test_draft_block_hook_matches_upstream(attn_type, algorithm):
    """The DFlash drafter's block (draft worker, TARGET_VERIFY) at a drafter's
    shape: non-causal layers see the whole block, causal ones the chain; eager
    and through a captured graph, against upstream's extend path."""
    from sglang.srt.layers.radix_attention import AttentionType

    dtype = torch.bfloat16
    kind, h, hkv, dqk, dv = SHAPES["gqa"]
    gen = torch.Generator().manual_seed(6)
    verify = Verify([16384, 3000, 0], 16, "DFLASH", gen, max_ctx=CTX, pool_size=POOL_SIZE, device="cuda")
    pool = Pool(hkv, dqk, dv, dtype, mla=False, size=POOL_SIZE, device="cuda")
    mk = lambda: triton_backend(  # noqa: E731
        model_runner(algorithm, dtype=dtype, is_draft=True, max_ctx=CTX, device="cuda"), pool, verify, mla=False
    )
    be, be_up = mk(), mk()
    be_up.tree_verify.kind = None  # what the drafter ran before
    layer = layer_for(kind, h, hkv, dqk, dv)
    layer.attn_type = getattr(AttentionType, attn_type)
    q, k, v = qkv(verify, h, hkv, dqk, dv, dtype, False, gen)
    hooked = _forward(be, verify, layer, (q, k, v), (h, dqk, dv))
    assert be.tree_verify.metadata.kind == BLOCK
    upstream = _forward(be_up, verify, layer, (q, k, v), (h, dqk, dv))
    torch.testing.assert_close(hooked.float(), upstream.float(), atol=2e-2, rtol=2e-2)

    be.tree_verify.init_graph_state(max_bs=4, max_num_tokens=4 * 16)
    fb = verify.forward_batch()
    be.kv_indptr[1:4] = torch.cumsum(fb.seq_lens, 0)
    be.tree_verify.prepare(fb, be.kv_indptr, graph=True)
    out = torch.zeros_like(hooked)
    run = lambda: be.tree_verify.run(  # noqa: E731
        q.view(-1, h, dqk), pool.get_key_buffer(0), pool.get_value_buffer(0), layer, fb, out=out,
        unsupported=triton_tree_verify_layer_unsupported(layer, attn_type == "DECODER", None),
    )
    run()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), upstream.float(), atol=2e-2, rtol=2e-2)


def _flashmla_or_skip(monkeypatch):
    """SGLANG_DDTREE_VERIFY_STRATEGY=flashmla_split, where FlashMLA can run."""
    require_flashmla()
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", "flashmla_split")


@pytest.mark.parametrize("prefix,n", [([16384], 65), ([1000, 0, 4097, 77], 65), ([513, 2048], 17)])
def test_flashmla_hook_matches_dense_attention(monkeypatch, prefix, n):
    """The hook's FlashMLA route (opt-in): pages copied from the slots, FlashMLA
    over them, our tree tail, against the dense definition."""
    _flashmla_or_skip(monkeypatch)
    verify, pool, be, layer, x, dims = _setup("DDTREE", "mla16", prefix, n, 1, torch.bfloat16)
    assert be.tree_verify.routes.forced == "flashmla_split"
    out = _forward(be, verify, layer, x, dims)
    ref = dense_reference(verify, x[0].view(-1, dims[0], dims[1]), pool, layer.scaling)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("shape,strategy", [("mla16", None), ("gqa", None), ("mla16", "flashmla_split")])
def test_graph_capture_and_replay(monkeypatch, shape, strategy):
    """Capture the hooked forward once (padded batch of 4), replay with new
    prefixes, trees and slots; outputs equal the eager hooked forward. With
    flashmla_split the capture must record the forward's planning (warm-ups
    ran the same batch eagerly first), so replays plan for their own batch."""
    if strategy == "flashmla_split":
        _flashmla_or_skip(monkeypatch)
    dtype = torch.bfloat16
    kind, h, hkv, dqk, dv = SHAPES[shape]
    n, graph_bs = 65, 4
    verify, pool, be, layer, x, dims = _setup("DDTREE", shape, [100, 200, 300, 400], n, 3, dtype)
    be.tree_verify.init_graph_state(max_bs=8, max_num_tokens=8 * n)
    static_q = torch.zeros(graph_bs * n, h * dqk, device="cuda", dtype=dtype)
    static_o = torch.zeros(graph_bs * n, h * dv, device="cuda", dtype=dtype)

    def prep(v_):
        fb = v_.forward_batch()
        be.kv_indptr[1 : graph_bs + 1] = torch.cumsum(fb.seq_lens, 0)
        be.tree_verify.prepare(fb, be.kv_indptr, graph=True)
        return fb

    fb = prep(verify)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up (Triton compiles)
            be.tree_verify.run(static_q.view(-1, h, dqk), pool.get_key_buffer(0), pool.get_value_buffer(0),
                               layer, fb, out=static_o.view(-1, h, dv))  # fmt: skip
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        be.tree_verify.run(static_q.view(-1, h, dqk), pool.get_key_buffer(0), pool.get_value_buffer(0),
                           layer, fb, out=static_o.view(-1, h, dv))  # fmt: skip

    gen = torch.Generator().manual_seed(4)
    for prefix in ([16000, 5, 0, 9000], [1, 2, 3, 4], [8192, 8192, 100, 7]):
        v2 = Verify(prefix, n, "DDTREE", gen, max_ctx=CTX, pool_size=POOL_SIZE, device="cuda")
        be.req_to_token.copy_(v2.req_to_token)
        v2.req_to_token = be.req_to_token
        q, k, vv = qkv(v2, h, hkv, dqk, dv, dtype, kind == "mla", gen)
        pool.set_kv_buffer(layer, v2.out_cache_loc, k, vv)
        prep(v2)
        static_q.copy_(q)
        g.replay()
        ref = dense_reference(v2, q.view(-1, h, dqk), pool, layer.scaling)
        torch.testing.assert_close(static_o.view(-1, h, dv).float(), ref, atol=2e-2, rtol=2e-2)


def test_report_step_time(monkeypatch, capsys):
    """Not a target: prints hooked vs upstream verify attention time per layer
    (MLA H=16, N=65, P=16K, bs 1) so the e2e numbers can be read against it."""
    dtype = torch.bfloat16
    verify, pool, be, layer, x, dims = _setup("DDTREE", "mla16", [16384], 65, 5, dtype, dense_mask=True)
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", "upstream_extend")
    be_up = triton_backend(model_runner("DDTREE", dtype=dtype, max_ctx=CTX, device="cuda"), pool, verify, mla=True)
    monkeypatch.delenv("SGLANG_DDTREE_VERIFY_STRATEGY")
    res = {}
    for name, b in (("hooked", be), ("upstream_dense_mask", be_up)):
        fb = verify.forward_batch()
        b.init_forward_metadata(fb)
        q, k, v = x
        for _ in range(3):
            b.forward_extend(q, k, v, layer, fb)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            b.forward_extend(q, k, v, layer, fb)
        torch.cuda.synchronize()
        res[name] = (time.perf_counter() - t0) / 20 * 1e3
    with capsys.disabled():
        print(f"\nverify attention per layer (eager, incl. KV store): {res}")
    assert res["hooked"] < res["upstream_dense_mask"]
