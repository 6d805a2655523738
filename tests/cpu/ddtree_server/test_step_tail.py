# SPDX-License-Identifier: Apache-2.0
"""The tail of a DDTREE step (the target's tokens, the walk, the commit, the drafter's
context), which the worker replays as one CUDA graph: which batches take it, and that the
segment the graph captures does what the step's eager phases do, greedy and sampled, on CPU
tensors. Replay against eager on a GPU: ``tests/gpu/ddtree_logic/test_step_graphs.py``; whole
servers: the GPU tier's e2e tests."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.speculative.ddtree import step_io
from sglang.srt.speculative.ddtree.accept import greedy_accept
from sglang.srt.speculative.ddtree.tree_build import build_tree
from sglang.srt.speculative.ddtree.tree_compile import CompiledTree, compile_tree, max_tree_depth
from sglang.srt.speculative.ddtree.worker import DDTreeWorker
from sglang.srt.speculative.verify_sampling.gumbel_draw import gumbel_draw
from sglang.srt.speculative.verify_sampling.verify_sampler import GraphDraw, plain_argmax


def _info(**over):
    info = dict(
        is_all_greedy=True, logit_bias=None, has_custom_logit_processor=False,
        acc_additive_penalties=None, acc_scaling_penalties=None,
        penalizer_orchestrator=SimpleNamespace(is_required=False),
    )  # fmt: skip
    info.update(over)
    return SimpleNamespace(**info)


@pytest.mark.parametrize(
    "info,plain",
    [
        (None, True),
        (_info(), True),
        (_info(is_all_greedy=False), False),
        (_info(logit_bias=torch.zeros(1, 8)), False),
        (_info(has_custom_logit_processor=True), False),
        (_info(acc_scaling_penalties=torch.ones(1, 8)), False),
        (_info(acc_additive_penalties=torch.zeros(1, 8)), False),
        (_info(penalizer_orchestrator=SimpleNamespace(is_required=True)), False),
    ],
    ids=["no-info", "greedy", "sampled", "logit-bias", "custom-processor", "repetition-penalty",
         "frequency-penalty", "penalizer-required"],  # fmt: skip
)
def test_plain_argmax(info, plain):
    assert plain_argmax(info) is plain


_DRAW = GraphDraw(True, True, False, None)


def _worker(graphs=True, linear=False, draw=_DRAW):
    w = object.__new__(DDTreeWorker)
    asked = []

    def graph_draw(info, reqs):
        asked.append(info)
        return draw

    w.__dict__.update(_tail_graphs=object() if graphs else None, _linear_state=linear,
                      verify_sampler=SimpleNamespace(graph_draw=graph_draw), asked=asked)  # fmt: skip
    return w


def _batch(grammar=False, **info):
    return SimpleNamespace(has_grammar=grammar, sampling_info=_info(**info), reqs=[])


def test_which_steps_take_the_tail_graph():
    assert _worker()._tail_draw(_batch(), verify_replayed=True) == (True, None)  # the argmax
    assert _worker(graphs=False)._tail_draw(_batch(), True) == (False, None)  # graphs off
    assert _worker()._tail_draw(_batch(), False) == (False, None)  # eager verify: its buffers move
    assert _worker(linear=True)._tail_draw(_batch(), True) == (False, None)  # recurrent states
    assert _worker()._tail_draw(_batch(grammar=True), True) == (False, None)
    # A sampled batch: as the verify sampler can draw it in a graph, or eagerly.
    w = _worker()
    assert w._tail_draw(_batch(is_all_greedy=False), True) == (True, _DRAW) and len(w.asked) == 1
    assert _worker(draw=None)._tail_draw(_batch(is_all_greedy=False), True) == (False, None)


@pytest.mark.parametrize("draw", [None, GraphDraw(False, False, False, None)], ids=["argmax", "sampled"])
@pytest.mark.parametrize("seed", range(3))
def test_the_captured_segment_is_the_eager_phases(seed, draw):
    bs, depths, budget, vocab, hidden_size, row_len = 3, 6, 12, 30, 5, 64
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(bs, depths, vocab, generator=g) * 3, -1)
    vals, ids = torch.topk(lp, budget, dim=-1)
    req_to_token = torch.randperm(8 * row_len, generator=g).view(8, row_len)
    rows = torch.randperm(8, generator=g)[:bs]
    prefix = torch.randint(0, row_len - budget - 1, (bs,), generator=g)
    compiled = compile_tree(
        build_tree(vals, ids, budget, use_triton=False),
        torch.randint(0, vocab, (bs,), generator=g), prefix, max_tree_depth(budget, depths),
        req_to_token=req_to_token, req_pool_indices=rows,
    )  # fmt: skip
    n = budget + 1
    logits = torch.randn(bs * n, vocab, generator=g)
    # Agree with the tree's first children often enough for paths longer than the root.
    child = compiled.retrive_next_token.clamp(min=0)
    logits.scatter_(1, torch.gather(compiled.tokens, 1, child).view(-1, 1), 50.0)
    hidden = torch.randn(bs * n, hidden_size, generator=g)

    written = []
    w = object.__new__(DDTreeWorker)
    w._dflash = SimpleNamespace(append_draft_context=lambda **kw: written.append(kw))
    fed = tuple(getattr(compiled, f.name) for f in dataclasses.fields(CompiledTree) if f.name != "max_depth")
    r2t = req_to_token.clone()
    temperatures = torch.full((bs, 1), 0.5)
    params = () if draw is None else (temperatures, None, None, None)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        got = w._step_tail(compiled.max_depth, False, draw, logits, hidden, None, r2t, *fed, prefix, rows, *params)
        torch.manual_seed(seed)
        draw_seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64)

    # The eager phases: the sampler's argmax or the draw, the walk, the commit, the drafter's
    # context.
    want_r2t = req_to_token.clone()
    if draw is None:
        tokens = logits.argmax(-1)
    else:
        tokens = gumbel_draw(logits, temperatures, nodes=n, seed=draw_seed)
    accepted = greedy_accept(compiled, tokens.view(bs, n), read_back=False)
    want = step_io.commit_accepted(accepted, compiled.cache_loc, prefix, want_r2t, rows)
    for name in ("new_cache_loc", "output_tokens", "commit_lens", "new_seq_lens", "ctx_rows", "ctx_positions",
                 "ctx_cache_loc"):  # fmt: skip
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.accept.next_bonus, want.accept.next_bonus)
    assert torch.equal(r2t, want_r2t)
    assert int(want.commit_lens.sum()) > bs, "the inputs must accept paths longer than the root"
    (ctx,) = written
    assert torch.equal(ctx["target_hidden"], hidden[want.ctx_rows])
    assert torch.equal(ctx["cache_loc_2d"], want.ctx_cache_loc)
    assert torch.equal(ctx["cache_loc"], want.ctx_cache_loc.reshape(-1))
    assert torch.equal(ctx["positions"], want.ctx_positions)
    assert torch.equal(ctx["commit_lens"], want.commit_lens)
