# SPDX-License-Identifier: Apache-2.0
"""benchmarks/sampling_boundaries.py: which contexts the target's logits decide a filter's cut
at, checked against perturbing the logits; and the sampling check cut at the first undecided
context, which no longer rejects two samplers that differ only by rounding at a cut but still
rejects a wrong one and the biased control."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from benchmarks import sampling_boundaries as sb
from benchmarks import sampling_check as sc

from tests.cpu.learned_pair.test_sampling_check import POSITIONS, VOCAB, FakeServer, _chain

SINGLE = [{"temperature": 0.7, "top_k": 3}, {"temperature": 0.7, "top_p": 0.8}, {"temperature": 0.7, "min_p": 0.1}]
COMBINED = [{"temperature": 0.7, "top_k": 4, "top_p": 0.8, "min_p": 0.05},
            {"temperature": 1.0, "top_k": 5, "top_p": 0.6}, {"temperature": 1.0, "top_k": 3, "min_p": 0.2}]


@pytest.mark.parametrize("order", sb.ORDERS)
@pytest.mark.parametrize("setting", SINGLE + COMBINED, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_decided_against_every_corner_of_the_perturbation(setting, order):
    """Decided rows keep their filtered set at every corner of the box of changes of at most
    delta (and at random points inside it); with one filter, every undecided row has a change
    that moves its set."""
    rng = np.random.default_rng(0)
    vocab, delta = 7, 0.05
    logits = rng.standard_normal((120, vocab)) * 1.2
    flags = sb.decided(torch.tensor(logits), setting, delta, orders=(order,)).numpy()
    corners = np.array(list(itertools.product([-delta, delta], repeat=vocab)))
    moved = []
    for row in logits:
        base = sb.filtered_set(row, setting, order)
        changes = np.concatenate([corners, rng.uniform(-delta, delta, (60, vocab))])
        moved.append(any(sb.filtered_set(row + c, setting, order) != base for c in changes))
    moved = np.array(moved)
    assert not (flags & moved).any()
    assert 0.2 < flags.mean() < 0.95  # both kinds of row occur
    if setting in SINGLE:
        assert (flags | moved).all()


def test_mass_tolerance_and_the_order_of_the_filters():
    # four tokens of mass .5, .28, .12, .10 at T=1: top-p 0.8 keeps three of them (.78 < .8)
    logits = torch.log(torch.tensor([[0.5, 0.28, 0.12, 0.10]]))
    setting = {"temperature": 1.0, "top_p": 0.8}
    assert sb.filtered_set(logits[0].numpy(), setting, "joint") == {0, 1, 2}
    assert sb.decided(logits, setting, 0.001, mass=0.01)  # .78 and .90 are .02 and .10 away from .8
    assert not sb.decided(logits, setting, 0.001, mass=0.03)
    assert sb.decided(logits, setting, 0.05)  # at worst .78 becomes .797 under 0.05 on every logit
    assert not sb.decided(logits, setting, 0.1)  # and .81 under 0.1
    # top-k 2, then top-p on the renormalised pair (.64, .36): the cut of the sequential order
    # lies elsewhere than the joint order's
    setting = {"temperature": 1.0, "top_k": 2, "top_p": 0.8}
    assert sb.filtered_set(logits[0].numpy(), setting, "sequential") == {0, 1}
    assert sb.decided(logits, setting, 0.001, mass=0.01, orders=("sequential",))
    assert sb.backend_order("flashinfer", {"min_p": 0.05}) == "sequential"
    assert sb.backend_order("flashinfer", {"top_p": 0.8}) == sb.backend_order("pytorch", {"min_p": 0.05}) == "joint"
    with pytest.raises(ValueError, match="flashinfer or pytorch"):
        sb.backend_order("triton", {})


def test_settings_without_a_cut_and_penalties_beside_one():
    logits = torch.randn(5, 9)
    assert sb.decided(logits, {"temperature": 1.0, "repetition_penalty": 1.1}, 1.0).all()
    assert not sb.has_cut({"temperature": 0.7, "top_k": 9}, 9) and sb.has_cut({"temperature": 0.7, "top_k": 8}, 9)
    with pytest.raises(ValueError, match="penalised logits"):
        sb.decided(logits, {"temperature": 1.0, "top_p": 0.9, "frequency_penalty": 0.5}, 0.1)
    with pytest.raises(ValueError, match="positive temperature"):
        sb.decided(logits, {"temperature": 0.0, "top_k": 3}, 0.1)
    with pytest.raises(ValueError, match="orders"):
        sb.decided(logits, {"temperature": 1.0, "top_k": 3}, 0.1, orders=("reverse",))


def test_truncation_at_the_first_undecided_context():
    decided_at = {(): True, (1,): True, (1, 2): False, (3,): False}
    samples = [[1, 2, 5, 6], [1, 4, 5, 6], [3, 2, 5, 6]]
    cut = sb.truncate_undecided(samples, decided_at, 4)
    u = sb.UNDECIDED
    # (1, 4) is not in the map: a context nobody looked at is not decided either
    assert cut == [[1, 2, u, u], [1, 4, u, u], [3, u, u, u]]
    assert sb.decided_share(cut, 4) == [1.0, 2 / 3, 0.0, 0.0]


def _markov_contexts(logits):
    """``decided_contexts``'s ``contexts`` for the Markov model: a context's logits are its last
    token's row (the prompt's last token is row VOCAB)."""

    def contexts(seqs):
        rows = [[VOCAB] + list(s) for s in seqs]
        return torch.tensor(np.stack([logits[r] for r in rows]), dtype=torch.float32)

    return contexts


def test_the_check_tells_rounding_at_a_cut_from_a_wrong_sampler():
    """Two servers of one Markov target whose logits differ by 0.02 where two tokens all but tie
    at the top-k cut (in every fourth context) and agree everywhere else: the raw test rejects; cut at the first
    undecided context, it does not, while a server that ignores top-k and the biased control are
    still rejected."""
    logits = _chain(3)
    setting = sc.parse_settings("temperature=1:top_k=5")
    rounded = logits.copy()
    for row in range(0, VOCAB, 4):  # every fourth context: ranks 5 and 6 0.01 apart, swapped by rounding
        order = np.argsort(-logits[row])
        a, b = order[4], order[5]
        logits[row, b] = logits[row, a] - 0.01
        rounded[row] = logits[row]
        rounded[row, a], rounded[row, b] = logits[row, a] - 0.02, logits[row, a] - 0.01 + 0.02
    contexts = _markov_contexts(logits)

    def decided(pi, samples, s):
        return sb.decided_contexts(contexts, (x for g in samples for x in g), POSITIONS, s, delta=0.05)

    servers = {"nospec": FakeServer(logits, 1), "dflash": FakeServer(rounded, 2)}
    raw = sc.run_check(servers, [[5]], samples=20000, settings=setting, log=lambda m: None)
    assert raw["verdict"]["reject"] and {r["server"] for r in raw["rejected"]} == {"dflash"}
    cut = sc.run_check({"nospec": FakeServer(logits, 1), "dflash": FakeServer(rounded, 2)}, [[5]], samples=20000,
                       settings=setting, log=lambda m: None, decided=decided)
    assert not cut["verdict"]["reject"], cut["rejected"]
    assert cut["biased_rejected"]
    entry = next(c for c in cut["comparisons"] if c["server"] == "dflash")
    assert min(t["p"] for t in entry["tests_all_contexts"]) < 1e-6  # the raw tests are kept beside
    share = entry["decided_share"]["dflash"]
    assert share[0] == 1.0 and 0.2 < share[1] < 0.8 and share == sorted(share, reverse=True)
    wrong = sc.run_check({"nospec": FakeServer(logits, 1), "ddtree16": FakeServer(logits, 2, ignore_top_k=True)},
                         [[5]], samples=20000, settings=setting, log=lambda m: None, decided=decided)
    assert wrong["verdict"]["reject"] and {r["server"] for r in wrong["rejected"]} == {"ddtree16"}


def test_decided_contexts_reads_each_prefix_once_per_sample_set():
    logits = _chain(4)
    calls = []
    contexts = _markov_contexts(logits)

    def counting(seqs):
        calls.append(len(seqs))
        return contexts(seqs)

    samples = [[1, 2, 3], [1, 2, 4], [1, 2, 3]]
    flags = sb.decided_contexts(counting, samples, 3, {"temperature": 1.0, "top_k": 5}, 0.05, batch=1)
    assert set(flags) == {(), (1,), (1, 2)} and calls == [1]  # one distinct sequence of positions - 1 tokens
    assert flags[(1,)] == bool(sb.decided(torch.tensor(logits[[1]]), {"temperature": 1.0, "top_k": 5}, 0.05)[0])


@pytest.mark.parametrize("order", sb.ORDERS)
def test_filtered_probs_is_the_filtered_set_renormalised(order):
    logits = np.random.default_rng(1).standard_normal((40, 9)) * 1.5
    for setting in SINGLE + COMBINED:
        probs = sb.filtered_probs(torch.tensor(logits), setting, order).numpy()
        for row, got in zip(logits, probs):
            kept = sorted(sb.filtered_set(row, setting, order))
            assert list(np.flatnonzero(got)) == kept
            z = row / setting["temperature"]
            want = np.zeros_like(z)
            want[kept] = np.exp(z[kept] - z.max())
            np.testing.assert_allclose(got, want / want.sum(), rtol=1e-9)


def test_prompts_ranked_by_what_a_check_can_judge(tmp_path):
    """The ranking CLI on a small transformers target: every prompt gets its decided share per
    position (the first always decided), the best go to --write, JSON and plot written."""
    import json

    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"source": f"p{i}", "prompt_ids": [1 + i, 2, 3]}) + "\n" for i in range(3)))
    best = tmp_path / "best.json"
    assert sb.main([str(tmp_path / "target"), "--prompts", str(prompts), "--settings", "temperature=1:top_k=4,default",
                    "--samples", "40", "--positions", "3", "--best", "2", "--write", str(best), "--delta", "0.02",
                    "--tag", "t", "--out-dir", str(tmp_path), "--device", "cpu"]) == 0
    r = json.loads((tmp_path / "sampling_boundaries_t.json").read_text())
    assert (tmp_path / "sampling_boundaries_t.png").stat().st_size > 0
    scores = [p["score"] for p in r["prompts"]]
    assert scores == sorted(scores, reverse=True) and len(scores) == 3
    for p in r["prompts"]:
        decided, informative = p["decided_share"], p["informative_share"]
        assert set(decided) == set(informative) == {"temperature1.0-top_k4", "T0.7-top_k20-top_p0.8-min_p0.05"}
        assert all(s[0] == 1.0 and s == sorted(s, reverse=True) for s in decided.values())
        assert all(i <= d for name in decided for i, d in zip(informative[name], decided[name]))
        assert informative["temperature1.0-top_k4"][0] == 1.0  # four tokens to choose from, always
    assert [p["source"] for p in json.loads(best.read_text())] == [p["source"] for p in r["prompts"][:2]]
    with pytest.raises(SystemExit):
        sb.main([str(tmp_path / "target"), "--prompts", str(prompts), "--settings",
                 "temperature=1:top_k=4:presence_penalty=1", "--tag", "t", "--out-dir", str(tmp_path)])


def test_kept_samples_judged_again_with_the_boundary_cut(tmp_path):
    """A check's samples kept (--samples-out) and replayed: the same verdict over every context,
    and, with the cut, the one the run would have given."""
    import json

    logits = _chain(3)
    setting = sc.parse_settings("temperature=1:top_k=5")
    npz = tmp_path / "kept.npz"
    run = sc.run_check({"nospec": FakeServer(logits, 1), "dflash": FakeServer(logits, 2, ignore_top_k=True)}, [[5]],
                       samples=2000, settings=setting, log=lambda m: None, samples_out=npz)
    drawn, positions = sc.load_samples(npz)
    assert positions == POSITIONS and drawn[0]["setting"] == setting[0]
    assert [label for label, _ in drawn[0]["pairs"]] == ["nospec (second sample)", sc.BIASED_LABEL, "dflash"]
    again = sc.judge(drawn, 2000, positions, 0.01, log=lambda m: None)
    assert again["comparisons"] == run["comparisons"] and again["verdict"] == run["verdict"]
    contexts = _markov_contexts(logits)
    cut = sc.judge(drawn, 2000, positions, 0.01, log=lambda m: None,
                   decided=lambda pi, samples, s: sb.decided_contexts(contexts, (x for g in samples for x in g),
                                                                      positions, s, delta=0.05))
    assert all("tests_all_contexts" in c for c in cut["comparisons"])
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[5]]))
    out = tmp_path / "replayed.json"
    assert sc.main(["--replay", str(npz), "--prompt-ids", str(prompts), "--out", str(out)]) == 1  # dflash ignores top-k
    assert json.loads(out.read_text())["comparisons"] == run["comparisons"]
    for bad in (["--out", str(out), "--prompt-ids", str(prompts)],
                ["--replay", str(npz), "--server", "nospec=http://x", "--prompt-ids", str(prompts), "--out", str(out)],
                ["--replay", str(prompts), "--prompt-ids", str(prompts), "--out", str(out)]):
        with pytest.raises(SystemExit):
            sc.main(bad)
