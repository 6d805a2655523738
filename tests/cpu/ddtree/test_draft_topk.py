# SPDX-License-Identifier: Apache-2.0
"""The vocabulary-sharded per-depth top-K equals the unsharded one: same ids in
the same order (ties towards the lower id), same log-probs."""

import pytest
import torch

from sglang.srt.speculative.ddtree.draft_topk import (
    local_vocab_topk,
    merge_vocab_shards,
    lm_head_topk,
)


def reference_topk(hidden, weight, k, vocab):
    """Full log-softmax over the model's vocabulary, ties towards the lower id."""
    lp = torch.log_softmax((hidden @ weight[:vocab].T).double(), dim=-1)
    order = torch.sort(lp, dim=-1, descending=True, stable=True)
    return order.values[:, :k], order.indices[:, :k]


def shards(weight, tp, vocab):
    """(slice, first id, real rows) per rank as VocabParallelEmbedding pads them:
    equal slices of the padded vocabulary, padding rows past ``vocab``."""
    per = -(-weight.shape[0] // tp)
    padded = torch.cat([weight, weight.new_zeros(per * tp - weight.shape[0], weight.shape[1])])
    return [(padded[r * per : (r + 1) * per], r * per, max(0, min(per, vocab - r * per))) for r in range(tp)]


def sharded_topk(hidden, weight, k, tp, vocab):
    """Every rank's local pass, then the merge that each rank runs on the gathered parts."""
    parts = [
        local_vocab_topk((hidden @ w.T).float(), k, start, valid) for w, start, valid in shards(weight, tp, vocab)
    ]
    return merge_vocab_shards(*(torch.stack(x) for x in zip(*parts)), k)


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@pytest.mark.parametrize("rows,vocab,k", [(7, 512, 16), (3, 509, 64), (5, 30, 8), (2, 100, 100)])
def test_sharded_equals_unsharded(tp, rows, vocab, k):
    gen = torch.Generator().manual_seed(rows * 1000 + vocab + tp)
    weight = torch.randn(vocab + 3, 24, generator=gen)  # 3 rows past the model's vocabulary
    hidden = torch.randn(rows, 24, generator=gen)
    lp, ids = sharded_topk(hidden, weight, k, tp, vocab)
    ref_lp, ref_ids = reference_topk(hidden, weight, k, vocab)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-4, rtol=1e-5)
    assert bool((ids < vocab).all())


@pytest.mark.parametrize("tp", [2, 4])
def test_ties_go_to_the_lower_id_on_every_split(tp):
    vocab, k = 64, 10
    weight = torch.zeros(vocab, 4)
    weight[[5, 40, 17, 63, 2], 0] = 1.0  # five equal best logits in different shards
    hidden = torch.tensor([[3.0, 0.0, 0.0, 0.0]])
    lp, ids = sharded_topk(hidden, weight, k, tp, vocab)
    assert ids[0, :5].tolist() == [2, 5, 17, 40, 63]
    assert ids[0, 5:].tolist() == [0, 1, 3, 4, 6]  # then the zeros, lowest ids first
    ref_lp, ref_ids = reference_topk(hidden, weight, k, vocab)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=1e-5)


def test_a_rank_without_real_tokens_contributes_nothing():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(16, 8, generator=gen)
    hidden = torch.randn(4, 8, generator=gen)
    # tp 4 over 16 padded rows with only 10 real tokens: rank 3 holds padding only.
    lp, ids = sharded_topk(hidden, weight, 6, 4, 10)
    ref_lp, ref_ids = reference_topk(hidden, weight, 6, 10)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=1e-5)


def test_lm_head_topk_chunks_and_gathers():
    """The worker's entry point on one rank's slice, with a gather that stacks
    what the other ranks would send (computed here from their slices)."""
    gen = torch.Generator().manual_seed(4)
    vocab, tp, k = 300, 2, 12
    weight = torch.randn(vocab, 16, generator=gen)
    hidden = torch.randn(9, 16, generator=gen)
    parts = shards(weight, tp, vocab)
    others = [local_vocab_topk((hidden @ w.T).float(), k, s, v) for w, s, v in parts[1:]]
    sent = iter([[o[0] for o in others], [o[1] for o in others], [o[2] for o in others]])

    def gather(t):
        return torch.stack([t, *next(sent)])

    w0, s0, v0 = parts[0]
    import sglang.srt.speculative.ddtree.draft_topk as dt

    old = dt._CHUNK_ELEMS
    dt._CHUNK_ELEMS = 2 * v0  # two rows per matmul: exercises the chunk loop
    try:
        lp, ids = lm_head_topk(hidden, w0, k, s0, v0, gather)
    finally:
        dt._CHUNK_ELEMS = old
    ref_lp, ref_ids = reference_topk(hidden, weight, k, vocab)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows_per_chunk", [1, 3, 64])
def test_lm_head_topk_on_one_rank(rows_per_chunk):
    """One rank (no gather): the same chunk loop, ``torch.topk`` instead of the
    id-ordered sort; ids past ``num_valid`` (LM-head padding) never appear."""
    gen = torch.Generator().manual_seed(5)
    vocab, k = 300, 16
    weight = torch.randn(vocab + 4, 16, generator=gen)
    hidden = torch.randn(7, 16, generator=gen)
    import sglang.srt.speculative.ddtree.draft_topk as dt

    old = dt._CHUNK_ELEMS
    dt._CHUNK_ELEMS = rows_per_chunk * vocab
    try:
        lp, ids = lm_head_topk(hidden, weight, k, 0, vocab)
    finally:
        dt._CHUNK_ELEMS = old
    ref_lp, ref_ids = reference_topk(hidden, weight, k, vocab)
    assert torch.equal(ids, ref_ids)  # random logits: no ties
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows,vocab,k,offset", [(15, 512, 16, 0), (8, 300, 64, 0), (4, 50, 50, 7)])
def test_single_rank_fast_path_equals_chunked_path(monkeypatch, rows, vocab, k, offset):
    """One rank, one chunk: the short path gives exactly what the chunked path gives."""
    from sglang.srt.speculative.ddtree import draft_topk

    g = torch.Generator().manual_seed(rows + vocab)
    hidden, weight = torch.randn(rows, 32, generator=g), torch.randn(vocab, 32, generator=g)
    fast = lm_head_topk(hidden, weight, k, offset, vocab)
    # A chunk smaller than the rows takes the staged, chunked path.
    monkeypatch.setattr(draft_topk, "_CHUNK_ELEMS", vocab * 2)
    chunked = lm_head_topk(hidden, weight, k, offset, vocab)
    assert torch.equal(fast[1], chunked[1])
    # Chunks of rows may round differently in the matmul.
    torch.testing.assert_close(fast[0], chunked[0], atol=1e-5, rtol=0)
    want_v, want_i = reference_topk(hidden, weight, k, vocab)
    assert torch.equal(fast[1], want_i + offset)
    torch.testing.assert_close(fast[0].double(), want_v, atol=1e-4, rtol=0)


@pytest.mark.parametrize("bs,max_bs,block,k", [(1, 4, 16, 16), (3, 3, 5, 8), (2, 8, 17, 64)])
def test_draft_graph_head_equals_the_eager_topk(bs, max_bs, block, k):
    """What the draft graph's tail hook leaves after a replay is the eager path's top-K of
    the block's depth rows (the bonus row left out), for any captured batch size; a smaller
    tree reads the leading columns, the top of the same order."""
    from sglang.srt.speculative.ddtree.draft_topk import DraftTopKHead

    g = torch.Generator().manual_seed(bs * 100 + block)
    vocab, width = 300, 24
    weight = torch.randn(vocab + 4, width, generator=g)  # 4 padding rows past the vocabulary
    head = DraftTopKHead(weight=weight, block_size=block, topk=k, id_offset=0, num_valid=vocab, max_bs=max_bs)
    hidden = torch.randn(bs * block, width, generator=g)
    head(hidden, None)
    got_lp, got_ids = head.read(bs, k)
    depth_rows = hidden.view(bs, block, width)[:, 1:, :].reshape(-1, width)
    want_lp, want_ids = lm_head_topk(depth_rows, weight, k, 0, vocab)
    assert got_lp.shape == got_ids.shape == (bs, block - 1, k)
    assert torch.equal(got_ids, want_ids.view(bs, block - 1, k))
    assert torch.equal(got_lp, want_lp.view(bs, block - 1, k))
    assert int(got_ids.max()) < vocab
    small_lp, small_ids = head.read(bs, k // 2)
    assert small_ids.is_contiguous() and torch.equal(small_ids, want_ids.view(bs, block - 1, k)[..., : k // 2])
    assert torch.equal(small_lp, want_lp.view(bs, block - 1, k)[..., : k // 2])
    with pytest.raises(ValueError, match="holds the top"):
        head.read(bs, k + 1)
