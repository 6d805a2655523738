# SPDX-License-Identifier: Apache-2.0
"""``step_graphs.SegmentGraphs`` on a real GPU, with the worker's own segments: the tree's build
and compile (``DDTreeWorker._build_and_compile``) and the step tail
(``DDTreeWorker._step_tail``: the argmax, the acceptance kernel, the commit launch), the
drafter's context write stood in for by a row copy at the committed slots, and the tree from a
DFlash 2 selector (``DDTreeWorker._build_selector_and_compile``) and DFLASH's selector path
(``dflash_step.greedy_path``). Every replay must
return and write what the eager segments do on the same inputs, with the tree read where its
graph left it; a new shape or guard captures anew; a segment that cannot be captured runs
eagerly. A sampled tail's draw, keyed by a seed drawn on the device inside the graph, draws
softmax(logits / T) afresh on every replay.

Run on the GPU host: ``python3 -m pytest tests/gpu/ddtree_logic -q``.
"""

from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from sglang.srt.speculative.ddtree.step_graphs import SegmentGraphs  # noqa: E402
from sglang.srt.speculative.ddtree.tree_compile import max_tree_depth  # noqa: E402
from sglang.srt.speculative.ddtree.worker import _TREE_TENSORS, DDTreeWorker  # noqa: E402

DEV = "cuda"
VOCAB, DEPTHS, HIDDEN, POOL_ROWS, ROW_LEN = 512, 15, 64, 40, 4096
_OUTPUTS = ("new_cache_loc", "output_tokens", "commit_lens", "new_seq_lens", "ctx_rows", "ctx_positions",
            "ctx_cache_loc")  # fmt: skip


class _State:
    """The buffers a server's step reads in place: the draft head's top-K, the verify graph's
    logits and hidden states, ``req_to_token`` and a KV pool of rows (its last row takes the
    rows past each request's commit)."""

    def __init__(self, max_bs, budget):
        n = budget + 1
        self.logprobs = torch.empty(max_bs * DEPTHS, budget, device=DEV)
        self.ids = torch.empty(max_bs * DEPTHS, budget, device=DEV, dtype=torch.int64)
        self.logits = torch.empty(max_bs * n, VOCAB, device=DEV)
        self.hidden = torch.empty(max_bs * n, HIDDEN, device=DEV, dtype=torch.bfloat16)
        self.req_to_token = torch.randperm(POOL_ROWS * ROW_LEN, device=DEV).view(POOL_ROWS, ROW_LEN).to(torch.int32)
        self.kv = torch.zeros(POOL_ROWS * ROW_LEN + 1, HIDDEN, device=DEV, dtype=torch.bfloat16)

    def snapshot(self):
        return self.req_to_token.clone(), self.kv.clone()


def _worker(state):
    def write_rows(*, target_hidden, cache_loc_2d, commit_lens, **_):
        width = cache_loc_2d.shape[1]
        live = torch.arange(width, device=DEV).unsqueeze(0) < commit_lens.unsqueeze(1)
        dest = torch.where(live, cache_loc_2d, state.kv.shape[0] - 1).reshape(-1)
        state.kv.index_copy_(0, dest, target_hidden)

    w = object.__new__(DDTreeWorker)
    w._dflash = SimpleNamespace(append_draft_context=write_rows)
    return w


def _new_step(state, bs, budget, seed):
    """This step's draft top-K and, once the tree is known, target logits that agree with most
    nodes' first child (long accepted paths). Returns the fed tensors and a function that fills
    the verify outputs from a compiled tree."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    lp = torch.randn(bs, DEPTHS, VOCAB, device=DEV, generator=g).log_softmax(-1)
    top = lp.topk(budget, dim=-1)
    state.logprobs[: bs * DEPTHS].copy_(top.values.view(-1, budget))
    state.ids[: bs * DEPTHS].copy_(top.indices.view(-1, budget))
    n = budget + 1
    rows = torch.randperm(POOL_ROWS, device=DEV, generator=g)[:bs]
    prefix = torch.randint(1, ROW_LEN - 2 * n, (bs,), device=DEV, generator=g)
    bonus = torch.randint(0, VOCAB, (bs,), device=DEV, generator=g)

    def verify(tree):
        child = tree.retrive_next_token.clamp(min=0)
        agree = torch.gather(tree.tokens, 1, child)
        noise = torch.randint(0, VOCAB, (bs, n), device=DEV, generator=g)
        pick = torch.where(torch.rand(bs, n, device=DEV, generator=g) < 0.8, agree, noise)
        state.logits[: bs * n].normal_(generator=g)
        state.logits[: bs * n].scatter_(1, pick.view(-1, 1), 100.0)
        state.hidden[: bs * n].normal_(generator=g)
        return state.logits[: bs * n], state.hidden[: bs * n]

    head = (state.logprobs[: bs * DEPTHS].view(bs, DEPTHS, budget), state.ids[: bs * DEPTHS].view(bs, DEPTHS, budget))
    return head, (bonus, prefix, rows), verify


def _step(w, trees, tails, state, bs, budget, seed, guard=()):
    """One step through the graphs, checked against the eager segments on the same inputs."""
    max_depth = max_tree_depth(budget, DEPTHS)
    head, (bonus, prefix, rows), verify = _new_step(state, bs, budget, seed)
    want_tree = w._build_and_compile(budget, max_depth, budget, *head, state.req_to_token, bonus, prefix, rows)
    tree = trees.run((budget, max_depth, budget), (*head, state.req_to_token), (bonus, prefix, rows))
    in_place = trees.last_replayed
    step_rows = trees.last_fed[1:] if in_place else (prefix, rows)
    for name in _TREE_TENSORS:
        assert torch.equal(getattr(tree, name), getattr(want_tree, name)), name
    logits, hidden = verify(tree)

    r2t, kv = state.snapshot()
    tree_tensors = tuple(getattr(tree, name) for name in _TREE_TENSORS)
    fixed = (logits, hidden, None, state.req_to_token)
    got = tails.run(
        (max_depth, in_place, None),
        fixed + tree_tensors + step_rows if in_place else fixed,
        () if in_place else tree_tensors + step_rows,
        guard=guard,
    )
    torch.cuda.synchronize()
    r2t_got, kv_got = state.snapshot()
    state.req_to_token.copy_(r2t)
    state.kv.copy_(kv)
    want = w._step_tail(max_depth, False, None, logits, hidden, None, state.req_to_token, *tree_tensors, prefix,
                        rows)
    for name in _OUTPUTS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.accept.next_bonus, want.accept.next_bonus)
    assert torch.equal(r2t_got, state.req_to_token), "req_to_token writes differ"
    # The last row takes every dead row (which of them lands there is not defined).
    assert torch.equal(kv_got[:-1], state.kv[:-1]), "context rows differ"
    return got


@pytest.mark.parametrize("bs,budget", [(1, 16), (8, 64)])
def test_replays_return_and_write_what_the_eager_segments_do(bs, budget):
    state = _State(bs, budget)
    w = _worker(state)
    trees, tails = SegmentGraphs("tree", w._build_and_compile), SegmentGraphs("tail", w._step_tail)
    accepted = [_step(w, trees, tails, state, bs, budget, seed).commit_lens.float().mean().item() for seed in range(7)]
    # Trees: step 0 eager, step 1 captured (and replayed), steps 2-6 replayed. Tails: step 0
    # copies an eager tree in (eager); step 1 reads the tree graph's output in place (eager,
    # a new key), step 2 captures, steps 3-6 replay.
    assert (trees.captures, trees.replays) == (1, 6)
    assert (tails.captures, tails.replays) == (1, 5) and tails.last_replayed
    assert trees.disabled_reason is None and tails.disabled_reason is None
    assert sum(accepted) / len(accepted) > 1.5, "the inputs must exercise accepted paths"


def test_a_smaller_tree_from_the_wider_head_replays_what_the_eager_narrow_head_builds():
    """A step budget below the head's width (the adaptive policy's): the tree graph takes the
    head's buffers at their full width and slices each depth's leading top-K inside the graph,
    which builds the tree ``DraftTopKHead.read`` gives the eager path (a contiguous copy)."""
    full, small, bs = 64, 16, 4
    state = _State(bs, full)
    w = _worker(state)
    trees = SegmentGraphs("tree", w._build_and_compile)
    max_depth = max_tree_depth(small, DEPTHS)
    for seed in range(4):  # eager, captured, replayed twice
        (logprobs, ids), (bonus, prefix, rows), _ = _new_step(state, bs, full, 200 + seed)
        want = w._build_and_compile(small, max_depth, small, logprobs[..., :small].contiguous(),
                                    ids[..., :small].contiguous(), state.req_to_token, bonus, prefix, rows)  # fmt: skip
        got = trees.run((small, max_depth, small), (logprobs, ids, state.req_to_token), (bonus, prefix, rows))
        for name in _TREE_TENSORS:
            assert torch.equal(getattr(got, name), getattr(want, name)), (seed, name)
    assert (trees.captures, trees.replays) == (1, 3) and trees.disabled_reason is None


def _selector_worker(state, k=8, rank=8):
    """A worker whose drafter is DFlash 2's own selector code (``DFlash2DraftModel``'s
    candidates and lattice over a ``CandidateSelector`` with random tables) on a random LM head."""
    import types

    from sglang.srt.models.dflash2 import DFlash2DraftModel
    from sglang.srt.speculative.dflash2.selector import CandidateSelector

    g = torch.Generator(device=DEV).manual_seed(7)
    selector = CandidateSelector(hidden_size=HIDDEN, vocab_size=VOCAB, rank=rank, top_k=k).to(DEV)
    with torch.no_grad():
        for p in selector.parameters():
            p.copy_(torch.randn(p.shape, device=DEV, generator=g) * 0.5)
    drafter = SimpleNamespace(candidate_selector=selector, lm_head=None,
                              dflash2=SimpleNamespace(output_multiplier=1.25, final_logit_softcapping=30.0))  # fmt: skip
    drafter.compute_candidates = types.MethodType(DFlash2DraftModel.compute_candidates, drafter)
    drafter.selector_lattice = types.MethodType(DFlash2DraftModel.selector_lattice, drafter)
    head = SimpleNamespace(weight=torch.randn(VOCAB, HIDDEN, device=DEV, generator=g, dtype=torch.bfloat16))
    w = _worker(state)
    w.draft_model = drafter
    w._target_worker = SimpleNamespace(model_runner=SimpleNamespace(model=SimpleNamespace(lm_head=head)))
    return w


@pytest.mark.parametrize("bs,budget", [(1, 16), (4, 64)])
def test_a_tree_from_the_selector_replays_what_the_eager_segment_builds(bs, budget):
    """The tree from a DFlash 2 selector's transitions as the worker replays it: the draft
    graph's hidden states read in place (new values at the same address every step), the
    bonus, prefix lengths and rows fed; every replay equals the eager segment."""
    state = _State(bs, budget)
    w = _selector_worker(state)
    block = DEPTHS + 1
    draft_out = torch.empty(bs, block, HIDDEN, device=DEV, dtype=torch.bfloat16)  # the draft graph's buffer
    trees = SegmentGraphs("selector tree", w._build_selector_and_compile)
    max_depth = max_tree_depth(budget, DEPTHS)
    for seed in range(5):  # eager, captured, replayed three times
        _, (bonus, prefix, rows), _ = _new_step(state, bs, budget, 300 + seed)
        draft_out.normal_(generator=torch.Generator(device=DEV).manual_seed(400 + seed))
        slots = draft_out[:, 1:, :]
        want = w._build_selector_and_compile(budget, max_depth, slots, state.req_to_token, bonus, prefix, rows)
        got = trees.run((budget, max_depth), (slots, state.req_to_token), (bonus, prefix, rows))
        for name in _TREE_TENSORS:
            assert torch.equal(getattr(got, name), getattr(want, name)), (seed, name)
        assert int(want.tokens.shape[1]) == budget + 1
    assert (trees.captures, trees.replays) == (1, 4) and trees.disabled_reason is None


def test_dflash_selector_path_replays_what_it_computes_eagerly():
    """DFLASH with a DFlash 2 drafter (``dflash_step.propose``): the greedy path over the
    selector's lattice replays as the worker's graph, reading the draft graph's hidden states in
    place; every step equals the eager path, at two batch sizes."""
    from sglang.srt.speculative.dflash2 import dflash_step

    state = _State(4, 16)
    w = _selector_worker(state)
    block = DEPTHS + 1
    worker = SimpleNamespace(draft_model=w.draft_model, block_size=block,
                             server_args=SimpleNamespace(disable_cuda_graph=False))  # fmt: skip
    head = w.target_worker.model_runner.model.lm_head
    buffers = {bs: torch.empty(bs * block, HIDDEN, device=DEV, dtype=torch.bfloat16) for bs in (1, 4)}
    for seed, bs in enumerate([1, 1, 1, 4, 4, 4, 1]):
        g = torch.Generator(device=DEV).manual_seed(500 + seed)
        buffers[bs].normal_(generator=g)
        anchors = torch.randint(0, VOCAB, (bs,), device=DEV, generator=g)
        got = dflash_step.propose(worker, SimpleNamespace(hidden_states=buffers[bs]), bs=bs, anchor_ids=anchors,
                                  lm_head=head)  # fmt: skip
        want = dflash_step.greedy_path(w.draft_model, head, buffers[bs].view(bs, block, -1)[:, 1:], anchors)
        assert torch.equal(got, want), seed
    graphs = worker._dflash2_path_graphs
    assert graphs.captures == 2 and graphs.replays == 5 and graphs.disabled_reason is None


def test_a_new_batch_size_or_guard_is_a_new_graph():
    budget = 16
    state = _State(4, budget)
    w = _worker(state)
    trees, tails = SegmentGraphs("tree", w._build_and_compile), SegmentGraphs("tail", w._step_tail)
    plan = [(2, 0)] * 3 + [(4, 0)] * 3 + [(2, 1)] * 3 + [(2, 0), (4, 0)]
    for seed, (bs, guard) in enumerate(plan):
        _step(w, trees, tails, state, bs, budget, 100 + seed, guard=(guard,))
    # Trees by batch size: 2 and 4 each eager, captured, then replayed.
    assert trees.captures == 2 and len(trees) == 2
    # Tails: a graph each for (2, guard 0), (4, guard 0), (2, guard 1) with the tree in place;
    # the last two steps replay theirs.
    assert tails.captures == 3 and len(tails) == 3 and tails.last_replayed


def test_a_segment_that_cannot_be_captured_runs_eagerly():
    calls = []

    def syncing(scale, x):
        calls.append(1)
        return x * scale + x.sum().item()  # a host read: not capturable

    graphs = SegmentGraphs("test syncing", syncing)
    x = torch.arange(4.0, device=DEV)
    for _ in range(4):
        assert torch.equal(graphs.run((2.0,), (), (x,)), x * 2 + 6)
    assert graphs.disabled_reason is not None and graphs.captures == 0 and len(graphs) == 0
    assert len(calls) == 5  # eager, the failed capture, then eager twice


def test_keys_that_keep_changing_stop_capturing():
    graphs = SegmentGraphs("test moving", lambda x: x * 2, max_captures=2)
    for size in (1, 1, 2, 2, 3, 3, 3):
        x = torch.ones(size, device=DEV)
        assert torch.equal(graphs.run((), (), (x,)), x * 2)
    assert graphs.captures == 2 and "keep changing" in graphs.disabled_reason and len(graphs) == 0


def test_a_sampled_draw_in_a_graph_draws_afresh_on_every_replay():
    """The tail's draw (``GraphDraw.tokens`` keyed by ``torch.randint`` on the device, as
    ``_step_tail`` does) captured once: each replay's rows fit softmax(logits / T) and no two
    replays draw alike."""
    from scipy import stats

    from sglang.srt.speculative.verify_sampling.verify_sampler import GraphDraw

    def draw_rows(draw, logits, temperatures):
        seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=logits.device)
        return draw.tokens(logits, temperatures, None, None, None, nodes=logits.shape[0], seed=seed)

    base = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0], device=DEV)
    rows, t = 20000, 0.7
    logits = base.expand(rows, -1).contiguous()
    temperatures = torch.full((1, 1), t, device=DEV)
    graphs = SegmentGraphs("draws", draw_rows)
    probs = torch.softmax(base.double() / t, -1).cpu()
    seen = []
    for _ in range(6):
        tokens = graphs.run((GraphDraw(False, False, False, None),), (logits,), (temperatures,))
        counts = torch.bincount(tokens.cpu(), minlength=5).double()
        assert stats.chisquare(counts.numpy(), (probs * rows).numpy()).pvalue > 1e-4, counts
        seen.append(tokens.clone())
    assert graphs.captures == 1 and graphs.replays == 5
    assert all(not torch.equal(a, b) for i, a in enumerate(seen) for b in seen[i + 1 :]), "replays drew alike"

