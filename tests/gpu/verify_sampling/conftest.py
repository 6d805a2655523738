# SPDX-License-Identifier: Apache-2.0
"""Servers for the verify-sampling suite (GPU host only), on the shared harness.

Per tiny test target (the MLA pair on Triton, the Qwen3 GQA pair on FlashInfer): the
reference, a server without speculation and *without* the overlap scheduler (which, in
upstream 0.5.17, feeds its penalizers the previous step's token a step late, so its
penalties are not those of the output so far), and the speculative servers of
``_servers.SPECULATIVE``. On the MLA target also the no-speculation server with the overlap
scheduler, whose outputs are only reported.

With ``DDTREE_LEARNED_PAIR`` (the directory ``python3 -m scripts.learned_pair unpack``
wrote), the seeded tests start no-speculation, DFLASH and DDTREE B=16 servers of the
learned pair with ``--enable-deterministic-inference`` (SGLang's seeded sampler).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.gpu.harness import harness

from tests.gpu.verify_sampling._servers import SPECULATIVE, TARGETS

COMMON = [
    "--mem-fraction-static", "0.85",
    "--max-total-tokens", "65536",
    "--max-running-requests", "16",
    "--cuda-graph-max-bs", "8",
    "--cuda-graph-backend-prefill", "disabled",  # prefill graphs lengthen a start; nothing here needs them
    "--log-level", "info",
]  # fmt: skip


def _spec_args(kind: str, drafter: str) -> list[str]:
    if kind == "dflash":
        return ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", drafter]
    budget, _, mode = kind.removeprefix("ddtree").partition("_")
    args = ["--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", drafter,
            "--speculative-ddtree-budget", budget]
    if mode == "eager":
        args += ["--disable-cuda-graph", "--disable-overlap-schedule"]
    return args


class _Started(dict):
    """Started servers by key; a key whose server did not start fails the test that asks for
    it (with that server's error), not every test of the suite."""

    def __init__(self):
        super().__init__()
        self.failed = {}

    def __missing__(self, key):
        pytest.fail(f"server {key} did not start: {self.failed.get(key, 'not configured')}"[-3000:])


def _start_all(h, specs, log_dir):
    """Spawn every server, then wait for each (their starts overlap); stop all on exit."""
    spawned, started = {}, _Started()
    try:
        for key, (model, args, env) in specs.items():
            spawned[key] = h.ServerProcess("verify-sampling-" + "-".join(key), model, args, log_dir, env=env)
        timeout = float(os.environ.get("DDTREE_SERVER_TIMEOUT", "420"))
        for key, s in spawned.items():
            try:
                s.wait_healthy(timeout)
            except Exception as e:  # noqa: BLE001  (recorded for the tests that need this server)
                started.failed[key] = str(e)
                print(f"\n[server {s.name} did not start]", flush=True)
                continue
            started[key] = s
            print(f"\n[server {s.name} healthy after {s.ready_s:.0f} s]", flush=True)
        yield started
    finally:
        for s in spawned.values():
            s.stop()


def _pair_dir():
    given = os.environ.get("DDTREE_LEARNED_PAIR")
    return Path(given) if given and (Path(given) / "manifest.json").exists() else None


@pytest.fixture(scope="session")
def all_servers(request, tiny_models, gpu_log_dir):
    """Every server of the suite, started together: ``(target, config)`` -> server. Per tiny
    target nospec_sync and ``SPECULATIVE[target]``, ("mla", "nospec") with the overlap scheduler;
    with the learned pair, its nospec_sync and speculative servers under
    ``--enable-deterministic-inference`` (SGLang's seeded sampler; greedy output is unchanged)."""
    h = harness(request.config)
    specs = {}
    for target, (model, backend) in TARGETS.items():
        base = [*COMMON, "--attention-backend", backend]
        path = str(tiny_models / model)
        specs[(target, "nospec_sync")] = (path, [*base, "--disable-overlap-schedule"], {})
        for kind in SPECULATIVE[target]:
            specs[(target, kind)] = (path, [*base, *_spec_args(kind, str(tiny_models / f"{model}-dflash"))], {})
    if "mla" in TARGETS:
        specs[("mla", "nospec")] = (str(tiny_models / "tiny-mla"), [*COMMON, "--attention-backend", "triton"], {})
    pair = _pair_dir()
    if pair is not None:
        det = [*COMMON, "--attention-backend", "triton", "--enable-deterministic-inference"]
        target = str(pair / "target")
        specs[("pair", "nospec_sync")] = (target, [*det, "--disable-overlap-schedule"], {})
        for kind in SPECULATIVE["pair"]:
            specs[("pair", kind)] = (target, [*det, *_spec_args(kind, str(pair / "drafter"))], {})
    yield from _start_all(h, specs, gpu_log_dir)


@pytest.fixture
def servers(request, all_servers):
    """The tiny targets' servers; a test of a target not selected does not apply."""
    spec = getattr(request.node, "callspec", None)
    target = spec.params.get("target", "mla") if spec is not None else "mla"
    if target not in TARGETS:
        pytest.skip(f"{harness(request.config).NOT_APPLICABLE}VERIFY_SAMPLING_TARGETS leaves out {target}")
    return all_servers


@pytest.fixture
def learned_pair(request, all_servers) -> Path:
    pair = _pair_dir()
    if pair is None:
        pytest.skip(f"{harness(request.config).NOT_APPLICABLE}DDTREE_LEARNED_PAIR names no learned pair "
                    "(python3 -m scripts.learned_pair unpack ... --to DIR)")
    return pair
