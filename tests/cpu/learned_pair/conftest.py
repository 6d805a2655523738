# SPDX-License-Identifier: Apache-2.0
"""A toy learned pair built once per session by the real build (``--profile toy``), on two
standard-library packages of this interpreter, and one torch thread for these tests (the
CPU runners are small and shared; torch's default thread pool oversubscribes them)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def stdlib_roots() -> dict[str, Path]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return {"email": lib / "email", "json": lib / "json"}


@pytest.fixture(scope="session")
def toy_pair(tmp_path_factory) -> tuple[Path, dict]:
    from scripts.learned_pair.build import BuildArgs, build

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path_factory.mktemp("toy_pair")
        manifest = build(BuildArgs(out=out, profile="toy", roots=stdlib_roots(), deadline_s=600), log=lambda m: None)
    finally:
        torch.set_num_threads(n)
    return out, manifest
