# SPDX-License-Identifier: Apache-2.0
"""Tree-verify attention on the GPU at real shapes (bf16 and fp16), the sm_120
configs forced through SGLANG_DDTREE_KERNEL_ARCH, CUDA-graph replay, and
agreement with the other strategies where they are installed."""

import pytest
import torch

from sglang.srt.layers.attention.tree_verify import (
    StrategyUnavailable,
    causal_tree_mask,
    tree_mask_from_parents,
    tree_verify_attention,
)
from sglang.srt.layers.attention.tree_verify.configs import TreeVerifyConfig, select_config
from sglang.srt.layers.attention.tree_verify.prefix_split import tree_verify_fused
from sglang.srt.layers.attention.tree_verify.reference import tree_verify_attention_ref
from sglang.srt.utils.gpu_arch import KERNEL_ARCH_ENV

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def make_case(seed, prefix_lens, n, h, hkv, dqk, dv, dtype, shared_kv, chain=False):
    gen = torch.Generator().manual_seed(seed)
    bs = len(prefix_lens)
    pool = sum(prefix_lens) + bs * n + 100
    k = torch.randn(pool, hkv, dqk, generator=gen).to("cuda", dtype)
    v = k[..., :dv] if shared_kv else torch.randn(pool, hkv, dv, generator=gen).to("cuda", dtype)
    perm = torch.randperm(pool, generator=gen).to(torch.int32).cuda()
    indptr = torch.tensor([0] + prefix_lens).cumsum(0).to(torch.int32).cuda()
    total = int(indptr[-1])
    prefix_idx = perm[:total].contiguous()
    tree_idx = perm[total : total + bs * n].view(bs, n).contiguous()
    if chain:
        mask = causal_tree_mask(bs, n, "cuda")
    else:
        parents = torch.full((bs, n), -1, dtype=torch.int64)
        for i in range(1, n):
            parents[:, i] = torch.randint(0, i, (bs,), generator=gen)
        mask = tree_mask_from_parents(parents).cuda()
    q = torch.randn(bs * n, h, dqk, generator=gen).to("cuda", dtype)
    return [q, k, v, indptr, prefix_idx, tree_idx, mask, dqk**-0.5]


def rel_err(out, ref):
    assert not out.isnan().any()
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check(case, strategy="fused", tol=1e-2, cap=0.0):
    ref = tree_verify_attention_ref(*case, logit_cap=cap)
    out = torch.full((case[0].shape[0], case[0].shape[1], case[2].shape[-1]), float("nan"),
                     dtype=case[0].dtype, device="cuda")  # fmt: skip
    tree_verify_attention(*case, out=out, logit_cap=cap, strategy=strategy)
    assert rel_err(out, ref) < tol


MLA_CASES = [
    ([16384], 65, 16),
    ([65536], 17, 16),
    ([4096], 65, 128),
    ([0, 1000, 5003, 70], 33, 16),  # ragged batch with an empty prefix
    ([777, 12345], 129, 16),
    ([2048], 257, 16),
    ([65536], 4, 16),
    ([3000, 3000, 3000], 1, 128),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prefix_lens,n,h", MLA_CASES)
@pytest.mark.parametrize("arch", [None, "12.0"], ids=["native", "sm120cfg"])
def test_mla(prefix_lens, n, h, dtype, arch, monkeypatch):
    if arch:
        monkeypatch.setenv(KERNEL_ARCH_ENV, arch)
    case = make_case(n + h, prefix_lens, n, h, 1, 576, 512, dtype, True)
    check(case)


CANDIDATE_TILES = [
    TreeVerifyConfig(64, 32, 8, 3),
    TreeVerifyConfig(64, 32, 8, 3, qk_ahead=True),
    TreeVerifyConfig(64, 16, 4, 2, dv_split=2, ctas_per_sm=2),
    TreeVerifyConfig(64, 32, 4, 3, dv_split=2),
    TreeVerifyConfig(64, 64, 4, 2, dv_split=2),
    TreeVerifyConfig(32, 32, 4, 2, dv_split=2, ctas_per_sm=2),
    TreeVerifyConfig(32, 16, 4, 4, q_as_b=True),
    # the sm_12x sweep of 2026-12-02: column-chunked head dims, the register prefetch
    TreeVerifyConfig(32, 32, 4, 2, q_as_b=True),
    TreeVerifyConfig(32, 16, 4, 4, q_as_b=True, d_chunks=4),
    TreeVerifyConfig(32, 16, 4, 4, q_as_b=True, d_chunks=8),
    TreeVerifyConfig(64, 16, 8, 1, q_as_b=True, register_prefetch=True),
    TreeVerifyConfig(64, 16, 8, 1, q_as_b=True, d_chunks=4, register_prefetch=True),
]


@pytest.mark.parametrize("cfg", CANDIDATE_TILES, ids=str)
@pytest.mark.parametrize("prefix_lens,n,h", [([0, 1000, 5003, 70], 33, 16), ([16384], 65, 16), ([3000], 129, 128)])
def test_mla_tile_candidates(cfg, prefix_lens, n, h):
    """Every MLA tile the benchmark sweeps, on real shapes (so a config picked
    from the sweep is already checked here)."""
    case = make_case(n * 3 + h, prefix_lens, n, h, 1, 576, 512, torch.bfloat16, True)
    ref = tree_verify_attention_ref(*case)
    out = tree_verify_fused(*case[:8], None, 0.0, cfg)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("arch", [None, "12.0"], ids=["native", "sm120cfg"])
@pytest.mark.parametrize("shape", ["mla", "gqa"])
def test_fp8_kv_cache(arch, shape, monkeypatch):
    """An fp8 e4m3 KV cache with per-layer scales, dequantized per tile."""
    if arch:
        monkeypatch.setenv(KERNEL_ARCH_ENV, arch)
    if shape == "mla":
        case = make_case(41, [16384, 77], 65, 16, 1, 576, 512, torch.bfloat16, True)
        scales = (0.7, 0.7)
        case[1] = (case[1].float() / scales[0]).to(torch.float8_e4m3fn)
        case[2] = case[1][..., :512]
    else:
        case = make_case(42, [5000, 0], 17, 32, 8, 128, 128, torch.bfloat16, False)
        scales = (0.5, 3.0)
        case[1] = (case[1].float() / scales[0]).to(torch.float8_e4m3fn)
        case[2] = (case[2].float() / scales[1]).to(torch.float8_e4m3fn)
    ref = tree_verify_attention_ref(*case, kv_scales=scales)
    out = tree_verify_attention(*case, k_scale=scales[0], v_scale=scales[1], strategy="fused")
    assert rel_err(out, ref) < 1e-2


def test_mla_separate_v_and_logit_cap(monkeypatch):
    case = make_case(3, [5000, 17], 65, 16, 1, 576, 512, torch.bfloat16, False)
    check(case)
    check(case, cap=30.0)
    monkeypatch.setenv(KERNEL_ARCH_ENV, "12.0")
    check(case)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("h,hkv", [(32, 8), (28, 4), (5, 5), (12, 1)])
@pytest.mark.parametrize("arch", [None, "12.0"], ids=["native", "sm120cfg"])
def test_gqa_mha(d, h, hkv, arch, monkeypatch):
    if arch:
        monkeypatch.setenv(KERNEL_ARCH_ENV, arch)
    case = make_case(d + h, [3000, 0, 1234], 17, h, hkv, d, d, torch.bfloat16, False)
    check(case)


def test_chain_mask_dflash():
    case = make_case(7, [16384, 16000], 16, 16, 1, 576, 512, torch.bfloat16, True, chain=True)
    check(case)


def test_sm120_override_selects_sm120_tiles(monkeypatch):
    monkeypatch.setenv(KERNEL_ARCH_ENV, "12.0")
    from sglang.srt.utils.gpu_arch import kernel_arch

    assert kernel_arch(torch.device("cuda")) == (12, 0)
    assert select_config((12, 0), 576, 512) != select_config((9, 0), 576, 512)


def test_cuda_graph_replay_with_new_lengths():
    """Launch shape depends on static sizes only: capture once, replay with
    different prefix lengths (same index-buffer capacity) and trees."""
    bs, n, h, cap = 2, 65, 16, 20000
    case = make_case(1, [cap // 2, cap // 2], n, h, 1, 576, 512, torch.bfloat16, True)
    q, k, v, indptr, pidx, tidx, mask, scale = case
    out = torch.empty(bs * n, h, 512, dtype=torch.bfloat16, device="cuda")
    tree_verify_attention(*case, out=out)  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tree_verify_attention(q, k, v, indptr, pidx, tidx, mask, scale, out=out)
    for lens in ([5, 17000], [12000, 0], [cap // 2, cap // 2]):
        new = make_case(sum(lens), lens, n, h, 1, 576, 512, torch.bfloat16, True)
        q.copy_(new[0])
        indptr.copy_(new[3])
        pidx.zero_()
        pidx[: new[4].numel()].copy_(new[4])
        tidx.copy_(new[5])
        mask.copy_(new[6])
        k_new = new[1]
        k[: k_new.shape[0]].copy_(k_new)
        g.replay()
        ref = tree_verify_attention_ref(q, k, v, indptr, pidx, tidx, mask, scale)
        assert rel_err(out, ref) < 1e-2, lens


@pytest.mark.parametrize("strategy", ["upstream_extend", "flashinfer_split", "flashmla_split"])
def test_other_strategies_agree(strategy):
    case = make_case(5, [4096, 100], 17, 16, 1, 576, 512, torch.bfloat16, True)
    try:
        check(case, strategy=strategy)
    except StrategyUnavailable as e:
        pytest.skip(str(e))


def test_flashinfer_split_planned_ahead_replays_in_a_graph():
    """Planned outside the capture, the FlashInfer prefix pass + our tail replay
    from a CUDA graph (how verify_attention.py times it, and how a backend that
    plans in init_forward_metadata would run it)."""
    try:
        from sglang.srt.layers.attention.tree_verify.flashinfer_split import (
            FlashInferPrefixPass,
            tree_verify_flashinfer_split,
        )

        case = make_case(6, [4096, 0, 777], 17, 16, 1, 576, 512, torch.bfloat16, True)
        planned = FlashInferPrefixPass(*case[:5], case[5].shape[1], case[7])
    except StrategyUnavailable as e:
        pytest.skip(str(e))
    cfg = select_config((9, 0), 576, 512)
    out = torch.full((case[0].shape[0], 16, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    run = lambda: tree_verify_flashinfer_split(*case, out, 0.0, cfg, prefix_pass=planned)  # noqa: E731
    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    out.fill_(float("nan"))
    case[0].copy_(torch.randn_like(case[0]))  # new queries, same layout
    g.replay()
    assert rel_err(out, tree_verify_attention_ref(*case)) < 1e-2


@pytest.mark.parametrize("lens,n,h", [([16384], 65, 16), ([4096, 0, 777, 64, 1], 65, 16), ([1000, 65], 17, 128)])
def test_flashmla_split_matches_the_reference(lens, n, h):
    """Prefixes copied into 64-token pages (ragged, empty, one token, exactly a
    page), FlashMLA over them, our tree tail, one combine."""
    case = make_case(7, lens, n, h, 1, 576, 512, torch.bfloat16, True)
    try:
        check(case, strategy="flashmla_split")
    except StrategyUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("chunks", [1, 3, None])
@pytest.mark.parametrize("overlap", [False, True])
def test_flashmla_split_chunks_and_overlap(chunks, overlap):
    """Any KV-chunk count (1: FlashMLA's own splits; None: one chunk per SM part) and
    the tail beside FlashMLA or after it give the same attention."""
    from sglang.srt.layers.attention.tree_verify import flashmla_split as fm

    case = make_case(9, [5000, 0, 130], 65, 16, 1, 576, 512, torch.bfloat16, True)
    q, k, v, indptr, pidx, tidx, mask, scale = case
    ref = tree_verify_attention_ref(*case)
    staging = fm.new_staging(fm.staging_pages(3, pidx.numel()), k)
    try:
        plan = fm.plan_flashmla(indptr, 65, 16, 5000, staging.shape[0], chunks=chunks)
    except StrategyUnavailable as e:
        pytest.skip(str(e))
    out = torch.full((q.shape[0], 16, 512), float("nan"), dtype=q.dtype, device="cuda")
    cfg = select_config(torch.cuda.get_device_capability(), 576, 512)
    fm.tree_verify_flashmla_split(*case, out, 0.0, cfg, staging=staging, plan=plan, overlap=overlap)
    torch.cuda.synchronize()
    assert rel_err(out, ref) < 1e-2


def _lone_long_request():
    """One request of 16K + 77 keys, 65 nodes x 16 heads, planned with the default
    KV chunks: ``(case, staging, plan)``; skips where FlashMLA cannot load."""
    from sglang.srt.layers.attention.tree_verify import flashmla_split as fm

    case = make_case(10, [16384 + 77], 65, 16, 1, 576, 512, torch.bfloat16, True)
    staging = fm.new_staging(fm.staging_pages(1, case[4].numel()), case[1])
    try:
        plan = fm.plan_flashmla(case[3], 65, 16, 16384 + 77, staging.shape[0])
    except StrategyUnavailable as e:
        pytest.skip(str(e))
    return case, staging, plan


def test_flashmla_chunks_leave_nothing_to_split():
    """One request as one chunk per SM part: FlashMLA's scheduler gives each part one
    whole chunk (every request one split), so its combine has nothing to do."""
    from sglang.srt.layers.attention.tree_verify import flashmla_split as fm

    _, _, plan = _lone_long_request()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert plan.chunks == fm.sm_parts(sms, 65, 16) > 1
    assert torch.diff(plan.splits).tolist() == [1] * plan.chunks


def test_flashmla_reads_shared_queries_through_a_zero_stride():
    """A lone request's chunks read its queries through a zero batch stride: what a
    copy per chunk gives, bit for bit."""
    from sglang.srt.layers.attention.tree_verify import flashmla_split as fm

    (q, k, v, indptr, pidx, tidx, mask, scale), staging, plan = _lone_long_request()
    o, lse = fm.flashmla_prefix_pass(q, k, indptr, pidx, scale, plan, staging)
    flash_mla_with_kvcache, _ = fm._flash_mla()
    copies = q.reshape(1, 65, 16, 576).expand(plan.chunks, 65, 16, 576).contiguous()
    o1, lse1 = flash_mla_with_kvcache(
        copies, staging, plan.page_table, plan.lengths, 512, plan.schedule, plan.splits,
        softmax_scale=scale, causal=False,
    )  # fmt: skip
    assert torch.equal(o, o1) and torch.equal(lse, lse1.transpose(1, 2))


@pytest.mark.parametrize("lens,replays", [
    ([3000, 500], ([3499, 1], [0, 3500], [2000, 1500])),  # a batch: whole requests
    ([3500], ([1], [3500], [0], [1999])),  # a lone request: KV chunks, the tail on the side stream
])  # fmt: skip
def test_flashmla_split_replays_in_a_graph_with_new_prefix_lengths(lens, replays):
    """With the staging and a prefix bound set ahead, the whole call is device
    work: one captured graph serves new queries and new prefix lengths."""
    from sglang.srt.layers.attention.tree_verify.flashmla_split import (
        new_staging,
        staging_pages,
        tree_verify_flashmla_split,
    )

    case = make_case(8, lens, 65, 16, 1, 576, 512, torch.bfloat16, True)
    q, k, v, indptr, pidx, tidx, mask, scale = case
    bound = 4096
    staging = new_staging(staging_pages(len(lens), pidx.numel()), k)
    cfg = select_config((9, 0), 576, 512)
    out = torch.full((q.shape[0], 16, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    run = lambda: tree_verify_flashmla_split(  # noqa: E731
        q, k, v, indptr, pidx, tidx, mask, scale, out, 0.0, cfg, max_prefix_len=bound, staging=staging
    )
    try:
        run()
    except StrategyUnavailable as e:
        pytest.skip(str(e))
    torch.cuda.synchronize()
    assert rel_err(out, tree_verify_attention_ref(*case)) < 1e-2
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    for new_lens in replays:  # within the bound and the 3,500 prefix slots
        indptr.copy_(torch.tensor([0, *new_lens], device="cuda").cumsum(0).to(torch.int32))
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        g.replay()
        ref = tree_verify_attention_ref(q, k, v, indptr, pidx, tidx, mask, scale)
        assert rel_err(out, ref) < 1e-2, new_lens
