"""Apply, check and reverse the series on a target tree, all or nothing.

Everything is computed in memory first; the target is written only when every patch applied,
and a failure while writing restores what was already written. A stamp inside the patched
package records what was applied (the patch texts themselves, so that reversing works even
after the repository moved on).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import shutil
import subprocess
import sys

from .series import Series
from .unidiff import HunkFailed, Patch, apply_file_diff, parse_patch

STAMP = "sglang/.ddtree-series.json"


class TargetError(RuntimeError):
    pass


def resolve_target(target: str | None = None, python: str | None = None) -> pathlib.Path:
    """The directory that holds the `sglang` package."""
    if target:
        p = pathlib.Path(target).resolve()
        if (p / "sglang" / "__init__.py").exists():
            return p
        if p.name == "sglang" and (p / "__init__.py").exists():
            return p.parent
        raise TargetError(f"{target}: no sglang package here (expected {p}/sglang/__init__.py)")
    python = python or "python3"
    code = (
        "import importlib.util as u; s = u.find_spec('sglang'); "
        "print(s.submodule_search_locations[0] if s else '')"
    )
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise TargetError(f"could not run {python!r} to locate sglang: {e}") from e
    location = out.stdout.strip()
    if not location:
        raise TargetError(f"{python} cannot import sglang; install sglang first or pass --target DIR")
    return pathlib.Path(location).resolve().parent


@dataclasses.dataclass
class PatchStatus:
    name: str
    state: str  # applied | already applied | FAILED | would apply | reversed
    offsets: list[str] = dataclasses.field(default_factory=list)
    failure: str = ""


@dataclasses.dataclass
class Plan:
    root: pathlib.Path
    files: dict[str, str]  # rel path -> new text for patched upstream files
    overlay_add: list[str]
    overlay_remove: list[str]
    statuses: list[PatchStatus]
    stamp: dict | None  # the stamp to write, None to remove it
    noop: bool = False

    @property
    def ok(self) -> bool:
        return all(s.state != "FAILED" for s in self.statuses)


def read_stamp(root: pathlib.Path) -> dict | None:
    p = root / STAMP
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise TargetError(f"{p} is corrupt ({e}); reinstall sglang or delete the stamp by hand") from e


def _read(root: pathlib.Path, rel: str) -> str:
    p = root / rel
    if not p.exists():
        raise TargetError(f"{p}: file the series patches does not exist in the target")
    return p.read_text()


def _stamped_patches(stamp: dict) -> list[Patch]:
    return [parse_patch(p["name"], p["text"]) for p in stamp["patches"]]


def _run_patches(files: dict[str, str], root, patches, reverse=False) -> list[PatchStatus]:
    """Apply patches to the in-memory `files`; stop at the first failure."""
    statuses = []
    for patch in reversed(patches) if reverse else patches:
        st = PatchStatus(patch.name, "reversed" if reverse else "applied")
        staged = {}
        try:
            for fd in patch.files:
                if fd.path in staged:
                    text = staged[fd.path]
                elif fd.path in files:
                    text = files[fd.path]
                else:
                    text = _read(root, fd.path)
                new, results = apply_file_diff(text, fd, reverse=reverse)
                staged[fd.path] = new
                st.offsets += [f"{fd.path} hunk #{r.index} offset {r.offset:+d}" for r in results if r.offset]
        except HunkFailed as e:
            st.state = "FAILED"
            st.failure = f"file {e.path}, hunk #{e.result.index} {e.result.header}\n{e.result.detail}"
            statuses.append(st)
            return statuses
        files.update(staged)
        statuses.append(st)
    return statuses


def plan_apply(root: pathlib.Path, series: Series, mode: str = "copy") -> Plan:
    stamp = read_stamp(root)
    digest = series.digest(mode)
    if stamp and stamp.get("digest") == digest:
        statuses = [PatchStatus(p.name, "already applied") for p in series.patches]
        return Plan(root, {}, [], [], statuses, stamp, noop=True)
    files: dict[str, str] = {}
    old_overlay: list[str] = []
    statuses: list[PatchStatus] = []
    if stamp:  # a different series is applied: take it off (in memory) first
        undo = _run_patches(files, root, _stamped_patches(stamp), reverse=True)
        if not all(s.state != "FAILED" for s in undo):
            bad = undo[-1]
            raise TargetError(
                f"the series applied earlier (stamp {root / STAMP}) no longer reverses: "
                f"{bad.name} {bad.failure}\nthe target was modified after patching; reinstall sglang"
            )
        old_overlay = [o["path"] for o in stamp.get("overlay", [])]
    for rel in series.overlay_files:
        if rel in series.touched_files():
            raise TargetError(f"{rel} is both an overlay file and patched by the series")
        if (root / rel).exists() and rel not in old_overlay:
            raise TargetError(
                f"overlay file {rel} would overwrite an upstream file in {root}; "
                "the overlay may only add files (edit upstream files with a patch)"
            )
    statuses += _run_patches(files, root, series.patches)
    statuses += [PatchStatus(p.name, "not tried") for p in series.patches[len(statuses):]]
    new_stamp = {
        "digest": digest,
        "mode": mode,
        "upstream_version": series.upstream_version,
        "applied_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "repo": str(series.overlay_root.parent),
        "patches": [{"name": p.name, "text": p.text} for p in series.patches],
        "overlay": [{"path": rel} for rel in series.overlay_files],
        "created_dirs": [],
    }
    remove = [rel for rel in old_overlay if rel not in series.overlay_files]
    return Plan(root, files, list(series.overlay_files), remove, statuses, new_stamp)


def plan_reverse(root: pathlib.Path) -> Plan:
    stamp = read_stamp(root)
    if not stamp:
        return Plan(root, {}, [], [], [], None, noop=True)
    files: dict[str, str] = {}
    statuses = _run_patches(files, root, _stamped_patches(stamp), reverse=True)
    remove = [o["path"] for o in stamp.get("overlay", [])]
    plan = Plan(root, files, [], remove, statuses, None)
    plan.created_dirs = stamp.get("created_dirs", [])  # type: ignore[attr-defined]
    return plan


class _Transaction:
    """Writes files one by one and can put every one of them back."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self.undo: list[tuple[pathlib.Path, bytes | None, bool]] = []  # path, old bytes, was link

    def _remember(self, p: pathlib.Path):
        if p.is_symlink():
            self.undo.append((p, os.readlink(p).encode(), True))
        elif p.exists():
            self.undo.append((p, p.read_bytes(), False))
        else:
            self.undo.append((p, None, False))

    def write(self, p: pathlib.Path, data: bytes):
        self._remember(p)
        mode = p.stat().st_mode if p.exists() and not p.is_symlink() else None
        tmp = p.with_name(p.name + ".ddtree-tmp")
        tmp.write_bytes(data)
        if mode is not None:
            os.chmod(tmp, mode)
        if p.is_symlink():
            p.unlink()
        os.replace(tmp, p)

    def link(self, p: pathlib.Path, to: pathlib.Path):
        self._remember(p)
        if p.exists() or p.is_symlink():
            p.unlink()
        p.symlink_to(to)

    def remove(self, p: pathlib.Path):
        if p.exists() or p.is_symlink():
            self._remember(p)
            p.unlink()

    def rollback(self):
        for p, old, was_link in reversed(self.undo):
            if p.exists() or p.is_symlink():
                p.unlink()
            if old is None:
                continue
            if was_link:
                p.symlink_to(old.decode())
            else:
                p.write_bytes(old)


def execute(plan: Plan, series: Series | None = None, mode: str = "copy") -> None:
    if plan.noop or not plan.ok:
        return
    root = plan.root
    tx = _Transaction(root)
    created: list[str] = []
    try:
        for rel, text in plan.files.items():
            tx.write(root / rel, text.encode())
        for rel in plan.overlay_remove:
            tx.remove(root / rel)
            for pyc in (root / rel).parent.glob(f"__pycache__/{pathlib.Path(rel).stem}.*.pyc"):
                pyc.unlink()
        for rel in plan.overlay_add:
            dst = root / rel
            missing = []
            d = dst.parent
            while not d.exists():
                missing.append(d)
                d = d.parent
            for d in reversed(missing):
                d.mkdir()
                created.append(d.relative_to(root).as_posix())
            src = series.overlay_root.parent / rel
            if mode == "link":
                tx.link(dst, src.resolve())
            else:
                tx.write(dst, src.read_bytes())
        stamp_path = root / STAMP
        if plan.stamp is None:
            tx.remove(stamp_path)
            for rel in sorted(getattr(plan, "created_dirs", []), key=len, reverse=True):
                _remove_dir_if_ours(root / rel)
        else:
            old = read_stamp(root)
            plan.stamp["created_dirs"] = sorted(set((old or {}).get("created_dirs", []) + created))
            tx.write(stamp_path, (json.dumps(plan.stamp, indent=1) + "\n").encode())
    except BaseException:
        tx.rollback()
        for rel in sorted(created, key=len, reverse=True):
            _remove_dir_if_ours(root / rel)
        raise


def _remove_dir_if_ours(d: pathlib.Path):
    """Remove a directory the overlay created, with the bytecode Python left in it."""
    if not d.is_dir():
        return
    pyc = d / "__pycache__"
    if pyc.is_dir() and all(f.suffix == ".pyc" for f in pyc.iterdir()):
        shutil.rmtree(pyc)
    try:
        d.rmdir()
    except OSError:
        print(f"note: left {d} in place: it holds files the overlay did not create", file=sys.stderr)
