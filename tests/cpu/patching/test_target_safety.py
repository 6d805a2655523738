# SPDX-License-Identifier: Apache-2.0
"""apply_patches.sh against targets in bad states: concurrent runs, stamps that lie, bad files.

Each test drives the real tools on a copy of the pristine pinned upstream tree."""

import fcntl
import json
import os
import pathlib
import random
import shutil
import subprocess

import pytest
from conftest import PRISTINE, REPO, replace_text, tree_digest

from patchkit import apply_cli, engine
from patchkit.series import load_series

APPLY = REPO / "scripts" / "apply_patches.sh"
SERVER_ARGS = "sglang/srt/server_args.py"


def run(capsys, *args):
    rc = apply_cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out + out.err


def fresh_copy(dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(PRISTINE / "sglang", dst / "sglang", copy_function=os.link,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def digest_without_stamp(root: pathlib.Path) -> str:
    """tree_digest with the stamp's contents left out (it holds the time of the run)."""
    stamp = root / engine.STAMP
    saved = stamp.read_bytes()
    try:
        stamp.write_bytes(b"")
        return tree_digest(root)
    finally:
        stamp.write_bytes(saved)


@pytest.fixture(scope="module")
def applied_once(tmp_path_factory):
    """The real series applied once, alone: what every concurrent run must end with."""
    root = fresh_copy(tmp_path_factory.mktemp("reference"))
    proc = subprocess.run(["bash", str(APPLY), "--target", str(root), "--quiet"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root


def test_two_applies_at_once_on_one_target(tmp_path, applied_once):
    """Both runs succeed, one after the other; the tree is exactly a single run's, the stamp
    checks out against the files, and a third run has nothing to do. Twelve trials: without the
    lock the two runs shared a temp file name and one's rollback overwrote the other's files."""
    want = digest_without_stamp(applied_once)
    patched = (applied_once / SERVER_ARGS).read_bytes()
    for trial in range(12):
        root = fresh_copy(tmp_path / f"t{trial}")
        cmd = ["bash", str(APPLY), "--target", str(root), "--quiet"]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], (trial, outs)
        assert sorted("nothing to do" in o for o in outs) == [False, True], (trial, outs)
        assert (root / SERVER_ARGS).read_bytes() == patched, trial
        assert engine.stamp_verified(root, engine.read_stamp(root)), trial
        assert digest_without_stamp(root) == want, trial
        assert not list((root / "sglang").rglob("*.ddtree-tmp")), trial
        third = subprocess.run(cmd, capture_output=True, text=True)
        assert third.returncode == 0 and "nothing to do" in third.stdout, (trial, third.stdout)
        shutil.rmtree(root)


def test_a_second_run_waits_for_the_lock(tmp_path):
    root = fresh_copy(tmp_path)
    fd = os.open(root / "sglang", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        proc = subprocess.Popen(["bash", str(APPLY), "--target", str(root), "--quiet"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert "waiting for another run of the patch tools" in proc.stderr.readline()
        assert proc.poll() is None and not (root / engine.STAMP).exists()
    finally:
        os.close(fd)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "applied" in out
    assert engine.stamp_verified(root, engine.read_stamp(root))


def test_a_stamp_whose_files_are_pristine_is_not_trusted(capsys, upstream_copy, pristine):
    """The state two overlapping runs used to leave: stamp "applied", server_args.py pristine."""
    assert run(capsys, "--target", upstream_copy)[0] == 0
    patched = (upstream_copy / SERVER_ARGS).read_bytes()
    (upstream_copy / SERVER_ARGS).unlink()
    shutil.copy(pristine / SERVER_ARGS, upstream_copy / SERVER_ARGS)
    rc, out = run(capsys, "--target", upstream_copy)
    assert rc == 0, out
    assert "nothing to do" not in out and "the files do not match it" in out
    assert f"these files are pristine" in out and SERVER_ARGS in out
    assert (upstream_copy / SERVER_ARGS).read_bytes() == patched
    assert engine.stamp_verified(upstream_copy, engine.read_stamp(upstream_copy))
    assert "nothing to do" in run(capsys, "--target", upstream_copy)[1]


def test_a_file_changed_after_applying_is_refused(capsys, upstream_copy):
    assert run(capsys, "--target", upstream_copy)[0] == 0
    replace_text(upstream_copy / SERVER_ARGS, "\n", "\n# local edit\n")
    before = tree_digest(upstream_copy)
    for args in ((), ("--reverse",)):
        rc, out = run(capsys, "--target", upstream_copy, *args)
        assert rc == 2, out
        assert f"{SERVER_ARGS} (changed after the series was applied)" in out and "reinstall sglang" in out
        assert tree_digest(upstream_copy) == before


def test_a_deleted_stamp_is_named(capsys, upstream_copy):
    assert run(capsys, "--target", upstream_copy)[0] == 0
    (upstream_copy / engine.STAMP).unlink()
    before = tree_digest(upstream_copy)
    rc, out = run(capsys, "--target", upstream_copy)
    assert rc == 2 and "but no stamp records a series" in out and "reinstall sglang" in out
    assert tree_digest(upstream_copy) == before


def test_patches_already_in_a_file_without_a_stamp(capsys, upstream_copy, synthetic_series, tmp_path):
    patches, _ = synthetic_series
    no_overlay = tmp_path / "empty" / "sglang"
    no_overlay.mkdir(parents=True)
    args = ("--target", upstream_copy, "--patches", patches, "--overlay", no_overlay)
    assert run(capsys, *args)[0] == 0
    (upstream_copy / engine.STAMP).unlink()
    before = tree_digest(upstream_copy)
    rc, out = run(capsys, *args)
    assert rc == 1 and "FAILED" in out
    assert "sglang/version.py already holds this patch's changes, but no stamp records them" in out
    assert tree_digest(upstream_copy) == before


def test_stamps_without_hashes_are_checked_by_reversing(capsys, upstream_copy):
    """A stamp written before the tools recorded hashes: re-derived once, then trusted."""
    assert run(capsys, "--target", upstream_copy)[0] == 0
    stamp_path = upstream_copy / engine.STAMP
    stamp = json.loads(stamp_path.read_text())
    del stamp["files"]
    stamp_path.write_text(json.dumps(stamp))
    patched = (upstream_copy / SERVER_ARGS).read_bytes()
    rc, out = run(capsys, "--target", upstream_copy)
    assert rc == 0 and "no file hashes to check it by" in out
    assert (upstream_copy / SERVER_ARGS).read_bytes() == patched
    assert "files" in json.loads(stamp_path.read_text())
    assert "nothing to do" in run(capsys, "--target", upstream_copy)[1]


def test_a_corrupt_stamp_is_an_error(capsys, upstream_copy):
    assert run(capsys, "--target", upstream_copy)[0] == 0
    (upstream_copy / engine.STAMP).write_bytes(random.Random(1).randbytes(512) + b"\xff")
    rc, out = run(capsys, "--target", upstream_copy)
    assert rc == 2 and "is corrupt" in out and "reinstall sglang" in out


def test_a_patch_of_random_bytes(upstream_copy, synthetic_series):
    """Through the shell wrapper: a clear message and exit 2, not a traceback and exit 1."""
    patches, overlay = synthetic_series
    (patches / "0002-lang-init-note.patch").write_bytes(b"\xff" + random.Random(0).randbytes(4096))
    before = tree_digest(upstream_copy)
    proc = subprocess.run(["bash", str(APPLY), "--target", str(upstream_copy), "--patches", str(patches),
                           "--overlay", str(overlay)], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "0002-lang-init-note.patch: not a text file (byte 0xff at offset 0 is not UTF-8)" in proc.stderr
    assert tree_digest(upstream_copy) == before


def test_a_series_file_of_random_bytes(capsys, upstream_copy, synthetic_series):
    patches, overlay = synthetic_series
    (patches / "series").write_bytes(b"0001-version-note.patch\n\xfe\xfe\n")
    rc, out = run(capsys, "--target", upstream_copy, "--patches", patches, "--overlay", overlay)
    assert rc == 2 and "series: not a text file (byte 0xfe at offset 24" in out


@pytest.mark.parametrize("what", ["missing", "file"])
def test_a_target_that_is_not_a_directory(capsys, tmp_path, what):
    target = tmp_path / "site"
    if what == "file":
        target.write_text("not a tree\n")
    rc, out = run(capsys, "--target", target)
    assert rc == 2 and "no sglang package here" not in out
    assert ("no such directory" if what == "missing" else "not a directory") in out


def test_python_without_sglang_never_patches_the_overlay(capsys, tmp_path):
    """An interpreter whose path holds a directory named sglang without __init__.py (this repo's
    overlay, run from the repo root) has no sglang to patch: refused, not patched in place."""
    (tmp_path / "sglang" / "srt").mkdir(parents=True)
    env_python = tmp_path / "py"
    env_python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path} exec {shutil.which('python3')} -S \"$@\"\n")
    env_python.chmod(0o755)
    rc, out = run(capsys, "--python", env_python)
    assert rc == 2 and "cannot import sglang" in out
    assert not (tmp_path / engine.STAMP).exists()


def test_edits_refreshed_into_the_series_apply_cleanly(capsys, upstream_copy, synthetic_series, pristine):
    """Apply, edit the patched file in place, refresh the patches from it, apply again: the tree
    holds the edits the series now contains, so the run re-stamps it instead of refusing."""
    from patchkit import refresh_cli

    patches, overlay = synthetic_series
    args = ("--target", upstream_copy, "--patches", patches, "--overlay", overlay)
    assert run(capsys, *args)[0] == 0
    replace_text(upstream_copy / "sglang/version.py", "# ddtree test", "# ddtree test, edited")
    assert refresh_cli.main(["--edited", str(upstream_copy), "--pristine", str(pristine),
                             "--patches", str(patches), "--overlay", str(overlay)]) == 0
    rc, out = run(capsys, *args)
    assert rc == 0, out
    assert "sglang/version.py was edited after applying; the edits are in the series being applied" in out
    assert engine.stamp_verified(upstream_copy, engine.read_stamp(upstream_copy))
    assert load_series(patches, overlay).digest() == engine.read_stamp(upstream_copy)["digest"]


def test_a_relative_python_path_names_the_interpreter_from_here(capsys, monkeypatch):
    """`make apply` passes .venv/bin/python: it is found from the caller's directory (the lookup
    itself runs elsewhere, so that a directory named sglang there is never taken for the package)."""
    monkeypatch.chdir(REPO)
    rc, out = run(capsys, "--python", ".venv/bin/python", "--check")
    assert rc == 0 and "already applied" in out, out
