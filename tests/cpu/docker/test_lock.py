# SPDX-License-Identifier: Apache-2.0
"""One lock for the image and the GPU host (scripts/gpu_host/lock_check.py): the GPU host's
carried and host-provided lists pin the lock's versions and cover sglang's closure, the CUDA
compiler is pinned to the runtime's release, and installed drift is reported."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "gpu_host" / "lock_check.py"
_spec = importlib.util.spec_from_file_location("ddtree_lock_check", SCRIPT)
lc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lc)


def test_the_gpu_host_lists_pin_the_lock_and_cover_sglang():
    assert lc.check_files() == []
    host = lc.read_pins(lc.HOST)
    assert host["torch"] == "2.11.0" and host["triton"] == "3.6.0"  # what the host image provides


def test_the_compiler_is_the_runtime_release():
    lock = lc.load_lock()
    for name in lc.COMPILER:
        assert lc.release(lock[name]) == lc.release(lock[lc.RUNTIME]), name


def _copy(tmp_path, path, edit):
    out = tmp_path / path.name
    out.write_text(edit(path.read_text()))
    return out


def test_a_drifted_pin_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(lc, "WHEELS", _copy(tmp_path, lc.WHEELS, lambda t: t.replace("fastapi==0.165.0", "fastapi==0.115.0")))
    monkeypatch.setattr(lc, "LOCK", _copy(tmp_path, lc.LOCK, lambda t: t.replace("nvidia-cuda-nvcc==13.0.88", "nvidia-cuda-nvcc==13.5.37")))
    errors = lc.check_files(with_closure=False)
    assert "wheels.txt: fastapi==0.115.0, the lock pins 0.165.0" in errors
    assert any("nvidia-cuda-nvcc==13.5.37 but nvidia-cuda-runtime==13.0.96" in e for e in errors)


def test_a_package_nobody_provides_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(lc, "WHEELS", _copy(tmp_path, lc.WHEELS, lambda t: t.replace("numpy==2.3.5\n", "")))
    errors = lc.check_files()
    assert errors == ["numpy (needed by sglang on the host) is neither carried, host-provided nor left out"]


def test_bad_lines_are_refused(tmp_path):
    bad = tmp_path / "w.txt"
    bad.write_text("torch>=2.0\n")
    with pytest.raises(ValueError, match="expected 'name==version'"):
        lc.read_pins(bad)


def test_installed_drift_fails_with_the_fix(tmp_path):
    """A site ahead of the venv's (as /tmp/site is on the host) with another fastapi and no nvcc."""
    dist = tmp_path / "site" / "fastapi-0.115.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fastapi\nVersion: 0.115.0\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "CUDA_HOME": str(tmp_path / "no-cuda")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "installed"], capture_output=True, text=True, env=env)
    assert proc.returncode == 1
    assert "DRIFT  fastapi: 0.115.0 installed (carried), the lock pins 0.165.0" in proc.stdout
    assert "no nvcc found" in proc.stdout and "add them, at the lock's version" in proc.stdout


def test_install_sh_checks_the_lock():
    text = (REPO / "scripts" / "gpu_host" / "install.sh").read_text()
    assert text.count("check_lock") >= 3  # defined, after a fresh install, on every later call
    assert 'lock_check.py" installed' in text and "DDTREE_ALLOW_LOCK_DRIFT" in text


def _dist(site, name, version, files):
    """A package installed in ``site`` the way pip does it: its files and a dist-info with RECORD."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    for rel, text in files.items():
        if text is not None:
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            (site / rel).write_text(text)
    (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in [*files, f"{info.name}/METADATA"]))
    return info


def _installed(tmp_path, *sites):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, sites)), "CUDA_HOME": str(tmp_path / "no-cuda")}
    return subprocess.run([sys.executable, str(SCRIPT), "installed"], capture_output=True, text=True, env=env)


def test_a_carried_copy_shadows_the_hosts_for_metadata_and_import(tmp_path):
    """The host's own older easydict behind the carried site: the first copy is reported and imported."""
    carried, host = tmp_path / "site", tmp_path / "host"
    lock = lc.load_lock()["easydict"]
    _dist(carried, "easydict", lock, {"easydict/__init__.py": "CARRIED = True\n"})
    _dist(host, "easydict", "1.10", {"easydict/__init__.py": "CARRIED = False\n"})
    proc = _installed(tmp_path, carried, host)
    assert not [line for line in proc.stdout.splitlines() if line.startswith("DRIFT  easydict")], proc.stdout
    assert f"easydict {lock} over 1.10" in proc.stdout  # (then the dev venv's own copy)


def test_metadata_without_its_module_is_drift(tmp_path):
    """A carried dist-info whose module is missing: Python imports the host's copy, which is drift."""
    carried, host = tmp_path / "site", tmp_path / "host"
    lock = lc.load_lock()["easydict"]
    _dist(carried, "easydict", lock, {"easydict/__init__.py": None})
    _dist(host, "easydict", "1.10", {"easydict/__init__.py": "CARRIED = False\n"})
    proc = _installed(tmp_path, carried, host)
    assert proc.returncode == 1
    assert (f"DRIFT  easydict: {lock} is the installed version but `import easydict` loads the 1.10 copy "
            f"({os.path.realpath(host / 'easydict' / '__init__.py')})") in proc.stdout


def test_import_names_are_read_from_record(tmp_path):
    import importlib.metadata as md

    info = _dist(tmp_path, "protobuf", "6.33.6", {
        "google/protobuf/__init__.py": "", "google/protobuf/internal/__init__.py": "",
        "google/_upb/_message.abi3.so": "", "six.py": "", "_cffi_backend.cpython-312-x86_64-linux-gnu.so": "",
        "protobuf-6.33.6.data/scripts/x": "", "../../bin/tool": None})
    assert lc._import_names(md.PathDistribution(info)) == {
        "google.protobuf": "google/protobuf/__init__.py", "six": "six.py",
        "_cffi_backend": "_cffi_backend.cpython-312-x86_64-linux-gnu.so"}
