# SPDX-License-Identifier: Apache-2.0
"""Sliding windows and attention sinks in the fused kernels at real layer shapes
(gpt-oss-20B: 64 query heads, 8 KV heads of 64, a 127-position window and
sinks; Gemma-4-31B sliding layers: 32/16 heads of 256, a 1,023-position
window), native and sm_120 tiles, against the fp32 reference; CUDA-graph replay
with new prefix lengths; and what upstream's dense-mask fallback does with a
window (exact for a chain, not for a tree: it places tree nodes by index)."""

import pytest
import torch

from sglang.srt.layers.attention.tree_verify import (
    StrategyUnavailable,
    causal_tree_mask,
    tree_mask_from_parents,
    tree_verify_attention,
)
from sglang.srt.layers.attention.tree_verify.reference import tree_verify_attention_ref
from sglang.srt.utils.gpu_arch import KERNEL_ARCH_ENV

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

GPTOSS = dict(h=64, hkv=8, d=64, window=127, sinks=True)
GEMMA4_SWA = dict(h=32, hkv=16, d=256, window=1023, sinks=False)


def make_case(seed, prefix_lens, n, h, hkv, d, chain=False, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    bs = len(prefix_lens)
    pool = sum(prefix_lens) + bs * n + 50
    k = torch.randn(pool, hkv, d, generator=gen).to("cuda", dtype)
    v = torch.randn(pool, hkv, d, generator=gen).to("cuda", dtype)
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
            parents[:, i] = torch.randint(max(0, i - 4), i, (bs,), generator=gen)  # deep trees
        mask = tree_mask_from_parents(parents).cuda()
    q = torch.randn(bs * n, h, d, generator=gen).to("cuda", dtype)
    return [q, k, v, indptr, prefix_idx, tree_idx, mask, d**-0.5]


def sinks_for(h):
    return torch.linspace(-3.0, 4.0, h, device="cuda").to(torch.bfloat16)


def rel_err(out, ref):
    assert not out.isnan().any()
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("arch", [None, "12.0"], ids=["native", "sm120cfg"])
@pytest.mark.parametrize("layer", ["gptoss_swa", "gptoss_full", "gemma4_swa"])
@pytest.mark.parametrize("prefix_lens,n", [([16384], 65), ([0, 100, 3000, 127], 33), ([2048], 129)])
def test_window_and_sinks_match_the_reference(layer, prefix_lens, n, arch, monkeypatch):
    if arch:
        monkeypatch.setenv(KERNEL_ARCH_ENV, arch)
    shape = GEMMA4_SWA if layer.startswith("gemma4") else GPTOSS
    window = None if layer.endswith("full") else shape["window"]
    sinks = sinks_for(shape["h"]) if shape["sinks"] else None
    case = make_case(n + len(prefix_lens), prefix_lens, n, shape["h"], shape["hkv"], shape["d"])
    ref = tree_verify_attention_ref(*case, sliding_window=window, sinks=sinks)
    out = torch.full_like(ref, float("nan"))
    tree_verify_attention(*case, out=out, strategy="fused", sliding_window=window, sinks=sinks)
    assert rel_err(out, ref) < 1e-2


def test_window_in_a_graph_replayed_with_new_prefix_lengths():
    shape = GPTOSS
    cap = [4096, 4096]
    case = make_case(3, cap, 17, shape["h"], shape["hkv"], shape["d"])
    sinks = sinks_for(shape["h"])
    out = torch.empty(case[0].shape[0], shape["h"], shape["d"], dtype=case[0].dtype, device="cuda")

    def run():
        tree_verify_attention(*case, out=out, strategy="fused", sliding_window=127, sinks=sinks)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for lens in ([4096, 10], [60, 4000], [0, 4096]):
        case[3].copy_(torch.tensor([0, lens[0], lens[0] + lens[1]], dtype=torch.int32))
        graph.replay()
        ref = tree_verify_attention_ref(*case, sliding_window=127, sinks=sinks)
        assert rel_err(out, ref) < 1e-2, lens


def test_upstream_dense_mask_fallback_places_tree_nodes_by_index():
    """Why SWA layers need this kernel for DDTree: upstream's extend kernel with
    the dense tree mask and the window puts extend token m at prefix_len + m, so
    it is exact for a DFlash chain and wrong for a tree once the window cuts."""
    try:
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    except ImportError as e:
        raise StrategyUnavailable(f"needs sglang's Triton extend kernel: {e}") from e
    from sglang.srt.layers.attention.tree_verify.upstream_extend import dense_custom_mask

    errs = {}
    for chain in (True, False):
        q, k, v, indptr, pidx, tidx, mask, scale = make_case(5, [2000], 65, 16, 8, 64, chain=chain)
        p, n, w = 2000, 65, 127
        keep = min(p, w)
        out = torch.empty_like(q)
        flat = tidx.reshape(-1).long()
        extend_attention_fwd(
            q, k[flat].contiguous(), v[flat].contiguous(), out, k, v,
            torch.tensor([0, n], dtype=torch.int32, device="cuda"),
            torch.tensor([0, keep], dtype=torch.int32, device="cuda"), pidx[p - keep :].contiguous(),
            dense_custom_mask(indptr, mask, n), False,
            torch.tensor([0, n * (p + n)], dtype=torch.int64, device="cuda"), n, 1.0, 1.0,
            sm_scale=scale, sliding_window_size=w,
            window_kv_offsets=torch.tensor([p - keep], dtype=torch.int32, device="cuda"),
        )  # fmt: skip
        ref = tree_verify_attention_ref(q, k, v, indptr, pidx, tidx, mask, scale, sliding_window=w)
        errs[chain] = rel_err(out, ref)
    assert errs[True] < 1e-2 and errs[False] > 5e-2, errs
