# SPDX-License-Identifier: Apache-2.0
"""Checks the speculative-server suites (tests/gpu/ddtree, hybrid, swa, dflash2) run alike: a
speculative server against the no-speculation server of the same target, both
``ServerProcess`` handles of the shared harness (tests/gpu/conftest.py).

Each suite picks its own prompts (its targets need different lengths) and keeps its
own test functions; these hold the requests and assertions the suites share.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

#: Output lengths of the 8 concurrent requests: ragged, so the batch's trees differ in size.
RAGGED_LENGTHS = [17, 64, 5, 33, 80, 1, 48, 29]


def random_prompts(n, seed=0, lo=3, hi=40):
    """``n`` prompts of the tiny models' vocabulary: BOS, then ``lo``..``hi`` ordinary tokens."""
    rng = random.Random(seed)
    return [[1] + [rng.randrange(16, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def models_manifest(models) -> dict:
    """``manifest.json`` of a ``scripts/make_test_models.py`` output dir."""
    return json.loads((models / "manifest.json").read_text())


def rule_continuation(models, prompt, n):
    """The test target's greedy continuation in closed form: y[i+1] = tau(y[i-1])."""
    tau = models_manifest(models)["tau"]
    seq = list(prompt)
    for _ in range(n):
        seq.append(tau[seq[-2]])
    return seq[len(prompt):]


def greedy(server, ids, n, **kw):
    """``n`` greedy tokens for ``ids`` on ``server``: (output ids, meta_info)."""
    out = server.generate_ids(ids, n, **kw)
    return out["output_ids"], out["meta_info"]


def assert_concurrent_identical(baseline, server, prompts, lengths=RAGGED_LENGTHS):
    """Concurrent requests with ragged output lengths: each has its length and equals
    the baseline's output."""
    want = [greedy(baseline, p, n)[0] for p, n in zip(prompts, lengths)]
    with ThreadPoolExecutor(len(prompts)) as ex:
        got = list(ex.map(lambda pn: greedy(server, *pn)[0], zip(prompts, lengths)))
    for w, g, n in zip(want, got, lengths):
        assert len(g) == n
        assert g == w


def assert_openai_identical(baseline, server, prompt):
    """The OpenAI surface: completions from token ids, and a streamed chat."""
    model = json.loads(baseline.get("/v1/models").read())["data"][0]["id"]
    req = {"model": model, "prompt": prompt, "max_tokens": 40, "temperature": 0}
    want = baseline.post("/v1/completions", req)["choices"][0]["text"]
    got = server.post("/v1/completions", req)
    assert got["choices"][0]["text"] == want and got["usage"]["completion_tokens"] == 40
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": "bako dilu fene"}],
        "max_tokens": 32,
        "temperature": 0,
    }
    want = baseline.post("/v1/chat/completions", chat)["choices"][0]["message"]["content"]
    chunks = [
        c["choices"][0]["delta"].get("content") or ""
        for c in server.stream("/v1/chat/completions", chat)
        if c.get("choices")
    ]
    assert "".join(chunks) == want and want


def assert_sampling_reproduces_greedy(baseline, server, prompts, min_accept_length: Optional[float] = None):
    """Sampling (temperature 1, top-p 0.95, top-k 20) on a target whose every greedy step
    wins by a wide logit margin, so top-p keeps only the argmax: the sampled outputs must
    equal the baseline's greedy ones (and, with ``min_accept_length``, each request's
    accept length must exceed it)."""
    want = [greedy(baseline, p, 48)[0] for p in prompts]

    def sample(p):
        return server.generate_ids(p, 48, temperature=1.0, top_p=0.95, top_k=20)

    with ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(sample, prompts))
    for w, o in zip(want, outs):
        assert o["output_ids"] == w
        if min_accept_length is not None:
            assert o["meta_info"]["spec_accept_length"] > min_accept_length


def assert_abort_mid_stream(server, prompt, baseline=None):
    """A client that disconnects from a long streamed request after 3 events: the server
    aborts it and then serves the same prompt: 8 tokens, or with ``baseline``, the
    baseline's 8."""
    events = server.stream(
        "/generate",
        {"input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": 3000, "ignore_eos": True}},
    )
    for _ in range(3):
        next(events)
    events.close()  # client disconnect: the server aborts the request
    time.sleep(2)
    out, _ = greedy(server, prompt, 8)
    if baseline is None:
        assert len(out) == 8
    else:
        assert out == greedy(baseline, prompt, 8)[0]


def assert_pools_clean_and_metrics(server) -> tuple[str, dict[str, float]]:
    """After a suite's traffic: the scheduler's strict idle pool check (enabled by the
    suite's conftest) has not killed the server, no leak, double free or use-after-free
    was logged, it still generates, and acceptance above 1 is on /metrics. Returns the
    log as read before the last requests and the metrics, for the suite's own checks."""
    time.sleep(3)  # let the scheduler go idle and run its strict pool check
    assert server.alive(), server.log_tail()
    assert not server.leak_lines(), server.leak_lines()
    log = server.log_text()
    for bad in ("double free", "use-after-free"):
        assert bad not in log, server.log_tail()
    server.get("/health_generate", timeout=60)
    metrics = server.metrics()
    assert metrics.get("sglang:spec_accept_length", 0.0) > 1.0, {k: v for k, v in metrics.items() if "spec" in k}
    return log, metrics
