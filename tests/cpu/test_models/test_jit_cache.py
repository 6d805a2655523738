# SPDX-License-Identifier: Apache-2.0
"""scripts/gpu_host/jit_cache.sh: the GPU host's JIT caches packed as one archive or in parts of a
chosen size, checked after copying, and restored on another host; a damaged copy changes nothing."""

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "gpu_host" / "jit_cache.sh"
MIB = 1 << 20


def run(home: Path, *args, **env):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "HOME": str(home), **env})


def tree(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def host(tmp_path):
    """A host whose caches hold ~3 MiB that xz cannot shrink, so the archive has parts."""
    home = tmp_path / "host1"
    files = {".cache/flashinfer/0.6/90a/mla/mla.so": os.urandom(3 * MIB),
             ".cache/flashinfer/0.6/90a/mla/build.ninja": b"rule cxx\n",
             ".cache/tvm-ffi/libtvm_ffi_cache.json": b"{}",
             ".triton/cache/ABC/_tree_verify_split_kernel.cubin": os.urandom(64 * 1024)}
    for rel, data in files.items():
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_bytes(data)
    return home


def test_round_trip_in_parts(host, tmp_path):
    out, kept, home2 = tmp_path / "out" / "jit", tmp_path / "copy", tmp_path / "host2"
    r = run(host, "pack", out, JIT_CACHE_PART_MIB="1")
    assert r.returncode == 0, r.stderr
    parts = sorted(out.glob("jit-cache.tar.xz.*"))
    assert len(parts) == 4 and all(p.stat().st_size <= MIB for p in parts)
    assert sorted(p.name for p in out.iterdir()) == sorted([*(p.name for p in parts), "jit-cache.manifest"])
    for p in out.iterdir():
        p.chmod(0o444)  # a copy may arrive read-only
    assert run(host, "keep", out, kept).returncode == 0
    home2.mkdir()
    r = run(home2, "unpack", kept)
    assert r.returncode == 0, r.stderr
    for cache in (".cache/flashinfer", ".cache/tvm-ffi", ".triton/cache"):
        assert tree(home2 / cache) == tree(host / cache)
    assert not list(home2.glob(".jit-cache-unpack.*"))  # the temporary folder is gone


def test_one_archive_by_default_and_parts_by_flag(host, tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert run(host, "pack", whole).returncode == 0
    assert sorted(p.name for p in whole.iterdir()) == ["jit-cache.manifest", "jit-cache.tar.xz"]
    assert "parts 1\n" in (whole / "jit-cache.manifest").read_text()
    r = run(host, "pack", parts, "--part-mib", "1", "flashinfer")
    assert r.returncode == 0, r.stderr
    assert len(list(parts.glob("jit-cache.tar.xz.*"))) == 4 and "triton" not in (parts / "jit-cache.manifest").read_text()
    for src in (whole, parts):
        home = tmp_path / f"h-{src.name}"
        home.mkdir()
        r = run(home, "unpack", src)
        assert r.returncode == 0, r.stderr
        assert tree(home / ".cache/flashinfer") == tree(host / ".cache/flashinfer")
    r = run(host, "pack", tmp_path / "x", "--part-mib", "0")
    assert r.returncode != 0 and "--part-mib takes a whole number" in r.stderr


def test_one_cache_only(host, tmp_path):
    out = tmp_path / "jit"
    assert run(host, "pack", out, "triton").returncode == 0
    assert "caches .triton/cache" in (out / "jit-cache.manifest").read_text()
    home2 = tmp_path / "h2"
    home2.mkdir()
    assert run(home2, "unpack", out).returncode == 0
    assert (home2 / ".triton/cache").is_dir() and not (home2 / ".cache/flashinfer").exists()


def test_a_damaged_copy_leaves_the_caches_alone(host, tmp_path):
    out = tmp_path / "jit"
    assert run(host, "pack", out, JIT_CACHE_PART_MIB="1").returncode == 0
    home2 = tmp_path / "h2"
    (home2 / ".triton/cache/OLD").mkdir(parents=True)
    (home2 / ".triton/cache/OLD/k.cubin").write_bytes(b"old")
    before = tree(home2)

    last = sorted(out.glob("jit-cache.tar.xz.*"))[-1]
    data = bytearray(last.read_bytes())
    data[-1] ^= 0xFF
    last.write_bytes(bytes(data))
    r = run(home2, "unpack", out)
    assert r.returncode != 0 and "do not match their manifest" in r.stderr
    last.unlink()
    r = run(home2, "unpack", out)
    assert r.returncode != 0 and "holds 3 of 4 parts" in r.stderr
    assert tree(home2) == before


def test_refusals_say_what_to_do(host, tmp_path):
    r = run(host, "pack", tmp_path / "jit", JIT_CACHE_MAX_MIB="1")
    assert r.returncode != 0 and "pack fewer caches" in r.stderr
    assert not list((tmp_path / "jit").glob("jit-cache*"))
    r = run(host, "pack", tmp_path / "jit", "--max-mib", "1")
    assert r.returncode != 0 and "over the limit of 1 MiB" in r.stderr
    r = run(host, "pack", tmp_path / "j2", "deepgemm")
    assert r.returncode != 0 and "unknown cache 'deepgemm'" in r.stderr
    r = run(tmp_path, "pack", tmp_path / "j3")
    assert r.returncode != 0 and "nothing to pack" in r.stderr
    r = run(host, "unpack", tmp_path)
    assert r.returncode != 0 and "not a folder made by" in r.stderr
