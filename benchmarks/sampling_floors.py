# SPDX-License-Identifier: Apache-2.0
"""The filters' floors for rows whose top-p or min-p cut lies beyond the candidates: the
whole-row search (no host sync, graph-capturable) as ``logit_floors`` runs it with
``split_rows`` (``search``: each row split over ``row_slices`` programs while the rows are few,
recorded as ``slices``; a server's default), with one program per row (``search_single``:
``_whole_row_floors_kernel``, ``SGLANG_DDTREE_FLOORS_SPLIT_ROWS=0`` in a server) and with the slices given by
``--slices``, against the sort it replaced (the candidates' kernel, a host sync, then a full sort
of the undecided rows) and against sorting every row. Every floor a search gives is checked
equal to the full sort's, but where a token sits at the top-p or min-p cut within float32
rounding (``floors_differ``: neither float32 path is exact there; such rows are counted apart).

    python3 -m benchmarks.sampling_floors --tag sampling_floors_<gpu>_<date>

Rows are ``bs x (budget + 1)`` verify rows at a real vocabulary; half of them flat (the cut
deep in the row), half peaked (decided among the candidates). Times are eager (``_ms``: the
sort path syncs the host) and, for the searches, replayed from a CUDA graph (``_graph_ms``).
On a machine without CUDA the floors are compared under Triton's interpreter at the sizes
given, with no timings.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.gpu_timing import bench
from benchmarks.plotting import pyplot
from sglang.srt.speculative.verify_sampling import sampling_filters as sf

#: name -> (backend, top_k, top_p, min_p); top_k 0 is none.
SETTINGS = {
    "top_p=0.95": ("pytorch", 0, 0.95, 0.0),
    "min_p=0.01": ("pytorch", 0, 1.0, 0.01),
    "top_p=0.9,min_p=0.02 (flashinfer)": ("flashinfer", 0, 0.9, 0.02),
    "top_k=20,top_p=0.8": ("pytorch", 20, 0.8, 0.0),
}


def make_rows(rows: int, vocab: int, seed: int, device) -> torch.Tensor:
    """Half the rows flat (scale 1.5 normal logits), half with a few tokens far ahead."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 1.5
    peaked = torch.arange(rows) % 2 == 1
    heads = torch.randint(0, vocab, (rows, 8), generator=gen)
    boost = torch.rand(rows, 8, generator=gen) * 6 + 8
    logits[peaked] = logits[peaked].scatter_add(1, heads[peaked], boost[peaked])
    return logits.to(device)


def _inputs(rows: int, vocab: int, setting: str, device):
    backend, k, p, m = SETTINGS[setting]
    temps = torch.full((rows, 1), 0.7, device=device)
    top_ks = torch.full((rows,), k, dtype=torch.int32, device=device) if k else None
    top_ps = torch.full((rows,), p, device=device) if p < 1.0 else None
    min_ps = torch.full((rows,), m, device=device) if m > 0 else None
    rule = sf.FilterRule.for_backend(backend, need_min_p=m > 0)
    cand = sf.Candidates.for_requests([k] * rows, [p] * rows, [m] * rows, vocab)
    return temps, top_ks, top_ps, min_ps, rule, cand


def paths(logits, setting: str, slices: tuple = ()):
    """The ways to the floors, as zero-argument callables returning ``[rows]`` floats: the
    searches (``search``: as ``logit_floors`` chooses with ``split_rows``; ``search_single``: one
    program per row; ``search_s<n>``: each row over ``n`` programs, for each of ``slices``), then
    the sorts."""
    rows, vocab = logits.shape
    temps, top_ks, top_ps, min_ps, rule, cand = _inputs(rows, vocab, setting, logits.device)

    def search():
        return sf.logit_floors(logits, temps, top_ks, top_ps, min_ps, rule, cand, split_rows=True)

    def search_in(n: int):
        def run():
            floors, decided = sf._floors_among_triton(logits, temps, top_ks, top_ps, min_ps, rule, cand.k)
            if cand.deep:
                sf._whole_row_floors_triton(logits, temps, top_ks, top_ps, min_ps, rule, floors, decided, slices=n)
            return floors

        return run

    def sort_undecided():
        floors, decided = sf._floors_among_triton(logits, temps, top_ks, top_ps, min_ps, rule, cand.k)
        if cand.deep:
            redo = torch.nonzero(~decided).view(-1)  # the host sync the search removed
            sub = lambda t: None if t is None else t[redo]  # noqa: E731
            floors[redo], _ = sf.floors_among_reference(
                logits[redo], temps[redo], sub(top_ks), sub(top_ps), sub(min_ps), rule, vocab
            )
        return floors

    def full_sort():
        return sf.floors_among_reference(logits, temps, top_ks, top_ps, min_ps, rule, vocab)[0]

    _, decided = sf._floors_among_triton(logits, temps, top_ks, top_ps, min_ps, rule, cand.k)
    undecided = int((~decided).sum()) if cand.deep else 0
    inputs = (temps, top_ks, top_ps, min_ps, rule)
    fns = {"search": search, "search_single": search_in(1)}
    fns.update({f"search_s{n}": search_in(n) for n in slices})
    fns.update(sort_undecided=sort_undecided, full_sort=full_sort)
    return fns, cand, undecided, inputs


def measure(rows: int, vocab: int, setting: str, seed: int = 0, slices: tuple = ()) -> dict:
    """Median ms of each path and whether its floors are the full sort's; ``slices``: also the
    search with each row over that many programs."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = make_rows(rows, vocab, seed, device)
    fns, cand, undecided, inputs = paths(logits, setting, slices)
    want = fns["full_sort"]()
    row = {"rows": rows, "vocab": vocab, "setting": setting, "candidates": cand.k, "undecided_rows": undecided,
           "slices": sf.row_slices(rows, vocab, device)}  # fmt: skip
    for name in (n for n in fns if n != "full_sort"):
        got = fns[name]()
        # Rows whose floors differ only by tokens at the cut within float32 rounding, and others.
        real = sf.floors_differ(got, want, logits, *inputs)
        row[f"{name}_rows_at_cut"] = int((got != want).sum()) - int(real.sum())
        row[f"{name}_rows_differ"] = int(real.sum())
    if device == "cuda":
        for name, fn in fns.items():
            row[f"{name}_ms"] = round(bench(fn, graph=False), 4)
        for name in (n for n in fns if n.startswith("search")):
            row[f"{name}_graph_ms"] = round(bench(fns[name], graph=True), 4)
        row["sort_undecided_over_search"] = round(row["sort_undecided_ms"] / row["search_ms"], 2)
        row["search_single_over_search"] = round(row["search_single_ms"] / row["search_ms"], 2)
    return row


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    rows = [r for r in result["rows"] if "search_ms" in r]
    if plt is None or not rows:
        return
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    fig, axes = plt.subplots(1, len(settings), figsize=(4.2 * len(settings), 3.6), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        mine = [r for r in rows if r["setting"] == setting]
        xs = [r["rows"] for r in mine]
        for name in ("search", "search_single", "sort_undecided", "full_sort"):
            ax.plot(xs, [r.get(f"{name}_ms") for r in mine], marker="o", label=name)
        for r in mine:  # the slices each row of the search was split into
            if r.get("slices", 1) > 1:
                ax.annotate(f"{r['slices']}", (r["rows"], r["search_ms"]), fontsize=7, textcoords="offset points",
                            xytext=(3, 3))  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("verify rows (bs x (B+1))")
        ax.set_title(setting, fontsize=9)
    axes[0][0].set_ylabel("ms (median)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{result['device']}, {result['date']}, V={rows[0]['vocab']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", default="17,65,272,1088")
    ap.add_argument("--slices", default="", help="','-separated slice counts to time the search at too")
    ap.add_argument("--settings", default=";".join(SETTINGS), help="';'-separated")
    ap.add_argument("--tag", default="sampling_floors")
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--replot", type=Path, help="only draw the PNG of a result JSON (beside it)")
    args = ap.parse_args(argv)
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return 0
    settings = [s for s in args.settings.split(";") if s]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        ap.error(f"unknown settings {unknown}; known: {list(SETTINGS)}")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter, no timings)"
    result = {"date": time.strftime("%Y-%m-%d"), "device": device, "rows": []}
    slices = tuple(int(n) for n in args.slices.split(",") if n)
    for setting in settings:
        for rows in (int(r) for r in args.rows.split(",")):
            row = measure(rows, args.vocab, setting, slices=slices)
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out_dir / f"{args.tag}.png")
    bad = [r for r in result["rows"] if any(v for k, v in r.items() if k.endswith("_rows_differ"))]
    if bad:
        print(f"error: floors differ from the full sort beyond rounding at the cut in {len(bad)} rows of the "
              f"table", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
