# SPDX-License-Identifier: Apache-2.0
"""scripts/bump_upstream.sh VERSION: how the series fares on another upstream release.

Fetches that release's wheel (sha256 checked against PyPI's published hash), tries every
patch hunk by hunk without stopping at the first failure, looks for the context of each
failing hunk in the rest of the new tree (upstream moves code between files), checks the
overlay for files that upstream now ships itself, and writes the result as a markdown report.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import pathlib
import sys

from .engine import TargetError, resolve_target
from .fetch import FetchError, download_wheel, pypi_hashes, unpack_sglang, verify
from .series import REPO, SeriesError, load_series
from .unidiff import PatchFormatError, apply_file_diff, is_distinctive


def _text(p: pathlib.Path) -> str:
    return p.read_bytes().decode("utf-8", errors="replace")


def relocations(tree: pathlib.Path, wanted: list[tuple[str, list[str]]]) -> list[tuple[str, int, int, int] | None]:
    """For each (file, hunk lines) that failed: the other file of the new tree holding most of the
    hunk's distinctive lines, as (file, line, lines found there, lines found in the original file),
    or None when no other file holds at least half of them and more than the original does.

    Lines are compared without their indentation, since moved code is often re-indented (a method
    turned into a function).
    """
    keys_of = [list(dict.fromkeys(l.strip() for l in lines if is_distinctive(l))) for _, lines in wanted]
    all_keys = {k for keys in keys_of for k in keys}
    where: dict[str, dict[str, int]] = collections.defaultdict(dict)  # line -> file -> first line number
    for f in sorted((tree / "sglang").rglob("*.py")):
        rel = f.relative_to(tree).as_posix()
        for n, line in enumerate(_text(f).splitlines(), 1):
            s = line.strip()
            if s in all_keys:
                where[s].setdefault(rel, n)
    out = []
    for (path, _), keys in zip(wanted, keys_of):
        counts = collections.Counter(rel for k in keys for rel in where.get(k, {}))
        here = counts.pop(path, 0)
        best = min(counts.items(), key=lambda kv: (-kv[1], kv[0])) if counts else None
        if not keys or best is None or 2 * best[1] < len(keys) or best[1] <= here:
            out.append(None)
            continue
        rel = best[0]
        first = min(where[k][rel] for k in keys if rel in where.get(k, {}))
        out.append((rel, first, best[1], here))
    return out


def assess(tree: pathlib.Path, series) -> tuple[list[dict], list[str]]:
    """Per patch: clean / offset / fails, with the failing hunks; plus overlay collisions."""
    files: dict[str, str] = {}
    rows = []
    failed: list[tuple[dict, int, str, list[str]]] = []  # row, note index, file, the hunk's old lines
    for patch in series.patches:
        row = {"patch": patch.name, "status": "clean", "notes": []}
        for fd in patch.files:
            if fd.path not in files:
                p = tree / fd.path
                if not p.exists():
                    row["status"] = "fails"
                    row["notes"].append(f"`{fd.path}` no longer exists upstream")
                    failed.append((row, len(row["notes"]) - 1, fd.path, [l for h in fd.hunks for l in h.old_lines()]))
                    continue
                files[fd.path] = _text(p)
            files[fd.path], results = apply_file_diff(files[fd.path], fd, keep_going=True)
            for r in results:
                if r.offset is None:
                    row["status"] = "fails"
                    row["notes"].append(f"`{fd.path}` hunk #{r.index} `{r.header}` fails:\n\n```\n{r.detail}\n```")
                    failed.append((row, len(row["notes"]) - 1, fd.path, fd.hunks[r.index - 1].old_lines()))
                elif r.offset:
                    if row["status"] == "clean":
                        row["status"] = "applies with offset"
                    row["notes"].append(f"`{fd.path}` hunk #{r.index} offset {r.offset:+d}")
        rows.append(row)
    moved = relocations(tree, [(path, lines) for _, _, path, lines in failed]) if failed else []
    for (row, k, path, lines), found in zip(failed, moved):
        if found:
            rel, line, n, here = found
            total = sum(is_distinctive(l) for l in lines)
            row["notes"][k] = (
                f"moved: the context of this hunk is in `{rel}` near line {line} now "
                f"({n} of its {total} distinctive lines there, {here} left in `{path}`); "
                f"the hunk belongs in that file\n\n" + row["notes"][k])
    collisions = [rel for rel in series.overlay_files if (tree / rel).exists()]
    return rows, collisions


def render(version: str, source: str, rows: list[dict], collisions: list[str], base: str) -> str:
    failed = sum(r["status"] == "fails" for r in rows)
    out = [
        f"# Patch series against sglang {version}",
        "",
        f"Generated {datetime.date.today().isoformat()} by `scripts/bump_upstream.sh {version}`; "
        f"series made for sglang {base}. Source: {source}.",
        "",
        f"**{len(rows) - failed} of {len(rows)} patches apply"
        + (f"; {failed} fail" if failed else "") + "**"
        + (f"; {len(collisions)} overlay files collide with upstream files" if collisions else "") + ".",
        "",
        "| patch | result |",
        "|---|---|",
    ]
    out += [f"| `{r['patch']}` | {r['status']} |" for r in rows]
    if not rows:
        out.append("| (series is empty) | |")
    details = [r for r in rows if r["notes"]]
    if details:
        out += ["", "## Details", ""]
        for r in details:
            out.append(f"### `{r['patch']}`: {r['status']}")
            out.append("")
            out += [f"- {n}" if not n.endswith("```") else f"- {n}" for n in r["notes"]]
            out.append("")
    if collisions:
        out += ["", "## Overlay collisions", ""] + [f"- `{c}` now exists upstream" for c in collisions]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bump_upstream.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("version", help="upstream sglang version to try, e.g. 0.5.18")
    ap.add_argument("--tree", help="use this unpacked tree (directory holding sglang/) instead of downloading")
    ap.add_argument("--python", default=sys.executable, help="interpreter whose wheel tag to download")
    ap.add_argument("--scratch", default=str(REPO / ".cache" / "upstream"), help="where wheels and trees go")
    ap.add_argument("--report", help="markdown report path (default: docs/bump/sglang-VERSION.md)")
    ap.add_argument("--patches", default=str(REPO / "patches"), help=argparse.SUPPRESS)
    ap.add_argument("--overlay", default=str(REPO / "sglang"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        series = load_series(pathlib.Path(args.patches), pathlib.Path(args.overlay))
        if args.tree:
            tree, source = resolve_target(args.tree), f"local tree `{args.tree}`"
        else:
            scratch = pathlib.Path(args.scratch)
            wheel = download_wheel(args.version, scratch / "wheels", args.python)
            digest = verify(wheel, pypi_hashes("sglang"))
            tree = unpack_sglang(wheel, scratch / f"sglang-{args.version}", digest)
            source = f"`{wheel.name}` (sha256 `{digest[:16]}…`, matches PyPI)"
        rows, collisions = assess(tree, series)
    except (FetchError, TargetError, SeriesError, PatchFormatError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = pathlib.Path(args.report or REPO / "docs" / "bump" / f"sglang-{args.version}.md")
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(render(args.version, source, rows, collisions, series.upstream_version))
    width = max([len(r["patch"]) for r in rows] + [5])
    print(f"sglang {args.version}:")
    for r in rows:
        print(f"  {r['patch']:<{width}}  {r['status']}")
        for n in r["notes"]:
            print("      " + n.splitlines()[0])
            if n.startswith("moved: "):
                print("        " + n.split("\n\n", 1)[1].splitlines()[0])
    for c in collisions:
        print(f"  overlay collision: {c} exists upstream")
    bad = any(r["status"] == "fails" for r in rows) or bool(collisions)
    print(f"report: {report}  ->  {'FAILS' if bad else 'ok'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
