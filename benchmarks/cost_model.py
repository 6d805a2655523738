#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Predicted tokens/s of DDTREE(B), DFLASH and no speculation for a bigger target:
accept length measured on a learned pair x step time measured at the bigger target's shape.

    tokens/s(config) = batch * tau(config) / step_time(config)

``tau`` (tokens per verify step: completion tokens / verify steps, pooled over the run's
requests) comes from a ``benchmarks/budget_sweep.py`` result on a learned pair, per
(config, batch, temperature); no speculation has tau = 1. A DDTREE budget the sweep did not
run takes the tau its server counted for it (``accept_length_at_budget`` of a DDTREE row with
a larger budget: exact, docs/ddtree.md#metrics; marked ``tau_from``). ``step_time`` comes from
``benchmarks/e2e_step.py`` results (dummy weights at the shape of the bigger target), per
(shape, context, batch, config). A DDTREE budget without a step-time row at a point is
interpolated linearly in log2(B) between the nearest measured budgets (marked
``interpolated``), never extrapolated.

The check of the model itself: at the learned pair's own shape the sweep can measure the
step time the way e2e_step does (``--step-ctx``); the prediction from those step times and
the sweep's tau is compared with the sweep's measured tokens/s (``own_shape``; each
temperature charged the step measured at it where the sweep measured one, else the greedy
step). What it leaves out shows there: prefill, the first token, request overheads, and a step
cost that depends on what is accepted (random-prompt step times against real traffic).

That last one is charged when ``--token-cost-from`` names sweeps to fit it from: a step's host
work grows with the tokens it commits (each request's output is processed and streamed per
token), which a step measured on random prompts (about one token per request) leaves out. Per
temperature, ``token_costs`` fits the milliseconds per extra committed token from sweeps'
batch >= 2 points (real step = batch x tau / tokens/s, against the measured step at its own
accept length); every step then costs ``c x batch x (tau - its measured accept length)`` more.
Fit it from other runs than the one checked, so the own-shape error stays a check.

  python3 benchmarks/cost_model.py --sweep results/budget_sweep_learned.json \\
      --e2e benchmarks/results/e2e_step_uniform_tile64x32_h200_2026-11-30.json benchmarks/results/e2e_step_dummy_routing_matrix_h200_2026-11-30.json \\
      --tag learned --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
DDTREE = re.compile(r"^ddtree([1-9][0-9]*)$")
#: e2e_step verify strategies that are what the fork serves (its hook; "-" = no speculation).
SERVED_VERIFY = ("fused", "auto", "-", "default")
#: Points fit the per-token cost only where the traffic commits this many more tokens per step
#: than the step measurement did, and only at this batch size or above (a batch-1 step's
#: run-to-run spread is larger than one request's extra tokens cost).
TOKEN_COST_MIN_EXTRA = 0.5
TOKEN_COST_MIN_BATCH = 2


def budget_of(config: str) -> Optional[int]:
    m = DDTREE.match(config)
    return int(m.group(1)) if m else None


def shape_of(result: dict) -> str:
    for key in ("model", "shape"):
        if result.get(key):
            return str(result[key])
    if result.get("target"):  # e2e_step's --target (v2lite, qwen3-8b, ...)
        return f"{result['target']}-shape"
    what = result.get("what", "")
    return "v2lite-shape" if "V2-Lite" in what else (what or "unknown")


def load_step_rows(paths: list[Path], verify: tuple = SERVED_VERIFY, routing: Optional[str] = None,
                   backend: str = "triton") -> dict:
    """(shape, ctx, batch, config) -> {ms_per_step, source} of greedy runs; a later file's row
    replaces an earlier one."""
    table: dict = {}
    for p in paths:
        r = json.loads(Path(p).read_text())
        if routing is not None and r.get("expert_routing", "model") != routing:
            continue
        if r.get("sampling", "greedy") != "greedy":  # the model's step times are greedy steps
            continue
        shape = shape_of(r)
        for row in r.get("rows", []):
            if row.get("verify", "-") not in verify or "ms_per_step" not in row:
                continue
            if row.get("backend", backend) != backend:
                continue
            key = (row.get("model") or shape, int(row["ctx"]), int(row["batch"]), row["config"])
            table[key] = {"ms_per_step": float(row["ms_per_step"]), "source": Path(p).name,
                          "accept_length": float(row.get("accept_length") or 1.0),
                          "date": r.get("date"), "device": r.get("device")}
    return table


def step_ms(table: dict, shape: str, ctx: int, batch: int, config: str) -> Optional[dict]:
    """A measured step time, or for a DDTREE budget one interpolated in log2(B)."""
    hit = table.get((shape, ctx, batch, config))
    if hit is not None:
        return {**hit, "interpolated": False}
    b = budget_of(config)
    if b is None:
        return None
    have = sorted(budget_of(k[3]) for k in table if k[:3] == (shape, ctx, batch) and budget_of(k[3]))
    lo = max((x for x in have if x < b), default=None)
    hi = min((x for x in have if x > b), default=None)
    if lo is None or hi is None:
        return None
    a, c = table[(shape, ctx, batch, f"ddtree{lo}")], table[(shape, ctx, batch, f"ddtree{hi}")]
    w = (math.log2(b) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return {"ms_per_step": a["ms_per_step"] + w * (c["ms_per_step"] - a["ms_per_step"]),
            "source": f"{a['source']} + {c['source']}", "interpolated": True, "between": [lo, hi]}


def tau_table(sweep: dict) -> dict:
    """(config, batch, temperature) -> {"tau": tokens per verify step, "from": the sweep row's
    config}: measured (pooled) where the sweep ran the config, else, for a DDTREE budget, what
    the largest-budget DDTREE row of the point counted for it."""
    out, counted = {}, {}
    rows = [r for r in sweep["rows"] if r.get("top_p", 1.0) == 1.0 and r.get("top_k", 0) <= 0]
    for r in sorted(rows, key=lambda r: -(budget_of(r["config"]) or 0)):
        point = (int(r["batch"]), float(r["temperature"]))
        if r["config"] == "nospec":
            tau = 1.0
        else:
            tau = r.get("accept_length_pooled") or r.get("accept_length")
        if tau is not None:
            out[(r["config"], *point)] = {"tau": float(tau), "from": r["config"]}
        if budget_of(r["config"]):
            for b, x in (r.get("accept_length_at_budget") or {}).items():
                counted.setdefault((f"ddtree{int(b)}", *point), {"tau": float(x), "from": r["config"]})
    for key, entry in counted.items():
        out.setdefault(key, entry)
    return out


def taus(sweep: dict) -> dict:
    """(config, batch, temperature) -> tokens per verify step, from a budget sweep (``tau_table``)."""
    return {k: v["tau"] for k, v in tau_table(sweep).items()}


def token_cost(costs: Optional[dict], temperature: float) -> float:
    """Milliseconds per extra committed token at ``temperature`` (the greedy fit where none was
    fitted at it; 0 without a fit)."""
    if not costs:
        return 0.0
    return float(costs.get(float(temperature), costs.get(0.0, 0.0)))


def charged_ms(measured_ms: float, batch: int, tau: float, step_accept: float, costs: Optional[dict],
               temperature: float) -> float:
    """A measured step's time charged the host work of the tokens the traffic commits beyond it."""
    return measured_ms + token_cost(costs, temperature) * batch * max(0.0, tau - step_accept)


def _own_points(sweep: dict) -> list[tuple]:
    """(config, batch, temperature, tau, step row, measured tokens/s) of a sweep's points that
    have both a step row and a measured throughput (plain temperature sampling only)."""
    tau = taus(sweep)
    measured = {(r["config"], int(r["batch"]), float(r["temperature"])): r["throughput_tok_s"]
                for r in sweep["rows"] if r.get("top_p", 1.0) == 1.0 and r.get("top_k", 0) <= 0}
    steps = {(s["config"], int(s["batch"]), float(s.get("temperature", 0.0))): s for s in sweep.get("steps", [])
             if s.get("top_p", 1.0) == 1.0 and s.get("top_k", 0) <= 0}
    out = []
    for (config, batch, t), x in sorted(tau.items()):
        # The step measured at the point's own temperature; a sweep that measured greedy steps
        # only is charged those (marked: a sampled step costs more).
        s = steps.get((config, batch, t)) or steps.get((config, batch, 0.0))
        if s is not None and (config, batch, t) in measured:
            out.append((config, batch, t, x, s, measured[(config, batch, t)]))
    return out


def token_costs(sweeps: list[dict]) -> dict:
    """Temperature -> milliseconds of host work per committed token beyond the measured step's
    (median over the sweeps' points at batch >= ``TOKEN_COST_MIN_BATCH`` whose traffic commits
    at least ``TOKEN_COST_MIN_EXTRA`` more tokens per request and step)."""
    per_t: dict = {}
    for sweep in sweeps:
        for _, batch, t, tau, s, tok_s in _own_points(sweep):
            extra = tau - float(s.get("accept_length") or 1.0)
            if batch < TOKEN_COST_MIN_BATCH or extra < TOKEN_COST_MIN_EXTRA or tok_s <= 0:
                continue
            real_ms = batch * tau * 1000.0 / tok_s
            per_t.setdefault(t, []).append((real_ms - s["ms_per_step"]) / (batch * extra))
    return {t: statistics.median(v) for t, v in sorted(per_t.items())}


def predict(sweep: dict, table: dict, costs: Optional[dict] = None) -> list[dict]:
    """Per (shape, ctx, batch, temperature): predicted tokens/s of every config with both inputs
    (each step charged ``costs``' per-token host work: ``token_costs``)."""
    tau = tau_table(sweep)
    points = sorted({k[:3] for k in table})
    temps = sorted({k[2] for k in tau})
    out = []
    for shape, ctx, batch in points:
        for t in temps:
            configs = {}
            for (config, b, tt), x in sorted(tau.items()):
                if b != batch or tt != t:
                    continue
                s = step_ms(table, shape, ctx, batch, config)
                if s is None:
                    continue
                ms = charged_ms(s["ms_per_step"], batch, x["tau"], s.get("accept_length", 1.0), costs, t)
                configs[config] = {"tau": x["tau"], "ms_per_step": ms, "measured_ms_per_step": s["ms_per_step"],
                                   "interpolated": s["interpolated"], "source": s["source"],
                                   "tok_s": batch * x["tau"] * 1000.0 / ms}
                if x["from"] != config:
                    configs[config]["tau_from"] = x["from"]
            if not configs:
                continue
            base, chain = configs.get("nospec"), configs.get("dflash")
            for c, e in configs.items():
                if base:
                    e["speedup_vs_nospec"] = e["tok_s"] / base["tok_s"]
                if chain and c != "dflash":
                    e["speedup_vs_dflash"] = e["tok_s"] / chain["tok_s"]
            trees = {c: e for c, e in configs.items() if budget_of(c)}
            best = max(trees, key=lambda c: trees[c]["tok_s"], default=None)
            out.append({"shape": shape, "ctx": ctx, "batch": batch, "temperature": t, "configs": configs,
                        "best_ddtree": best})
    return out


def own_shape(sweep: dict, costs: Optional[dict] = None) -> list[dict]:
    """The model at the learned pair's own shape: its e2e-style step times (charged ``costs``'
    per-token host work) x its tau, against the tokens/s the sweep measured (same servers, same
    run)."""
    out = []
    for config, batch, t, x, s, tok_s in _own_points(sweep):
        ms = charged_ms(s["ms_per_step"], batch, x, float(s.get("accept_length") or 1.0), costs, t)
        pred = batch * x * 1000.0 / ms
        out.append({"config": config, "batch": batch, "temperature": t, "tau": x, "ms_per_step": ms,
                    "measured_ms_per_step": s["ms_per_step"], "step_temperature": float(s.get("temperature", 0.0)),
                    "predicted_tok_s": pred, "measured_tok_s": tok_s, "error": pred / tok_s - 1.0})
    return out


def error_summary(own: list[dict]) -> Optional[dict]:
    """Mean and largest |predicted / measured - 1| of own-shape points."""
    errs = [abs(o["error"]) for o in own]
    return {"max_abs": max(errs), "mean_abs": sum(errs) / len(errs)} if errs else None


def markdown(pred: list[dict], temperature: float = 0.0) -> str:
    """The README table: per point, DFLASH's predicted tokens/s, the best budget and every
    budget's ratio to DFLASH (* = step time interpolated between measured budgets)."""
    lines = ["| shape | ctx | batch | DFLASH tok/s | best DDTREE | its tok/s | x DFLASH | DDTREE(B) x DFLASH |",
             "|---|---|---|---|---|---|---|---|"]
    for p in pred:
        if p["temperature"] != temperature or "dflash" not in p["configs"]:
            continue
        chain = p["configs"]["dflash"]["tok_s"]
        best = p["best_ddtree"]
        trees = sorted((budget_of(c), e) for c, e in p["configs"].items() if budget_of(c))
        per_b = ", ".join(f"{b}: {e['speedup_vs_dflash']:.2f}{'*' if e['interpolated'] else ''}" for b, e in trees)
        if best:
            e = p["configs"][best]
            cells = [best, f"{e['tok_s']:.0f}", f"{e['speedup_vs_dflash']:.2f}", per_b]
        else:
            cells = ["-", "-", "-", ""]
        lines.append(f"| {p['shape']} | {p['ctx']} | {p['batch']} | {chain:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG", flush=True)
        return
    preds = [p for p in result["predictions"] if p["temperature"] == 0.0]
    own = result["own_shape"]
    n = len(preds) + (1 if own else 0)
    if n == 0:
        return
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, p in zip(axes.flat, preds):
        trees = sorted((budget_of(c), e) for c, e in p["configs"].items() if budget_of(c))
        if trees:
            ax.plot([b for b, _ in trees], [e["tok_s"] for _, e in trees], "o-", label="DDTREE(B)")
            for b, e in trees:
                if e["interpolated"]:
                    ax.plot([b], [e["tok_s"]], "o", mfc="white", color="C0")
        if "dflash" in p["configs"]:
            ax.axhline(p["configs"]["dflash"]["tok_s"], ls="--", color="C1", label="DFLASH")
        if "nospec" in p["configs"]:
            ax.axhline(p["configs"]["nospec"]["tok_s"], ls=":", color="C2", label="no spec")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{p['shape']} ctx {p['ctx']} bs {p['batch']} T=0", fontsize=8)
        ax.set_xlabel("budget B", fontsize=8)
        ax.set_ylabel("predicted tok/s", fontsize=8)
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    if own:
        ax = axes.flat[len(preds)]
        for batch in sorted({o["batch"] for o in own}):
            sel = [o for o in own if o["batch"] == batch]
            ax.plot([o["measured_tok_s"] for o in sel], [o["predicted_tok_s"] for o in sel], "o", label=f"bs {batch}")
        lim = max(max(o["measured_tok_s"], o["predicted_tok_s"]) for o in own) * 1.1
        ax.plot([0, lim], [0, lim], "k--", lw=0.8)
        ax.set_title("learned pair: predicted vs measured", fontsize=8)
        ax.set_xlabel("measured tok/s", fontsize=8)
        ax.set_ylabel("predicted tok/s", fontsize=8)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(f"cost model: learned-pair accept length x e2e_step step time ({result['date']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", type=Path, required=True, help="a budget_sweep JSON")
    ap.add_argument("--e2e", type=Path, nargs="+", required=True, help="e2e_step JSON files (later ones win)")
    ap.add_argument("--verify", default=",".join(SERVED_VERIFY), help="e2e_step verify strategies to use")
    ap.add_argument("--routing", help="only e2e_step runs with this expert routing (model / uniform)")
    ap.add_argument("--backend", default="triton", help="e2e_step attention backend to use")
    ap.add_argument("--token-cost-from", type=Path, nargs="+", default=[],
                    help="budget_sweep JSONs to fit the host cost per committed token from (other runs "
                         "than --sweep, so its own-shape error stays a check)")
    ap.add_argument("--tag", default="run")
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args(argv)
    for p in [args.sweep, *args.e2e, *args.token_cost_from]:
        if not p.is_file():
            raise SystemExit(f"{p}: no such file")
    sweep = json.loads(args.sweep.read_text())
    if "rows" not in sweep or not sweep["rows"]:
        raise SystemExit(f"{args.sweep}: no sweep rows")
    table = load_step_rows(args.e2e, tuple(args.verify.split(",")), args.routing, args.backend)
    if not table:
        raise SystemExit("no usable e2e_step rows (check --verify / --routing)")
    costs = token_costs([json.loads(p.read_text()) for p in args.token_cost_from]) or None
    if args.token_cost_from and not costs:
        raise SystemExit(f"--token-cost-from: no batch >= {TOKEN_COST_MIN_BATCH} point with step rows in "
                         f"{', '.join(map(str, args.token_cost_from))} to fit a per-token cost from")
    result = {
        "what": "cost model: learned-pair accept length x e2e_step step time (benchmarks/cost_model.py)",
        "date": time.strftime("%Y-%m-%d"),
        "sweep": {"file": str(args.sweep), "date": sweep.get("date"), "device": sweep.get("device")},
        "e2e_step_files": [str(p) for p in args.e2e],
        "filters": {"verify": args.verify, "routing": args.routing, "backend": args.backend},
        "token_cost_ms": {str(t): c for t, c in (costs or {}).items()},
        "token_cost_from": [str(p) for p in args.token_cost_from],
        "predictions": predict(sweep, table, costs),
        "own_shape": own_shape(sweep, costs),
    }
    result["own_shape_error"] = error_summary(result["own_shape"])
    result["own_shape_error_without_token_cost"] = error_summary(own_shape(sweep)) if costs else None
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"cost_model_{args.tag}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(markdown(result["predictions"]))
    if costs:
        print("host cost per committed token (ms): " + ", ".join(f"T={t:g} {c:.3f}" for t, c in costs.items()))
    for key, what in (("own_shape_error", "own shape"), ("own_shape_error_without_token_cost", "  without it")):
        if result[key]:
            print(f"{what}: |predicted / measured - 1| mean {result[key]['mean_abs']:.1%}, "
                  f"max {result[key]['max_abs']:.1%}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
