# SPDX-License-Identifier: Apache-2.0
import pytest
import torch

from sglang.srt.layers.attention.tree_verify import (
    causal_tree_mask,
    pack_tree_mask,
    tree_mask_from_parents,
    unpack_tree_mask,
)
from sglang.srt.layers.attention.tree_verify.masks import mask_words

from _interp import random_parents


@pytest.mark.parametrize("n", [1, 2, 31, 32, 33, 64, 65, 257])
def test_pack_roundtrip(n):
    gen = torch.Generator().manual_seed(n)
    dense = torch.rand(3, n, n, generator=gen) < 0.5
    bits = pack_tree_mask(dense)
    assert bits.dtype == torch.int32 and bits.shape == (3, n, mask_words(n))
    assert torch.equal(unpack_tree_mask(bits, n), dense)


def test_bit_layout_matches_interface():
    # Bit (j % 32) of word j // 32 of row i set <=> node i sees node j.
    dense = torch.zeros(1, 40, 40, dtype=torch.bool)
    dense[0, 5, 33] = True
    dense[0, 5, 31] = True
    bits = pack_tree_mask(dense)
    assert bits[0, 5, 1].item() == 1 << 1
    assert bits[0, 5, 0].item() == -(2**31)  # bit 31 of an int32 word


def test_causal_is_chain():
    bits = causal_tree_mask(2, 37)
    dense = unpack_tree_mask(bits, 37)
    assert torch.equal(dense[1], torch.ones(37, 37, dtype=torch.bool).tril())
    parents = torch.arange(-1, 36).expand(2, 37)
    assert torch.equal(tree_mask_from_parents(parents), bits)


def test_parents_give_ancestors():
    gen = torch.Generator().manual_seed(0)
    parents = random_parents(4, 50, gen)
    dense = unpack_tree_mask(tree_mask_from_parents(parents), 50)
    for b in range(4):
        for i in range(50):
            seen, j = set(), i
            while j >= 0:
                seen.add(j)
                j = int(parents[b, j])
            assert set(torch.nonzero(dense[b, i]).flatten().tolist()) == seen


@pytest.mark.parametrize(
    "parents", [torch.tensor([[-1, 1]]), torch.tensor([[-1, 0, 5]]), torch.tensor([[-1, -1]])]
)
def test_bad_parents_rejected(parents):
    with pytest.raises(ValueError, match="parent"):
        tree_mask_from_parents(parents)


def test_tree_size_limit():
    with pytest.raises(ValueError, match="257"):
        causal_tree_mask(1, 258)
