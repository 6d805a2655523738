# SPDX-License-Identifier: Apache-2.0
"""The repository's own series against the pristine pinned upstream, and the patched venv."""

import json
import subprocess
import sys

from conftest import REPO, tree_digest

from patchkit import apply_cli, engine
from patchkit.series import HEADER_FIELDS, load_series, read_lock


def test_series_applies_with_zero_fuzz_and_no_offset(capsys, upstream_copy):
    series = load_series()
    assert series.patches, "the series is empty"
    rc = apply_cli.main(["--target", str(upstream_copy)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "offset" not in out, f"a hunk needed an offset against pristine {read_lock()['version']}:\n{out}"
    for p in series.patches:
        assert p.header_field("Upstream-Version") == read_lock()["version"], p.name
        for field in HEADER_FIELDS:
            assert p.header_field(field), f"{p.name} lacks {field}"
    before_reverse = tree_digest(upstream_copy)
    assert apply_cli.main(["--target", str(upstream_copy), "--reverse"]) == 0
    assert tree_digest(upstream_copy) != before_reverse


def test_reverse_of_real_series_is_byte_exact(capsys, upstream_copy):
    before = tree_digest(upstream_copy)
    assert apply_cli.main(["--target", str(upstream_copy)]) == 0
    assert apply_cli.main(["--target", str(upstream_copy), "--reverse"]) == 0
    assert tree_digest(upstream_copy) == before


def test_every_patch_edits_existing_files_only_and_is_small():
    for p in load_series().patches:
        changed = sum(1 for fd in p.files for h in fd.hunks for l in h.lines if l[0] in "+-")
        assert changed <= 120, f"{p.name} changes {changed} lines: move logic into the overlay"


def _installed_root():
    return engine.resolve_target(python=sys.executable)


def test_venv_carries_the_current_series():
    stamp = engine.read_stamp(_installed_root())
    assert stamp is not None, "the venv's sglang is not patched: run 'make apply'"
    assert stamp["digest"] == load_series().digest(stamp["mode"]), "stale patches in the venv: run 'make apply'"


def test_patched_and_overlay_modules_import():
    """Every module the series edits, and every overlay module, imports in a fresh interpreter."""
    series = load_series()
    modules = sorted({
        rel[:-3].replace("/", ".").removesuffix(".__init__")
        for rel in series.touched_files() + series.overlay_files if rel.endswith(".py")
    })
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\nprint('ok')"
    proc = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True,
                          cwd=REPO / "tests", timeout=600)
    assert proc.returncode == 0, f"import failed:\n{proc.stderr[-4000:]}"
    assert proc.stdout.strip().endswith("ok")
