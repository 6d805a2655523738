# SPDX-License-Identifier: Apache-2.0
"""DDTREE on a sliding-window + attention-sink target (gpt-oss architecture, hybrid
SWA KV pool) through the real server: greedy output identical to no speculation
(native API and OpenAI API, single and 8 concurrent clients with ragged trees,
prompts far beyond the window), sampling, abort mid-stream, a repeated prompt over
the SWA radix cache, DFLASH's chain on the same path, and strict checks of both KV
pools.

Each tree test runs against both DDTREE servers (CUDA graphs + overlap, and eager +
synchronous with DDTREE's own backend choice; conftest.py) and compares with the
no-speculation server.

On the GPU host after scripts/gpu_host/install.sh:
    bash scripts/gpu_host/run_gpu_tier.sh --only swa
"""

from __future__ import annotations

import json
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("GPU tier: needs a CUDA device", allow_module_level=True)


def _prompts(n, seed, lo=12, hi=40):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(16, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _manifest(models):
    return json.loads((models / "manifest.json").read_text())


def _window(models):
    return json.loads((models / "tiny-gptoss" / "config.json").read_text())["sliding_window"]


def _rule(models, prompt, n):
    """The target's greedy continuation in closed form: y[i+1] = tau(y[i-1])."""
    tau = _manifest(models)["tau"]
    seq = list(prompt)
    for _ in range(n):
        seq.append(tau[seq[-2]])
    return seq[len(prompt):]


def _greedy(server, ids, n, **kw):
    out = server.generate_ids(ids, n, **kw)
    return out["output_ids"], out["meta_info"]


def test_greedy_identical_and_the_tree_pays_off(servers, tree, swa_models, swa_setup):
    n = 96
    prompt = _prompts(1, seed=1)[0]
    assert len(prompt) > _window(swa_models)
    want, _ = _greedy(servers["baseline"], prompt, n)
    assert want == _rule(swa_models, prompt, n)  # the reference follows the constructed rule
    got, meta = _greedy(tree, prompt, n)
    assert got == want
    print(f"\n[{tree.name}] accept length {meta.get('spec_accept_length')}, verify steps {meta.get('spec_verify_ct')}")
    # The drafter's top-1 is a decoy at block offset decoy_offset, so a chain
    # commits at most that many tokens a step; the tree takes the decoy's sibling,
    # whose index in the tree is far from its parent's: an index-counted window
    # would hide the parent from it.
    if swa_setup["budget"] >= 16:
        decoy = _manifest(swa_models)["decoy_offset"]
        assert meta["spec_verify_ct"] < math.ceil((n - 1) / decoy), meta


def test_prompt_far_beyond_the_window(servers, tree, swa_models):
    """A 400-token prompt: the SWA pool keeps only its last window of it."""
    prompt = _prompts(1, seed=3, lo=400, hi=400)[0]
    want, _ = _greedy(servers["baseline"], prompt, 64)
    assert want == _rule(swa_models, prompt, 64)
    assert _greedy(tree, prompt, 64)[0] == want


def test_concurrent_ragged_identical(servers, tree):
    base = servers["baseline"]
    prompts = _prompts(8, seed=2, lo=3, hi=60)
    lengths = [17, 64, 5, 33, 80, 1, 48, 29]
    want = [_greedy(base, p, k)[0] for p, k in zip(prompts, lengths)]
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda pk: _greedy(tree, *pk)[0], zip(prompts, lengths)))
    for w, g, k in zip(want, got, lengths):
        assert len(g) == k
        assert g == w


def test_openai_api_identical(servers, tree):
    """The OpenAI surface: completions from token ids, and a streamed chat."""
    base = servers["baseline"]
    model = json.loads(base.get("/v1/models").read())["data"][0]["id"]
    prompt = _prompts(1, seed=4)[0]
    req = {"model": model, "prompt": prompt, "max_tokens": 40, "temperature": 0}
    want = base.post("/v1/completions", req)["choices"][0]["text"]
    got = tree.post("/v1/completions", req)
    assert got["choices"][0]["text"] == want and got["usage"]["completion_tokens"] == 40
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": "bako dilu fene"}],
        "max_tokens": 32,
        "temperature": 0,
    }
    want = base.post("/v1/chat/completions", chat)["choices"][0]["message"]["content"]
    chunks = [
        c["choices"][0]["delta"].get("content") or ""
        for c in tree.stream("/v1/chat/completions", chat)
        if c.get("choices")
    ]
    assert "".join(chunks) == want and want


def test_sampling_on_the_peaked_target(servers, tree):
    """Every greedy step of the test target wins by a logit margin above 12, so
    top-p 0.95 keeps only the argmax: sampling must reproduce the greedy text
    through DDTREE's sampling verify."""
    base = servers["baseline"]
    prompts = _prompts(4, seed=5)
    want = [_greedy(base, p, 48)[0] for p in prompts]
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda p: tree.generate_ids(p, 48, temperature=1.0, top_p=0.95, top_k=20), prompts))
    for w, o in zip(want, outs):
        assert o["output_ids"] == w


def test_abort_mid_stream(servers, tree):
    prompt = _prompts(1, seed=7)[0]
    events = tree.stream(
        "/generate",
        {"input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": 3000, "ignore_eos": True}},
    )
    for _ in range(3):
        next(events)
    events.close()  # client disconnect: the server aborts the request
    time.sleep(2)
    out, _ = _greedy(tree, prompt, 8)
    assert out == _greedy(servers["baseline"], prompt, 8)[0]


def test_repeated_prompt_over_the_swa_radix_cache(servers, tree):
    """The same long prompt twice, and a request that extends a finished one:
    whatever the SWA radix cache reuses (its evicted window slots are tombstones),
    the outputs equal the reference's."""
    base = servers["baseline"]
    prompt = _prompts(1, seed=9, lo=120, hi=120)[0]
    first, _ = _greedy(tree, prompt, 40)
    again, meta = _greedy(tree, prompt, 40)
    assert first == again == _greedy(base, prompt, 40)[0]
    longer = prompt + first
    got, meta_longer = _greedy(tree, longer, 24)
    assert got == _greedy(base, longer, 24)[0]
    print(f"\n[{tree.name}] cached tokens: repeated {meta.get('cached_tokens')}, extended {meta_longer.get('cached_tokens')}")


def test_dflash_chain_identical(servers, swa_models):
    """DFLASH's chain verify on the sliding-window target now goes through the
    tree-verify path too: identical to no speculation, single and concurrent."""
    base, chain = servers["baseline"], servers["dflash"]
    prompt = _prompts(1, seed=11)[0]
    want, _ = _greedy(base, prompt, 96)
    got, meta = _greedy(chain, prompt, 96)
    assert got == want == _rule(swa_models, prompt, 96)
    assert meta["spec_verify_ct"] < 96
    prompts = _prompts(8, seed=12, lo=3, hi=60)
    want = [_greedy(base, p, 40)[0] for p in prompts]
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda p: _greedy(chain, p, 40)[0], prompts))
    assert got == want


@pytest.mark.parametrize("name,kind", [("ddtree", "tree"), ("ddtree_eager", "tree"), ("dflash", "chain")])
def test_pools_clean_and_the_verify_path(servers, name, kind):
    """After all the traffic above: the strict idle check of the full and SWA pools
    has not killed the server, no leak or double free was logged; the verify ran on
    the hybrid SWA pool through the tree-verify path (not upstream's dense-mask path),
    and acceptance is on /metrics."""
    server = servers[name]
    time.sleep(3)  # let the scheduler go idle and run its strict pool check
    assert server.alive(), server.log_tail()
    assert not server.leak_lines(), server.leak_lines()
    log = server.log_text()
    for bad in ("double free", "use-after-free"):
        assert bad not in log, server.log_tail()
    server.get("/health_generate", timeout=60)
    metrics = server.metrics()
    assert metrics.get("sglang:spec_accept_length", 0.0) > 1.0, {k: v for k, v in metrics.items() if "spec" in k}
    assert "SWAKVPool mem usage" in log
    assert f"TritonAttnBackend serves {kind} verify through the tree-verify path." in log
    if kind == "tree":
        assert "DDTREE worker: budget=" in log
