# SPDX-License-Identifier: Apache-2.0
"""tests/gpu/soak itself (its conftest, fixtures and tests, as the tier runs them) on stand-in
servers (``_gpu_module_plugin.py``): every test but the malformed-request one, which needs the
real server's validation (tests/cpu/request_checks runs its loop against upstream's app), passes
and the figures and the phases' wall seconds reach ``DDTREE_SOAK_JSON``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _fake_models(root: Path) -> Path:
    """What the soak reads of the test models: the manifest and each pair's config."""
    root.mkdir()
    (root / "manifest.json").write_text("{}")
    for name in ("tiny-mla", "tiny-mla-dflash", "tiny-qwen3", "tiny-qwen3-dflash"):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, "vocab_size": 512}))
    return root


def test_the_gpu_module_runs_on_stand_ins(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDTREE_", "SOAK_"))}
    env.update(DDTREE_GPU_HOST="0", DDTREE_TEST_MODELS=str(_fake_models(tmp_path / "models")),
               DDTREE_GPU_LOG_DIR=str(tmp_path / "logs"), DDTREE_SOAK_JSON=str(tmp_path / "soak.json"),
               SOAK_DURATION_S="3", SOAK_CLIENTS="4", SOAK_DRAIN_S="10")  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu/soak", "-q", "-p", "no:cacheprovider",
                        "-p", "tests.cpu.soak._gpu_module_plugin", "-k", "not get_a_400", "-rfEs"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    last = r.stdout.strip().splitlines()[-1]
    assert r.returncode == 0 and "19 passed, 1 deselected" in last, r.stdout[-6000:] + r.stderr[-3000:]
    data = json.loads((tmp_path / "soak.json").read_text())
    assert set(data["servers"]) == {"mla-ddtree", "mla-dflash", "gqa-ddtree", "gqa-dflash"}
    assert data["settings"]["clients_per_server"] == 4 and data["gpu"] == "stand-in"
    fig = data["servers"]["gqa-dflash"]
    assert fig["requests_served"] > 0 and fig["retracted_requests_in_log"] > 0 and fig["latency_ms_p99"] > 0
    assert data["context_edge"]["problems"] == []
    phases = data["phases_s"]
    assert set(phases) == {"setup", "warmup", "load", "references", "idle"}, phases
    assert all(v >= 0 for v in phases.values()) and phases["load"] >= 3.0
    assert sum(phases.values()) <= data["soak_wall_s"] + 0.1
    # the request filling the context ran during the load (the malformed ones are deselected)
    assert set(data["during_load_s"]) == {"context_edge"} and data["during_load_s"]["context_edge"] > 0
    assert data["servers_stop_s"] >= 0  # the servers' stop, added after they stopped
    assert (tmp_path / "logs" / "soak.json").exists() and (tmp_path / "logs" / "server-soak-mla-ddtree.log").exists()
