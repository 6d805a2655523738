# SPDX-License-Identifier: Apache-2.0
"""DFlash 2 drafters through the real server on the GPU host: DFLASH (the selector's path
as the chain) and DDTREE (the tree from the drafter's marginals, and from the selector's
transitions, ``--speculative-ddtree-tree transitions``) with the constructed DFlash 2 drafters of the tiny Qwen3 and MLA pairs give the target's own greedy
output (native API, 8 concurrent clients, the OpenAI API), sampling on the peaked target
reproduces it, no KV leaks; a DFlash 2 drafter with an unsupported feature stops the
server at start-up with a message naming it, and so does a tree from transitions asked of
a DFlash drafter, which has no selector.

On the GPU host after scripts/gpu_host/install.sh:
    source scripts/gpu_host/env.sh && python3 -m pytest tests/gpu/dflash2 -q
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("GPU tier: needs a CUDA device", allow_module_level=True)

from tests.gpu.harness import harness  # noqa: E402
from tests.gpu.server_checks import (  # noqa: E402
    assert_concurrent_identical,
    assert_openai_identical,
    assert_sampling_reproduces_greedy,
    greedy,
    random_prompts,
    rule_continuation,
)


def test_greedy_single_identical(servers, spec, dflash2_models):
    n = 96
    prompt = random_prompts(1, seed=1)[0]
    want, _ = greedy(servers["baseline"], prompt, n)
    got, meta = greedy(spec, prompt, n)
    assert got == want
    assert want == rule_continuation(dflash2_models, prompt, n)
    print(f"\n[{spec.name}] accept length {meta.get('spec_accept_length')}, verify steps {meta.get('spec_verify_ct')}")
    # The constructed drafter's chain is right up to the decoy at block offset 5.
    assert meta["spec_accept_length"] > 2.0, meta


def test_greedy_concurrent_identical(servers, spec):
    assert_concurrent_identical(servers["baseline"], spec, random_prompts(8, seed=2))


def test_openai_identical(servers, spec):
    assert_openai_identical(servers["baseline"], spec, random_prompts(1, seed=3)[0])


def test_sampling_reproduces_greedy(servers, spec):
    assert_sampling_reproduces_greedy(servers["baseline"], spec, random_prompts(4, seed=4))


def test_no_kv_leak(servers, spec):
    greedy(spec, random_prompts(1, seed=5)[0], 32)
    time.sleep(2)
    assert spec.alive() and not spec.leak_lines(), spec.log_tail()


def _refused_at_startup(request, models, gpu_log_dir, name: str, drafter: str, extra: list) -> str:
    """Start tiny-qwen3 with ``drafter`` and ``extra``; the server must stop by itself. Its log."""
    server = harness(request.config).ServerProcess(
        name, str(models / "tiny-qwen3"),
        ["--speculative-draft-model-path", str(models / drafter), *extra, "--attention-backend", "triton",
         "--mem-fraction-static", "0.5"],
        gpu_log_dir,
    )  # fmt: skip
    try:
        deadline = time.time() + 420
        while server.alive() and time.time() < deadline:
            time.sleep(2)
        assert not server.alive(), f"{name}: the server started"
        return server.log_text()
    finally:
        server.stop()


def test_unsupported_drafter_refused_at_startup(request, dflash2_models, gpu_log_dir):
    log = _refused_at_startup(request, dflash2_models, gpu_log_dir, "dflash2-unsupported",
                              "tiny-qwen3-dflash2-unsupported", ["--speculative-algorithm", "DFLASH"])
    assert "cannot be served" in log and "attention_sink_bias" in log, log[-3000:]


def test_transitions_without_a_selector_refused_at_startup(request, dflash2_models, gpu_log_dir):
    log = _refused_at_startup(request, dflash2_models, gpu_log_dir, "ddtree-transitions-dflash1", "tiny-qwen3-dflash",
                              ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-tree", "transitions"])
    assert "--speculative-ddtree-tree marginals (the default)" in log, log[-3000:]
