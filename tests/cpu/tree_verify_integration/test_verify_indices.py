# SPDX-License-Identifier: Apache-2.0
"""The verify's KV indices in one launch (``tree_verify/verify_indices.py``): the Triton kernel
(under TRITON_INTERPRET=1) against its torch reference and a per-request loop, with the row
pointers filled or given, padding rows past the tree's slots, and int32 / int64 inputs."""

import pytest
import torch

from sglang.srt.layers.attention.tree_verify import verify_indices as vi

POOL_ROWS, CTX = 9, 1100  # a prefix longer than two of the kernel's copy blocks


def _loop(req_to_token, rows, lens, tree_src, bs, width):
    """What the indices are, one request at a time."""
    indptr = [0]
    prefix = []
    for r, n in zip(rows.tolist(), lens.tolist()):
        prefix += req_to_token[r, :n].tolist()
        indptr.append(indptr[-1] + n)
    tree = tree_src.tolist() + [0] * (bs * width - tree_src.shape[0])
    return indptr, prefix, tree


def _case(seed, bs, raw_bs, width, dtype):
    gen = torch.Generator().manual_seed(seed)
    req_to_token = torch.randint(0, 1 << 20, (POOL_ROWS, CTX), generator=gen, dtype=torch.int32)
    rows = torch.randint(0, POOL_ROWS, (bs,), generator=gen).to(dtype)
    lens = torch.randint(0, CTX + 1, (bs,), generator=gen).to(dtype)
    lens[raw_bs:] = 1  # a CUDA graph's padding rows: the fill value, pool row 0
    rows[raw_bs:] = 0
    tree_src = torch.randint(1, 1 << 20, (raw_bs * width,), generator=gen, dtype=torch.int64)
    return req_to_token, rows, lens, tree_src


@pytest.mark.skipif(not vi._interpreted(), reason="needs TRITON_INTERPRET=1 before triton loads")
@pytest.mark.parametrize("bs,raw_bs,width", [(1, 1, 17), (4, 3, 5), (8, 8, 65), (5, 2, 1)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_kernel_matches_reference_and_loop(bs, raw_bs, width, dtype):
    req_to_token, rows, lens, tree_src = _case(bs * 100 + width, bs, raw_bs, width, dtype)
    want_indptr, want_prefix, want_tree = _loop(req_to_token, rows, lens, tree_src, bs, width)
    total = want_indptr[-1]
    for name, fn in (("kernel", vi.verify_indices), ("reference", vi.verify_indices_reference)):
        indptr = torch.full((bs + 3,), -5, dtype=torch.int32)
        prefix = torch.full((total + 7,), -5, dtype=torch.int32)
        tree = torch.full((bs * width + 4,), -5, dtype=torch.int32)
        fn(req_to_token, rows, lens, indptr, prefix, fill_indptr=True, tree_src=tree_src, tree_out=tree, width=width)
        assert indptr[: bs + 1].tolist() == want_indptr, name
        assert prefix[:total].tolist() == want_prefix, name
        assert tree[: bs * width].tolist() == want_tree, name
        # Nothing past what the batch owns is written.
        assert (indptr[bs + 1 :] == -5).all() and (prefix[total:] == -5).all() and (tree[bs * width :] == -5).all()


@pytest.mark.skipif(not vi._interpreted(), reason="needs TRITON_INTERPRET=1 before triton loads")
def test_given_row_pointers_are_read_not_written():
    """A backend that built ``kv_indptr`` itself: the kernel gathers by them and leaves them."""
    bs, width = 3, 4
    req_to_token, rows, lens, _ = _case(7, bs, bs, width, torch.int64)
    want_indptr, want_prefix, _ = _loop(req_to_token, rows, lens, torch.zeros(0), bs, 0)
    indptr = torch.tensor(want_indptr, dtype=torch.int32)
    before = indptr.clone()
    prefix = torch.full((want_indptr[-1],), -5, dtype=torch.int32)
    vi.verify_indices(req_to_token, rows, lens, indptr, prefix, fill_indptr=False)
    assert torch.equal(indptr, before)
    assert prefix.tolist() == want_prefix


def test_reference_without_a_tree_and_an_empty_batch():
    req_to_token, rows, lens, _ = _case(3, 2, 2, 1, torch.int64)
    want_indptr, want_prefix, _ = _loop(req_to_token, rows, lens, torch.zeros(0), 2, 0)
    indptr = torch.empty(3, dtype=torch.int32)
    prefix = torch.empty(want_indptr[-1], dtype=torch.int32)
    vi.verify_indices_reference(req_to_token, rows, lens, indptr, prefix, fill_indptr=True)
    assert indptr.tolist() == want_indptr and prefix.tolist() == want_prefix
    untouched = torch.full((4,), -5, dtype=torch.int32)
    vi.verify_indices(req_to_token, rows[:0], lens[:0], untouched, untouched, fill_indptr=True)
    assert (untouched == -5).all()


@pytest.mark.parametrize("fn", [vi.verify_indices, vi.verify_indices_reference])
def test_more_tree_slots_than_the_batch_holds_are_refused(fn):
    req_to_token, rows, lens, tree_src = _case(5, 2, 2, 4, torch.int64)
    indptr, prefix = torch.empty(3, dtype=torch.int32), torch.empty(2 * CTX, dtype=torch.int32)
    with pytest.raises(ValueError, match="8 tree slots for 2 requests of width 3"):
        fn(req_to_token, rows, lens, indptr, prefix, fill_indptr=True, tree_src=tree_src,
           tree_out=torch.empty(8, dtype=torch.int32), width=3)
