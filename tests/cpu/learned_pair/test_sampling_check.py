# SPDX-License-Identifier: Apache-2.0
"""benchmarks/sampling_check.py's statistics: identical samplers pass at the stated rate,
biased ones (wrong temperature, a pull towards the most likely token, top-k or top-p
ignored) are rejected at the sample sizes the GPU run uses; and its runner against
in-process servers."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest

from benchmarks import sampling_check as sc

VOCAB, POSITIONS = 40, 8


def _chain(seed=0):
    """A Markov 'language model': next-token distribution given the previous token, with the
    skewed shape of a real one (a few likely tokens, a long tail)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((VOCAB + 1, VOCAB)) * 1.6  # row VOCAB = the prompt's last token


def _probs(logits, temperature=1.0, top_p=1.0, top_k=-1):
    z = logits / temperature
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if top_k > 0:
        kth = -np.sort(-p, axis=-1)[..., top_k - 1 : top_k]
        p = np.where(p >= kth, p, 0.0)
    if top_p < 1.0:
        order = np.argsort(-p, axis=-1)
        sp = np.take_along_axis(p, order, -1)
        keep = (np.cumsum(sp, -1) - sp) < top_p * sp.sum(-1, keepdims=True)
        mask = np.zeros_like(p, dtype=bool)
        np.put_along_axis(mask, order, keep, -1)
        p = np.where(mask, p, 0.0)
    return p / p.sum(axis=-1, keepdims=True)


def sample(logits, n, rng, temperature=1.0, top_p=1.0, top_k=-1, greedy_pull=0.0, pull_at=None):
    """n continuations of POSITIONS tokens; ``greedy_pull`` replaces a draw by the argmax with that
    probability (at every position, or only at ``pull_at``): how an acceptance bug that favours
    the drafter's top token shows up."""
    out = np.zeros((n, POSITIONS), dtype=np.int64)
    prev = np.full(n, VOCAB)
    for k in range(POSITIONS):
        p = _probs(logits[prev], temperature, top_p, top_k)
        tok = (rng.random((n, 1)) > np.cumsum(p, -1)).sum(-1).clip(max=VOCAB - 1)
        if greedy_pull and (pull_at is None or pull_at == k):
            pull = rng.random(n) < greedy_pull
            tok = np.where(pull, p.argmax(-1), tok)
        out[:, k] = tok
        prev = tok
    return out.tolist()


def test_single_test_rejects_identical_samples_at_the_nominal_rate():
    logits, rng = _chain(), np.random.default_rng(1)
    rejections = 0
    for _ in range(400):
        a, b = sample(logits, 600, rng), sample(logits, 600, rng)
        t = sc.compare(a, b, positions=1, joint=())[0]
        rejections += t["p"] < 0.05
    assert 0.025 <= rejections / 400 <= 0.08, rejections


def test_family_false_rejection_at_most_alpha():
    logits, rng = _chain(), np.random.default_rng(2)
    reps, alpha = 100, 0.05
    rejected = sum(sc.family_verdict(sc.compare(sample(logits, 2000, rng), sample(logits, 2000, rng), POSITIONS),
                                     alpha)["reject"] for _ in range(reps))
    assert rejected / reps <= alpha + 0.02, rejected


@pytest.mark.parametrize("bias", ["temperature 0.8", "greedy pull 15% everywhere", "greedy pull 20% at position 3",
                                  "top-k ignored"])
def test_biased_samplers_are_rejected_at_3000_samples(bias):
    """The resolution of the GPU run's test (3000 samples per server, its whole family of tests
    at alpha 0.01). Smaller biases (temperature 0.9, a 5 % pull) are below it."""
    logits, rng = _chain(), np.random.default_rng(3)
    hits = 0
    for _ in range(20):
        if bias == "top-k ignored":
            a = sample(logits, 3000, rng, top_p=0.9, top_k=20)
            b = sample(logits, 3000, rng, top_p=0.9)
        else:
            kw = {"temperature 0.8": {"temperature": 0.8}, "greedy pull 15% everywhere": {"greedy_pull": 0.15},
                  "greedy pull 20% at position 3": {"greedy_pull": 0.20, "pull_at": 2}}[bias]
            a, b = sample(logits, 3000, rng), sample(logits, 3000, rng, **kw)
        # the family of the GPU run: 2 settings x 2 prompts x (2 servers + control) x 10 tests
        hits += sc.family_verdict(sc.compare(a, b, POSITIONS) * 12, alpha=0.01)["reject"]
    assert hits >= 18, hits


def test_pooling_and_degenerate_cases():
    a = Counter({1: 500, 2: 480, 3: 4, 4: 3, 5: 2})  # 3, 4, 5 rare together: pooled (9 + b's)
    b = Counter({1: 490, 2: 500, 3: 3, 4: 2, 5: 1})
    r = sc.homogeneity(a, b)
    assert r["bins"] == 3 and r["df"] == 2 and r["p"] > 0.5
    assert sc.homogeneity(Counter({7: 100}), Counter({7: 90}))["p"] == 1.0  # one category: nothing to test
    # a pool too small for its own bin joins the smallest bin
    r = sc.homogeneity(Counter({1: 50, 2: 30, 3: 1}), Counter({1: 50, 2: 30}))
    assert r["bins"] == 2
    # pooling never looks at which sample a count came from: swapping the samples changes nothing
    assert sc.homogeneity(a, b) == sc.homogeneity(b, a)
    # clearly different distributions
    assert sc.homogeneity(Counter({1: 600, 2: 400}), Counter({1: 400, 2: 600}))["p"] < 1e-10


class FakeServer:
    """Native /generate over the Markov model, with the request's sampling parameters.

    ``draw`` sends its equal-sized chunks from four threads: each call draws from its own
    generator (the server's seed and the call's number), so a run's samples, as counts, do not
    depend on the threads' order and a run's p-values are reproducible."""

    def __init__(self, logits, seed, ignore_top_p=False, ignore_top_k=False):
        self.logits, self.seed, self.ignore_top_p, self.ignore_top_k = logits, seed, ignore_top_p, ignore_top_k
        self.calls = 0
        self._lock = threading.Lock()

    def post(self, path, body):
        assert path == "/generate"
        with self._lock:
            call = self.calls
            self.calls += 1
        p = body["sampling_params"]
        assert p["ignore_eos"] and 1 <= p["max_new_tokens"] <= POSITIONS
        n = len(body["input_ids"])
        rng = np.random.default_rng((self.seed, call))
        top_p = 1.0 if self.ignore_top_p else p.get("top_p", 1.0)
        top_k = -1 if self.ignore_top_k else p.get("top_k", -1)
        out = sample(self.logits, n, rng, p["temperature"], top_p, top_k)
        return [{"output_ids": o} for o in out]


def test_run_check_accepts_equal_servers_and_rejects_one_that_ignores_top_p():
    logits = _chain()
    ok = sc.run_check({"nospec": FakeServer(logits, 1), "ddtree16": FakeServer(logits, 2),
                       "dflash": FakeServer(logits, 3)}, [[5, 6, 7]], samples=12000, log=lambda m: None)
    assert not ok["verdict"]["reject"] and not ok["rejected"]
    assert len(ok["comparisons"]) == 2 * 4  # settings x (control + biased control + 2 servers)
    assert ok["verdict"]["tests"] == 6 * (POSITIONS + 2)  # the biased control is not in the family
    assert {c["server"] for c in ok["comparisons"]} == {"nospec (second sample)", sc.BIASED_LABEL, "ddtree16",
                                                        "dflash"}
    assert ok["biased_rejected"]  # the check can fail: a 10 % temperature error is seen
    assert 0.0 < ok["detectable_shift"] < 0.1
    bad = sc.run_check({"nospec": FakeServer(logits, 1), "ddtree16": FakeServer(logits, 2, ignore_top_p=True)},
                       [[5]], samples=3000, log=lambda m: None)
    assert bad["verdict"]["reject"]
    assert {r["setting"] for r in bad["rejected"]} == {"T0.7-top_k20-top_p0.8-min_p0.05"}
    assert {r["server"] for r in bad["rejected"]} == {"ddtree16"}


def test_settings_from_the_command_line_and_the_counts_behind_a_rejection():
    settings = sc.parse_settings("temperature=0.7:top_k=20,default,temperature=1:repetition_penalty=1.1")
    assert settings[0] == {"name": "temperature0.7-top_k20", "temperature": 0.7, "top_k": 20}
    assert settings[1:3] == sc.SETTINGS and settings[3]["repetition_penalty"] == 1.1
    for bad in ("top_k=20", "temperature=0.7:top_k=x", "temperature=0.7:seed=1", "temperature", ","):
        with pytest.raises(ValueError):
            sc.parse_settings(bad)
    logits = _chain()
    r = sc.run_check({"nospec": FakeServer(logits, 1), "ddtree16": FakeServer(logits, 2, ignore_top_p=True)},
                     [[5]], samples=3000, positions=4, settings=sc.parse_settings("temperature=0.7:top_p=0.5"),
                     log=lambda m: None)
    assert r["verdict"]["reject"] and {x["server"] for x in r["rejected"]} == {"ddtree16"}
    counts = {c["server"]: c["top_counts"] for c in r["comparisons"]}
    assert len(counts["ddtree16"]) == 3 and all(1 <= len(pos) <= sc.TOP_COUNTS for pos in counts["ddtree16"])
    # the base sample's first tokens are all within top-p, so its listed counts cover it; the
    # server that ignores top-p draws its tail, so the same tokens come less often there
    first = counts["ddtree16"][0]
    assert sum(x[1] for x in first) == 3000 and sum(x[2] for x in first) < 2700


def test_concurrency_sets_the_batch_the_servers_see():
    logits = _chain()
    servers = {"nospec": FakeServer(logits, 1), "dflash": FakeServer(logits, 2)}
    sizes = []
    for srv in servers.values():
        post = srv.post
        srv.post = lambda path, body, post=post: (sizes.append(len(body["input_ids"])), post(path, body))[1]
    r = sc.run_check(servers, [[5]], samples=100, positions=2, settings=sc.parse_settings("temperature=1"),
                     concurrency=16, log=lambda m: None)
    assert r["concurrency"] == 16 and max(sizes) == 16 and sum(sizes) == 4 * 100
    with pytest.raises(ValueError):
        sc.run_check(servers, [[5]], samples=10, concurrency=0, log=lambda m: None)


def test_run_check_needs_a_baseline_and_respects_the_deadline():
    logits = _chain()
    with pytest.raises(ValueError, match="no-speculation"):
        sc.run_check({"ddtree16": FakeServer(logits, 1)}, [[1]])
    r = sc.run_check({"nospec": FakeServer(logits, 1), "dflash": FakeServer(logits, 2)}, [[1], [2]], samples=500,
                     deadline_s=1e-3, log=lambda m: None)
    # the first draw runs (its time is the estimate); a prompt that would not fit is
    # listed with what it needs, not run past the deadline
    assert r["comparisons"] == [] and len(r["skipped"]) == 2 * 2
    assert all(x["reason"].startswith("deadline") for x in r["skipped"])
    assert "one draw took" in r["skipped"][0]["reason"]
    r = sc.run_check({"nospec": FakeServer(logits, 1), "dflash": FakeServer(logits, 2)}, [[1], [2]], samples=500,
                     deadline_s=600.0, log=lambda m: None)
    # per setting: the first prompt with the two controls, the second without
    assert not r["skipped"] and len(r["comparisons"]) == 2 * (3 + 1)


def test_controls_are_drawn_with_the_first_prompt_of_each_setting():
    """The control and the biased control show the test's level and power once per setting;
    the later prompts cost only their speculative servers' draws (and the base sample)."""
    logits = _chain()

    def run(**kw):
        servers = {"nospec": FakeServer(logits, 1), "dflash": FakeServer(logits, 2), "ddtree16": FakeServer(logits, 3)}
        r = sc.run_check(servers, [[5], [6], [7]], samples=400, positions=2, log=lambda m: None,
                         settings=sc.parse_settings("temperature=0.7:top_k=20,temperature=1"), **kw)
        return r, {label: srv.calls for label, srv in servers.items()}

    r, calls = run()
    assert r["controls"] == "first prompt of each setting"
    by = {}
    for c in r["comparisons"]:
        by.setdefault((c["setting"], c["prompt"]), set()).add(c["server"])
    controls = {"nospec (second sample)", sc.BIASED_LABEL}
    for setting in ("temperature0.7-top_k20", "temperature1.0"):
        assert by[(setting, 0)] == controls | {"dflash", "ddtree16"}
        assert by[(setting, 1)] == by[(setting, 2)] == {"dflash", "ddtree16"}
    # draws of 400 in chunks of 250: two requests each; nospec draws base x 3 prompts + 2 controls per setting
    assert calls == {"nospec": 2 * 2 * (3 + 2), "dflash": 2 * 2 * 3, "ddtree16": 2 * 2 * 3}
    r, calls = run(controls_every_prompt=True)
    assert r["controls"] == "every prompt" and len(r["comparisons"]) == 2 * 3 * 4
    assert calls["nospec"] == 2 * 2 * 3 * 3


def test_detectable_shift_shrinks_with_the_sample():
    """About 27,000 samples per server find a 2 % shift in a family of 60 tests at alpha 0.01."""
    assert 0.019 < sc.detectable_shift(27000, 60, 0.01) < 0.021
    assert sc.detectable_shift(4 * 27000, 60, 0.01) == pytest.approx(sc.detectable_shift(27000, 60, 0.01) / 2)
