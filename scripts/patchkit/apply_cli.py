# SPDX-License-Identifier: Apache-2.0
"""scripts/apply_patches.sh: put the overlay and the series onto an installed or unpacked sglang.

Exit status: 0 applied, reversed, checked or nothing to do; 1 a patch does not apply to this
target (nothing was changed); 2 the target, the series or the arguments are unusable (the
message says which and why).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from .engine import STAMP, TargetError, execute, locked, plan_apply, plan_reverse, resolve_target
from .series import REPO, SeriesError, load_series
from .unidiff import PatchFormatError


def _print_statuses(plan, quiet: bool) -> None:
    width = max([len(s.state) for s in plan.statuses] + [len("already applied")])
    for st in plan.statuses:
        if quiet and st.state == "already applied":
            continue
        print(f"  {st.state:<{width}}  {st.name}")
        for off in st.offsets:
            print(f"  {'':<{width}}    {off}")
        if st.failure:
            for line in st.failure.splitlines():
                print(f"  {'':<{width}}    {line}")


def _print_notes(plan) -> None:
    for note in plan.notes:
        print(f"note: {note}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="apply_patches.sh",
        description="Apply the ddtree-sglang overlay and patch series to an sglang install.",
        epilog="exit status: 0 done (or nothing to do), 1 a patch does not apply (nothing changed), "
               "2 unusable target, series or arguments",
    )
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--python", help="patch the sglang this interpreter imports (default: python3)")
    where.add_argument("--target", help="patch an unpacked tree: the directory holding sglang/ (or sglang/ itself)")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--check", action="store_true", help="dry run: change nothing, exit 0 iff it would apply")
    what.add_argument("--reverse", action="store_true", help="take the applied series off, restoring the files byte for byte")
    ap.add_argument("--link", action="store_true", help="install overlay files as symlinks into this repo (development)")
    ap.add_argument("--patches", default=str(REPO / "patches"), help=argparse.SUPPRESS)
    ap.add_argument("--overlay", default=str(REPO / "sglang"), help=argparse.SUPPRESS)
    ap.add_argument("-q", "--quiet", action="store_true", help="print only changes, failures and the summary")
    args = ap.parse_args(argv)

    try:
        root = resolve_target(args.target, args.python)
        if args.reverse:
            with locked(root):
                return _reverse(root, args.quiet)
        series = load_series(pathlib.Path(args.patches), pathlib.Path(args.overlay))
        # A dry run takes the lock shared: it waits for a run that is writing, never for another check.
        with locked(root, exclusive=not args.check):
            return _apply(root, series, args)
    except (TargetError, SeriesError, PatchFormatError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _reverse(root, quiet: bool) -> int:
    plan = plan_reverse(root)
    if plan.noop:
        print(f"nothing to reverse: no series is applied to {root} (no {STAMP})")
        return 0
    _print_notes(plan)
    _print_statuses(plan, quiet)
    execute(plan)
    print(f"reversed {len(plan.statuses)} patches and removed {len(plan.overlay_remove)} overlay files in {root}")
    return 0


def _apply(root, series, args) -> int:
    mode = "link" if args.link else "copy"
    plan = plan_apply(root, series, mode)
    _print_notes(plan)
    _print_statuses(plan, args.quiet)
    digest = series.digest(mode)[:12]
    if not plan.ok:
        failed = next(s for s in plan.statuses if s.state == "FAILED")
        print(f"FAILED: {failed.name} does not apply to {root}; nothing was changed"
              + (" (dry run)" if args.check else ""))
        return 1
    if plan.noop:
        print(f"series {digest} already applied to {root}: nothing to do")
        return 0
    if args.check:
        print(f"check: all {len(series.patches)} patches and {len(series.overlay_files)} overlay files "
              f"would apply to {root} (dry run, nothing changed)")
        return 0
    execute(plan, series, mode)
    print(f"applied {len(series.patches)} patches and {len(series.overlay_files)} overlay files "
          f"({mode}) to {root}; series {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
