# SPDX-License-Identifier: Apache-2.0
"""tests/gpu/conftest.py on the GPU host (DDTREE_GPU_HOST=1): a skip is a failure, whether it
comes from pytest.skip, a skipif mark or a module that skips itself while being collected,
except a skip whose reason starts with NOT_APPLICABLE. Run for real: pytest on small test files
with the GPU tier's conftest loaded as a plugin, with and without the marker."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.conftest import NOT_APPLICABLE

REPO = Path(__file__).resolve().parents[3]

CASES = {
    "test_cases.py": f'''
import pytest

def test_passes():
    pass

def test_flashinfer_missing():
    pytest.skip("flashinfer: No module named 'flashinfer'")

@pytest.mark.skipif(True, reason="needs sgl_kernel")
def test_needs_sgl_kernel():
    pass

def test_two_gpus():
    pytest.skip("{NOT_APPLICABLE}needs 2 GPUs, this host has 1")

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    assert False
''',
    "test_module_skip.py": '''
import pytest
pytest.importorskip("a_module_that_is_not_installed")

def test_never_collected():
    pass
''',
}


def run(tmp_path, marker):
    for name, text in CASES.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "DDTREE_GPU_HOST"}
    if marker is not None:
        env["DDTREE_GPU_HOST"] = marker
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.gpu.conftest", "-rfEsx", "-p", "no:cacheprovider",
         "--continue-on-collection-errors",
         "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|xfailed|errors?)", proc.stdout.splitlines()[-1])}
    return proc, counts


def test_skips_fail_on_the_gpu_host(tmp_path):
    proc, counts = run(tmp_path, "1")
    out = proc.stdout
    assert proc.returncode == 1, out
    # a skipif mark skips in setup, so it fails there: pytest counts that as an error
    assert counts == {"passed": 1, "failed": 1, "skipped": 1, "xfailed": 1, "errors": 2}, (counts, out)
    assert "FAILED test_cases.py::test_flashinfer_missing" in out
    assert "ERROR test_cases.py::test_needs_sgl_kernel" in out
    assert "ERROR test_module_skip.py" in out
    assert "skipped on the GPU host (DDTREE_GPU_HOST=1), where a skip means a broken install: needs sgl_kernel" in out
    assert "a_module_that_is_not_installed" in out
    assert re.search(rf"SKIPPED \[1\] test_cases.py:\d+: {NOT_APPLICABLE}needs 2 GPUs", out), out


@pytest.mark.parametrize("marker", [None, "0"])
def test_elsewhere_skips_stay_skips(tmp_path, marker):
    proc, counts = run(tmp_path, marker)
    assert proc.returncode == 0, proc.stdout
    assert counts == {"passed": 1, "skipped": 4, "xfailed": 1}, (counts, proc.stdout)
