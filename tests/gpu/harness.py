# SPDX-License-Identifier: Apache-2.0
"""The shared GPU harness, ``tests/gpu/conftest.py``, as pytest loaded it: for the suites'
conftests, which start their servers with its ``ServerProcess`` and helpers. Importing
``tests.gpu.conftest`` instead would run a second copy of that module beside the plugin."""

from __future__ import annotations

from pathlib import Path

HARNESS_PATH = Path(__file__).resolve().parent / "conftest.py"


def harness(config):
    """The shared GPU harness module (tests/gpu/conftest.py), as pytest loaded it."""
    for plugin in config.pluginmanager.get_plugins():
        path = getattr(plugin, "__file__", None) or ""
        if Path(path).resolve() == HARNESS_PATH:
            return plugin
    raise RuntimeError("tests/gpu/conftest.py (the shared GPU harness) is not loaded")
