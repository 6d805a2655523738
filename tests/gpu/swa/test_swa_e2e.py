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
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("GPU tier: needs a CUDA device", allow_module_level=True)

from tests.gpu.server_checks import (  # noqa: E402
    assert_abort_mid_stream,
    assert_concurrent_identical,
    assert_openai_identical,
    assert_pools_clean_and_metrics,
    assert_sampling_reproduces_greedy,
    greedy,
    models_manifest,
    rule_continuation,
)


def _prompts(n, seed, lo=12, hi=40):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(16, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _window(models):
    return json.loads((models / "tiny-gptoss" / "config.json").read_text())["sliding_window"]


def test_greedy_identical_and_the_tree_pays_off(servers, tree, swa_models, swa_setup):
    n = 96
    prompt = _prompts(1, seed=1)[0]
    assert len(prompt) > _window(swa_models)
    want, _ = greedy(servers["baseline"], prompt, n)
    assert want == rule_continuation(swa_models, prompt, n)  # the reference follows the constructed rule
    got, meta = greedy(tree, prompt, n)
    assert got == want
    print(f"\n[{tree.name}] accept length {meta.get('spec_accept_length')}, verify steps {meta.get('spec_verify_ct')}")
    # The drafter's top-1 is a decoy at block offset decoy_offset, so a chain
    # commits at most that many tokens a step; the tree takes the decoy's sibling,
    # whose index in the tree is far from its parent's: an index-counted window
    # would hide the parent from it.
    if swa_setup["budget"] >= 16:
        decoy = models_manifest(swa_models)["decoy_offset"]
        assert meta["spec_verify_ct"] < math.ceil((n - 1) / decoy), meta


def test_prompt_far_beyond_the_window(servers, tree, swa_models):
    """A 400-token prompt: the SWA pool keeps only its last window of it."""
    prompt = _prompts(1, seed=3, lo=400, hi=400)[0]
    want, _ = greedy(servers["baseline"], prompt, 64)
    assert want == rule_continuation(swa_models, prompt, 64)
    assert greedy(tree, prompt, 64)[0] == want


def test_concurrent_ragged_identical(servers, tree):
    assert_concurrent_identical(servers["baseline"], tree, _prompts(8, seed=2, lo=3, hi=60))


def test_openai_api_identical(servers, tree):
    """The OpenAI surface: completions from token ids, and a streamed chat."""
    assert_openai_identical(servers["baseline"], tree, _prompts(1, seed=4)[0])


def test_sampling_on_the_peaked_target(servers, tree):
    """Every greedy step of the test target wins by a logit margin above 12, so
    top-p 0.95 keeps only the argmax: sampling must reproduce the greedy text
    through DDTREE's sampling verify."""
    assert_sampling_reproduces_greedy(servers["baseline"], tree, _prompts(4, seed=5))


def test_abort_mid_stream(servers, tree):
    assert_abort_mid_stream(tree, _prompts(1, seed=7)[0], baseline=servers["baseline"])


def test_repeated_prompt_over_the_swa_radix_cache(servers, tree):
    """The same long prompt twice, and a request that extends a finished one:
    whatever the SWA radix cache reuses (its evicted window slots are tombstones),
    the outputs equal the reference's."""
    base = servers["baseline"]
    prompt = _prompts(1, seed=9, lo=120, hi=120)[0]
    first, _ = greedy(tree, prompt, 40)
    again, meta = greedy(tree, prompt, 40)
    assert first == again == greedy(base, prompt, 40)[0]
    longer = prompt + first
    got, meta_longer = greedy(tree, longer, 24)
    assert got == greedy(base, longer, 24)[0]
    print(f"\n[{tree.name}] cached tokens: repeated {meta.get('cached_tokens')}, extended {meta_longer.get('cached_tokens')}")


def test_dflash_chain_identical(servers, swa_models):
    """DFLASH's chain verify on the sliding-window target now goes through the
    tree-verify path too: identical to no speculation, single and concurrent."""
    base, chain = servers["baseline"], servers["dflash"]
    prompt = _prompts(1, seed=11)[0]
    want, _ = greedy(base, prompt, 96)
    got, meta = greedy(chain, prompt, 96)
    assert got == want == rule_continuation(swa_models, prompt, 96)
    assert meta["spec_verify_ct"] < 96
    prompts = _prompts(8, seed=12, lo=3, hi=60)
    want = [greedy(base, p, 40)[0] for p in prompts]
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda p: greedy(chain, p, 40)[0], prompts))
    assert got == want


@pytest.mark.parametrize("name,kind", [("ddtree", "tree"), ("ddtree_eager", "tree"), ("dflash", "chain")])
def test_pools_clean_and_the_verify_path(servers, name, kind):
    """After all the traffic above: the strict idle check of the full and SWA pools
    has not killed the server, no leak or double free was logged; the verify ran on
    the hybrid SWA pool through the tree-verify path (not upstream's dense-mask path),
    and acceptance is on /metrics."""
    log, _ = assert_pools_clean_and_metrics(servers[name])
    assert "SWAKVPool mem usage" in log
    assert f"TritonAttnBackend serves {kind} verify through the tree-verify path." in log
    if kind == "tree":
        assert "DDTREE worker: budget=" in log
