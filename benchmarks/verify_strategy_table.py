#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The measured table the verify-strategy policy chooses from, one arch family per run.

Per shape of the MLA matrix (``verify_attention.full_matrix``: H 16/128, N 17/65/129,
P 1K-64K, bs 1/8, and N=4 at 64K) it times each serving strategy the way a server runs
it, as CUDA-graph replays (median): ``fused`` with this policy's tiles,
``flashinfer_split`` with its FlashInfer pass made for graphs and planned ahead from
host lengths (as the hook plans it outside the graph every forward), ``flashmla_split``
with its staging and plan made ahead. It also times the FlashInfer plan itself on the
host (``plan_ms``: the per-forward cost a server pays outside the graph, the lengths
copied from the device as the hook does, here with the GPU idle; ``plan_from_host_ms``
without that copy), checks every
strategy against the fp32 reference at the shapes small enough, and then applies the
policy (``tree_verify/policy.py``) to the measured rows: which strategy it chooses per
shape, and how that compares with the fused kernel, the route before the table.

``--attn gqa`` measures MHA/GQA targets instead (``fused`` and ``flashinfer_split``): query
heads 32 and 64 over 8 KV heads of 64, 128 and 256 (Qwen3, Llama, gpt-oss and Gemma
layouts), N 17/65/129, P 1K/16K/64K, bs 1/8; its rows carry their layout (``Hkv``, ``D``),
and the policy takes the rows of the layout nearest a target's. ``--strategies
fused,flashinfer_split,xqa`` also times FlashInfer's XQA kernel over the same KV in
pages of 16 (``benchmarks/xqa_verify.py``): a candidate, reported per row
(``candidates_ms``, and against the policy's choice) but never written into the table.

``--sm120-proxy`` measures the sm_12x family on another GPU (SGLANG_DDTREE_SM120_PROXY=1:
sm_120 tiles, FlashInfer's fa2 kernels, no FlashMLA). ``--table PATH`` writes the run's
section into a strategy table (replacing that family's section); the shipped one is
``sglang/srt/layers/attention/tree_verify/strategy_table.json``.

GPU host (``source scripts/gpu_host/env.sh``):
  python3 benchmarks/verify_strategy_table.py --sm120-proxy --tag h200_sm120_proxy --out-dir DIR \\
      --table DIR/strategy_table.json
  python3 benchmarks/verify_strategy_table.py --tag h200 --out-dir DIR --table DIR/strategy_table.json
  python3 benchmarks/verify_strategy_table.py --attn gqa --sm120-proxy --tag h200_sm120_proxy_gqa --out-dir DIR \
      --table DIR/strategy_table.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SHIPPED_TABLE = REPO / "sglang" / "srt" / "layers" / "attention" / "tree_verify" / "strategy_table.json"
#: The targets the sm_12x route is held to (H, N, P, bs) -> ms, measured as the proxy.
SM12X_TARGETS = {(16, 65, 16384, 1): 0.22, (128, 65, 65536, 1): 4.6}
PLAN_CALLS = 50
#: Seconds a run with --deadline-s keeps for its last shape, the policy, the plot and the files.
DEADLINE_RESERVE_S = 30.0
#: Kernels measured beside the serving strategies, never written into the table.
CANDIDATES = ("xqa",)
#: The page size the XQA candidate reads (its smallest).
XQA_PAGE_SIZE = 16
#: MHA/GQA layouts of the table: (query heads, KV heads, head dim).
GQA_HEADS = (32, 64)
GQA_LAYOUTS = ((8, 64), (8, 128), (8, 256))


def gqa_matrix() -> list[dict]:
    return [{"kind": "mha", "H": h, "Hkv": hkv, "D": d, "N": n, "P": p, "bs": bs}
            for bs in (1, 8) for h in GQA_HEADS for hkv, d in GQA_LAYOUTS
            for n in (17, 65, 129) for p in (1024, 16384, 65536)]  # fmt: skip


def mla_shape(h: int, n: int, p: int, bs: int) -> dict:
    return {"kind": "mla", "H": h, "N": n, "P": p, "bs": bs}


def shape_key(row: dict) -> tuple:
    """A shape's identity in a run: (kind, H, Hkv, D, N, P, bs)."""
    return (row.get("kind", "mla"), row["H"], row.get("Hkv"), row.get("D"), row["N"], row["P"], row["bs"])


def verify_shape(row: dict, **kw):
    """The policy's view of a table row's shape."""
    from sglang.srt.layers.attention.tree_verify.policy import VerifyShape

    layout = {"kv_heads": row["Hkv"], "head_dim": row["D"]} if row.get("kind") == "mha" else {}
    return VerifyShape(row["H"], row["N"], row["bs"], kind=row.get("kind", "mla"), **layout, **kw)


def _table_row(r: dict, ms: dict) -> dict:
    out = {"kind": r.get("kind", "mla"), "H": r["H"], "N": r["N"], "P": r["P"], "bs": r["bs"], "ms": ms}
    if out["kind"] == "mha":
        out.update(Hkv=r["Hkv"], D=r["D"])
    return out


def section_from_rows(rows: list[dict], family: str, meta: dict, command: str) -> dict:
    """The table section of a run: per shape, the median ms of each strategy that ran."""
    out = []
    for r in rows:
        ms = {k: round(v, 5) for k, v in r.get("ms", {}).items()}
        if ms:
            out.append(_table_row(r, ms))
    hardware = (f"{meta['gpu']} ({meta['sms']} SMs, compute capability {meta['capability'][0]}."
                f"{meta['capability'][1]}), torch {meta['torch']}, triton {meta['triton']}, "
                f"flashinfer {meta['flashinfer']}")  # fmt: skip
    return {"arch": family, "date": meta["date"], "hardware": hardware, "proxy": meta["sm120_proxy"],
            "command": command, "rows": out}  # fmt: skip


def _kinds(section: dict) -> set:
    return {r.get("kind", "mla") for r in section.get("rows", []) if isinstance(r, dict)} or {"mla"}


def merge_section(table: dict, section: dict) -> dict:
    """``table`` with ``section`` replacing the section of the same family, proxy flag and
    attention kind (an MLA run and a GQA run of one family keep a section each)."""
    same = lambda s: ((s["arch"], bool(s.get("proxy", False))) == (section["arch"], section["proxy"])  # noqa: E731
                      and _kinds(s) & _kinds(section))  # fmt: skip
    return {**table, "sections": [s for s in table.get("sections", []) if not same(s)] + [section]}


def apply_policy(rows: list[dict], family: str, arch) -> list[dict]:
    """Per shape: the policy's choice from this run's rows (a server's choice: over all
    prefix lengths of the nearest point) and the per-length optimum, against fused."""
    from sglang.srt.layers.attention.tree_verify.policy import StrategyTable, choose_strategy

    meta = {"date": "x", "hardware": "x", "command": "x"}
    table = StrategyTable.from_json({"sections": [{"arch": family, **meta, "rows": [
        _table_row(r, r["ms"]) for r in rows if r.get("ms")
    ]}]})  # fmt: skip
    out = []
    for r in rows:
        if "fused" not in r.get("ms", {}):
            continue
        measured = set(r["ms"])
        served = choose_strategy(arch, verify_shape(r), measured, table)
        best = min(r["ms"], key=r["ms"].get)
        rec = {**{k: v for k, v in _table_row(r, {}).items() if k != "ms"}, "chosen": served,
               "chosen_ms": r["ms"].get(served), "fused_ms": r["ms"]["fused"], "fastest": best}  # fmt: skip
        if rec["chosen_ms"] is not None:
            rec["chosen_over_fused"] = rec["chosen_ms"] / rec["fused_ms"]
            for name, ms in r.get("candidates_ms", {}).items():
                rec.setdefault("candidate_over_chosen", {})[name] = ms / rec["chosen_ms"]
        out.append(rec)
    return out


def _time_plan(prefix_pass, indptr, indices, lens=None) -> float:
    """Median host ms of one FlashInfer plan (from the device's lengths when ``lens`` is
    None, as the hook plans; the GPU is idle, so the copy waits on nothing)."""
    import torch

    times = []
    for _ in range(PLAN_CALLS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prefix_pass.plan(indptr, indices, lens)
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def _check_against_reference(row: dict, name: str, err) -> None:
    """Record a strategy's max error against the fp32 reference (None: the shape is too
    large to check) and refuse to time one that is wrong."""
    if err is not None:
        row["max_err"][name] = err
        if not err < 5e-2:
            raise AssertionError(f"max error {err} against the reference")


def _measure_candidate(row: dict, name: str, args, layout, check) -> None:
    """A kernel measured beside the serving strategies but not one of them (so not in
    the table's ``ms``): ``xqa``, FlashInfer's XQA over the same KV laid out in pages of
    ``XQA_PAGE_SIZE`` (``benchmarks/xqa_verify.py``)."""
    import torch

    from benchmarks.gpu_timing import bench
    from benchmarks.xqa_verify import XqaTreeVerify, paged_copy, xqa_reason

    q, k, v, indptr, indices, tidx, mask, scale = args
    h, n, p, bs = (row[key] for key in ("H", "N", "P", "bs"))
    why = xqa_reason(h, layout.hkv, layout.dqk, layout.dv, q.dtype, k.dtype, XQA_PAGE_SIZE)
    if why is not None:
        row["errors"][name] = f"unavailable: {why}"
        return
    try:
        paged = paged_copy(k, v, indptr, indices, tidx, XQA_PAGE_SIZE)
        kernel = XqaTreeVerify(q.device, layout.hkv, scale, layout.dqk)
        out = torch.empty_like(q)

        def fn():
            return kernel(q, paged, mask, out)

        _check_against_reference(row, name, check(fn(), args, h, n, p, bs, heads=layout))
        row.setdefault("candidates_ms", {})[name] = bench(fn)
        del paged
    except Exception as e:  # a candidate failing must not lose the rest of the matrix
        row["errors"][name] = f"{type(e).__name__}: {e}"[:500]
        torch.cuda.synchronize()


def measure(shapes, strategies, proxy: bool, deadline: float | None = None) -> tuple[list[dict], list[dict]]:
    """``shapes``: ``mla_shape`` / ``gqa_matrix`` dicts. Returns the measured rows and the
    shapes left unmeasured because ``deadline`` (a ``time.monotonic()`` value) had passed,
    so that a run cut short still writes what it measured."""
    import torch

    from benchmarks.gpu_timing import bench
    from verify_attention import MLA, Heads, check, make_inputs

    from sglang.srt.layers.attention.tree_verify import StrategyUnavailable, tree_verify_attention
    from sglang.srt.layers.attention.tree_verify.flashinfer_split import (
        FlashInferPrefixPass,
        PrefixPassShape,
    )
    from sglang.srt.layers.attention.tree_verify.flashmla_split import (
        new_staging,
        plan_flashmla,
        staging_pages,
    )
    from sglang.srt.layers.attention.tree_verify.strategies.flashinfer_split import flashinfer_backend

    rows = []
    for i, shape_row in enumerate(shapes):
        if deadline is not None and time.monotonic() > deadline:
            return rows, list(shapes[i:])
        h, n, p, bs = (shape_row[k] for k in ("H", "N", "P", "bs"))
        layout = MLA
        if shape_row["kind"] == "mha":
            d = shape_row["D"]
            layout = Heads(f"gqa{shape_row['Hkv']}x{d}", shape_row["Hkv"], d, d, False, (h,))
        args = make_inputs(h, n, p, bs, heads=layout)
        q, k, v, indptr, indices, tidx, mask, scale = args
        row = {**shape_row, "ms": {}, "errors": {}, "max_err": {}}
        for name in strategies:
            if name in CANDIDATES:
                _measure_candidate(row, name, args, layout, check)
                continue
            options = {}
            try:
                if name == "flashmla_split" and layout is not MLA:
                    raise StrategyUnavailable("FlashMLA serves absorbed MLA only")
                if name == "flashinfer_split":
                    shape = PrefixPassShape(h, layout.hkv, layout.dqk, layout.dv, n, q.dtype, k.dtype, scale)
                    prefix_pass = FlashInferPrefixPass.create(
                        shape, bs, q.device, backend=flashinfer_backend(), graph_prefix_indices=indices
                    )
                    row["plan_from_host_ms"] = _time_plan(prefix_pass, indptr, indices, (indptr[1:] - indptr[:-1]).cpu())
                    row["plan_ms"] = _time_plan(prefix_pass, indptr, indices)
                    row["flashinfer_backend"] = getattr(prefix_pass.wrapper, "_backend", None)
                    options = {"prefix_pass": prefix_pass}
                elif name == "flashmla_split":
                    staging = new_staging(staging_pages(bs, indices.numel()), k)
                    options = {"staging": staging, "plan": plan_flashmla(indptr, n, h, p, staging.shape[0])}

                def fn(name=name, options=options):
                    return tree_verify_attention(*args, strategy=name, strategy_options=options)

                _check_against_reference(row, name, check(fn(), args, h, n, p, bs, heads=layout))
                row["ms"][name] = bench(fn)
            except (StrategyUnavailable, ImportError) as e:
                row["errors"][name] = f"unavailable: {e}"
            except Exception as e:  # one strategy failing must not lose the rest of the matrix
                row["errors"][name] = f"{type(e).__name__}: {e}"[:500]
                torch.cuda.synchronize()
        rows.append(row)
        print(json.dumps(row), flush=True)
        del args
        torch.cuda.empty_cache()
    return rows, []


def plot(result: dict, path: Path) -> None:
    from benchmarks.plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in result["rows"] if r.get("ms")]
    if not rows:
        return
    labels = [f"H{r['H']}" + (f"/{r['Hkv']}x{r['D']}" if r.get("kind") == "mha" else "")
              + f" N{r['N']} P{r['P'] // 1024}K bs{r['bs']}" for r in rows]  # fmt: skip
    fig, ax = plt.subplots(figsize=(max(10, len(rows) * 0.3), 5))
    for name, style in (("fused", "rs"), ("flashinfer_split", "bo"), ("flashmla_split", "k^"), ("xqa", "mD")):
        pts = [(i, r["ms"].get(name, r.get("candidates_ms", {}).get(name))) for i, r in enumerate(rows)]
        pts = [(i, ms) for i, ms in pts if ms is not None]
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=name, markersize=4)
    chosen = {shape_key(c): c for c in result.get("policy", [])}
    pts = [(i, chosen[shape_key(r)]["chosen_ms"]) for i, r in enumerate(rows)
           if chosen.get(shape_key(r), {}).get("chosen_ms")]  # fmt: skip
    if pts:
        ax.plot([x for x, _ in pts], [y for _, y in pts], "g_", markersize=12, label="policy's choice")
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("ms per layer (CUDA-graph replay, median)")
    meta = result["meta"]
    label = "sm_120 proxy on " if meta["sm120_proxy"] else ""
    ax.set_title(f"tree-verify strategies, {label}{meta['gpu']}, {meta['date']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sm120-proxy", action="store_true",
                    help="measure the sm_12x family on this GPU (sm_120 tiles, FlashInfer fa2, no FlashMLA)")
    ap.add_argument("--attn", choices=("mla", "gqa"), default="mla",
                    help="the attention family: absorbed MLA, or MHA/GQA layouts (rows with Hkv and D)")
    ap.add_argument("--strategies", default="fused,flashinfer_split,flashmla_split")
    ap.add_argument("--shapes", default="",
                    help="instead of the matrix: H:N:P:bs,... (mla) or H:Hkv:D:N:P:bs,... (gqa)")
    ap.add_argument("--tag", default=time.strftime("%Y%m%d-%H%M%S"))
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--table", type=Path, default=None,
                    help="write this run's section into this strategy table (created from the shipped one)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="end within about this many seconds: no shape starts in the last "
                         f"{DEADLINE_RESERVE_S:.0f} s; the shapes left are listed as 'unmeasured' and the "
                         "section holds the rows measured")
    args = ap.parse_args(argv)
    if args.deadline_s is not None and not args.deadline_s > 0:
        ap.error(f"--deadline-s takes a positive number of seconds, got {args.deadline_s}")
    deadline = None if args.deadline_s is None else time.monotonic() + args.deadline_s - DEADLINE_RESERVE_S
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = set(strategies) - {"fused", "flashinfer_split", "flashmla_split", *CANDIDATES}
    if unknown:
        ap.error(f"not serving strategies or candidates ({', '.join(CANDIDATES)}): {sorted(unknown)}")
    if args.attn == "mla" and set(strategies) & set(CANDIDATES):
        ap.error(f"{', '.join(CANDIDATES)} serve MHA/GQA targets only: use --attn gqa")
    fields = ("H", "N", "P", "bs") if args.attn == "mla" else ("H", "Hkv", "D", "N", "P", "bs")
    try:
        shapes = [tuple(int(x) for x in v.split(":")) for v in args.shapes.split(",") if v]
    except ValueError:
        shapes = None
    if shapes is None or any(len(s) != len(fields) or min(s) < 1 for s in shapes):
        example = "16:65:16384:1" if args.attn == "mla" else "32:8:128:65:16384:1"
        ap.error(f"--shapes takes {':'.join(fields)},... (e.g. {example}) with --attn {args.attn}, "
                 f"got {args.shapes!r}")
    shapes = [{"kind": "mla" if args.attn == "mla" else "mha", **dict(zip(fields, s))} for s in shapes]
    if args.sm120_proxy or args.attn == "gqa":
        strategies = [s for s in strategies if s != "flashmla_split"]
    if args.sm120_proxy:
        os.environ["SGLANG_DDTREE_SM120_PROXY"] = "1"

    import torch
    import triton

    from verify_attention import full_matrix

    from sglang.srt.utils.gpu_arch import arch_family
    from sglang.srt.utils.gpu_arch import device_capability, policy_arch

    try:
        import flashinfer

        fi_version = flashinfer.__version__
    except ImportError:
        fi_version = "missing"
    arch = policy_arch()
    family = arch_family(arch)
    meta = dict(
        date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(),
        capability=list(device_capability()), sms=torch.cuda.get_device_properties(0).multi_processor_count,
        torch=torch.__version__, triton=triton.__version__, flashinfer=fi_version,
        python=platform.python_version(), sm120_proxy=bool(args.sm120_proxy), policy_family=family, attn=args.attn,
        timing="cuda_graph_replay, median; plan_ms: host time of one FlashInfer plan from the device's lengths",
    )  # fmt: skip
    if "xqa" in strategies:
        meta["xqa_page_size"] = XQA_PAGE_SIZE
    print(json.dumps(meta), flush=True)
    if not shapes:
        shapes = [mla_shape(*s) for s in full_matrix()] if args.attn == "mla" else gqa_matrix()
    rows, unmeasured = measure(shapes, strategies, args.sm120_proxy, deadline)
    result = {"meta": meta, "rows": rows, "policy": apply_policy(rows, family, arch)}
    if unmeasured:
        result["unmeasured"] = unmeasured
    command = "python3 benchmarks/verify_strategy_table.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result["section"] = section_from_rows(rows, family, meta, command)
    slower = [c for c in result["policy"] if c.get("chosen_over_fused", 1.0) > 1.0]
    result["slower_than_fused"] = slower
    if args.sm120_proxy and args.attn == "mla":
        result["targets"] = [
            {"H": h, "N": n, "P": p, "bs": bs, "target_ms": t,
             "chosen_ms": next((c["chosen_ms"] for c in result["policy"]
                                if shape_key(c) == shape_key(mla_shape(h, n, p, bs))), None)}
            for (h, n, p, bs), t in SM12X_TARGETS.items()
        ]  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"verify_strategy_table_{args.tag}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    if args.table is not None:
        base = json.loads((args.table if args.table.exists() else SHIPPED_TABLE).read_text())
        args.table.write_text(json.dumps(merge_section(base, result["section"]), indent=1) + "\n")
        print(f"wrote the {family} section into {args.table}")
    for c in result["policy"]:
        layout = f" {c['Hkv']}x{c['D']}" if c.get("kind") == "mha" else ""
        cand = "".join(f", {k} {v:.2f}x the choice" for k, v in c.get("candidate_over_chosen", {}).items())
        print(f"H{c['H']:>4}{layout} N{c['N']:>4} P{c['P']:>6} bs{c['bs']:>2}: {c['chosen']:<17} "
              f"{c['chosen_ms'] or float('nan'):8.4f} ms, fused {c['fused_ms']:8.4f} ms, fastest here {c['fastest']}"
              f"{cand}")
    for t in result.get("targets", []):
        print(f"target H{t['H']} N{t['N']} P{t['P']} bs{t['bs']}: {t['chosen_ms']} ms (<= {t['target_ms']})")
    print(f"{len(slower)} shapes where the policy's choice is slower than the fused kernel")
    if unmeasured:
        print(f"{len(unmeasured)} of {len(shapes)} shapes left unmeasured at the deadline ({args.deadline_s} s)")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
