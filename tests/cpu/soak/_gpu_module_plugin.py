# SPDX-License-Identifier: Apache-2.0
"""A pytest plugin that lets tests/gpu/soak run on a CPU machine against stand-in servers:
the GPU check passes, and the shared harness's ``ServerProcess`` launches ``_standin.py``
instead of ``python -m sglang.launch_server`` (used by ``test_soak_gpu_module.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

STANDIN = Path(__file__).resolve().parent / "_standin.py"

torch.cuda.is_available = lambda: True
torch.cuda.get_device_name = lambda device=None: "stand-in"


def pytest_sessionstart(session):
    for plugin in session.config.pluginmanager.get_plugins():
        server_process = getattr(plugin, "ServerProcess", None)
        if server_process is not None and getattr(plugin, "__file__", "").endswith("tests/gpu/conftest.py"):
            server_process.launcher = (sys.executable, str(STANDIN))
            return
    raise RuntimeError("the GPU harness (tests/gpu/conftest.py) is not loaded")
