# SPDX-License-Identifier: Apache-2.0
"""The fused split-KV kernels under TRITON_INTERPRET=1 against the fp32 torch
reference, with random trees, ragged batches and awkward sizes (fp16 inputs:
triton 3.6's interpreter mis-computes bf16 tl.dot)."""

import math

import pytest
import torch

from sglang.srt.layers.attention.tree_verify import tree_mask_from_parents
from sglang.srt.layers.attention.tree_verify.configs import (
    TreeVerifyConfig,
    select_config,
)
from sglang.srt.layers.attention.tree_verify.reference import tree_verify_attention_ref

from _interp import interpreted_prefix_split, random_parents

SMALL = TreeVerifyConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
SMALL_QB = TreeVerifyConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, q_as_b=True)
SMALL_AHEAD = TreeVerifyConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, qk_ahead=True)
# Two programs per row tile, each owning half of the value columns.
SMALL_DV = TreeVerifyConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, dv_split=2)
# The next prefix KV tile loaded into registers ahead (one shared KV buffer).
SMALL_RP = TreeVerifyConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, register_prefetch=True)
# Head dims in column chunks (a score product and an accumulator per chunk),
# pipelined by Triton, and with the register prefetch.
SMALL_CHUNKS = TreeVerifyConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, q_as_b=True, d_chunks=2)
SMALL_CHUNKS_RP = TreeVerifyConfig(
    block_m=16, block_n=16, num_warps=4, num_stages=1, d_chunks=4, register_prefetch=True
)
ALL_SMALL = [SMALL, SMALL_QB, SMALL_AHEAD, SMALL_DV, SMALL_RP, SMALL_CHUNKS, SMALL_CHUNKS_RP]
ALL_IDS = ["qk", "kq", "ahead", "dvsplit", "prefetch", "chunks", "chunks_prefetch"]


def make_case(seed, prefix_lens, n, h, hkv, dqk, dv, shared_kv, chain=False):
    gen = torch.Generator().manual_seed(seed)
    bs = len(prefix_lens)
    pool = sum(prefix_lens) + bs * n + 17
    k = torch.randn(pool, hkv, dqk, generator=gen).half()
    v = k[..., :dv] if shared_kv else torch.randn(pool, hkv, dv, generator=gen).half()
    perm = torch.randperm(pool, generator=gen).to(torch.int32)
    indptr = torch.tensor([0] + prefix_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    total = int(indptr[-1])
    prefix_idx = perm[:total].contiguous()
    tree_idx = perm[total : total + bs * n].view(bs, n).contiguous()
    if chain:
        parents = torch.arange(-1, n - 1).expand(bs, n)
    else:
        parents = random_parents(bs, n, gen)
    mask = tree_mask_from_parents(parents)
    q = torch.randn(bs * n, h, dqk, generator=gen).half()
    return q, k, v, indptr, prefix_idx, tree_idx, mask


def check(case, scale, cfg, num_splits, cap=0.0, kv_scales=None, tol=4e-3):
    ps = interpreted_prefix_split()
    ref = tree_verify_attention_ref(*case, scale, logit_cap=cap, kv_scales=kv_scales).float()
    out = torch.full_like(ref, float("nan")).half()  # poison: every element must be written
    ps.tree_verify_fused(*case, scale, out, cap, cfg, num_splits=num_splits, kv_scales=kv_scales)
    err = (out.float() - ref).abs().max().item()
    assert err < tol, err


def fp8_kv(case, k_scale, v_scale, shared_kv):
    """The case with its KV cache stored as fp8 e4m3 holding K / k_scale, V / v_scale."""
    q, k, v, *rest = case
    k8 = (k.float() / k_scale).to(torch.float8_e4m3fn)
    v8 = k8[..., : v.shape[-1]] if shared_kv else (v.float() / v_scale).to(torch.float8_e4m3fn)
    return [q, k8, v8, *rest]


# Absorbed-MLA shape in miniature: Dqk = 64 latent + 16 rope, V = K[..., :64],
# one KV head, every head of a node shares the KV tile.
@pytest.mark.parametrize(
    "prefix_lens,n,h,splits",
    [
        ([37], 5, 3, 3),
        ([0], 7, 5, None),  # P = 0: tail only
        ([0, 50, 3], 33, 3, 2),  # mixed batch, two mask words
        ([65, 1], 19, 1, None),
        ([100], 1, 7, 4),  # a lone root
        ([16, 0, 31, 47], 9, 2, 5),  # more splits than some prefixes have tiles
    ],
)
@pytest.mark.parametrize("cfg", ALL_SMALL, ids=ALL_IDS)
def test_mla_like(prefix_lens, n, h, splits, cfg):
    case = make_case(len(prefix_lens) * 100 + n, prefix_lens, n, h, 1, 80, 64, True)
    check(case, 0.125, cfg, splits)


@pytest.mark.parametrize(
    "prefix_lens,n,h,hkv,d",
    [
        ([29, 0], 6, 6, 2, 32),  # GQA, group 3
        ([40], 17, 3, 3, 16),  # MHA, odd heads
        ([21, 5, 60], 11, 4, 1, 32),  # MQA
        ([13], 5, 2, 1, 24),  # head dim not a power of two
    ],
)
@pytest.mark.parametrize("cfg", [SMALL, SMALL_RP, SMALL_CHUNKS], ids=["qk", "prefetch", "chunks"])
def test_gqa(prefix_lens, n, h, hkv, d, cfg):
    case = make_case(n * 7 + h, prefix_lens, n, h, hkv, d, d, False)
    check(case, d**-0.5, cfg, None)


@pytest.mark.parametrize("cfg", [SMALL_QB, SMALL_RP, SMALL_CHUNKS_RP], ids=["kq", "prefetch", "chunks_prefetch"])
def test_separate_v_with_rope_split(cfg):
    # Dqk 80 = 64 + 16 with a V buffer of its own (no K/V sharing).
    case = make_case(5, [30, 12], 10, 3, 1, 80, 64, False)
    check(case, 0.1, cfg, 2)


@pytest.mark.parametrize("cfg", [SMALL, SMALL_DV, SMALL_CHUNKS], ids=["qk", "dvsplit", "chunks"])
def test_logit_cap(cfg):
    case = make_case(9, [45], 12, 2, 1, 80, 64, True)
    check(case, 0.5, cfg, 3, cap=3.0)


@pytest.mark.parametrize("cfg", [SMALL, SMALL_DV], ids=["qk", "dvsplit"])
def test_chain_mask(cfg):
    case = make_case(11, [20, 33], 16, 2, 1, 80, 64, True, chain=True)
    check(case, 0.125, cfg, None)


def test_d_chunks_apply_where_the_dims_allow():
    from sglang.srt.layers.attention.tree_verify.prefix_split import d_chunks_for

    assert d_chunks_for(SMALL_CHUNKS, 80, 64, share_kv=True) == 2  # 64 main dims + rope
    assert d_chunks_for(SMALL_CHUNKS, 32, 32, share_kv=False) == 2
    assert d_chunks_for(SMALL_CHUNKS_RP, 32, 32, share_kv=False) == 1  # chunks under 16 dims
    assert d_chunks_for(SMALL_CHUNKS, 24, 24, share_kv=False) == 1  # not a power of two
    assert d_chunks_for(SMALL, 80, 64, share_kv=True) == 1
    with pytest.raises(ValueError, match="d_chunks"):
        TreeVerifyConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, dv_split=2, d_chunks=2)
    with pytest.raises(ValueError, match="register_prefetch"):
        TreeVerifyConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, qk_ahead=True,
                         register_prefetch=True)


def test_dv_split_applies_only_to_shared_kv():
    from sglang.srt.layers.attention.tree_verify.prefix_split import dv_split_for

    assert dv_split_for(SMALL_DV, 80, 64, share_kv=True) == 2
    assert dv_split_for(SMALL_DV, 80, 64, share_kv=False) == 1  # separate V: one program
    assert dv_split_for(SMALL, 80, 64, share_kv=True) == 1


def test_real_mla_config_tiny_shape():
    # The selected Hopper and sm_120 MLA configs with the real 576/512 dims.
    case = make_case(13, [70, 0], 3, 2, 1, 576, 512, True)
    for arch in ((9, 0), (12, 0)):
        check(case, 576**-0.5, select_config(arch, 576, 512), None)
    case = make_case(14, [33], 2, 3, 1, 576, 512, False)
    for arch in ((9, 0), (12, 0)):
        check(case, 576**-0.5, select_config(arch, 576, 512, share_kv=False), 2)


@pytest.mark.parametrize("cfg", ALL_SMALL, ids=ALL_IDS)
def test_fp8_kv_cache_mla_like(cfg):
    """Absorbed-MLA layout with an fp8 cache (V is the K cache's slice)."""
    case = fp8_kv(make_case(21, [40, 0, 17], 9, 3, 1, 80, 64, True), 0.5, 0.5, True)
    check(case, 0.125, cfg, 2, kv_scales=(0.5, 0.5))


def test_fp8_kv_cache_gqa_with_separate_scales_and_cap():
    case = fp8_kv(make_case(22, [29, 5], 6, 6, 2, 32, 32, False), 0.25, 2.0, False)
    check(case, 32**-0.5, SMALL, None, kv_scales=(0.25, 2.0))
    check(case, 32**-0.5, SMALL, 3, cap=2.0, kv_scales=(0.25, 2.0))


def test_fp8_kv_real_mla_configs():
    case = fp8_kv(make_case(23, [70, 0], 3, 2, 1, 576, 512, True), 1.5, 1.5, True)
    for arch in ((9, 0), (12, 0)):
        check(case, 576**-0.5, select_config(arch, 576, 512), None, kv_scales=(1.5, 1.5))



@pytest.mark.parametrize("layout", ["flashinfer", "flashmla"])
@pytest.mark.parametrize("prefix_lens,n,h", [([37, 0, 5], 5, 3), ([64], 9, 2)])
def test_merge_external_prefix(prefix_lens, n, h, layout):
    """The contract flashinfer_split and flashmla_split rely on: a prefix pass computed
    elsewhere, merged into our tree tail in the tail kernel's epilogue, equals the whole
    attention. FlashInfer's layout: token-major, base-2 LSE. FlashMLA's: a head-major
    natural-log LSE, and whatever it leaves for a request with no prefix (here NaN and
    +inf, which must not reach the output). The output is a strided view."""
    q, k, v, indptr, pidx, tidx, mask = make_case(7, prefix_lens, n, h, 1, 80, 64, True)
    scale = 0.125
    bs = len(prefix_lens)
    o_pre = torch.full((bs, n, h, 64), float("nan"))
    lse_nat = torch.full((bs, n, h), float("inf"))
    for b in range(bs):
        keys = k[pidx[indptr[b] : indptr[b + 1]].long(), 0].float()
        if keys.shape[0] == 0:
            continue
        s = torch.einsum("thd,pd->thp", q[b * n : (b + 1) * n].float(), keys) * scale
        o_pre[b] = torch.softmax(s, -1) @ keys[:, :64]
        lse_nat[b] = torch.logsumexp(s, -1)
    if layout == "flashinfer":
        lse, lse_scale = lse_nat / math.log(2.0), 1.0
    else:
        lse, lse_scale = lse_nat.transpose(1, 2).contiguous().transpose(1, 2), 1 / math.log(2.0)
        assert lse.stride(1) == 1  # head-major, as FlashMLA returns it
    wide = torch.full((bs * n, h, 80), float("nan"), dtype=q.dtype)
    out = wide[..., 8:72]
    got = interpreted_prefix_split().merge_external_prefix(
        q, k, v, indptr, pidx, tidx, mask, scale, SMALL, o_pre.to(q.dtype), lse, out,
        lse_scale=lse_scale,
    )  # fmt: skip
    assert got is out
    ref = tree_verify_attention_ref(q, k, v, indptr, pidx, tidx, mask, scale).float()
    assert (out.float() - ref).abs().max().item() < 4e-3
    assert torch.isnan(wide[..., :8]).all() and torch.isnan(wide[..., 72:]).all()


def test_merge_external_prefix_refuses_wrong_shapes():
    q, k, v, indptr, pidx, tidx, mask = make_case(7, [5, 3], 4, 2, 1, 80, 64, True)
    with pytest.raises(ValueError, match=r"want o \[2, 4, 2, 64\]"):
        interpreted_prefix_split().merge_external_prefix(
            q, k, v, indptr, pidx, tidx, mask, 0.1, SMALL,
            torch.zeros(8, 2, 64), torch.zeros(8, 2), None,
        )  # fmt: skip
