# SPDX-License-Identifier: Apache-2.0
"""FlashInfer's XQA kernel as a tree verify (``benchmarks/xqa_verify.py``, the candidate
``verify_strategy_table.py --strategies ...,xqa`` times) computes the tree-verify
attention: against the fp32 reference, trees and chains, several requests with
different prefixes, under CUDA-graph replay."""

import pytest
import torch

from benchmarks.xqa_verify import XqaTreeVerify, paged_copy, xqa_reason
from sglang.srt.layers.attention.tree_verify.reference import tree_verify_attention_ref

from tests.gpu.tree_verify.test_tree_verify_gpu import make_case, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

CASES = [
    # prefix lengths, N, H, Hkv, D, chain
    ([1000, 37], 17, 32, 8, 128, False),
    ([4096], 65, 32, 8, 128, False),
    ([333, 2048, 16], 17, 64, 8, 64, False),
    ([777], 9, 32, 8, 128, True),
]


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("prefix_lens,n,h,hkv,d,chain", CASES)
def test_xqa_equals_the_reference(prefix_lens, n, h, hkv, d, chain, page_size):
    case = make_case(3, prefix_lens, n, h, hkv, d, d, torch.bfloat16, False, chain=chain)
    q, k, v, indptr, prefix_idx, tree_idx, mask, scale = case
    assert xqa_reason(h, hkv, d, d, q.dtype, k.dtype, page_size) is None
    paged = paged_copy(k, v, indptr, prefix_idx, tree_idx, page_size)
    kernel = XqaTreeVerify(q.device, hkv, scale, d)
    ref = tree_verify_attention_ref(*case)
    out = torch.full_like(q, float("nan"))
    kernel(q, paged, mask, out)
    assert rel_err(out, ref) < 1e-2
    # Replayed from a CUDA graph, as a server's verify runs.
    graph_out = torch.full_like(q, float("nan"))
    kernel(q, paged, mask, graph_out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kernel(q, paged, mask, graph_out)
    graph_out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(graph_out, ref) < 1e-2


def test_a_wrong_mask_is_seen():
    """The check can fail: a chain's mask on a tree's queries differs from the reference."""
    case = make_case(5, [512], 17, 32, 8, 128, 128, torch.bfloat16, False)
    q, k, v, indptr, prefix_idx, tree_idx, mask, scale = case
    chain = make_case(5, [512], 17, 32, 8, 128, 128, torch.bfloat16, False, chain=True)[6]
    paged = paged_copy(k, v, indptr, prefix_idx, tree_idx, 16)
    out = XqaTreeVerify(q.device, 8, scale, 128)(q, paged, chain)
    assert rel_err(out, tree_verify_attention_ref(*case)) > 5e-2
