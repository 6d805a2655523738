# SPDX-License-Identifier: Apache-2.0
"""Apply, check and reverse the series on a target tree, all or nothing.

Everything is computed in memory first; the target is written only when every patch applied,
and a failure while writing restores what was already written. A stamp inside the patched
package records what was applied (the patch texts themselves, so that reversing works even
after the repository moved on) and the hash of every file it wrote, so that a stamp whose
files were changed afterwards is not trusted. Runs on one target take turns: each holds an
exclusive lock on the target's ``sglang`` directory from planning to the last write.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from .series import Series
from .unidiff import HunkFailed, Patch, apply_file_diff, parse_patch

STAMP = "sglang/.ddtree-series.json"


class TargetError(RuntimeError):
    pass


def resolve_target(target: str | None = None, python: str | None = None) -> pathlib.Path:
    """The directory that holds the `sglang` package."""
    if target:
        p = pathlib.Path(target).resolve()
        if not p.exists():
            raise TargetError(f"{target}: no such directory")
        if not p.is_dir():
            raise TargetError(f"{target}: not a directory (expected the directory holding sglang/)")
        if (p / "sglang" / "__init__.py").exists():
            return p
        if p.name == "sglang" and (p / "__init__.py").exists():
            return p.parent
        raise TargetError(f"{target}: no sglang package here (expected {p}/sglang/__init__.py)")
    python = python or "python3"
    if os.sep in python:  # a path: it names the interpreter from here, not from the directory it runs in
        python = os.path.abspath(python)
    # A regular package only (origin set): a directory named sglang on the interpreter's path,
    # such as this repository's overlay, is a namespace portion and must never be patched.
    code = (
        "import importlib.util as u; s = u.find_spec('sglang'); "
        "print(s.submodule_search_locations[0] if s and s.origin else '')"
    )
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True,
                             cwd=tempfile.gettempdir())
    except (OSError, subprocess.CalledProcessError) as e:
        raise TargetError(f"could not run {python!r} to locate sglang: {e}") from e
    location = out.stdout.strip()
    if not location:
        raise TargetError(f"{python} cannot import sglang; install sglang first or pass --target DIR")
    return pathlib.Path(location).resolve().parent


@contextlib.contextmanager
def locked(root: pathlib.Path, exclusive: bool = True):
    """Hold a lock on the target's sglang/ directory: runs on one target take turns.

    A second apply on the same target waits for the first and then finds its stamp. The lock is
    flock(2) on the directory itself, so no lock file is left in the target; it goes with the
    process, however that ends.
    """
    fd = os.open(root / "sglang", os.O_RDONLY | os.O_DIRECTORY)
    try:
        op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another run of the patch tools on {root} to finish ...", file=sys.stderr)
            fcntl.flock(fd, op)
        yield
    finally:
        os.close(fd)  # releases the lock


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
    notes: list[str] = dataclasses.field(default_factory=list)  # what the plan found and did about it

    @property
    def ok(self) -> bool:
        return all(s.state != "FAILED" for s in self.statuses)


def read_stamp(root: pathlib.Path) -> dict | None:
    p = root / STAMP
    if not p.exists():
        return None
    try:
        stamp = json.loads(p.read_bytes().decode("utf-8"))
        if not isinstance(stamp, dict) or not isinstance(stamp.get("patches"), list):
            raise ValueError("not a stamp written by apply_patches.sh")
        return stamp
    except ValueError as e:  # JSON errors and undecodable bytes alike
        raise TargetError(f"{p} is corrupt ({e}); reinstall sglang or delete the stamp by hand") from e


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _sha256_file(p: pathlib.Path) -> str | None:
    try:
        return hashlib.sha256(p.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def _read(root: pathlib.Path, rel: str) -> str:
    p = root / rel
    if not p.exists():
        raise TargetError(f"{p}: file the series patches does not exist in the target")
    try:
        return p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise TargetError(f"{p}: not UTF-8 text ({e}); the target is not an sglang source tree") from e


def file_states(root: pathlib.Path, stamp: dict) -> dict[str, str]:
    """What each file the stamp records looks like now: applied | pristine | changed | missing.

    Stamps written before the tools recorded hashes have no "files": every state is unknown
    then, and the caller re-derives the files from the stamped patches instead of trusting it.
    """
    states = {}
    for rel, rec in stamp.get("files", {}).items():
        p = root / rel
        if "link" in rec:
            ok = p.is_symlink() and os.readlink(p) == rec["link"]
            states[rel] = "applied" if ok else ("missing" if not (p.exists() or p.is_symlink()) else "changed")
            continue
        digest = None if p.is_symlink() else _sha256_file(p)
        if digest is None:
            states[rel] = "missing"
        elif digest == rec.get("applied"):
            states[rel] = "applied"
        elif digest == rec.get("pristine"):
            states[rel] = "pristine"
        else:
            states[rel] = "changed"
    return states


def _stamped_patches(stamp: dict) -> list[Patch]:
    return [parse_patch(p["name"], p["text"]) for p in stamp["patches"]]


def _run_patches(files: dict[str, str], root, patches, reverse=False) -> list[PatchStatus]:
    """Apply patches to the in-memory `files`; stop at the first failure."""
    statuses = []
    for patch in reversed(patches) if reverse else patches:
        st = PatchStatus(patch.name, "reversed" if reverse else "applied")
        staged = {}
        for fd in patch.files:
            if fd.path in staged:
                text = staged[fd.path]
            elif fd.path in files:
                text = files[fd.path]
            else:
                text = _read(root, fd.path)
            try:
                new, results = apply_file_diff(text, fd, reverse=reverse)
            except HunkFailed as e:
                st.state = "FAILED"
                st.failure = f"file {e.path}, hunk #{e.result.index} {e.result.header}\n{e.result.detail}"
                if not reverse and _applies(text, fd, reverse=True):
                    st.failure += (f"\n{fd.path} already holds this patch's changes, but no stamp records them "
                                   "(edited by hand, or patched by another tool): reinstall sglang")
                statuses.append(st)
                return statuses
            staged[fd.path] = new
            st.offsets += [f"{fd.path} hunk #{r.index} offset {r.offset:+d}" for r in results if r.offset]
        files.update(staged)
        statuses.append(st)
    return statuses


def _applies(text: str, fd, reverse: bool) -> bool:
    try:
        apply_file_diff(text, fd, reverse=reverse)
        return True
    except HunkFailed:
        return False


def _reverse_file(text: str, rel: str, patches: list[Patch]) -> str | None:
    """`text` with every hunk the patches make to `rel` taken off (last patch first), or None."""
    for patch in reversed(patches):
        for fd in reversed(patch.files):
            if fd.path != rel:
                continue
            try:
                text, _ = apply_file_diff(text, fd, reverse=True)
            except HunkFailed:
                return None
    return text


def _undo_stamped(root: pathlib.Path, stamp: dict, files: dict[str, str], notes: list[str],
                  also: list[Patch] = ()) -> None:
    """Put the pristine text of every file the stamped series patched into `files`.

    The stamp's hashes say what each file holds: "applied" files are reversed in memory, files
    that are pristine already (a run cut short, or two runs that overlapped before the tools took
    a lock) are taken as they are. A file changed after patching is accepted only if taking off
    the stamped series, or the series about to be applied (`also`: an edited tree whose edits
    were refreshed into the patches), gives back exactly the pristine bytes the stamp recorded;
    anything else can only be repaired by reinstalling sglang. Stamps without hashes (written by
    older tools) are reversed as they say.
    """
    patches = _stamped_patches(stamp)
    touched = list(dict.fromkeys(fd.path for p in patches for fd in p.files))
    recs = stamp.get("files")
    states = file_states(root, stamp)
    bad, pristine_now = [], []
    for rel in touched:
        if recs is None:
            text = _reverse_file(_read(root, rel), rel, patches)
            if text is None:
                bad.append(f"{rel} (the stamped patches do not come off it)")
                continue
            files[rel] = text
            continue
        rec, state = recs.get(rel, {}), states.get(rel, "missing")
        if state == "missing":
            bad.append(f"{rel} (missing)")
            continue
        current = _read(root, rel)
        if state == "pristine":
            files[rel] = current
            pristine_now.append(rel)
            continue
        for source in (patches, list(also)):
            text = _reverse_file(current, rel, source)
            if text is not None and sha256_text(text) == rec.get("pristine"):
                files[rel] = text
                if state == "changed":
                    notes.append(f"{rel} was edited after applying; the edits are in the series being applied")
                break
        else:
            bad.append(f"{rel} ({'changed after the series was applied' if state == 'changed' else 'does not reverse'})")
    if pristine_now:
        notes.append("the stamp says applied, but these files are pristine (an interrupted or overlapping run): "
                     + ", ".join(pristine_now))
    if bad:
        raise TargetError(
            f"the target does not match the series recorded in {root / STAMP}: " + "; ".join(bad)
            + "\nreinstall sglang (pip install --force-reinstall --no-deps sglang==<version>) and apply again"
        )


def stamp_verified(root: pathlib.Path, stamp: dict) -> bool:
    """The stamp records hashes and every file it records still has the bytes it wrote."""
    return "files" in stamp and all(st == "applied" for st in file_states(root, stamp).values())


def plan_apply(root: pathlib.Path, series: Series, mode: str = "copy") -> Plan:
    stamp = read_stamp(root)
    digest = series.digest(mode)
    notes: list[str] = []
    if stamp and stamp.get("digest") == digest:
        if stamp_verified(root, stamp):
            statuses = [PatchStatus(p.name, "already applied") for p in series.patches]
            return Plan(root, {}, [], [], statuses, stamp, noop=True)
        notes.append("the stamp records this series, but "
                     + ("it has no file hashes to check it by" if "files" not in stamp
                        else "the files do not match it") + ": applying again")
    files: dict[str, str] = {}
    old_overlay: list[str] = []
    statuses: list[PatchStatus] = []
    if stamp:  # a series is recorded: take it off (in memory) first
        _undo_stamped(root, stamp, files, notes, also=series.patches)
        old_overlay = [o["path"] for o in stamp.get("overlay", [])]
    for rel in series.overlay_files:
        if rel in series.touched_files():
            raise TargetError(f"{rel} is both an overlay file and patched by the series")
        if (root / rel).exists() and rel not in old_overlay:
            if not stamp and (root / rel).read_bytes() == (series.overlay_root.parent / rel).read_bytes():
                raise TargetError(
                    f"overlay file {rel} is already in {root}, but no stamp records a series "
                    f"({root / STAMP} was deleted, or another tool installed the files): "
                    "reinstall sglang (pip install --force-reinstall --no-deps sglang==<version>) and apply again"
                )
            raise TargetError(
                f"overlay file {rel} would overwrite an upstream file in {root}; "
                "the overlay may only add files (edit upstream files with a patch)"
            )
    pristine = {rel: files[rel] if rel in files else _read(root, rel) for rel in series.touched_files()}
    statuses += _run_patches(files, root, series.patches)
    statuses += [PatchStatus(p.name, "not tried") for p in series.patches[len(statuses):]]
    hashes: dict[str, dict] = {
        rel: {"pristine": sha256_text(text), "applied": sha256_text(files.get(rel, text))}
        for rel, text in pristine.items()
    }
    for rel in series.overlay_files:
        src = series.overlay_root.parent / rel
        hashes[rel] = ({"link": str(src.resolve())} if mode == "link"
                       else {"applied": hashlib.sha256(src.read_bytes()).hexdigest()})
    new_stamp = {
        "digest": digest,
        "mode": mode,
        "upstream_version": series.upstream_version,
        "applied_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "repo": str(series.overlay_root.parent),
        "patches": [{"name": p.name, "text": p.text} for p in series.patches],
        "overlay": [{"path": rel} for rel in series.overlay_files],
        "files": hashes,
        "created_dirs": [],
    }
    remove = [rel for rel in old_overlay if rel not in series.overlay_files]
    return Plan(root, files, list(series.overlay_files), remove, statuses, new_stamp, notes=notes)


def plan_reverse(root: pathlib.Path) -> Plan:
    stamp = read_stamp(root)
    if not stamp:
        return Plan(root, {}, [], [], [], None, noop=True)
    files: dict[str, str] = {}
    notes: list[str] = []
    _undo_stamped(root, stamp, files, notes)
    statuses = [PatchStatus(p["name"], "reversed") for p in reversed(stamp["patches"])]
    remove = [o["path"] for o in stamp.get("overlay", [])]
    plan = Plan(root, files, [], remove, statuses, None, notes=notes)
    plan.created_dirs = stamp.get("created_dirs", [])  # type: ignore[attr-defined]
    return plan


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


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
        mode = p.stat().st_mode if p.exists() and not p.is_symlink() else 0o666 & ~_UMASK
        # A name of its own: a fixed one would let two writers share (and delete) one temp file.
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".ddtree-tmp", dir=p.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, mode & 0o7777)
            if p.is_symlink():
                p.unlink()
            os.replace(tmp, p)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

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
