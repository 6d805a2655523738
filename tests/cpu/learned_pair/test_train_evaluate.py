# SPDX-License-Identifier: Apache-2.0
"""Training steps reduce the loss (target and drafter), the learning-rate schedule ends in
time, and the offline tree/acceptance replay equals the server's DDTree reference."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from scripts.learned_pair import evaluate, train
from scripts.learned_pair.model import Drafter, DrafterShape, Target, TargetShape

SHAPE = TargetShape(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=256)


def _periodic_tokens(n=6000, seed=0):
    """A stream with structure to learn: repeated random 'words' from a small lexicon."""
    rng = random.Random(seed)
    words = [[rng.randrange(3, 64) for _ in range(rng.randrange(2, 6))] for _ in range(12)]
    out = []
    while len(out) < n:
        out += rng.choice(words)
    return torch.tensor(out[:n], dtype=torch.int32)


def test_target_steps_reduce_loss():
    m = Target(SHAPE)
    m.init_weights(torch.Generator().manual_seed(0))
    tokens = _periodic_tokens()
    probe = train.random_windows(tokens, 8, 33, torch.Generator().manual_seed(9))
    with torch.no_grad():
        before = train.lm_loss(m, probe).item()
    cfg = train.TargetTrainConfig(seq_len=32, batch=8, lr=1e-2, warmup=5, steps=40, log_every=1000)
    rec = train.train_target(m, tokens, cfg, seconds=1e9, seed=1, log=lambda s: None)
    with torch.no_grad():
        after = train.lm_loss(m, probe).item()
    assert rec["steps"] == 40 and rec["decay_start"] == 30
    assert after < 0.7 * before, (before, after)


def test_drafter_steps_reduce_loss():
    m = Target(SHAPE)
    m.init_weights(torch.Generator().manual_seed(0))
    tokens = _periodic_tokens()
    train.train_target(m, tokens, train.TargetTrainConfig(seq_len=32, batch=8, lr=1e-2, warmup=5, steps=30),
                       seconds=1e9, seed=1, log=lambda s: None)
    seqs = train.generate(m, train.random_windows(tokens, 12, 8, torch.Generator().manual_seed(2)), 40,
                          torch.tensor([0.0, 1.0] * 6), torch.Generator().manual_seed(3))
    d = Drafter(SHAPE, DrafterShape(num_hidden_layers=1, intermediate_size=64, target_layer_ids=(1,)))
    d.init_weights(torch.Generator().manual_seed(4))

    def loss_now():
        with torch.no_grad():
            return train.drafter_step_loss(d, m, seqs, 8, 6, 2, torch.Generator().manual_seed(7))[0].item()

    before = loss_now()
    cfg = train.DrafterTrainConfig(batch=6, anchors=6, lr=3e-3, warmup=3, steps=30)
    rec = train.train_drafter(d, m, seqs, 8, 2, cfg, seconds=1e9, seed=5, log=lambda s: None)
    assert rec["steps"] == 30 and len(rec["accuracy_by_offset"]) == 16
    assert not any(p.requires_grad for p in m.parameters())  # the target stays frozen
    assert loss_now() < 0.8 * before


def test_wsd_schedule_decays_to_fit_the_time():
    s = train.WSD(peak_lr=1.0, warmup=10, decay_frac=0.25, min_frac=0.1)
    assert s.lr(0) == pytest.approx(0.1) and s.lr(9) == pytest.approx(1.0) and s.lr(500) == 1.0
    # 1 s per step, 100 s in total: the decay (a quarter of the run) starts when it just fits
    start = None
    for step in range(1, 200):
        s.decide(step, now=float(step), end=100.0, step_s=1.0)
        if s.decay_start is not None:
            start = step
            break
    assert start == 75 and s.total == 100  # 75 + ceil(75 / 3) = 100
    assert s.lr(75) == 1.0 and s.lr(100) == pytest.approx(0.1) and s.done(100) and not s.done(99)
    assert s.lr(88) == pytest.approx(1.0 - 0.9 * 13 / 25)


# ---------------------------------------------------------------------------------------------
# The offline replay of DDTree against the server's plain-Python reference


def _random_logp(rng, depths, k):
    x = np.sort(rng.standard_normal((depths, k)).astype(np.float32) * 2, axis=1)[:, ::-1]
    return (x - np.log(np.exp(x).sum(axis=1, keepdims=True))).tolist()


@pytest.mark.parametrize("budget", [1, 4, 7, 16, 40])
def test_build_tree_equals_server_reference(budget):
    from sglang.srt.speculative.ddtree.reference import build_tree_ref

    rng = np.random.default_rng(budget)
    for _ in range(30):
        depths, k = int(rng.integers(1, 16)), int(rng.integers(1, 12))
        logp = _random_logp(rng, depths, k)
        if rng.random() < 0.3:  # exact ties exercise the tie-break
            logp = [[round(v, 1) for v in row] for row in logp]
        tokens = [[int(t) for t in rng.permutation(50)[:k]] for _ in range(depths)]
        mine = evaluate.build_tree(logp, budget)
        ref = build_tree_ref(logp, tokens, budget)
        assert [(n.parent + 1, n.depth, n.rank) for n in mine] == [(r.parent, r.depth, r.rank) for r in ref]
        assert [n.score for n in mine] == [float(r.score) for r in ref]


def test_tree_accept_equals_server_greedy_walk():
    from sglang.srt.speculative.ddtree.reference import build_tree_ref, greedy_accept_ref

    rng = np.random.default_rng(0)
    for _ in range(200):
        depths, k, budget = int(rng.integers(1, 8)), int(rng.integers(1, 5)), int(rng.integers(1, 20))
        logp = _random_logp(rng, depths, k)
        tokens = [[int(t) for t in rng.permutation(6)[:k]] for _ in range(depths)]
        truth = [int(t) for t in rng.integers(0, 6, depths)]
        nodes = evaluate.build_tree(logp, budget)
        accepted = evaluate.tree_accept(nodes, tokens, truth)
        ref = build_tree_ref(logp, tokens, budget)
        toks = [-1] + [r.token for r in ref]
        parents = [-1] + [r.parent for r in ref]
        depth_of = [0] + [r.depth for r in ref]
        # the target's greedy token at a node of depth d is the true token d + 1
        predict = [truth[d] if d < depths else -1 for d in depth_of]
        path, _ = greedy_accept_ref(toks, parents, predict)
        assert accepted == len(path) - 1


def test_chain_accept_and_a_chain_is_a_budget_of_depths_with_one_rank():
    assert evaluate.chain_accept([5, 6, 7], [5, 6, 8]) == 2
    assert evaluate.chain_accept([5, 6], [5, 6, 7]) == 2
    assert evaluate.chain_accept([1], [2]) == 0
    # a tree whose per-depth distributions are certain is the chain
    logp = [[0.0, -50.0]] * 5
    tokens = [[10 + d, 99] for d in range(5)]
    nodes = evaluate.build_tree(logp, 5)
    assert [(n.parent, n.depth, n.rank) for n in nodes] == [(i - 1, i + 1, 0) for i in range(5)]
    assert evaluate.tree_accept(nodes, tokens, [10, 11, 12, 0, 0]) == 3


def test_sampling_probs_are_the_samplers():
    """Top-k and top-p on the original distribution (p = .4 .3 .2 .1, k = 2, p = 0.5 keeps two),
    min-p relative to the top token, temperature before all of it."""
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    torch.testing.assert_close(evaluate.Sampling(1.0, 2, 0.5).probs(logits), torch.tensor([4 / 7, 3 / 7, 0, 0]))
    torch.testing.assert_close(evaluate.Sampling(1.0, 0, 1.0, 0.4).probs(logits),
                               torch.tensor([0.4, 0.3, 0.2, 0.0]) / 0.9)  # fmt: skip
    sharp = evaluate.Sampling(0.5).probs(logits)
    torch.testing.assert_close(sharp, torch.softmax(logits / 0.5, -1))
    assert evaluate.Sampling.parse("0.7/20/0.8") == evaluate.Sampling(0.7, 20, 0.8, 0.0)


def test_offline_replay_at_a_sampling_setting(toy_pair):
    from scripts.learned_pair import checkpoint
    from scripts.learned_pair.tokenizer import MASK_ID

    pair, _ = toy_pair
    target, drafter = checkpoint.load_pair(pair)
    prompts = [json.loads(line)["prompt_ids"][:24] for line in (pair / "prompts.jsonl").read_text().splitlines()[:2]]
    r = evaluate.offline_accept_sampled(drafter, target, prompts, 24, [4, 8], MASK_ID, 0, evaluate.Sampling(1.0, 20))
    assert set(r) >= {"dflash", "ddtree4", "ddtree8", "ddtree4_matched", "ddtree8_matched"}
    for name in ("dflash", "ddtree4", "ddtree8", "ddtree8_matched"):
        assert 1.0 <= r[name] <= drafter.shape.block_size
    # T=0 replays the greedy continuation, where both scorings are the drafter's own
    g = evaluate.offline_accept_sampled(drafter, target, prompts, 24, [8], MASK_ID, 0, evaluate.Sampling())
    assert g["ddtree8"] == g["ddtree8_matched"]


def test_add_drafter_continues_a_drafter_with_soft_labels(toy_pair, tmp_path):
    """``add-drafter --init-from drafter --soft-labels 1 --name soft``: a drafter continued from the
    pair's own (its weights moved a little, not re-initialised), recorded with its data and loss,
    beside a pair that stays byte for byte; ``offline --drafter`` replays it. Bad options are
    refused before any work."""
    import hashlib
    import shutil

    from safetensors.torch import save_file

    from scripts.learned_pair import checkpoint
    from scripts.learned_pair.__main__ import main as cli
    from tests.cpu.learned_pair.conftest import stdlib_roots

    pair = tmp_path / "pair"
    shutil.copytree(toy_pair[0], pair)

    def digests():
        return {str(p.relative_to(pair)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(pair.rglob("*")) if p.is_file() and p.name != "manifest.json"}

    before = digests()
    roots = [a for label, path in stdlib_roots().items() for a in ("--root", f"{label}={path}")]
    argv = ["add-drafter", str(pair), "--kind", "dflash", "--name", "soft", "--init-from", "drafter",
            "--soft-labels", "1", "--temperatures", "1,0.7", "--sequences", "6", "--new-tokens", "32",
            "--batch", "3", "--anchors", "3", "--lr", "1e-4", "--deadline-s", "600", *roots]
    assert cli(argv) == 0
    assert {k: v for k, v in digests().items() if not k.startswith("drafter-soft/")} == before
    record = json.loads((pair / "manifest.json").read_text())["drafter_soft"]
    assert record["dir"] == "drafter-soft" and record["kind"] == "dflash" and record["init_from"] == "drafter"
    assert record["data"]["temperatures"] == [1.0, 0.7] and record["data"]["sequences"] == 6
    assert record["data"]["new_tokens"] == 32
    assert record["train"]["soft_labels"] == 1.0 and record["train"]["batch"] == 3 and record["train"]["lr"] == 1e-4
    _, own = checkpoint.load_pair(pair)
    _, soft = checkpoint.load_pair(pair, drafter="drafter-soft")
    with torch.no_grad():
        moved = [float((a - b).norm() / b.norm()) for a, b in zip(soft.parameters(), own.parameters()) if b.dim() >= 2]
    assert 0 < max(moved) < 0.25  # continued, not started again

    out = tmp_path / "offline.json"
    assert cli(["offline", str(pair), "--drafter", "drafter-soft", "--sampling", "1", "--budgets", "4",
                "--prompts", "2", "--new-tokens", "24", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["drafter"] == "drafter-soft" and 1.0 <= result["settings"][0]["ddtree4"] <= 16

    for bad, message in ((["--name", "Soft_1"], "lower-case letters"), (["--soft-labels", "1.5"], "share of the loss"),
                         (["--init-from", "nowhere"], "no .*nowhere"), (["--temperatures", "-1"], "temperatures >= 0"),
                         (["--batch", "0"], "must be positive: --batch 0"),
                         (["--init-from", "drafter-bad"], "--init-from drafter-bad: not a dflash drafter"),
                         ([], "drafter-soft exists")):
        (pair / "drafter-bad").mkdir()
        save_file({"fc.weight": torch.zeros(3, 3)}, str(pair / "drafter-bad" / "model.safetensors"))
        try:
            with pytest.raises(SystemExit, match=message):
                cli(argv + (["--name", "other", *bad] if bad else []))
        finally:
            shutil.rmtree(pair / "drafter-bad")
    with pytest.raises(SystemExit, match="no drafter directory 'drafter-x'.*drafter-soft"):
        cli(["offline", str(pair), "--drafter", "drafter-x", "--sampling", "1"])
    assert {k: v for k, v in digests().items() if not k.startswith("drafter-soft/")} == before


def test_a_dflash2_drafter_grows_from_the_pairs_dflash_drafter(toy_pair, tmp_path):
    """``add-drafter --kind dflash2 --init-from drafter``: the DFlash layers start as the pair's
    drafter, the convolutions and the selector as ``build`` starts them; the DFlash 2 drafter's
    offline replay adds the selector's chain and trees from its transitions."""
    import shutil

    from scripts.learned_pair import checkpoint
    from scripts.learned_pair.__main__ import main as cli
    from scripts.learned_pair.tokenizer import MASK_ID
    from tests.cpu.learned_pair.conftest import stdlib_roots

    pair = tmp_path / "pair"
    shutil.copytree(toy_pair[0], pair)
    roots = [a for label, path in stdlib_roots().items() for a in ("--root", f"{label}={path}")]
    assert cli(["add-drafter", str(pair), "--kind", "dflash2", "--name", "d2", "--init-from", "drafter",
                "--sequences", "6", "--new-tokens", "32", "--batch", "3", "--anchors", "3", "--lr", "1e-5",
                "--deadline-s", "600", *roots]) == 0
    record = json.loads((pair / "manifest.json").read_text())["drafter_d2"]
    assert record["kind"] == "dflash2" and record["init_from"] == "drafter" and record["shape"]["selector_top_k"] == 8
    target, own = checkpoint.load_pair(pair)
    _, d2 = checkpoint.load_pair(pair, drafter="drafter-d2")
    assert d2.shape.dflash2
    mine = dict(d2.named_parameters())
    with torch.no_grad():
        for name, p in own.named_parameters():  # the DFlash part: continued at a tiny rate, so close
            assert float((mine[name] - p).norm()) <= 0.05 * float(p.norm()) + 1e-6, name
    prompts = [json.loads(line)["prompt_ids"][:24] for line in (pair / "prompts.jsonl").read_text().splitlines()[:2]]
    r = evaluate.offline_accept_sampled(d2, target, prompts, 24, [4, 16], MASK_ID, 0, evaluate.Sampling(1.0),
                                        scorings=("raw",))  # fmt: skip
    for name in ("dflash", "dflash_transitions", "ddtree4", "ddtree16", "ddtree4_transitions", "ddtree16_transitions"):
        assert 1.0 <= r[name] <= d2.shape.block_size, name
