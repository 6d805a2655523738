# SPDX-License-Identifier: Apache-2.0
"""Sliding windows and attention sinks in the fused kernels, under
TRITON_INTERPRET=1 against the fp32 torch reference (fp16 inputs: the
interpreter mis-computes bf16 dots), and the reference itself against a
softmax written out by hand."""

import math

import pytest
import torch

from sglang.srt.layers.attention.tree_verify import StrategyUnavailable, tree_verify_attention
from sglang.srt.layers.attention.tree_verify.configs import TreeVerifyConfig
from sglang.srt.layers.attention.tree_verify.masks import unpack_tree_mask
from sglang.srt.layers.attention.tree_verify.reference import tree_verify_attention_ref

from _interp import interpreted_prefix_split
from test_fused_interpreter import SMALL, SMALL_CHUNKS, SMALL_QB, SMALL_RP, make_case

CONFIGS = [SMALL, SMALL_RP, SMALL_CHUNKS]
IDS = ["qk", "prefetch", "chunks"]


def run_fused(case, scale, cfg, splits, window=None, sinks=None):
    ref = tree_verify_attention_ref(*case, scale, sliding_window=window, sinks=sinks).float()
    out = torch.full_like(ref, float("nan")).half()  # poison: every element must be written
    interpreted_prefix_split().tree_verify_fused(
        *case, scale, out, 0.0, cfg, num_splits=splits, sliding_window=window, sinks=sinks
    )
    return out.float(), ref


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
@pytest.mark.parametrize(
    "prefix_lens,n,window,splits",
    [
        ([40, 3, 0], 9, 5, 3),  # the window starts inside the prefix, tails shorter than it
        ([70], 17, 20, None),  # the window cuts the prefix; deep trees reach past their prefix
        ([25, 50], 33, 0, 2),  # a node sees itself only
        ([33], 12, 100, 4),  # a window longer than everything: full attention
    ],
)
def test_sliding_window_gqa(cfg, prefix_lens, n, window, splits):
    case = make_case(n * 11 + window, prefix_lens, n, 6, 2, 32, 32, False)
    out, ref = run_fused(case, 32**-0.5, cfg, splits, window=window)
    assert (out - ref).abs().max().item() < 4e-3
    full = tree_verify_attention_ref(*case, 32**-0.5).float()
    assert ((full - ref).abs().max().item() > 1e-2) == (window < 100)  # the window cuts


def test_sliding_window_chain_reaches_back_into_the_tree():
    """A DFlash chain of 20 with a window of 3: deep nodes drop the prefix and
    their oldest ancestors."""
    case = make_case(3, [10, 0], 20, 4, 4, 16, 16, False, chain=True)
    out, ref = run_fused(case, 0.25, SMALL, 2, window=3)
    assert (out - ref).abs().max().item() < 4e-3


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
@pytest.mark.parametrize("window", [None, 6])
def test_sinks_with_and_without_window(cfg, window):
    case = make_case(17, [30, 0, 9], 7, 8, 2, 32, 32, False)
    sinks = torch.linspace(-2.0, 3.0, 8).half()  # gpt-oss keeps them in the model dtype
    out, ref = run_fused(case, 32**-0.5, cfg, 2, window=window, sinks=sinks)
    assert (out - ref).abs().max().item() < 4e-3
    # The sink takes probability mass: without it every output would differ.
    plain = tree_verify_attention_ref(*case, 32**-0.5, sliding_window=window).float()
    assert (plain - ref).abs().amax(dim=(0, 2)).min().item() > 1e-3


def test_window_on_an_mla_like_layout():
    case = make_case(5, [45, 12], 9, 3, 1, 80, 64, True)
    out, ref = run_fused(case, 0.125, SMALL_QB, 2, window=10)
    assert (out - ref).abs().max().item() < 4e-3


def test_reference_window_and_sink_by_hand():
    """One request, one head: the reference against softmax over the keys a
    node may see, written out (positions P + depth, keys at distance <= W)."""
    gen = torch.Generator().manual_seed(0)
    p, n, d, w = 6, 4, 8, 3
    parents = torch.tensor([[-1, 0, 1, 0]])
    from sglang.srt.layers.attention.tree_verify import tree_mask_from_parents

    mask = tree_mask_from_parents(parents)
    k = torch.randn(p + n, 1, d, generator=gen)
    v = torch.randn(p + n, 1, d, generator=gen)
    q = torch.randn(n, 1, d, generator=gen)
    sink = torch.tensor([0.7])
    got = tree_verify_attention_ref(
        q, k, v, torch.tensor([0, p], dtype=torch.int32), torch.arange(p, dtype=torch.int32),
        torch.arange(p, p + n, dtype=torch.int32).view(1, n), mask, 1.0,
        sliding_window=w, sinks=sink,
    )  # fmt: skip
    depth = [0, 1, 2, 1]
    ancestors = [{0}, {0, 1}, {0, 1, 2}, {0, 3}]
    for i in range(n):
        qp = p + depth[i]
        keys = [t for t in range(p) if qp - t <= w]
        keys += [p + j for j in sorted(ancestors[i]) if depth[i] - depth[j] <= w]
        s = torch.stack([q[i, 0] @ k[t, 0] for t in keys])
        e = torch.exp(s)
        want = (e[:, None] * v[keys, 0]).sum(0) / (e.sum() + math.exp(0.7))
        assert torch.allclose(got[i, 0], want, atol=1e-5), i
    assert unpack_tree_mask(mask, n)[0].sum(-1).tolist() == [1, 2, 3, 2]


def test_dispatcher_validates_and_routes_window_and_sinks():
    case = make_case(1, [12], 5, 4, 2, 16, 16, False)
    sinks = torch.zeros(4)
    out = tree_verify_attention(*case, 0.25, strategy="reference", sliding_window=2, sinks=sinks)
    assert torch.equal(out, tree_verify_attention_ref(*case, 0.25, sliding_window=2, sinks=sinks))
    with pytest.raises(ValueError, match=r"sinks must be \[H\] = \[4\]"):
        tree_verify_attention(*case, 0.25, strategy="reference", sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="sliding_window must be an int >= 0"):
        tree_verify_attention(*case, 0.25, strategy="reference", sliding_window=-1)
    with pytest.raises(StrategyUnavailable, match="sliding windows and attention sinks"):
        tree_verify_attention(*case, 0.25, strategy="upstream_extend", sliding_window=2)


def test_window_refused_by_the_mla_only_loops():
    case = make_case(2, [64], 3, 2, 1, 576, 512, True)
    scratch = TreeVerifyConfig(64, 64, 8, 2, scores_via_scratch=True)
    with pytest.raises(ValueError, match="apply no window"):
        interpreted_prefix_split().tree_verify_fused(
            *case, 0.05, None, 0.0, scratch, num_splits=1, sliding_window=8
        )
