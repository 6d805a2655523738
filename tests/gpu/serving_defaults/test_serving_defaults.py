# SPDX-License-Identifier: Apache-2.0
"""The serving commands of README.md and docs/docker.md, run as written: no memory flags.

Each server is started through the image's entrypoint (``docker/entrypoint.py``, the
argv ``docker run IMAGE --model-path T --speculative-draft-model-path D`` gives it)
with no ``--mem-fraction-static``, no ``--max-total-tokens``, no CUDA-graph caps:
upstream sizes the KV pools from the GPU's whole memory, and the target's token pool
must leave room for the draft model's pool of the same token count (patch 0071).
Each must become healthy and serve chat requests; ``max_total_num_tokens``, the
automatic memory fraction, the per-token cost the pool was sized with and the memory
left after start-up are logged and written to ``serving_defaults.json`` in the log dir.

Targets, all at real-model shapes with ``--load-format dummy`` (configs written by
``scripts/make_test_models.py``) but the first:

* tiny-mla + its drafter: the project's constructed test pair (whose drafter holds 7x
  the target's KV per token), also the server ``dflash benchmark openai`` runs against;
* DeepSeek-V2-Lite-shaped MLA target (27 layers, 512+64 latent) + a 5-layer GQA drafter;
* Qwen3-8B-shaped GQA target (36 layers, 8 KV heads of 128) + a 5-layer drafter of its shape.

Backends on this host (H200, sm_90): upstream's default there is FA3, which the host's
sglang-kernel (slimmed of FA3) does not ship. DDTREE runs with the backend unset, as the
README command does, so it exercises DDTREE's own choice of a tree-capable backend
(triton for MLA, flashinfer for MHA; logged). DFLASH, whose default stays upstream's,
runs with the backends upstream defaults to on sm_120, the GPUs this project targets:
``--attention-backend triton`` for MLA, ``flashinfer`` for MHA.

The servers take the whole GPU, one at a time: run this piece alone
(``scripts/gpu_host/run_gpu_tier.sh --only serving_defaults``). Each takes 1.5-3 minutes
to start at the defaults (CUDA-graph capture over the whole pool); ``SERVING_DEFAULTS_SERVERS``
(a comma list of the names in ``SERVERS``) runs some of them, to split the piece over runs.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("GPU tier: needs a CUDA device", allow_module_level=True)

from tests.gpu.conftest import NOT_APPLICABLE  # noqa: E402
from tests.gpu.serving_defaults._dflash_client import reported, run_benchmark  # noqa: E402

MEMORY_FLAGS = ("--mem-fraction-static", "--max-total-tokens", "--cuda-graph-max-bs", "--max-running-requests",
                "--context-length", "--chunked-prefill-size")  # fmt: skip
DUMMY = ["--load-format", "dummy"]
# name -> (target, algorithm, attention kind, extra argv, expected verify backend)
SERVERS = {
    "tiny-mla-ddtree": ("tiny-mla", "DDTREE", "mla", [], "triton"),
    "v2lite-ddtree": ("v2lite-shape", "DDTREE", "mla", DUMMY, "triton"),
    "v2lite-dflash": ("v2lite-shape", "DFLASH", "mla", [*DUMMY, "--speculative-algorithm", "DFLASH",
                                                         "--attention-backend", "triton"], "triton"),
    "qwen3-8b-ddtree": ("qwen3-8b-shape", "DDTREE", "mha", DUMMY, "flashinfer"),
    "qwen3-8b-dflash": ("qwen3-8b-shape", "DFLASH", "mha", [*DUMMY, "--speculative-algorithm", "DFLASH",
                                                            "--attention-backend", "flashinfer"], "flashinfer"),
}  # fmt: skip
RESULTS: dict = {}


def _selected_servers() -> list:
    raw = os.environ.get("SERVING_DEFAULTS_SERVERS", "").strip()
    if not raw:
        return list(SERVERS)
    chosen = [n.strip() for n in raw.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in SERVERS]
    if unknown:
        raise pytest.UsageError(
            f"SERVING_DEFAULTS_SERVERS names unknown servers {unknown}; known: {', '.join(SERVERS)}")
    return chosen


SELECTED = _selected_servers()


def _model_dir(name, tiny_models, shape_models):
    return (tiny_models if name.startswith("tiny-") else shape_models) / name


def start(pool, name, tiny_models, shape_models):
    target, _, _, extra, _ = SERVERS[name]
    model = _model_dir(target, tiny_models, shape_models)
    args = ["--speculative-draft-model-path", str(model) + "-dflash", *extra]
    assert not set(args) & set(MEMORY_FLAGS)
    return pool.get(name, str(model), args)


def chat(server, content, max_tokens=32, **extra):
    return server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_meta_info": True, **extra,
    })  # fmt: skip


def prompts(tiny_models, n, words_each=24):
    words = json.loads((tiny_models / "manifest.json").read_text())["words"]
    return [" ".join(words[(7 * i + 3 * j) % len(words)] for j in range(words_each)) for i in range(n)]


def _write_results(gpu_log_dir):
    (gpu_log_dir / "serving_defaults.json").write_text(json.dumps(RESULTS, indent=2) + "\n")


def test_dflash_client_reports_acceptance_against_ddtree(entrypoint_pool, tiny_models, shape_models, gpu_log_dir):
    """``dflash benchmark openai`` (the real client, its hub loader replaced by local
    prompts) prints an accept length against DDTREE: the tiny drafter agrees with its
    target for several tokens a step, so the length is well above the bonus token's 1."""
    if "tiny-mla-ddtree" not in SELECTED:
        pytest.skip(f"{NOT_APPLICABLE}SERVING_DEFAULTS_SERVERS leaves out tiny-mla-ddtree, the client's server")
    server = start(entrypoint_pool, "tiny-mla-ddtree", tiny_models, shape_models)
    model = server.get("/v1/models").read().decode()
    served = json.loads(model)["data"][0]["id"]
    out = run_benchmark(server.base_url, served, prompts(tiny_models, 12), num_prompts=8, concurrency=4,
                        max_new_tokens=96)  # fmt: skip
    print(out)
    accept, verify, tokens = reported(out, "Accept length"), reported(out, "Spec verify ct"), reported(
        out, "Output tokens")
    RESULTS["dflash_client"] = {"server": "tiny-mla-ddtree", "accept_length": accept, "spec_verify_ct": verify,
                                "output_tokens": tokens, "stdout": out}  # fmt: skip
    _write_results(gpu_log_dir)
    assert accept is not None, f"the client printed no accept length:\n{out}"
    assert tokens > 0 and verify > 0
    assert accept > 2.0, out


@pytest.mark.parametrize("name", SELECTED)
def test_serves_at_default_memory_flags(entrypoint_pool, tiny_models, shape_models, gpu_log_dir, name):
    target, algorithm, kind, _, backend = SERVERS[name]
    server = start(entrypoint_pool, name, tiny_models, shape_models)
    log = server.log_text()
    assert "ddtree-sglang: python -m sglang.launch_server" in log  # the entrypoint started it

    info = json.loads(server.get("/server_info").read())
    tokens = int(info["max_total_num_tokens"])
    cost = re.findall(rf"KV pool per token for {algorithm}: (.*)", log)
    free = re.findall(r"available_gpu_mem=([0-9.]+) GB", log)
    RESULTS[name] = {
        "max_total_num_tokens": tokens, "mem_fraction_static": info["mem_fraction_static"],
        "kv_pool_per_token": cost[-1] if cost else None,
        "available_gpu_mem_gb_after_start": float(free[-1]) if free else None,
        "attention_backend": info["attention_backend"], "ready_s": round(server.ready_s or 0, 1),
        "gpu": torch.cuda.get_device_name(0),
    }  # fmt: skip
    _write_results(gpu_log_dir)
    print(f"\n[{name}] {json.dumps(RESULTS[name])}", flush=True)

    assert info["speculative_algorithm"] == algorithm
    assert info["attention_backend"] == backend
    assert cost, f"the pool was not sized by pool_token_bytes:\n{server.log_tail()}"
    if algorithm == "DDTREE" and torch.cuda.get_device_capability(0) == (9, 0):
        assert "cannot verify a token tree" in log  # FA3, the sm_90 default, gave way
    assert tokens > 100_000
    if algorithm == "DDTREE":  # the default budget policy, auto: B=64 with verify graphs at 16 as well
        assert "DDTREE budget policy auto: adaptive, budget 64, verify graphs at budgets 16." in log
        assert "DDTREE worker: budget=64 (verify width 65)" in log and "budget policy adaptive" in log
        assert "DDTREE verify graphs at width 17 (budget 16)" in log

    r = chat(server, prompts(tiny_models, 1)[0], max_tokens=48)
    assert r["usage"]["completion_tokens"] == 48
    assert r["meta_info"]["spec_verify_ct"] > 0  # top level, where the DFlash client reads it
    with ThreadPoolExecutor(8) as ex:  # eight at once, with longer prompts
        outs = list(ex.map(lambda p: chat(server, " ".join([p] * 40), max_tokens=32), prompts(tiny_models, 8)))
    assert all(o["usage"]["completion_tokens"] == 32 for o in outs)
    assert server.alive() and not server.leak_lines()
