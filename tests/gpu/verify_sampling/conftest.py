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


def _start_all(h, specs, log_dir):
    """Spawn every server, then wait for each (their starts overlap); stop all on exit."""
    started = {}
    try:
        for key, (model, args, env) in specs.items():
            started[key] = h.ServerProcess("verify-sampling-" + "-".join(key), model, args, log_dir, env=env)
        timeout = float(os.environ.get("DDTREE_SERVER_TIMEOUT", "420"))
        for key, s in started.items():
            s.wait_healthy(timeout)
            print(f"\n[server {s.name} healthy after {s.ready_s:.0f} s]", flush=True)
        yield started
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="session")
def servers(request, tiny_models, gpu_log_dir):
    """``servers[(target, config)]``: nospec_sync, the configurations of ``SPECULATIVE[target]``,
    and ("mla", "nospec")."""
    h = harness(request.config)
    specs = {}
    for target, (model, backend) in TARGETS.items():
        base = [*COMMON, "--attention-backend", backend]
        path = str(tiny_models / model)
        specs[(target, "nospec_sync")] = (path, [*base, "--disable-overlap-schedule"], {})
        for kind in SPECULATIVE[target]:
            specs[(target, kind)] = (path, [*base, *_spec_args(kind, str(tiny_models / f"{model}-dflash"))], {})
    specs[("mla", "nospec")] = (str(tiny_models / "tiny-mla"), [*COMMON, "--attention-backend", "triton"], {})
    yield from _start_all(h, specs, gpu_log_dir)


@pytest.fixture(scope="session")
def learned_pair(request) -> Path:
    given = os.environ.get("DDTREE_LEARNED_PAIR")
    if not given or not (Path(given) / "manifest.json").exists():
        pytest.skip(f"{harness(request.config).NOT_APPLICABLE}DDTREE_LEARNED_PAIR names no learned pair "
                    "(python3 -m scripts.learned_pair unpack ... --to DIR)")
    return Path(given)


@pytest.fixture(scope="session")
def seeded_servers(request, learned_pair, gpu_log_dir):
    """The learned pair under ``--enable-deterministic-inference``: nospec, dflash, ddtree16."""
    h = harness(request.config)
    det = [*COMMON, "--attention-backend", "triton", "--enable-deterministic-inference"]
    drafter = str(learned_pair / "drafter")
    specs = {("pair", "nospec"): (str(learned_pair / "target"), det, {})}
    for kind in ("dflash", "ddtree16"):
        specs[("pair", kind)] = (str(learned_pair / "target"), [*det, *_spec_args(kind, drafter)], {})
    yield from _start_all(h, specs, gpu_log_dir)
