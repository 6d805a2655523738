# SPDX-License-Identifier: Apache-2.0
"""scripts/gpu_host/install.sh: the wheel set as one archive or as parts (in any order, all at
once or a few at a time), checked by sha256 before anything is unpacked; a second run only
re-applies the series. Run for real on a small archive laid out as build_wheelhouse.sh lays it
out, with the series and the lock check replaced by stubs that record their calls.
scripts/gpu_host/build_wheelhouse.sh: its options are checked before anything is downloaded."""

import hashlib
import io
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

STUB_APPLY = """#!/usr/bin/env bash
# records the target it was asked to patch
while [ $# -gt 0 ]; do case $1 in --target) echo applied >>"$2/.series-applied"; shift 2 ;; *) shift ;; esac; done
"""
STUB_LOCK = """import sys
print("lock ok")
"""
PACKAGES = {"sglang/__init__.py": '__version__ = "0.5.17"\n', "transformers/__init__.py": '__version__ = "5.12.1"\n',
            "numpy/__init__.py": '__version__ = "2.3.5"\n', "sglang/data.bin": None,
            "sglang/server.py": "SERVING = True\n"}  # imported by no check: byte-compiled by the install alone


@pytest.fixture
def repo(tmp_path):
    """A repository with the real install.sh and stubs for what it calls."""
    root = tmp_path / "repo"
    (root / "scripts" / "gpu_host").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "gpu_host" / "install.sh", root / "scripts" / "gpu_host" / "install.sh")
    (root / "scripts" / "apply_patches.sh").write_text(STUB_APPLY)
    (root / "scripts" / "gpu_host" / "lock_check.py").write_text(STUB_LOCK)
    return root


def archive_bytes() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, text in PACKAGES.items():
            data = os.urandom(200_000) if text is None else text.encode()  # incompressible: several parts
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return lzma.compress(buf.getvalue(), preset=1)


def wheel_set(where: Path, nparts: int = 0) -> list[Path]:
    """The archive folder (nparts 0) or nparts part folders, as build_wheelhouse.sh writes them."""
    data = archive_bytes()
    sums = f"{hashlib.sha256(data).hexdigest()}  site.tar.xz\n"
    if not nparts:
        d = where / ".whl-e2e"
        d.mkdir(parents=True)
        (d / "site.tar.xz").write_bytes(data)
        (d / "SHA256SUMS").write_text(sums)
        return [d]
    size = -(-len(data) // nparts)
    dirs = []
    for i in range(nparts):
        d = where / f".whl-e2e-{i + 1}"
        d.mkdir(parents=True)
        (d / f"site.tar.xz.{i:02d}").write_bytes(data[i * size:(i + 1) * size])
        (d / "SHA256SUMS").write_text(sums)
        (d / "NPARTS").write_text(f"{nparts}\n")
        dirs.append(d)
    return dirs


def install(repo: Path, tmp_path: Path, *args, env_extra=None):
    env = {**os.environ, "DDTREE_SITE": str(tmp_path / "site"), "DDTREE_STAGE": str(tmp_path / "stage"),
           "PYTHON": sys.executable, "DDTREE_INSTALL_IMPORTS": "sglang transformers", **(env_extra or {})}
    return subprocess.run(["bash", str(repo / "scripts" / "gpu_host" / "install.sh"), *map(str, args)],
                          capture_output=True, text=True, cwd=repo, env=env, timeout=120)


def installed(tmp_path: Path) -> bool:
    site = tmp_path / "site"
    return (site / ".ddtree-installed").is_file() and (site / "sglang" / "data.bin").stat().st_size == 200_000


def test_the_whole_archive_then_a_rerun_reapplies(repo, tmp_path):
    (folder,) = wheel_set(tmp_path / "copied")
    r = install(repo, tmp_path, folder)
    assert r.returncode == 0, r.stderr
    assert "installed into" in r.stdout and "sglang 0.5.17" in r.stdout and "lock ok" in r.stdout
    assert installed(tmp_path)
    assert (tmp_path / "site" / ".series-applied").read_text() == "applied\n"
    # Byte-compiled at install, as pip leaves a site: the servers started together import it.
    assert "byte-compiled" in r.stdout
    assert list((tmp_path / "site" / "sglang" / "__pycache__").glob("server.*.pyc"))
    r = install(repo, tmp_path)
    assert r.returncode == 0 and "already installed; series re-applied" in r.stdout
    assert (tmp_path / "site" / ".series-applied").read_text() == "applied\n" * 2


def test_the_archive_file_needs_its_sums(repo, tmp_path):
    (folder,) = wheel_set(tmp_path / "copied")
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(folder / "site.tar.xz", lone / "wheels.tar.xz")
    r = install(repo, tmp_path, lone / "wheels.tar.xz")
    assert r.returncode != 0 and "no SHA256SUMS beside" in r.stderr and not installed(tmp_path)
    r = install(repo, tmp_path, folder / "site.tar.xz")
    assert r.returncode == 0, r.stderr
    assert installed(tmp_path)


@pytest.mark.parametrize("together", [True, False])
def test_parts_in_any_order(repo, tmp_path, together):
    parts = wheel_set(tmp_path / "copied", nparts=3)
    order = [parts[2], parts[0], parts[1]]
    if together:
        r = install(repo, tmp_path, *order)
    else:
        for k, part in enumerate(order[:2], start=1):
            r = install(repo, tmp_path, part)
            assert r.returncode == 0 and f"have {k} of 3 parts" in r.stdout, r.stderr
            assert not installed(tmp_path)
        r = install(repo, tmp_path, order[2])
    assert r.returncode == 0, r.stderr
    assert installed(tmp_path) and not (tmp_path / "stage").exists()


def test_a_damaged_part_installs_nothing_and_can_be_replaced(repo, tmp_path):
    parts = wheel_set(tmp_path / "copied", nparts=2)
    good = (parts[1] / "site.tar.xz.01").read_bytes()
    (parts[1] / "site.tar.xz.01").write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    r = install(repo, tmp_path, *parts)
    assert r.returncode != 0 and "checksum mismatch" in r.stderr
    assert not (tmp_path / "site").exists()
    (parts[1] / "site.tar.xz.01").write_bytes(good)
    r = install(repo, tmp_path, parts[1])  # the first part is still kept
    assert r.returncode == 0, r.stderr
    assert installed(tmp_path)


def test_parts_of_another_build_are_dropped(repo, tmp_path):
    old = wheel_set(tmp_path / "old", nparts=2)
    assert "have 1 of 2" in install(repo, tmp_path, old[0]).stdout
    new = wheel_set(tmp_path / "new", nparts=2)  # another archive: other random bytes, other sum
    r = install(repo, tmp_path, new[1])
    assert "parts of another build; dropped" in r.stdout and "have 1 of 2" in r.stdout
    r = install(repo, tmp_path, new[0])
    assert r.returncode == 0, r.stderr
    assert installed(tmp_path)


def test_refusals_say_what_to_give(repo, tmp_path):
    r = install(repo, tmp_path)
    assert r.returncode != 0 and "usage: install.sh" in r.stderr
    (tmp_path / "empty").mkdir()
    r = install(repo, tmp_path, tmp_path / "empty")
    assert r.returncode != 0 and "neither an archive folder" in r.stderr
    a, b = wheel_set(tmp_path / "a")[0], wheel_set(tmp_path / "b")[0]
    r = install(repo, tmp_path, a, b)
    assert r.returncode != 0 and "two archives given" in r.stderr


def test_build_wheelhouse_checks_its_options_first(tmp_path):
    script = REPO / "scripts" / "gpu_host" / "build_wheelhouse.sh"

    def build(*args):
        env = {k: v for k, v in os.environ.items() if k not in ("PART_MIB", "XZ_LEVEL")}
        return subprocess.run(["bash", str(script), *map(str, args)], capture_output=True, text=True,
                              env=env, timeout=60)

    r = build("--help")
    assert r.returncode == 0 and "--part-mib N" in r.stdout and "--out DIR" in r.stdout
    r = build("--part-mib", "54MiB")
    assert r.returncode != 0 and "--part-mib takes a whole number of MiB" in r.stderr
    r = build("--xz-level", "0")
    assert r.returncode != 0 and "--xz-level takes 1-9" in r.stderr
    r = build("--bogus")
    assert r.returncode != 0 and "unknown argument --bogus" in r.stderr
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    r = build("--out", tmp_path / "mine")
    assert r.returncode != 0 and "not a wheel-set folder" in r.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


STUB_PIP = r"""#!/usr/bin/env bash
# python, except `-m pip download` (one fake wheel into -d) and `-m pip install --target DIR`
# (the packages of PACKAGES written there, the last with incompressible bytes)
if [ "$1 $2" = "-m pip" ]; then
    while [ $# -gt 0 ]; do
        case $1 in
            -d) touch "$2/fake-1.0-py3-none-any.whl"; shift 2 ;;
            --target) t=$2; shift 2 ;;
            *) shift ;;
        esac
    done
    if [ -n "${t:-}" ]; then
        mkdir -p "$t/sglang" "$t/transformers" "$t/numpy"
        echo '__version__ = "0.5.17"' >"$t/sglang/__init__.py"
        echo '__version__ = "5.12.1"' >"$t/transformers/__init__.py"
        echo '__version__ = "2.3.5"' >"$t/numpy/__init__.py"
        head -c 2500000 /dev/urandom >"$t/sglang/data.bin"
    fi
    exit 0
fi
exec REAL_PYTHON "$@"
"""


def test_build_then_install_as_one_archive_and_as_parts(repo, tmp_path):
    """build_wheelhouse.sh with pip stubbed: one archive by default, with --part-mib N parts in
    DIR-1, DIR-2, ... (each with the whole archive's sum and the part count); install.sh installs
    either, and a rebuild replaces the other form."""
    shutil.copy(REPO / "scripts" / "gpu_host" / "build_wheelhouse.sh", repo / "scripts" / "gpu_host")
    (repo / "scripts" / "gpu_host" / "wheels.txt").write_text("fake==1.0\n")
    (repo / "docker").mkdir()
    shutil.copy(REPO / "docker" / "wheelhouse.py", repo / "docker" / "wheelhouse.py")
    py = tmp_path / "py"
    py.write_text(STUB_PIP.replace("REAL_PYTHON", sys.executable))
    py.chmod(0o755)

    def build(*args):
        env = {k: v for k, v in os.environ.items() if k not in ("PART_MIB", "XZ_LEVEL")}
        return subprocess.run(["bash", str(repo / "scripts" / "gpu_host" / "build_wheelhouse.sh"), "--python", str(py),
                               "--xz-level", "1", *args], capture_output=True, text=True, env=env, timeout=300)

    r = build("--part-mib", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    parts = sorted(repo.glob(".whl-e2e-*"))
    assert [p.name for p in parts] == [".whl-e2e-1", ".whl-e2e-2", ".whl-e2e-3"] and not (repo / ".whl-e2e").exists()
    for i, d in enumerate(parts):
        assert sorted(f.name for f in d.iterdir()) == ["NPARTS", "SHA256SUMS", f"site.tar.xz.{i:02d}"]
        assert (d / "NPARTS").read_text() == "3\n" and (d / f"site.tar.xz.{i:02d}").stat().st_size <= 1 << 20
    assert "3 parts of at most 1 MiB" in r.stdout
    r = install(repo, tmp_path, parts[1], parts[2], parts[0])
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "site" / "sglang" / "data.bin").stat().st_size == 2_500_000

    r = build()
    assert r.returncode == 0, r.stdout + r.stderr
    assert not list(repo.glob(".whl-e2e-*"))
    assert sorted(f.name for f in (repo / ".whl-e2e").iterdir()) == ["SHA256SUMS", "site.tar.xz"]
    shutil.rmtree(tmp_path / "site")
    r = install(repo, tmp_path, repo / ".whl-e2e")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "site" / "sglang" / "data.bin").stat().st_size == 2_500_000


STUB_JIT = """import os, sys
open(os.environ["JIT_CALLS"], "a").write("built\\n")
sys.exit(int(os.environ.get("JIT_RC", "0")))
"""


@pytest.mark.parametrize("gpu,switch,rc", [(True, None, 0), (True, None, 1), (True, "0", 0), (False, None, 0)])
def test_the_jit_caches_are_built_when_a_gpu_is_visible(repo, tmp_path, gpu, switch, rc):
    """With ``nvidia-smi -L`` answering, a fresh install builds the servers' JIT modules
    (build_jit_caches.py, a stub here); a failed build leaves the install done; DDTREE_JIT_BUILD=0
    and a machine without a GPU skip it."""
    (repo / "scripts" / "gpu_host" / "build_jit_caches.py").write_text(STUB_JIT)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if gpu:
        (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'GPU 0: NVIDIA H100'\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    calls = tmp_path / "jit-calls"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "JIT_CALLS": str(calls), "JIT_RC": str(rc),
           **({"DDTREE_JIT_BUILD": switch} if switch is not None else {})}
    (folder,) = wheel_set(tmp_path / "copied")
    r = install(repo, tmp_path, folder, env_extra=env)
    assert r.returncode == 0, r.stderr
    assert installed(tmp_path)
    built = gpu and switch != "0"
    assert (calls.read_text() if calls.exists() else "") == ("built\n" if built else "")
    assert ("the servers build them on first use" in r.stdout) == (built and rc != 0)
    r = install(repo, tmp_path, env_extra=env)  # a re-apply builds nothing
    assert r.returncode == 0 and (calls.read_text() if calls.exists() else "") == ("built\n" if built else "")
