# SPDX-License-Identifier: Apache-2.0
"""benchmarks/xqa_verify.py's CPU parts: the paged layout XQA reads holds each request's
prefix then its tree, and the reasons it cannot run."""

import torch

from benchmarks.xqa_verify import paged_copy, xqa_reason


def test_pages_hold_the_prefix_then_the_tree():
    gen = torch.Generator().manual_seed(0)
    pool, hkv, d, n = 300, 2, 16, 5
    k = torch.randn(pool, hkv, d, generator=gen)
    v = torch.randn(pool, hkv, d, generator=gen)
    perm = torch.randperm(pool, generator=gen)
    lens = [37, 0, 16]
    indptr = torch.tensor([0] + lens).cumsum(0)
    prefix = perm[: sum(lens)]
    tree = perm[sum(lens) : sum(lens) + 3 * n].view(3, n)
    paged = paged_copy(k, v, indptr, prefix, tree, 16)
    assert paged.seq_lens.view(-1).tolist() == [42, 5, 21]
    for b in range(3):
        slots = torch.cat([prefix[indptr[b] : indptr[b + 1]], tree[b]])
        got_k = paged.k_pages[paged.page_table[b].long()].reshape(-1, hkv, d)[: slots.numel()]
        got_v = paged.v_pages[paged.page_table[b].long()].reshape(-1, hkv, d)[: slots.numel()]
        assert torch.equal(got_k, k[slots]) and torch.equal(got_v, v[slots])


def test_reasons():
    assert "Dqk == Dv" in xqa_reason(32, 8, 192, 128, torch.bfloat16, torch.bfloat16, 16)
    assert "multiple of 16" in xqa_reason(32, 8, 72, 72, torch.bfloat16, torch.bfloat16, 16)
    assert "pages of" in xqa_reason(32, 8, 128, 128, torch.bfloat16, torch.bfloat16, 1)
    assert "16-bit" in xqa_reason(32, 8, 128, 128, torch.bfloat16, torch.float8_e4m3fn, 16)
    if not torch.cuda.is_available():
        assert "CUDA" in xqa_reason(32, 8, 128, 128, torch.bfloat16, torch.bfloat16, 16)
