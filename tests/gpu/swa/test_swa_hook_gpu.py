# SPDX-License-Identifier: Apache-2.0
"""GPU: the patched Triton backend's tree-verify hook on upstream's real hybrid SWA KV
pool at gpt-oss's and Gemma 4's sliding-layer shapes (bf16): DDTREE trees against the
depth-positioned fp32 reference, a DFLASH chain against upstream's own extend path,
and the SWA slot buffers under CUDA-graph capture and replay. The step and the
reference are the CPU tests' (tests/cpu/tree_verify_integration/_swa.py), on CUDA.

On the GPU host after scripts/gpu_host/install.sh:
    bash scripts/gpu_host/run_gpu_tier.sh --only swa
"""

from __future__ import annotations

import pytest
import torch

from tests.cpu.tree_verify_integration._swa import (
    FULL_LAYER,
    SWA_LAYER,
    Shape,
    SWAVerify,
    layer,
    prepared,
    reference,
    run_layer,
)
from tests.gpu.tree_verify_integration._gpu_host import require_cuda

SHAPES = {
    # gpt-oss: 64 query and 8 KV heads of 64, a 128-token window (sliding_window_size 127)
    "gptoss": Shape(h=64, hkv=8, d=64, window=127, full_slots=24576, swa_slots=16384, max_ctx=10240),
    # Gemma 4 31B's sliding layers: 32 query and 16 KV heads of 256, a 1,024-token window
    "gemma4": Shape(h=32, hkv=16, d=256, window=1023, full_slots=24576, swa_slots=16384, max_ctx=10240),
}
TOL = 2e-2


@pytest.fixture(autouse=True)
def _cuda():
    require_cuda()


def sinks_for(shape: Shape, gen):
    return (torch.randn(shape.h, generator=gen) * 2).to("cuda", torch.bfloat16)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("prefix,n", [([4096], 65), ([3000, 0, 200, 1500], 17), ([129, 1024, 7], 33)])
def test_tree_on_the_swa_pool_matches_depth_positions(shape, prefix, n):
    s = SHAPES[shape]
    gen = torch.Generator().manual_seed(sum(prefix) + n)
    sv = SWAVerify(prefix, n, "DDTREE", gen, shape=s, device="cuda", dtype=torch.bfloat16)
    be = prepared(sv.backend(), sv)
    assert be.tree_verify.metadata.swa is not None
    sinks = sinks_for(s, gen) if shape == "gptoss" else None
    for layer_id, window in ((SWA_LAYER, s.window), (FULL_LAYER, None)):
        q, k, v, o = run_layer(be, sv, layer_id, window, sinks, gen)
        torch.testing.assert_close(o, reference(sv, q, k, v, layer_id, window, sinks), atol=TOL, rtol=TOL)


def test_dflash_chain_equals_upstreams_path():
    """A chain through the hook equals upstream's own extend path (the hook off)
    on the same SWA pool and step: window, sinks and SWA slot ids included."""
    s = SHAPES["gptoss"]
    gen = torch.Generator().manual_seed(3)
    sv = SWAVerify([3000, 40, 0, 700], 16, "DFLASH", gen, shape=s, device="cuda", dtype=torch.bfloat16)
    hooked = prepared(sv.backend("DFLASH"), sv)
    upstream = sv.backend("DFLASH")
    upstream.tree_verify.kind = None
    upstream = prepared(upstream, sv)
    sinks = sinks_for(s, gen)
    for layer_id, window in ((SWA_LAYER, s.window), (FULL_LAYER, None)):
        state = gen.get_state()
        q, k, v, o = run_layer(hooked, sv, layer_id, window, sinks, gen)
        gen.set_state(state)
        _, _, _, o_up = run_layer(upstream, sv, layer_id, window, sinks, gen)
        torch.testing.assert_close(o, o_up, atol=TOL, rtol=TOL)
        torch.testing.assert_close(o, reference(sv, q, k, v, layer_id, window, sinks), atol=TOL, rtol=TOL)


def test_graph_capture_and_replay_on_the_swa_pool():
    """The sliding layer's hooked attention captured once (a padded batch of 4),
    replayed for new requests on the same pools: the SWA window CSR and tree slots
    are refilled outside the graph, at fixed addresses."""
    s = SHAPES["gptoss"]
    n, graph_bs = 65, 4
    gen = torch.Generator().manual_seed(4)
    sv = SWAVerify([300, 200, 100, 400], n, "DDTREE", gen, shape=s, device="cuda", dtype=torch.bfloat16)
    be = sv.backend()
    be.tree_verify.init_graph_state(max_bs=8, max_num_tokens=8 * n)
    sinks = sinks_for(s, gen)
    lay = layer(s, SWA_LAYER, s.window)
    k_buf, v_buf = sv.pool.get_key_buffer(SWA_LAYER), sv.pool.get_value_buffer(SWA_LAYER)
    static_q = torch.zeros(graph_bs * n, s.h, s.d, device="cuda", dtype=torch.bfloat16)
    static_o = torch.zeros(graph_bs * n, s.h, s.d, device="cuda", dtype=torch.bfloat16)

    def prep():
        fb = sv.verify.forward_batch()
        be.tree_verify.req_to_token = sv.verify.req_to_token
        be.kv_indptr[1 : graph_bs + 1] = torch.cumsum(fb.seq_lens, 0)
        be.tree_verify.prepare(fb, be.kv_indptr, graph=True)
        return fb

    fb = prep()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up (Triton compiles)
            be.tree_verify.run(static_q, k_buf, v_buf, lay, fb, out=static_o, sinks=sinks)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        be.tree_verify.run(static_q, k_buf, v_buf, lay, fb, out=static_o, sinks=sinks)

    for prefix in ([5000, 5, 0, 2000], [1, 2, 3, 4], [127, 128, 129, 4096]):
        sv.step(prefix, n, "DDTREE", gen)
        q = torch.randn(graph_bs * n, s.h, s.d, generator=gen).to("cuda", torch.bfloat16)
        k = torch.randn(graph_bs * n, s.hkv, s.d, generator=gen).to("cuda", torch.bfloat16)
        v = torch.randn(graph_bs * n, s.hkv, s.d, generator=gen).to("cuda", torch.bfloat16)
        tree_swa = sv.pool.translate_loc_from_full_to_swa(sv.verify.out_cache_loc)
        k_buf[tree_swa], v_buf[tree_swa] = k, v
        prep()
        static_q.copy_(q)
        g.replay()
        ref = reference(sv, q, k, v, SWA_LAYER, s.window, sinks)
        torch.testing.assert_close(static_o.float(), ref, atol=TOL, rtol=TOL)
