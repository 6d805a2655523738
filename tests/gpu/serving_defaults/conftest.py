# SPDX-License-Identifier: Apache-2.0
"""Servers started the way the image starts them: through ``docker/entrypoint.py``.

``entrypoint_pool`` keeps one server alive at a time (each takes the whole GPU at the
default memory flags) and restarts only when the configuration changes. A server's
command line is the entrypoint's: ``python docker/entrypoint.py --model-path M
--host 127.0.0.1 --port P ARGS``, which the entrypoint turns into the
``sglang.launch_server`` command it runs in the container (adding
``--speculative-algorithm DDTREE`` when a drafter is given and no algorithm is).

``shape_models``: the config-only pairs of ``scripts/make_test_models.py`` (in
``DDTREE_TEST_MODELS`` when it has them, else generated once into a temp dir).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import pytest

from tests.gpu.harness import harness

REPO = Path(__file__).resolve().parents[3]
SHAPE_PAIRS = ("v2lite-shape", "qwen3-8b-shape")


@pytest.fixture(scope="session")
def shape_models() -> Path:
    given = os.environ.get("DDTREE_TEST_MODELS")
    need = [f"{p}{s}/config.json" for p in SHAPE_PAIRS for s in ("", "-dflash")]
    if given and all((Path(given) / n).exists() for n in need):
        return Path(given)
    out = Path(tempfile.mkdtemp(prefix="ddtree_shape_models_"))
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_test_models.py"), str(out), "--only", "shapes"],
                   check=True)  # fmt: skip
    return out


class EntrypointPool:
    """One live server at a time, started through the image's entrypoint."""

    def __init__(self, server_cls, log_dir: Path):
        self.server_cls = server_cls
        self.log_dir = log_dir
        self.env = {"DDTREE_PORT_FILE": str(log_dir / "entrypoint-port")}
        self._stack: Optional[contextlib.ExitStack] = None
        self.current = None
        self.failed: dict[str, str] = {}

    def get(self, name: str, model: str, args: list[str]):
        if self.current is not None and self.current.name == name and self.current.alive():
            return self.current
        self.close()
        if name in self.failed:
            pytest.fail(f"server {name} failed to start earlier:\n{self.failed[name]}")
        server = self.server_cls(name, model, args, self.log_dir, env=self.env)
        self._stack = contextlib.ExitStack()
        self._stack.callback(server.stop)
        try:
            server.wait_healthy(float(os.environ.get("DDTREE_SERVER_TIMEOUT", "420")))
        except Exception as e:
            self.failed[name] = str(e)
            self.close()
            raise
        self.current = server
        print(f"\n[server {name} healthy after {server.ready_s:.0f} s]", flush=True)
        return server

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
        self._stack, self.current = None, None


@pytest.fixture(scope="session")
def entrypoint_pool(request, gpu_log_dir):
    server_cls = type(
        "EntrypointServer",
        (harness(request.config).ServerProcess,),
        {"launcher": (sys.executable, str(REPO / "docker" / "entrypoint.py"))},
    )
    pool = EntrypointPool(server_cls, gpu_log_dir)
    yield pool
    pool.close()
