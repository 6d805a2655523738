#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Where a server's host time goes, from a py-spy profile of its scheduler (offline, CPU).

On a small target a speculative decode step is host time: the GPU works a fraction of it
(`e2e_step --profile-host` gives the phases, not the functions inside them).
``budget_sweep.py --py-spy CONFIGS`` samples the scheduler process of each named server into
``hostprof_<tag>_<config>.json`` (speedscope). This reads such files and reports, over the
samples inside ``--root`` (by default the speculative worker's decode entry,
``forward_batch_generation``):

- ``tree``: the share of those samples in each callee, down to ``--depth`` calls below the root
  (inclusive: a function's callees count towards it), keeping callees of at least
  ``--min-share``;
- ``self``: the functions whose own code holds the most samples (the leaves of the stacks);
- ``lines``: the same by line (``file.py:LINE``), which says which call inside a function it is.

``--skip-compiles`` leaves out the samples spent compiling a kernel (Triton's compile, a JIT
module's build): a one-off cost of the first step at a new shape, not a step's host time; their
share is reported as ``compile_share``.

Functions are named ``Class.method (file.py)``: py-spy records one frame per line executing, and
the lines of one function are summed. Shares, not milliseconds: py-spy samples at a fixed
rate, so shares compare within a profile; per step, multiply by the step's host time.

  python3 -m benchmarks.host_profile hostprof_learned_h100_2026-12-06_ddtree16.json \\
      --tag learned_ddtree16_h100_2026-12-06 --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from benchmarks.plotting import pyplot

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = "forward_batch_generation"

Stack = Tuple[str, ...]  # function names, outermost first
#: Frames of a kernel compile (Triton's JIT and its stages).
COMPILE_FRAMES = ("JITFunction._do_compile ", "CUDABackend.make_")


def load(path: Path) -> List[Tuple[Stack, float, str]]:
    """Every sample of every thread of a speedscope file (gzipped or not): its stack as function
    names, outermost first, with the lines of one function merged, its weight, and the line its
    innermost frame was on (``name (file.py:LINE)``)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    frames = data.get("shared", {}).get("frames")
    if not isinstance(frames, list) or not isinstance(data.get("profiles"), list):
        raise ValueError(f"{path}: not a speedscope file (no shared.frames / profiles)")
    names = [f"{fr['name']} ({Path(fr.get('file') or '?').name})" for fr in frames]
    lines = [f"{name[:-1]}:{fr.get('line')})" for name, fr in zip(names, frames)]
    samples = []
    for prof in data["profiles"]:
        if prof.get("type") != "sampled":
            continue
        for stack, weight in zip(prof["samples"], prof["weights"]):
            if stack:
                samples.append((tuple(names[i] for i in stack), float(weight), lines[stack[-1]]))
    return samples


def is_root(function: str, root: str) -> bool:
    """``root`` names the function alone (``forward_batch_generation``), with its class
    (``DDTreeWorker.forward_batch_generation``) or in full, file included."""
    name = function.split(" (", 1)[0]
    return function == root or name == root or name.endswith("." + root)


def is_compile(stack: Stack) -> bool:
    return any(fn.startswith(COMPILE_FRAMES) for fn in stack)


def summarize(samples: Sequence[Tuple[Stack, float, str]], root: str = DEFAULT_ROOT, depth: int = 3,
              min_share: float = 0.02, top: int = 15, skip_compiles: bool = False) -> dict:
    """The shares below ``root`` (see the module docstring). A sample counts from the outermost
    call of ``root`` in its stack; recursion below it is counted once per function."""
    total = sum(w for _, w, _ in samples)
    inside = compiling = 0.0
    tree: Dict[Stack, float] = defaultdict(float)
    own: Dict[str, float] = defaultdict(float)
    own_lines: Dict[str, float] = defaultdict(float)
    for stack, w, line in samples:
        at = next((i for i, fn in enumerate(stack) if is_root(fn, root)), None)
        if at is None:
            continue
        if skip_compiles and is_compile(stack[at:]):
            compiling += w
            continue
        inside += w
        below = stack[at + 1:]
        for k in range(1, min(depth, len(below)) + 1):
            tree[below[:k]] += w
        own[stack[-1]] += w
        own_lines[line] += w
    if inside == 0:
        raise ValueError(f"no sample runs inside {root!r} (of {len(samples)} samples)")

    def share(w: float) -> float:
        return round(w / inside, 4)

    rows = []

    def walk(prefix: Stack) -> None:
        kids = sorted(((p, w) for p, w in tree.items() if len(p) == len(prefix) + 1 and p[:-1] == prefix),
                      key=lambda item: -item[1])
        for path, w in kids:
            if w / inside < min_share:
                continue
            rows.append({"path": list(path), "share": share(w)})
            walk(path)

    walk(())
    return {
        "root": root,
        "samples_inside": round(inside, 4),
        "share_of_all_samples": round(inside / total, 4) if total else None,
        "compile_share": round(compiling / (inside + compiling), 4) if skip_compiles else None,
        "tree": rows,
        "self": [{"function": fn, "share": share(w)}
                 for fn, w in sorted(own.items(), key=lambda item: -item[1])[:top]],
        "lines": [{"line": ln, "share": share(w)}
                  for ln, w in sorted(own_lines.items(), key=lambda item: -item[1])[:top]],
    }


def plot(result: dict, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    profiles = result["profiles"]
    fig, axes = plt.subplots(len(profiles), 2, figsize=(15, 0.4 * 16 * len(profiles) + 1), squeeze=False)
    for row, prof in zip(axes, profiles):
        first = [r for r in prof["tree"] if len(r["path"]) == 1][:15]
        for ax, items, title in (
            (row[0], [(r["path"][-1], r["share"]) for r in first], f"callees of {prof['root']} (inclusive)"),
            (row[1], [(s["function"], s["share"]) for s in prof["self"]], "own code (self)"),
        ):
            labels = [name if len(name) <= 60 else name[:57] + "..." for name, _ in items][::-1]
            ax.barh(labels, [100 * v for _, v in items][::-1], color="tab:blue")
            ax.set_xlabel(f"% of the samples inside {prof['root']}")
            ax.set_title(f"{Path(prof['file']).name}: {title}", fontsize=9)
            ax.tick_params(axis="y", labelsize=7)
            ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"scheduler host time under py-spy ({result['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profiles", type=Path, nargs="+", help="py-spy speedscope files (.json or .json.gz)")
    ap.add_argument("--root", default=DEFAULT_ROOT,
                    help="the function whose samples are shared out: a name, Class.name, or 'Class.name (file.py)'")
    ap.add_argument("--depth", type=int, default=3, help="calls below the root that the tree keeps")
    ap.add_argument("--min-share", type=float, default=0.02, help="callees below this share are left out")
    ap.add_argument("--top", type=int, default=15, help="functions (and lines) listed by their own samples")
    ap.add_argument("--skip-compiles", action="store_true",
                    help="leave out the samples spent compiling kernels (reported as compile_share)")
    ap.add_argument("--tag", default=datetime.date.today().isoformat())
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args(argv)
    if args.depth < 1 or args.top < 1 or not 0 <= args.min_share < 1:
        ap.error("--depth and --top take positive numbers, --min-share a share in [0, 1)")
    result = {"what": "host time of a server's scheduler under py-spy, shared out below one function "
                      "(benchmarks/host_profile.py)",
              "date": datetime.date.today().isoformat(), "argv": sys.argv[1:] if argv is None else list(argv),
              "profiles": []}
    for path in args.profiles:
        try:
            prof = summarize(load(path), args.root, args.depth, args.min_share, args.top, args.skip_compiles)
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"{path}: {e}")
        result["profiles"].append({"file": str(path), **prof})
        skipped = (f", {100 * prof['compile_share']:.0f} % compiling left out"
                   if prof["compile_share"] is not None else "")
        print(f"== {path.name}: {prof['samples_inside']:.1f} s of samples inside {args.root} "
              f"({100 * (prof['share_of_all_samples'] or 0):.0f} % of the process's{skipped})")
        for r in prof["tree"]:
            print(f"{'  ' * (len(r['path']) - 1)}{100 * r['share']:5.1f} %  {r['path'][-1]}")
        print("   own code:")
        for s in prof["self"]:
            print(f"{100 * s['share']:5.1f} %  {s['function']}")
        print("   own code by line:")
        for s in prof["lines"]:
            print(f"{100 * s['share']:5.1f} %  {s['line']}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"host_profile_{args.tag}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
