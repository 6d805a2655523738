# SPDX-License-Identifier: Apache-2.0
"""refresh_patches.sh, bump_upstream.sh and the hash-checked fetch, on real upstream files."""

import zipfile

import pytest
from conftest import replace_text
from test_apply import synthetic

from patchkit import apply_cli, bump_cli, fetch, refresh_cli
from patchkit.series import read_lock


def apply(capsys, patches, overlay, target):
    rc = apply_cli.main([str(a) for a in synthetic(patches, overlay, target)])
    capsys.readouterr()
    assert rc == 0


def refresh(capsys, patches, overlay, edited, pristine, *extra):
    rc = refresh_cli.main(["--edited", str(edited), "--pristine", str(pristine),
                           "--patches", str(patches), "--overlay", str(overlay), *extra])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_refresh_unchanged_tree_changes_nothing(capsys, upstream_copy, synthetic_series, pristine):
    patches, overlay = synthetic_series
    apply(capsys, patches, overlay, upstream_copy)
    before = {p.name: p.read_bytes() for p in patches.iterdir()}
    rc, out = refresh(capsys, patches, overlay, upstream_copy, pristine)
    assert rc == 0 and "0 of 2 patches changed" in out
    assert {p.name: p.read_bytes() for p in patches.iterdir()} == before


def test_refresh_takes_edits_and_keeps_header(capsys, upstream_copy, synthetic_series, pristine, tmp_path):
    patches, overlay = synthetic_series
    apply(capsys, patches, overlay, upstream_copy)
    edited_file = upstream_copy / "sglang/version.py"
    replace_text(edited_file, "# ddtree test", "# ddtree test, refreshed")
    rc, out = refresh(capsys, patches, overlay, upstream_copy, pristine)
    assert rc == 0 and "1 of 2 patches changed" in out
    text = (patches / "0001-version-note.patch").read_text()
    assert text.startswith("Description: test patch\nAuthor: test\nForwarded: no\nLast-Update: ")
    assert "+            __version__ = \"0.0.0.dev0\"  # ddtree test, refreshed" in text
    # the refreshed series reproduces the edited tree on a fresh pristine copy
    import os, shutil
    fresh = tmp_path / "fresh"
    shutil.copytree(pristine / "sglang", fresh / "sglang", copy_function=os.link,
                    ignore=shutil.ignore_patterns("__pycache__"))
    apply(capsys, patches, overlay, fresh)
    assert (fresh / "sglang/version.py").read_text() == edited_file.read_text()
    # and refreshing again is a no-op, byte for byte
    again = {p.name: p.read_bytes() for p in patches.iterdir()}
    assert refresh(capsys, patches, overlay, upstream_copy, pristine)[0] == 0
    assert {p.name: p.read_bytes() for p in patches.iterdir()} == again


def test_refresh_unowned_edit_needs_a_new_patch(capsys, upstream_copy, synthetic_series, pristine):
    patches, overlay = synthetic_series
    apply(capsys, patches, overlay, upstream_copy)
    replace_text(upstream_copy / "sglang/srt/speculative/spec_registry.py", "\n", "\n# new hook\n")
    rc, out = refresh(capsys, patches, overlay, upstream_copy, pristine)
    assert rc == 2 and "sglang/srt/speculative/spec_registry.py" in out and "--new" in out
    rc, out = refresh(capsys, patches, overlay, upstream_copy, pristine,
                      "--new", "0003-hook.patch", "--description", "Add a hook")
    assert rc == 0 and "created" in out
    assert (patches / "series").read_text().splitlines()[-1] == "0003-hook.patch"
    assert (patches / "0003-hook.patch").read_text().startswith("Description: Add a hook\n")


def test_bump_report_classifies_each_patch(capsys, upstream_copy, synthetic_series, tmp_path):
    patches, overlay = synthetic_series
    # a "new release": lines inserted above patch 0001's hunk, patch 0002's context changed
    replace_text(upstream_copy / "sglang/version.py", "try:\n", "# moved down\n# by two lines\ntry:\n")
    replace_text(upstream_copy / "sglang/srt/speculative/spec_info.py", "from enum import", "from enum  import")
    report = tmp_path / "report.md"
    rc = bump_cli.main(["9.9.9", "--tree", str(upstream_copy), "--report", str(report),
                        "--patches", str(patches), "--overlay", str(overlay)])
    out = capsys.readouterr().out
    assert rc == 1 and "FAILS" in out
    md = report.read_text()
    assert "| `0001-version-note.patch` | applies with offset |" in md
    assert "hunk #1 offset +2" in md
    assert "| `0002-lang-init-note.patch` | fails |" in md
    assert "from enum  import" in md  # the report shows what was found instead
    assert "1 of 2 patches apply; 1 fail" in md


def test_bump_clean_tree(capsys, upstream_copy, synthetic_series, tmp_path):
    patches, overlay = synthetic_series
    report = tmp_path / "r.md"
    rc = bump_cli.main(["0.5.17", "--tree", str(upstream_copy), "--report", str(report),
                        "--patches", str(patches), "--overlay", str(overlay)])
    assert rc == 0 and "2 of 2 patches apply" in report.read_text()
    assert "| `0001-version-note.patch` | clean |" in report.read_text()


def test_bump_reports_overlay_collision(capsys, upstream_copy, synthetic_series, tmp_path):
    patches, overlay = synthetic_series
    (upstream_copy / "sglang/srt/ddtree_probe").mkdir()
    (upstream_copy / "sglang/srt/ddtree_probe/__init__.py").write_text("upstream now has it\n")
    rc = bump_cli.main(["9.9.9", "--tree", str(upstream_copy), "--report", str(tmp_path / "r.md"),
                        "--patches", str(patches), "--overlay", str(overlay)])
    assert rc == 1 and "sglang/srt/ddtree_probe/__init__.py" in (tmp_path / "r.md").read_text()


def test_fetch_refuses_a_wheel_with_the_wrong_hash(tmp_path):
    lock = read_lock()
    name = next(iter(lock["sha256"]))
    fake = tmp_path / name
    with zipfile.ZipFile(fake, "w") as z:
        z.writestr("sglang/__init__.py", "tampered = True\n")
    with pytest.raises(fetch.FetchError, match="does not match the recorded"):
        fetch.verify(fake, lock["sha256"])
    with pytest.raises(fetch.FetchError, match="no recorded sha256"):
        fetch.verify(tmp_path / "sglang-0.0.1-py3-none-any.whl", lock["sha256"])


def test_pristine_tree_is_the_locked_wheel(pristine):
    lock = read_lock()
    digest = (pristine / ".wheel-sha256").read_text().strip()
    assert digest in lock["sha256"].values()
    assert lock["version"] == "0.5.17" and lock["pins"]["torch"] == "2.11.0"


def test_refresh_rewrites_a_patch_that_needs_an_offset(capsys, upstream_copy, synthetic_series, pristine):
    import re

    patches, overlay = synthetic_series
    p1 = patches / "0001-version-note.patch"
    shifted = re.sub(r"@@ -(\d+),(\d+) \+(\d+),(\d+) @@",
                     lambda m: f"@@ -{int(m[1]) - 5},{m[2]} +{int(m[3]) - 5},{m[4]} @@", p1.read_text())
    p1.write_text(shifted)
    apply(capsys, patches, overlay, upstream_copy)
    rc, out = refresh(capsys, patches, overlay, upstream_copy, pristine)
    assert rc == 0 and "1 of 2 patches changed" in out
    assert p1.read_text() != shifted
    rc = apply_cli.main(["--target", str(pristine), "--check", "--patches", str(patches), "--overlay", str(overlay)])
    assert rc == 0 and "offset" not in capsys.readouterr().out


def test_bump_names_the_file_a_hunk_moved_to(capsys, upstream_copy, tmp_path):
    """Upstream moves code between files (0.5.20 moved the backend defaults out of server_args.py
    into srt/arg_groups/). Here the method patch 0010 hooks into is cut out of server_args.py and
    pasted, re-indented as a function, into a new module: the report names that module for the
    failing hunk instead of pointing at an unrelated line of server_args.py."""
    import re

    server_args = upstream_copy / "sglang/srt/server_args.py"
    text = server_args.read_text()
    start = text.index("    def _handle_attention_backend_compatibility(self):")
    end = start + re.search(r"\n    def ", text[start + 10:]).start() + 10 + 1
    method = text[start:end]
    assert "run_post_process_pass(self, _attention_backend_default)" in method
    server_args.unlink()
    server_args.write_text(text[:start] + "    def _handle_attention_backend_compatibility(self):\n"
                           "        handle_attention_backend_compatibility(self)\n\n" + text[end:])
    moved = "\n".join(line[4:] for line in method.replace("(self):", "(args):", 1).splitlines())
    (upstream_copy / "sglang/srt/arg_groups/attention_compat.py").write_text(moved + "\n")
    report = tmp_path / "report.md"
    rc = bump_cli.main(["9.9.9", "--tree", str(upstream_copy), "--report", str(report)])
    out = capsys.readouterr().out
    assert rc == 1
    md = report.read_text()
    assert "| `0010-sm12x-attention-backend-gate.patch` | fails |" in md
    section = md.split("### `0010-sm12x-attention-backend-gate.patch`")[1].split("###")[0]
    assert "the context of this hunk is in `sglang/srt/arg_groups/attention_compat.py` near line" in section
    assert "no similar block exists in the file" in section  # no unrelated near miss in server_args.py
    assert "moved: the context of this hunk is in `sglang/srt/arg_groups/attention_compat.py`" in out
    # every other patch is untouched by the move
    assert md.count("| fails |") == 1


def test_a_hunk_changed_in_place_is_not_called_moved(capsys, upstream_copy, synthetic_series, tmp_path):
    patches, overlay = synthetic_series
    replace_text(upstream_copy / "sglang/srt/speculative/spec_info.py", "from enum import", "from enum  import")
    report = tmp_path / "report.md"
    assert bump_cli.main(["9.9.9", "--tree", str(upstream_copy), "--report", str(report),
                          "--patches", str(patches), "--overlay", str(overlay)]) == 1
    assert "moved:" not in report.read_text() and "nearest match" in report.read_text()
