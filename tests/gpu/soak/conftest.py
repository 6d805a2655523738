# SPDX-License-Identifier: Apache-2.0
"""Servers for the soak piece (GPU host only), on the shared GPU harness of
``tests/gpu/conftest.py`` (``ServerProcess``, ``tiny_models``, ``gpu_log_dir``).

Up to six servers on one GPU, all spawned before any is waited for so that their starts
overlap: DDTREE and DFLASH on the tiny MLA pair (``tiny-mla``) and on the tiny GQA pair
(``tiny-qwen3``), each with a KV pool of about a quarter of the load the soak offers
(``--max-total-tokens``, from ``_load_mix.pool_tokens``), so that the scheduler runs out
of KV in decode and retracts; and per target a no-speculation server with a large pool,
the greedy reference. Every server runs the scheduler's strict idle pool check (a leaked,
double-freed or used-after-free KV or request slot kills it) and exports /metrics.
Triton attention everywhere: no FlashInfer attention JIT on a fresh host.

Environment (defaults in ``_soak.SoakSettings``): SOAK_DURATION_S (300), SOAK_CLIENTS (64
per speculative server), SOAK_SERVERS (mla-ddtree,mla-dflash,gqa-ddtree,gqa-dflash),
SOAK_POOL_FRACTION (0.25), SOAK_SEED, SOAK_DRAIN_S, SOAK_REQUEST_TIMEOUT_S; SOAK_EXTRA_ARGS
is appended to the speculative servers; SOAK_BUSY_CHECK=1 adds upstream's per-step pool
check (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY``) to them.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.gpu.harness import harness
from tests.gpu.soak._load_mix import LoadMix, MixConfig, pool_tokens
from tests.gpu.soak._soak import PAIRS, SPEC_SERVERS, SoakSettings

REFERENCE_POOL = 262144
STRICT_IDLE_CHECK = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}


@pytest.fixture(scope="session")
def soak_settings() -> SoakSettings:
    return SoakSettings.from_env()


def model_limits(models, target: str) -> tuple:
    """(context length, vocabulary size) of a target's config."""
    cfg = json.loads((models / PAIRS[target] / "config.json").read_text())
    return int(cfg["max_position_embeddings"]), int(cfg["vocab_size"])


@pytest.fixture(scope="session")
def soak_mixes(tiny_models, soak_settings) -> dict:
    mixes = {}
    for target in soak_settings.targets:
        context, vocab = model_limits(tiny_models, target)
        mixes[target] = LoadMix(MixConfig(context_len=context, vocab_size=vocab, seed=soak_settings.seed))
    return mixes


def common_args(clients: int) -> list:
    return [
        "--attention-backend", "triton",
        # Up to six servers start at once on one GPU: every pool is capped by tokens,
        # not sized from the memory the others are taking.
        "--mem-fraction-static", "0.85",
        "--max-running-requests", str(max(clients, 16)),
        "--cuda-graph-max-bs", "16",
        "--enable-metrics",
        "--log-level", "info",
    ]  # fmt: skip


def server_configs(models, settings: SoakSettings, mixes: dict) -> dict:
    """name -> (model dir, args, env) of every server the selection needs."""
    configs = {}
    base = common_args(settings.clients)
    busy = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1"} if os.environ.get("SOAK_BUSY_CHECK") == "1" else {}
    extra = shlex.split(os.environ.get("SOAK_EXTRA_ARGS", ""))
    for target in settings.targets:
        pair = models / PAIRS[target]
        configs[f"{target}-reference"] = (pair, [*base, "--max-total-tokens", str(REFERENCE_POOL)], STRICT_IDLE_CHECK)
    for name in settings.servers:
        target, algorithm = SPEC_SERVERS[name]
        pair = models / PAIRS[target]
        pool = pool_tokens(mixes[target], settings.clients, settings.pool_fraction)
        args = [*base, "--max-total-tokens", str(pool), "--speculative-algorithm", algorithm,
                "--speculative-draft-model-path", str(models / f"{PAIRS[target]}-dflash"), *extra]  # fmt: skip
        configs[name] = (pair, args, {**STRICT_IDLE_CHECK, **busy})
    return configs


@pytest.fixture(scope="session")
def soak_servers(request, tiny_models, gpu_log_dir, soak_settings, soak_mixes):
    """name -> ServerProcess, every one healthy; stopped at the end of the session."""
    h = harness(request.config)
    configs = server_configs(tiny_models, soak_settings, soak_mixes)
    timeout = float(os.environ.get("DDTREE_SERVER_TIMEOUT", "420"))
    started = {}
    try:
        for name, (model, args, env) in configs.items():
            started[name] = h.ServerProcess(f"soak-{name}", str(model), args, gpu_log_dir, env=env)
        for server in started.values():
            server.wait_healthy(timeout)
            print(f"\n[server {server.name} healthy after {server.ready_s:.0f} s]", flush=True)
        yield started
    finally:
        # In parallel: each waits up to 30 s for its processes to exit after SIGTERM, and six
        # such waits one after another add up; how long the stop took goes to soak.json.
        t0 = time.monotonic()
        with ThreadPoolExecutor(max(1, len(started))) as ex:
            list(ex.map(lambda server: server.stop(), started.values()))
        _note_in_results(gpu_log_dir, "servers_stop_s", round(time.monotonic() - t0, 1))


def _note_in_results(gpu_log_dir, key: str, value) -> None:
    """Adds ``key`` to the piece's soak.json files written by the tests (if they were)."""
    for path in {gpu_log_dir / "soak.json", *([Path(os.environ["DDTREE_SOAK_JSON"])]
                                             if os.environ.get("DDTREE_SOAK_JSON") else [])}:  # fmt: skip
        if path.exists():
            data = json.loads(path.read_text())
            data[key] = value
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
