# SPDX-License-Identifier: Apache-2.0
import hashlib
import os
import pathlib
import shutil

import pytest

from patchkit.series import read_lock

REPO = pathlib.Path(__file__).resolve().parents[3]

PRISTINE = REPO / ".cache" / "upstream" / f"sglang-{read_lock()['version']}"


def tree_digest(root: pathlib.Path) -> str:
    """Hash of every file (path, bytes, link target) under root/sglang, bytecode excluded."""
    h = hashlib.sha256()
    base = root / "sglang"
    for p in sorted(base.rglob("*")):
        if "__pycache__" in p.parts:
            continue
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            h.update(f"L {rel} {os.readlink(p)}\n".encode())
        elif p.is_file():
            h.update(f"F {rel}\n".encode())
            h.update(p.read_bytes())
        elif p.is_dir():
            h.update(f"D {rel}\n".encode())
    return h.hexdigest()


def replace_text(path: pathlib.Path, old: str, new: str) -> None:
    """Edit a file of a hard-linked copy without writing through to the pristine cache."""
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.unlink()
    path.write_text(text.replace(old, new, 1))


@pytest.fixture(scope="session")
def pristine() -> pathlib.Path:
    if not (PRISTINE / "sglang" / "__init__.py").exists():
        pytest.fail(f"pristine upstream tree missing at {PRISTINE}: run 'make setup'")
    return PRISTINE


@pytest.fixture
def upstream_copy(pristine, tmp_path) -> pathlib.Path:
    """A hard-linked copy of the pristine tree (the tooling only ever replaces files)."""
    dst = tmp_path / "site"
    shutil.copytree(pristine / "sglang", dst / "sglang", copy_function=os.link,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return dst


HEADER = (
    "Description: {desc}\nAuthor: test\nForwarded: no\nLast-Update: 2026-11-29\n"
    "Upstream-Version: 0.5.17\n---\n"
)


@pytest.fixture
def synthetic_series(tmp_path, pristine):
    """A two-patch series on real upstream files, plus a one-file overlay."""
    import difflib

    def make(name, rel, old, new, desc="test patch"):
        before = (pristine / rel).read_text()
        assert old in before
        after = before.replace(old, new, 1)
        body = "".join(difflib.unified_diff(
            before.splitlines(True), after.splitlines(True), f"a/{rel}", f"b/{rel}"))
        return name, HEADER.format(desc=desc) + body

    patches = tmp_path / "patches"
    patches.mkdir()
    items = [
        make("0001-version-note.patch", "sglang/version.py",
             '            __version__ = "0.0.0.dev0"\n',
             '            __version__ = "0.0.0.dev0"  # ddtree test\n'),
        make("0002-lang-init-note.patch", "sglang/srt/speculative/spec_info.py",
             "from enum import", "# ddtree test\nfrom enum import"),
    ]
    for name, text in items:
        (patches / name).write_text(text)
    (patches / "series").write_text("# test series\n" + "".join(n + "\n" for n, _ in items))
    overlay = tmp_path / "overlay" / "sglang"
    (overlay / "srt" / "ddtree_probe").mkdir(parents=True)
    (overlay / "srt" / "ddtree_probe" / "__init__.py").write_text("PROBE = 1\n")
    return patches, overlay
