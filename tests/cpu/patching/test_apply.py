# SPDX-License-Identifier: Apache-2.0
"""scripts/apply_patches.sh behaviour on real upstream 0.5.17 files."""

import json
import os
import pathlib

import pytest
from conftest import REPO, replace_text, tree_digest

from patchkit import apply_cli, engine


def run(capsys, *args):
    rc = apply_cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out + out.err


def status_of(out, name):
    """The state column of the line apply_patches.sh prints for one patch."""
    for line in out.splitlines():
        if line.strip().endswith(name):
            return line.strip()[: -len(name)].strip()
    return None


def synthetic(patches, overlay, target, *extra):
    return ("--target", target, "--patches", patches, "--overlay", overlay, *extra)


def test_applies_and_records_stamp(capsys, upstream_copy, synthetic_series, pristine):
    patches, overlay = synthetic_series
    rc, out = run(capsys, *synthetic(patches, overlay, upstream_copy))
    assert rc == 0, out
    assert status_of(out, "0001-version-note.patch") == "applied"
    assert status_of(out, "0002-lang-init-note.patch") == "applied"
    assert "# ddtree test" in (upstream_copy / "sglang/version.py").read_text()
    assert (upstream_copy / "sglang/srt/ddtree_probe/__init__.py").read_text() == "PROBE = 1\n"
    stamp = json.loads((upstream_copy / engine.STAMP).read_text())
    assert [p["name"] for p in stamp["patches"]] == ["0001-version-note.patch", "0002-lang-init-note.patch"]
    assert stamp["created_dirs"] == ["sglang/srt/ddtree_probe"]
    # the pristine cache behind the hard links is untouched
    assert "# ddtree test" not in (pristine / "sglang/version.py").read_text()


def test_check_changes_nothing(capsys, upstream_copy, synthetic_series):
    patches, overlay = synthetic_series
    before = tree_digest(upstream_copy)
    rc, out = run(capsys, *synthetic(patches, overlay, upstream_copy, "--check"))
    assert rc == 0 and "would apply" in out and "dry run" in out
    assert tree_digest(upstream_copy) == before


def test_reverse_restores_byte_for_byte(capsys, upstream_copy, synthetic_series):
    patches, overlay = synthetic_series
    before = tree_digest(upstream_copy)
    assert run(capsys, *synthetic(patches, overlay, upstream_copy))[0] == 0
    assert tree_digest(upstream_copy) != before
    # bytecode left behind by importing an overlay module must not survive the reverse
    (upstream_copy / "sglang/srt/ddtree_probe/__pycache__").mkdir()
    (upstream_copy / "sglang/srt/ddtree_probe/__pycache__/__init__.cpython-311.pyc").write_bytes(b"x")
    rc, out = run(capsys, "--target", upstream_copy, "--reverse")
    assert rc == 0, out
    assert tree_digest(upstream_copy) == before
    assert not (upstream_copy / "sglang/srt/ddtree_probe").exists()
    rc, out = run(capsys, "--target", upstream_copy, "--reverse")
    assert rc == 0 and "nothing to reverse" in out


def test_idempotent(capsys, upstream_copy, synthetic_series):
    patches, overlay = synthetic_series
    assert run(capsys, *synthetic(patches, overlay, upstream_copy))[0] == 0
    mtimes = {p: p.stat().st_mtime_ns for p in (upstream_copy / "sglang").rglob("*.py")}
    digest = tree_digest(upstream_copy)
    rc, out = run(capsys, *synthetic(patches, overlay, upstream_copy))
    assert rc == 0
    assert status_of(out, "0001-version-note.patch") == "already applied"
    assert status_of(out, "0002-lang-init-note.patch") == "already applied"
    assert "nothing to do" in out
    assert tree_digest(upstream_copy) == digest
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes


def test_broken_patch_leaves_target_untouched(capsys, upstream_copy, synthetic_series):
    patches, overlay = synthetic_series
    p2 = patches / "0002-lang-init-note.patch"
    p2.write_text(p2.read_text().replace(" from enum import", " from enum import nothing", 1)
                  .replace("-from enum import", "-from enum import nothing", 1))
    before = tree_digest(upstream_copy)
    rc, out = run(capsys, *synthetic(patches, overlay, upstream_copy))
    assert rc == 1
    assert status_of(out, "0001-version-note.patch") == "applied"  # in memory only
    assert status_of(out, "0002-lang-init-note.patch") == "FAILED"
    assert "file sglang/srt/speculative/spec_info.py, hunk #1" in out
    assert "expected these" in out and "nothing was changed" in out
    assert tree_digest(upstream_copy) == before  # patch 0001 and the overlay were not written either


def test_modified_upstream_file_fails_clearly(capsys, upstream_copy, synthetic_series):
    patches, overlay = synthetic_series
    replace_text(upstream_copy / "sglang/version.py", "# Fallback for development without build",
                 "# Fallback for dev builds")
    before = tree_digest(upstream_copy)
    rc, out = run(capsys, *synthetic(patches, overlay, upstream_copy))
    assert rc == 1
    assert status_of(out, "0001-version-note.patch") == "FAILED" and "sglang/version.py" in out
    assert "nearest match" in out and "found" in out and "# Fallback for dev builds" in out
    assert status_of(out, "0002-lang-init-note.patch") == "not tried"  # listed, not dropped
    assert tree_digest(upstream_copy) == before


def test_write_failure_rolls_back(capsys, upstream_copy, synthetic_series, monkeypatch):
    patches, overlay = synthetic_series
    before = tree_digest(upstream_copy)
    real_write = engine._Transaction.write
    calls = []

    def failing_write(self, p, data):
        calls.append(p)
        if len(calls) == 3:
            raise OSError("disk full (injected)")
        return real_write(self, p, data)

    monkeypatch.setattr(engine._Transaction, "write", failing_write)
    with pytest.raises(OSError, match="injected"):
        apply_cli.main([str(a) for a in synthetic(patches, overlay, upstream_copy)])
    assert len(calls) == 3
    assert tree_digest(upstream_copy) == before


def test_changed_series_is_swapped_in(capsys, upstream_copy, synthetic_series, pristine):
    patches, overlay = synthetic_series
    assert run(capsys, *synthetic(patches, overlay, upstream_copy))[0] == 0
    # drop patch 0002 and rename the overlay file: re-applying must leave only the new state
    (patches / "0002-lang-init-note.patch").unlink()
    (patches / "series").write_text("0001-version-note.patch\n")
    (overlay / "srt/ddtree_probe/__init__.py").rename(overlay / "srt/ddtree_probe/probe.py")
    rc, out = run(capsys, *synthetic(patches, overlay, upstream_copy))
    assert rc == 0, out
    spec = upstream_copy / "sglang/srt/speculative/spec_info.py"
    assert spec.read_bytes() == (pristine / "sglang/srt/speculative/spec_info.py").read_bytes()
    assert not (upstream_copy / "sglang/srt/ddtree_probe/__init__.py").exists()
    assert (upstream_copy / "sglang/srt/ddtree_probe/probe.py").exists()
    assert run(capsys, "--target", upstream_copy, "--reverse")[0] == 0
    assert not (upstream_copy / "sglang/srt/ddtree_probe").exists()


def test_link_mode(capsys, upstream_copy, synthetic_series):
    patches, overlay = synthetic_series
    rc, out = run(capsys, *synthetic(patches, overlay, upstream_copy, "--link"))
    assert rc == 0 and "(link)" in out
    dst = upstream_copy / "sglang/srt/ddtree_probe/__init__.py"
    assert dst.is_symlink() and pathlib.Path(os.readlink(dst)) == (overlay / "srt/ddtree_probe/__init__.py").resolve()
    assert run(capsys, "--target", upstream_copy, "--reverse")[0] == 0
    assert not dst.exists() and not dst.is_symlink()


def test_overlay_may_not_shadow_upstream(capsys, upstream_copy, synthetic_series):
    patches, overlay = synthetic_series
    (overlay / "srt" / "server_args.py").write_text("x = 1\n")
    before = tree_digest(upstream_copy)
    rc, out = run(capsys, *synthetic(patches, overlay, upstream_copy))
    assert rc == 2 and "would overwrite an upstream file" in out and "sglang/srt/server_args.py" in out
    assert tree_digest(upstream_copy) == before


def test_patch_without_header_is_refused(capsys, upstream_copy, synthetic_series):
    patches, overlay = synthetic_series
    p1 = patches / "0001-version-note.patch"
    p1.write_text(p1.read_text().replace("Forwarded: no\n", ""))
    rc, out = run(capsys, *synthetic(patches, overlay, upstream_copy))
    assert rc == 2 and "header lacks Forwarded" in out


def test_unlisted_patch_is_refused(capsys, upstream_copy, synthetic_series):
    patches, overlay = synthetic_series
    (patches / "0003-stray.patch").write_text("x")
    rc, out = run(capsys, *synthetic(patches, overlay, upstream_copy))
    assert rc == 2 and "not listed" in out and "0003-stray.patch" in out


def test_target_without_sglang(capsys, tmp_path):
    rc, out = run(capsys, "--target", tmp_path)
    assert rc == 2 and "no sglang package here" in out


def test_shell_wrapper_runs(upstream_copy, synthetic_series):
    import subprocess

    patches, overlay = synthetic_series
    proc = subprocess.run(
        ["bash", str(REPO / "scripts/apply_patches.sh"), *map(str, synthetic(patches, overlay, upstream_copy, "--check"))],
        capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "would apply" in proc.stdout
