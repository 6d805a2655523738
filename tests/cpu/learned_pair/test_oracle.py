# SPDX-License-Identifier: Apache-2.0
"""The oracle bound of ``evaluate.py``: the best-first tree is the best prefix-closed tree
(brute force on a tiny vocabulary), the tree-masked target forward gives the target's own
conditionals, the exact expectation of a tree matches sampling the target and replaying,
and on a toy pair the oracle bounds the drafter's tree and chain (T=0: the whole depth)."""

from __future__ import annotations

import itertools
import json
import zlib

import numpy as np
import pytest
import torch

from scripts.learned_pair import evaluate


def _synthetic_cond(vocab: int, zeros: bool):
    """A fixed conditional distribution per path, hashed from the path (some entries 0)."""

    def dist(path: tuple) -> np.ndarray:
        rng = np.random.default_rng(zlib.crc32(repr(path).encode()))
        w = rng.random(vocab) ** 3
        if zeros:
            w[rng.random(vocab) < 0.3] = 0.0
            if not w.any():
                w[0] = 1.0
        return w / w.sum()

    calls = []

    def cond(paths):
        calls.append(list(paths))
        return [dist(p) for p in paths]

    return cond, dist, calls


def _prob(dist, path):
    q = 1.0
    for d in range(len(path)):
        q *= dist(path[:d])[path[d]]
    return q


@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("max_depth", [1, 2, 3])
def test_best_first_equals_brute_force_over_prefix_closed_trees(zeros, max_depth):
    vocab = 3
    cond, dist, _ = _synthetic_cond(vocab, zeros)
    paths = [p for d in range(1, max_depth + 1) for p in itertools.product(range(vocab), repeat=d)]
    prob = {p: _prob(dist, p) for p in paths}
    best = evaluate.best_first_tree(cond, 3, max_depth)
    for budget in (1, 2, 3):
        brute = 0.0
        for size in range(budget + 1):
            for tree in itertools.combinations(paths, size):
                if all(p[:-1] in tree for p in tree if len(p) > 1):
                    brute = max(brute, sum(prob[p] for p in tree))
        got = best[:budget]
        assert sum(q for _, q in got) == pytest.approx(brute, abs=1e-12)
        assert all(p[:-1] in [x for x, _ in got] for p, _ in got if len(p) > 1)  # prefix-closed
        assert all(q == pytest.approx(prob[p]) and q > 0 for p, q in got)


def test_best_first_is_the_top_paths_and_batches_its_expansions():
    vocab, depth, budget = 5, 4, 24
    cond, dist, calls = _synthetic_cond(vocab, zeros=True)
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(vocab), repeat=d)]
    probs = sorted((_prob(dist, p) for p in paths), reverse=True)
    best = evaluate.best_first_tree(cond, budget, depth)
    np.testing.assert_allclose([q for _, q in best], [q for q in probs[:budget] if q > 0], rtol=1e-12)
    assert len(calls) <= depth + 1 < budget  # rounds, not one call per node


def test_path_probs_multiply_the_conditionals():
    cond, dist, _ = _synthetic_cond(4, zeros=False)
    paths = [(1,), (1, 2), (1, 2, 0), (3,)]
    assert evaluate.path_probs(cond, paths) == pytest.approx([_prob(dist, p) for p in paths])
    nodes = evaluate.build_tree([[-0.1, -2.0], [-0.2, -3.0]], 3)
    assert evaluate.tree_paths(nodes, [[7, 8], [9, 5]]) == [(7,), (7, 9), (8,)]


def _toy(toy_pair):
    from scripts.learned_pair import checkpoint

    pair, _ = toy_pair
    target, drafter = checkpoint.load_pair(pair)
    prompts = [json.loads(line)["prompt_ids"][:24] for line in (pair / "prompts.jsonl").read_text().splitlines()[:2]]
    return target, drafter, prompts


def _cond_at(target, seq, a, sampling):
    cache = evaluate.KVCache(target.shape, 1, len(seq), "cpu", torch.float32)
    logits, _ = target(torch.tensor([seq]), cache=cache)
    return evaluate.TargetCond(target, cache.k, cache.v, a + 1, logits[0, a], sampling)


@torch.no_grad()
def test_tree_masked_forward_is_the_targets_conditional(toy_pair):
    target, _, prompts = _toy(toy_pair)
    seq, a = prompts[0], 20
    s = evaluate.Sampling(1.0)
    cond = _cond_at(target, seq, a, s)
    paths = [(5,), (5, 9), (7,), (5, 9, 11), (7, 3), (12, 4, 4, 1)]  # ancestors of the last run with it
    for p, got in zip(paths, cond(paths)):
        logits, _ = target(torch.tensor([seq[: a + 1] + list(p)]))
        np.testing.assert_allclose(got, evaluate.target_dist(logits[0, -1], s).double().numpy(), atol=2e-6)


@torch.no_grad()
def test_exact_expectation_matches_sampling_the_target(toy_pair):
    """Sample the target's continuation from the anchor, replay the tree the server's way
    (``tree_accept``): the mean accept length agrees with the sum of path probabilities."""
    target, _, prompts = _toy(toy_pair)
    seq, a, depth = prompts[0], 20, 6
    s = evaluate.Sampling(0.7, 20, 0.8)
    cond = _cond_at(target, seq, a, s)
    best = evaluate.best_first_tree(cond, 12, depth)
    paths = [p for p, _ in best]
    exact = sum(evaluate.path_probs(cond, paths))
    assert exact == pytest.approx(sum(q for _, q in best), rel=1e-9)
    assert exact > 0.3  # a tree worth testing

    n = 4000
    gen = torch.Generator().manual_seed(0)
    cache = evaluate.KVCache(target.shape, n, a + 1 + depth, "cpu", torch.float32)
    logits, _ = target(torch.tensor([seq[: a + 1]]).expand(n, -1), cache=cache)
    draws = []
    for d in range(depth):
        tok = torch.multinomial(evaluate.target_dist(logits[:, -1], s), 1, generator=gen)
        draws.append(tok)
        logits, _ = target(tok, cache=cache)
    draws = torch.cat(draws, 1).tolist()
    # the tree in tree_accept's terms: node j is rank j of its depth's row
    nodes = [evaluate.Node(paths.index(p[:-1]) if len(p) > 1 else -1, len(p), j, 0.0) for j, p in enumerate(paths)]
    tokens = [[p[-1] if len(p) == d + 1 else -1 for p in paths] for d in range(depth)]
    accepted = [evaluate.tree_accept(nodes, tokens, truth) for truth in draws]
    mc = float(np.mean(accepted))
    se = float(np.std(accepted)) / np.sqrt(n)
    assert abs(mc - exact) < 4 * se + 0.01, (mc, exact, se)


def test_oracle_bounds_the_drafter_and_takes_the_whole_depth_at_t0(toy_pair):
    from scripts.learned_pair.tokenizer import MASK_ID

    target, drafter, prompts = _toy(toy_pair)
    cap = drafter.shape.block_size - 1
    budgets = [2, 4, 16]
    for s in (evaluate.Sampling(1.0), evaluate.Sampling(0.7, 20, 0.8)):
        r = evaluate.oracle_accept(drafter, target, prompts, 24, budgets, MASK_ID, 0, s, stride=4)
        assert r["anchors"] > 0 and 0 <= r["target_entropy_mean"] and 0 < r["target_top1_mean"] <= 1
        for row in r["budgets"]:
            assert 1.0 <= row["drafter_tree_expected_accept"] <= row["oracle_expected_accept"] + 1e-9
            assert row["oracle_expected_accept"] <= min(row["budget"], cap) + 1
            if row["budget"] >= cap:  # the chain is a tree of cap nodes
                assert row["drafter_chain_expected_accept"] <= row["oracle_expected_accept"] + 1e-9
        oracle = [row["oracle_expected_accept"] for row in r["budgets"]]
        assert oracle == sorted(oracle)
    g = evaluate.oracle_accept(drafter, target, prompts, 24, budgets, MASK_ID, 0, evaluate.Sampling(), stride=4)
    assert [row["oracle_expected_accept"] for row in g["budgets"]] == [min(b, cap) + 1.0 for b in budgets]
    assert g["target_entropy_mean"] == 0.0 and g["target_top1_mean"] == 1.0


def test_trees_from_the_drafter_at_other_temperatures(toy_pair):
    """At temperature 1 the tempered tree is the drafter's own tree; every tempered tree is
    bounded by the oracle, at every sampling setting."""
    from scripts.learned_pair.tokenizer import MASK_ID

    target, drafter, prompts = _toy(toy_pair)
    budgets = [4, 16]
    for s in (evaluate.Sampling(1.0), evaluate.Sampling(0.7, 20, 0.8), evaluate.Sampling()):
        r = evaluate.oracle_accept(drafter, target, prompts, 24, budgets, MASK_ID, 0, s, stride=4,
                                   tree_temperatures=(0.5, 1.0, 2.0))
        for row in r["budgets"]:
            at = row["drafter_tree_expected_accept_at_temperature"]
            assert set(at) == {"0.5", "1.0", "2.0"}
            assert at["1.0"] == row["drafter_tree_expected_accept"]
            assert all(1.0 <= v <= row["oracle_expected_accept"] + 1e-9 for v in at.values())
    plain = evaluate.oracle_accept(drafter, target, prompts, 24, budgets, MASK_ID, 0, evaluate.Sampling(1.0), stride=4)
    assert all("drafter_tree_expected_accept_at_temperature" not in row for row in plain["budgets"])


def test_offline_oracle_command_writes_its_run(toy_pair, tmp_path):
    """The command line end to end on the toy pair: one setting, the tempered trees, and the
    run's date and host in the JSON."""
    from scripts.learned_pair.__main__ import main as cli

    pair, _ = toy_pair
    out = tmp_path / "oracle.json"
    assert cli(["offline", str(pair), "--oracle", "--sampling", "1", "--budgets", "4", "--prompts", "1",
                "--new-tokens", "24", "--stride", "6", "--tree-temperatures", "0.8,1.25", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["oracle"] and r["date"] and "CPUs, torch" in r["host"]
    (setting,) = r["settings"]
    (row,) = setting["budgets"]
    assert set(row["drafter_tree_expected_accept_at_temperature"]) == {"0.8", "1.25"}


def test_speculative_chain_accept_against_fixed_tokens_and_a_matching_proposal():
    cond, dist, _ = _synthetic_cond(5, zeros=True)
    draft = (1, 3, 0, 2)
    fixed = evaluate.speculative_chain_accept(cond, draft, [None] * 4)
    assert fixed == pytest.approx(sum(evaluate.path_probs(cond, [draft[:d] for d in range(1, 5)])))
    # Proposing each depth from the target's own conditional keeps every depth that has mass.
    proposal = [dist(draft[:d]) for d in range(4)]
    kept = 0
    for d in range(4):
        if proposal[d][draft[d]] == 0:
            break
        kept += 1
    assert evaluate.speculative_chain_accept(cond, draft, proposal) == pytest.approx(kept)


def test_speculative_chain_accept_is_the_mean_of_the_verify_it_describes():
    """Draw chains from per-depth proposals that ignore the drawn prefix (a block drafter), run
    speculative sampling's keep/reject coin per depth: the mean kept length is the exact value's
    mean, and the tokens the steps emit first follow the target's distribution (lossless)."""
    cond, dist, _ = _synthetic_cond(4, zeros=False)
    rng = np.random.default_rng(3)
    proposal = [w / w.sum() for w in rng.random((3, 4)) ** 2]
    n, kept, exact, first = 20000, [], [], np.zeros(4)
    for _ in range(n):
        draft = tuple(int(rng.choice(4, p=q)) for q in proposal)
        exact.append(evaluate.speculative_chain_accept(cond, draft, proposal))
        k = 0
        for d in range(3):
            p, q = dist(draft[:d]), proposal[d]
            if rng.random() < min(1.0, p[draft[d]] / q[draft[d]]):
                k += 1
                continue
            if d == 0:  # rejected at the root: the step's token from the residual
                r = np.maximum(p - q, 0.0)
                first[rng.choice(4, p=r / r.sum())] += 1
            break
        if k:
            first[draft[0]] += 1
        kept.append(k)
    se = np.std(kept) / np.sqrt(n)
    assert abs(np.mean(kept) - np.mean(exact)) < 4 * se
    np.testing.assert_allclose(first / n, dist(()), atol=0.012)


def _simulate_rrs(rng, p, q, k):
    """One node's verify as the server would run it: k children drawn from q without replacement,
    each kept with min(1, p_i / q_i), the residual after each rejection; the emitted token."""
    p, q = p.copy(), q.copy()
    for _ in range(k):
        qi = q / q.sum()
        c = int(rng.choice(len(q), p=qi))
        if rng.random() < min(1.0, p[c] / qi[c]):
            return c
        r = np.maximum(p - qi, 0.0)
        p = r / r.sum()
        q[c] = 0.0
    return int(rng.choice(len(p), p=p))


def test_recursive_rejection_sampling_is_lossless_and_its_probabilities_are_the_mean():
    rng = np.random.default_rng(5)
    p = rng.random(6) ** 2
    p /= p.sum()
    q = rng.random(6) ** 3
    q /= q.sum()
    assert evaluate.recursive_rejection_probs(p, [4, 1]) == pytest.approx([p[4], p[1]])
    n, emitted = 30000, np.zeros(6)
    for _ in range(n):
        emitted[_simulate_rrs(rng, p, q, 3)] += 1
    np.testing.assert_allclose(emitted / n, p, atol=0.01)  # the node's token follows p
    # the keep probability of a fixed set of draws, against the coins alone
    draws = [2, 5, 0]
    probs = evaluate.recursive_rejection_probs(p, draws, q, [True] * 3)
    hits = np.zeros(3)
    for _ in range(n):
        pp, qq = p.copy(), q.copy()
        for i, c in enumerate(draws):
            qi = qq / qq.sum()
            if rng.random() < min(1.0, pp[c] / qi[c]):
                hits[i] += 1
                break
            r = np.maximum(pp - qi, 0.0)
            pp = r / r.sum()
            qq[c] = 0.0
    np.testing.assert_allclose(hits / n, probs, atol=0.01)
    # drawing the children beats fixing the most likely ones when q is close to a flat p
    flat = np.full(6, 1 / 6)
    assert sum(evaluate.recursive_rejection_probs(flat, [0, 1], flat, [True, True])) == pytest.approx(1.0)
    assert sum(evaluate.recursive_rejection_probs(flat, [0, 1])) == pytest.approx(2 / 6)


def test_drawn_tree_without_drawn_depths_is_the_servers_tree():
    cond, dist, _ = _synthetic_cond(5, zeros=True)
    logp = np.log(np.array([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.7, 0.2, 0.1]]))
    tokens = [[3, 1, 0], [2, 4, 1], [0, 2, 3]]
    nodes = evaluate.build_tree(logp.tolist(), 7)
    want = sum(evaluate.path_probs(cond, evaluate.tree_paths(nodes, tokens)))
    rng = np.random.default_rng(0)
    proposal = [np.full(5, 0.2)] * 3
    assert evaluate.drawn_tree_accept(cond, nodes, tokens, proposal, (), rng) == pytest.approx(want)


@pytest.mark.parametrize("fixed_first", [0, 1])
def test_drawn_tree_accept_is_the_mean_of_simulating_its_verify(fixed_first):
    """Children drawn at every depth from skewed proposals (past the first ``fixed_first``, the
    shape's own tokens): the mean of the exact values over draws equals walking the tree with the
    verify's coins (draws and coins both simulated); the root's token follows the target's."""
    cond, dist, _ = _synthetic_cond(5, zeros=False)
    logp = np.log(np.array([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.7, 0.2, 0.1]]))
    tokens = [[3, 1, 0], [2, 4, 1], [0, 2, 3]]
    nodes = evaluate.build_tree(logp.tolist(), 7)
    rng = np.random.default_rng(2)
    proposal = [w / w.sum() for w in rng.random((3, 5)) ** 2]
    n = 6000
    exact = [evaluate.drawn_tree_accept(cond, nodes, tokens, proposal, (1, 2, 3), rng, fixed_first)
             for _ in range(n)]
    children: dict = {}
    for i, node in enumerate(nodes):
        children.setdefault(node.parent, []).append(i)
    walked, root_tokens = [], np.zeros(5)
    for _ in range(n):
        at, path, depth = -1, (), 0
        while at in children:
            kids = sorted(children[at], key=lambda i: nodes[i].rank)
            d = nodes[kids[0]].depth
            p, q = dist(path), proposal[d - 1].copy()
            nxt = None
            for j, i in enumerate(kids):  # the next child (fixed, or drawn without replacement), its coin
                if j < fixed_first:
                    c = tokens[d - 1][j]
                    qi = np.eye(5)[c]
                else:
                    qi = q / q.sum()
                    c = int(rng.choice(5, p=qi))
                if rng.random() < min(1.0, p[c] / qi[c]):
                    nxt = (i, c)
                    break
                r = np.maximum(p - qi, 0.0)
                p = r / r.sum()
                q[c] = 0.0
            if at == -1:
                root_tokens[nxt[1] if nxt else int(rng.choice(5, p=p))] += 1
            if nxt is None:
                break
            at, path, depth = nxt[0], path + (nxt[1],), depth + 1
        walked.append(depth)
    se = np.hypot(np.std(exact), np.std(walked)) / np.sqrt(n)
    assert abs(np.mean(exact) - np.mean(walked)) < 4 * se, (np.mean(exact), np.mean(walked), se)
    np.testing.assert_allclose(root_tokens / n, dist(()), atol=0.02)


def test_draws_in_the_oracle(toy_pair):
    from scripts.learned_pair.__main__ import main as cli
    from scripts.learned_pair.tokenizer import MASK_ID

    target, drafter, prompts = _toy(toy_pair)
    cap = drafter.shape.block_size - 1
    r = evaluate.oracle_accept(drafter, target, prompts, 24, [4], MASK_ID, 0, evaluate.Sampling(0.7, 20, 0.8),
                               stride=6, draws=3)
    (row,) = r["budgets"]
    assert row["draws_per_anchor"] == 3
    for key in ("drawn_chain_expected_accept", "first_drawn_chain_expected_accept"):
        assert 1.0 <= row[key] <= cap + 1
    for key in [f"{name}_expected_accept" for name, _, _ in evaluate.DRAWN_TREES]:
        assert 1.0 <= row[key] <= min(4, cap) + 1
    greedy = evaluate.oracle_accept(drafter, target, prompts, 24, [4], MASK_ID, 0, evaluate.Sampling(),
                                    stride=6, draws=3)
    assert "drawn_chain_expected_accept" not in greedy["budgets"][0]  # nothing to draw at T=0
    pair, _ = toy_pair
    with pytest.raises(SystemExit, match="with --oracle"):
        cli(["offline", str(pair), "--sampling", "1", "--draws", "2"])


def test_offline_replay_in_bfloat16_records_its_run(toy_pair, tmp_path):
    """``--dtype bfloat16`` (the server's dtype on a GPU) replays with bf16 models; the JSON records
    the dtype, the seed and the argv."""
    from scripts.learned_pair.__main__ import main as cli

    pair, _ = toy_pair
    runs = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / f"{dtype}.json"
        argv = ["offline", str(pair), "--sampling", "1", "--budgets", "4", "--prompts", "1", "--new-tokens", "24",
                "--seed", "3", "--dtype", dtype, "--out", str(out)]
        assert cli(argv) == 0
        runs[dtype] = json.loads(out.read_text())
        assert runs[dtype]["dtype"] == dtype and runs[dtype]["seed"] == 3 and runs[dtype]["argv"] == argv
        assert runs[dtype]["settings"][0]["ddtree4"] >= 1.0
    with pytest.raises(SystemExit):
        cli(["offline", str(pair), "--sampling", "1", "--dtype", "float16"])
