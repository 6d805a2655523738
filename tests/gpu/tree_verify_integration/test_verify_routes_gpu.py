# SPDX-License-Identifier: Apache-2.0
"""GPU: the verify routes the policy adds, on the real patched backends at real shapes.

* flashinfer_split behind the Triton backend's hook, chosen by a measured table (or
  forced): FlashInfer planned once per forward from the host's lengths, eager and
  under CUDA-graph capture with replays at new prefix lengths; natively (FA3 on
  sm_90a) and as the sm_120 proxy (FlashInfer's fa2 kernels, sm_120 tiles);
* the DFLASH chain verify and the DFlash drafter's block on the FlashInfer MHA
  backend through the hook, eager and replayed.

Run on the GPU host:
    bash scripts/gpu_host/run_gpu_tier.sh --only tree_verify_integration
"""

import json

import pytest
import torch

from tests.cpu.tree_verify_integration._setup import (
    Pool,
    Verify,
    dense_reference,
    flashinfer_backend,
    layer_for,
    model_runner,
    qkv,
    triton_backend,
)
from tests.gpu.tree_verify_integration._gpu_host import require_cuda, require_flashinfer

from sglang.srt.layers.attention.tree_verify.hook import BLOCK, CHAIN  # noqa: E402
from sglang.srt.layers.radix_attention import AttentionType  # noqa: E402

CTX = 16384 + 512
POOL_SIZE = 3 * CTX
MLA16 = ("mla", 16, 1, 576, 512)
GQA = ("mha", 32, 8, 128, 128)
TOL = 2e-2  # bf16


@pytest.fixture(autouse=True)
def _gpu():
    require_cuda()
    require_flashinfer()


@pytest.fixture
def flashinfer_policy(monkeypatch, tmp_path):
    """A measured table in which flashinfer_split serves H16 N65 at any batch, for
    the family this GPU's policy follows (sm12x under the proxy)."""

    def use(proxy: bool):
        from sglang.srt.utils import gpu_arch

        monkeypatch.delenv("SGLANG_DDTREE_VERIFY_STRATEGY", raising=False)
        if proxy:
            monkeypatch.setenv(gpu_arch.SM120_PROXY_ENV, "1")
        else:
            monkeypatch.delenv(gpu_arch.SM120_PROXY_ENV, raising=False)
        family = gpu_arch.arch_family(gpu_arch.policy_arch())
        rows = [{"H": 16, "N": 65, "P": p, "bs": bs, "ms": {"fused": 1.0, "flashinfer_split": 0.5}}
                for p in (1024, 16384) for bs in (1, 4)]  # fmt: skip
        path = tmp_path / "table.json"
        path.write_text(json.dumps({"sections": [
            {"arch": family, "date": "2026-12-02", "hardware": "test", "command": "test", "rows": rows}
        ]}))  # fmt: skip
        monkeypatch.setenv("SGLANG_DDTREE_STRATEGY_TABLE", str(path))

    return use


def _mla_backend(verify, pool):
    runner = model_runner("DDTREE", dtype=torch.bfloat16, max_ctx=CTX, device="cuda", attention=MLA16)
    return triton_backend(runner, pool, verify, mla=True)


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("proxy", [False, True])
@pytest.mark.parametrize("prefix,n", [([16384], 65), ([1000, 0, 4097, 77], 65)])
def test_flashinfer_route_matches_dense_attention(flashinfer_policy, proxy, prefix, n, staged):
    """``staged``: the lengths copied to pinned host memory ahead, as the workers do
    before the draft, and the plan made from them."""
    flashinfer_policy(proxy)
    _, h, hkv, dqk, dv = MLA16
    gen = torch.Generator().manual_seed(11)
    verify = Verify(prefix, n, "DDTREE", gen, max_ctx=CTX, pool_size=POOL_SIZE, device="cuda")
    pool = Pool(hkv, dqk, dv, torch.bfloat16, mla=True, size=POOL_SIZE, device="cuda")
    be = _mla_backend(verify, pool)
    routes = be.tree_verify.routes
    assert routes.strategy(len(prefix), n, h) == "flashinfer_split"
    assert ("flashmla_split" in routes.available) == (not proxy and torch.cuda.get_device_capability()[0] == 9)
    layer = layer_for("mla", h, hkv, dqk, dv)
    q, k, v = qkv(verify, h, hkv, dqk, dv, torch.bfloat16, True, gen)
    fb = verify.forward_batch()
    if staged:  # the workers stage once a verify has taken a strategy that plans on the host
        be.init_forward_metadata(fb)
        assert be.tree_verify.wants_prefix_lens
        be.tree_verify.stage_prefix_lens(verify.prefix)
    be.init_forward_metadata(fb)
    (prefix_pass,) = routes.planners["flashinfer_split"]._passes.values()
    assert (prefix_pass._host is not None) == staged
    if staged:
        assert prefix_pass._host["lens"].is_pinned() and prefix_pass._host["lens"].tolist() == prefix
    if proxy:  # FlashInfer's kernels of an sm_120 GPU
        assert prefix_pass.wrapper._backend == "fa2"
    o = be.forward_extend(q, k, v, layer, fb).view(-1, h, dv)
    ref = dense_reference(verify, q.view(-1, h, dqk), pool, layer.scaling)
    torch.testing.assert_close(o.float(), ref, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("proxy", [False, True])
def test_flashinfer_route_replays_with_new_prefix_lengths(flashinfer_policy, proxy, staged):
    """Captured once at batch 4; every replay is planned from its own lengths
    (outside the graph: from the device, or ``staged`` on the host ahead, as the
    workers do before the draft) and reads the hook's persistent buffers."""
    flashinfer_policy(proxy)
    _, h, hkv, dqk, dv = MLA16
    n, graph_bs = 65, 4
    gen = torch.Generator().manual_seed(12)
    verify = Verify([100, 200, 300, 400], n, "DDTREE", gen, max_ctx=CTX, pool_size=POOL_SIZE, device="cuda")
    pool = Pool(hkv, dqk, dv, torch.bfloat16, mla=True, size=POOL_SIZE, device="cuda")
    be = _mla_backend(verify, pool)
    be.tree_verify.init_graph_state(max_bs=8, max_num_tokens=8 * n)
    layer = layer_for("mla", h, hkv, dqk, dv)
    static_q = torch.zeros(graph_bs * n, h, dqk, device="cuda", dtype=torch.bfloat16)
    static_o = torch.zeros(graph_bs * n, h, dv, device="cuda", dtype=torch.bfloat16)

    def prep(v_):
        fb = v_.forward_batch()
        be.kv_indptr[1 : graph_bs + 1] = torch.cumsum(fb.seq_lens, 0)
        be.tree_verify.prepare(fb, be.kv_indptr, graph=True)
        return fb

    def run(fb):
        be.tree_verify.run(static_q, pool.get_key_buffer(0), pool.get_value_buffer(0), layer, fb, out=static_o)

    fb = prep(verify)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run(fb)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run(fb)
    assert len(be.tree_verify.routes.planners["flashinfer_split"]._passes) == 1
    for prefix in ([16000, 5, 0, 9000], [1, 2, 3, 4], [8192, 8192, 100, 7]):
        v2 = Verify(prefix, n, "DDTREE", gen, max_ctx=CTX, pool_size=POOL_SIZE, device="cuda")
        be.req_to_token.copy_(v2.req_to_token)
        v2.req_to_token = be.req_to_token
        q, k, vv = qkv(v2, h, hkv, dqk, dv, torch.bfloat16, True, gen)
        pool.set_kv_buffer(layer, v2.out_cache_loc, k, vv)
        if staged:  # prep() above took flashinfer_split: the workers stage from here on
            assert be.tree_verify.wants_prefix_lens
            be.tree_verify.stage_prefix_lens(v2.prefix)
        prep(v2)
        static_q.copy_(q.view(-1, h, dqk))
        g.replay()
        ref = dense_reference(v2, q.view(-1, h, dqk), pool, layer.scaling)
        torch.testing.assert_close(static_o.float(), ref, atol=TOL, rtol=TOL)
    assert len(be.tree_verify.routes.planners["flashinfer_split"]._passes) == 1  # one pass per captured batch size


def _gqa_flashinfer(algorithm, verify, pool, is_draft=False):
    runner = model_runner(algorithm, dtype=torch.bfloat16, is_draft=is_draft, max_ctx=CTX, device="cuda",
                          attention=GQA)  # fmt: skip
    return flashinfer_backend(runner, pool, verify)


@pytest.mark.parametrize("prefix", [[16384, 3000], [0, 511, 4096]])
def test_dflash_chain_on_flashinfer_mha_through_the_hook(prefix):
    _, h, hkv, d, _ = GQA
    gen = torch.Generator().manual_seed(13)
    verify = Verify(prefix, 16, "DFLASH", gen, max_ctx=CTX, pool_size=POOL_SIZE, device="cuda")
    pool = Pool(hkv, d, d, torch.bfloat16, mla=False, size=POOL_SIZE, device="cuda")
    be = _gqa_flashinfer("DFLASH", verify, pool)
    assert be.tree_verify.kind == CHAIN
    layer = layer_for("mha", h, hkv, d, d)
    q, k, v = qkv(verify, h, hkv, d, d, torch.bfloat16, False, gen)
    fb = verify.forward_batch()
    be.init_forward_metadata(fb)
    o = be.forward_extend(q, k, v, layer, fb).view(-1, h, d)
    ref = dense_reference(verify, q.view(-1, h, d), pool, layer.scaling)  # the causal block
    torch.testing.assert_close(o.float(), ref, atol=TOL, rtol=TOL)


def test_dflash_chain_on_flashinfer_mha_replays(monkeypatch):
    _, h, hkv, d, _ = GQA
    n, graph_bs = 16, 2
    gen = torch.Generator().manual_seed(14)
    verify = Verify([300, 40], n, "DFLASH", gen, max_ctx=CTX, pool_size=POOL_SIZE, device="cuda")
    pool = Pool(hkv, d, d, torch.bfloat16, mla=False, size=POOL_SIZE, device="cuda")
    be = _gqa_flashinfer("DFLASH", verify, pool)
    be.tree_verify.init_graph_state(max_bs=4, max_num_tokens=4 * n)
    layer = layer_for("mha", h, hkv, d, d)
    static_q = torch.zeros(graph_bs * n, h, d, device="cuda", dtype=torch.bfloat16)
    static_o = torch.zeros(graph_bs * n, h, d, device="cuda", dtype=torch.bfloat16)
    fb = verify.forward_batch()
    be.tree_verify.prepare(fb, graph=True)

    def run():
        be.tree_verify.run(static_q, pool.get_key_buffer(0), pool.get_value_buffer(0), layer, fb, out=static_o)

    run()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    for prefix in ([16384, 1], [5, 9000]):
        v2 = Verify(prefix, n, "DFLASH", gen, max_ctx=CTX, pool_size=POOL_SIZE, device="cuda")
        be.tree_verify.req_to_token.copy_(v2.req_to_token)  # the hook's view of the runner's table
        v2.req_to_token = be.tree_verify.req_to_token
        q, k, vv = qkv(v2, h, hkv, d, d, torch.bfloat16, False, gen)
        pool.set_kv_buffer(layer, v2.out_cache_loc, k, vv)
        be.tree_verify.prepare(v2.forward_batch(), graph=True)
        static_q.copy_(q.view(-1, h, d))
        g.replay()
        ref = dense_reference(v2, q.view(-1, h, d), pool, layer.scaling)
        torch.testing.assert_close(static_o.float(), ref, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("algorithm", ["DFLASH", "DDTREE"])
@pytest.mark.parametrize("attn_type", [AttentionType.ENCODER_ONLY, AttentionType.DECODER])
def test_draft_block_on_flashinfer_mha_through_the_hook(algorithm, attn_type):
    _, h, hkv, d, _ = GQA
    n = 16
    gen = torch.Generator().manual_seed(15)
    verify = Verify([16384, 3000, 0], n, "DFLASH", gen, max_ctx=CTX, pool_size=POOL_SIZE, device="cuda")
    pool = Pool(hkv, d, d, torch.bfloat16, mla=False, size=POOL_SIZE, device="cuda")
    be = _gqa_flashinfer(algorithm, verify, pool, is_draft=True)
    assert be.tree_verify.kind == BLOCK
    layer = layer_for("mha", h, hkv, d, d)
    layer.attn_type = attn_type
    q, k, v = qkv(verify, h, hkv, d, d, torch.bfloat16, False, gen)
    fb = verify.forward_batch()
    be.init_forward_metadata(fb)
    o = be.forward_extend(q, k, v, layer, fb).view(-1, h, d).float()
    if attn_type == AttentionType.ENCODER_ONLY:
        verify.visible = lambda b: torch.ones(n, int(verify.prefix[b]) + n, dtype=torch.bool, device="cuda")
    ref = dense_reference(verify, q.view(-1, h, d), pool, layer.scaling)
    torch.testing.assert_close(o, ref, atol=TOL, rtol=TOL)
