# SPDX-License-Identifier: Apache-2.0
"""scripts/refresh_patches.sh: rewrite the patch files from an edited, patched sglang tree.

Workflow: apply the series, edit the patched upstream files in place, refresh. Each file's
edits go to the last patch in the series that touches that file (quilt's "top patch" rule);
edits to files no patch touches go to a new patch named with --new. A patch whose content
did not change keeps its exact bytes, so refreshing an unchanged tree changes nothing.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys

from .engine import TargetError, locked, read_stamp, resolve_target
from .series import HEADER_FIELDS, REPO, SeriesError, load_series, read_lock
from .unidiff import HunkFailed, PatchFormatError, apply_file_diff, make_file_diff, parse_patch


def _read_text(p: pathlib.Path) -> str:
    try:
        return p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise TargetError(f"{p}: not UTF-8 text ({e})") from e


def _split_header(text: str) -> tuple[str, str]:
    idx = text.find("\n--- ")
    if text.startswith("--- "):
        return "", text
    return (text[: idx + 1], text[idx + 1 :]) if idx >= 0 else (text, "")


def _set_last_update(header: str) -> str:
    today = datetime.date.today().isoformat()
    out = []
    for line in header.splitlines(keepends=True):
        out.append(f"Last-Update: {today}\n" if line.lower().startswith("last-update:") else line)
    return "".join(out)


def _diff_text_for(patch_text: str, path: str) -> str:
    """The exact bytes of one file's section inside an existing patch."""
    _, body = _split_header(patch_text)
    sections, current, cur_path = {}, [], None
    for line in body.splitlines(keepends=True):
        if line.startswith("--- "):
            if cur_path:
                sections[cur_path] = "".join(current)
            cur_path = line[4:].split("\t")[0].strip()
            cur_path = cur_path[2:] if cur_path.startswith("a/") else cur_path
            current = [line]
        else:
            current.append(line)
    if cur_path:
        sections[cur_path] = "".join(current)
    return sections[path]


def refresh(edited: pathlib.Path, pristine: pathlib.Path, patches_dir: pathlib.Path,
            overlay: pathlib.Path, new_name: str | None, description: str | None,
            subject: str | None = None) -> list[tuple[str, str]]:
    series = load_series(patches_dir, overlay)
    if read_stamp(edited) is None:
        raise TargetError(f"{edited} has no applied series (no stamp): apply the series, edit, then refresh")
    last_owner: dict[str, str] = {}
    for p in series.patches:
        for fd in p.files:
            last_owner[fd.path] = p.name
    state: dict[str, str] = {}
    results: list[tuple[str, str]] = []
    for p in series.patches:
        header, _ = _split_header(p.text)
        sections = []
        for fd in p.files:
            before = state.get(fd.path)
            if before is None:
                before = _read_text(pristine / fd.path)
            if last_owner[fd.path] == p.name:
                after = _read_text(edited / fd.path)
            else:
                after, _ = apply_file_diff(before, fd)
            try:  # keep the patch's bytes only if it still applies exactly where it says
                applied, hunks = apply_file_diff(before, fd)
                unchanged = applied == after and not any(h.offset for h in hunks)
            except HunkFailed:
                unchanged = False
            if unchanged:
                sections.append(_diff_text_for(p.text, fd.path))
            else:
                d = make_file_diff(fd.path, before, after)
                if d:
                    sections.append(d)
            state[fd.path] = after
        body = "".join(sections)
        if header + body == p.text:
            results.append((p.name, "unchanged"))
            continue
        if not body:
            results.append((p.name, "EMPTY now: remove it from patches/series"))
        else:
            results.append((p.name, "refreshed"))
        (patches_dir / p.name).write_text(_set_last_update(header) + body)

    owned = set(last_owner) | set(series.overlay_files)
    unowned = []
    for f in sorted((pristine / "sglang").rglob("*.py")):
        rel = f.relative_to(pristine).as_posix()
        if rel in owned:
            continue
        e = edited / rel
        if not e.exists() or e.read_bytes() != f.read_bytes():
            unowned.append(rel)
    if unowned:
        if not new_name or not description:
            raise SeriesError(
                "edits to files no patch touches: " + ", ".join(unowned)
                + "\nname a new patch for them and say what it does: "
                "--new NNNN-what-it-does.patch --description '...' [--subject '...']"
            )
        missing = [r for r in unowned if not (edited / r).exists()]
        if missing:
            raise SeriesError(f"upstream files deleted in the edited tree (not supported): {', '.join(missing)}")
        header = (f"Subject: {subject}\n" if subject else "") + "".join(f"{k}: {v}\n" for k, v in zip(HEADER_FIELDS, (
            description, "ddtree-sglang developers", "no", datetime.date.today().isoformat(), read_lock()["version"],
        ))) + "---\n"
        body = "".join(make_file_diff(r, _read_text(pristine / r), _read_text(edited / r)) for r in unowned)
        parse_patch(new_name, header + body)  # validate before writing
        (patches_dir / new_name).write_text(header + body)
        with open(patches_dir / "series", "a") as s:
            s.write(new_name + "\n")
        results.append((new_name, "created"))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="refresh_patches.sh", description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--python", help="the edited tree is the sglang this interpreter imports (default: python3)")
    where.add_argument("--edited", help="the edited tree: the directory holding sglang/")
    ap.add_argument("--pristine", help="pristine upstream tree (default: .cache/upstream/sglang-<locked version>)")
    ap.add_argument("--new", metavar="NAME", help="put edits to files no patch touches into this new patch")
    ap.add_argument("--description", help="Description: line for the --new patch (required with --new)")
    ap.add_argument("--subject", help="Subject: line (one line) for the --new patch")
    ap.add_argument("--patches", default=str(REPO / "patches"), help=argparse.SUPPRESS)
    ap.add_argument("--overlay", default=str(REPO / "sglang"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        edited = resolve_target(args.edited, args.python)
        pristine = resolve_target(args.pristine or str(REPO / ".cache" / "upstream" / f"sglang-{read_lock()['version']}"))
        with locked(edited, exclusive=False):
            results = refresh(edited, pristine, pathlib.Path(args.patches), pathlib.Path(args.overlay),
                              args.new, args.description, args.subject)
    except (TargetError, SeriesError, PatchFormatError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, state in results:
        print(f"  {state:<10}  {name}")
    changed = sum(s != "unchanged" for _, s in results)
    print(f"{changed} of {len(results)} patches changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
