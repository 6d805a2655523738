# SPDX-License-Identifier: Apache-2.0
"""Accept lengths of a learned pair's drafters side by side, replayed offline.

For each sampling setting and seed, the target's own continuations of the pair's held-out
prompts are generated once (``evaluate.sampled_continuations``: the same tokens for every
drafter), and each drafter's DFLASH chain and DDTREE trees of each budget are replayed on them
(``evaluate.offline_accept_sampled``, the tree scored from the drafter's own distribution as
the server builds it). Accept length = tokens per verify step. The first drafter is the
reference: every other one gets its ratio to it, per seed and as the median over seeds.
Runs on a CPU (torch models, no server); the budget's step cost is not part of it, so a
drafter change is priced in tokens/s only by the server sweep.

    python3 -m benchmarks.drafter_accept PAIR --drafters drafter,drafter-soft \\
        --sampling 0,1,0.7/20/0.8 --budgets 1,16,64 --seeds 0,1 --tag NAME --out-dir DIR
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from benchmarks.plotting import pyplot


def _manifest_record(manifest: dict, drafter: str) -> dict:
    """What the pair's manifest says about how ``drafter`` was trained."""
    from scripts.learned_pair.checkpoint import added_drafters

    if drafter == "drafter":
        return {"data": manifest.get("drafter_data"), "train": _train_summary(manifest.get("drafter_train", {}))}
    rec = added_drafters(manifest).get(drafter, {})
    return {"init_from": rec.get("init_from"), "data": rec.get("data"), "train": _train_summary(rec.get("train", {})),
            "added": rec.get("added", {}).get("date")}


def _train_summary(train: dict) -> dict:
    keys = ("steps", "batch", "anchors", "lr", "soft_labels", "final_loss", "wall_s", "accuracy_by_offset")
    return {k: train[k] for k in keys if k in train}


def run(pair: Path, drafters: list[str], settings: list[str], budgets: list[int], seeds: list[int], prompts: int,
        new_tokens: int, device: str = "cpu", log=print) -> dict:
    import torch

    from scripts.learned_pair import checkpoint, evaluate
    from scripts.learned_pair.tokenizer import MASK_ID

    manifest = json.loads((pair / "manifest.json").read_text())
    models = {d: checkpoint.load_pair(pair, device, drafter=d) for d in drafters}
    rows = [json.loads(line) for line in (pair / "prompts.jsonl").read_text().splitlines() if line.strip()]
    ids = [r["prompt_ids"] for r in rows[:prompts]]
    result = {
        "what": "offline accept length (tokens per verify step) of a pair's drafters on the target's own "
                "continuations; the first drafter is the reference",
        "pair": str(pair), "pair_date": manifest.get("date"), "date": time.strftime("%Y-%m-%d"),
        "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "device": device, "torch_threads": torch.get_num_threads(), "argv": sys.argv[1:],
        "prompts": len(ids), "new_tokens": new_tokens, "seeds": seeds, "budgets": budgets,
        "drafters": {d: _manifest_record(manifest, d) for d in drafters}, "settings": [],
    }
    for spec in settings:
        sampling = evaluate.Sampling.parse(spec)
        per: dict = {d: {} for d in drafters}
        for seed in seeds:
            for d in drafters:
                target, drafter = models[d]
                t0 = time.monotonic()
                r = evaluate.offline_accept_sampled(drafter, target, ids, new_tokens, budgets, MASK_ID, seed, sampling,
                                                    scorings=("raw",))  # fmt: skip
                configs = _configs(r)
                for c in configs:
                    per[d].setdefault(c, []).append(r[c])
                log(json.dumps({"setting": spec, "seed": seed, "drafter": d, "s": round(time.monotonic() - t0, 1),
                                **{c: round(r[c], 3) for c in configs}}))
        ref = drafters[0]
        row = {"sampling": spec, "accept": {}, "ratio_to_reference": {}}
        for d in drafters:
            row["accept"][d] = {c: {"median": statistics.median(v), "per_seed": v} for c, v in per[d].items()}
            if d != ref:  # the configurations both have (a DFlash 2 drafter adds its selector's)
                row["ratio_to_reference"][d] = {
                    c: {"median": statistics.median(a / b for a, b in zip(per[d][c], per[ref][c])),
                        "per_seed": [a / b for a, b in zip(per[d][c], per[ref][c])]}
                    for c in per[d] if c in per[ref]}
        result["settings"].append(row)
    return result


def _configs(replay: dict) -> list[str]:
    """The accept lengths in one replay's result: DFLASH's chain and DDTREE per budget (and a
    DFlash 2 drafter's selector chain and transition trees)."""
    return [k for k, v in replay.items() if k.startswith(("dflash", "ddtree")) and isinstance(v, float)]


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    settings = result["settings"]
    drafters = list(result["drafters"])
    configs = list(dict.fromkeys(c for d in drafters for c in settings[0]["accept"][d]))
    fig, axes = plt.subplots(1, len(settings), figsize=(4.2 * len(settings), 3.6), squeeze=False)
    width = 0.8 / len(drafters)
    for ax, row in zip(axes[0], settings):
        for i, d in enumerate(drafters):
            vals = [row["accept"][d].get(c, {}).get("median", 0.0) for c in configs]
            ax.bar([x + i * width for x in range(len(configs))], vals, width, label=d)
        ax.set_xticks([x + width * (len(drafters) - 1) / 2 for x in range(len(configs))], configs, rotation=30,
                      ha="right", fontsize=7)
        ax.set_title(f"sampling {row['sampling']}")
        ax.set_ylabel("accept length (tokens / step)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{result['date']}, {result['host']}: offline replay, {result['prompts']} prompts x "
                 f"{result['new_tokens']} tokens, seeds {result['seeds']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pair", type=Path)
    ap.add_argument("--drafters", default="drafter", help="the pair's drafter directories, the reference first")
    ap.add_argument("--sampling", default="0,1,0.7/20/0.8", help="settings T[/top_k[/top_p[/min_p]]], comma-separated")
    ap.add_argument("--budgets", default="1,16,64")
    ap.add_argument("--seeds", default="0", help="continuation seeds (each a separate replay)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--device", default="cpu", help="torch device of the replay (float32 either way)")
    ap.add_argument("--tag", required=True)
    ap.add_argument("--out-dir", type=Path, required=True)
    args = ap.parse_args(argv)
    if not (args.pair / "manifest.json").is_file():
        ap.error(f"{args.pair} is not a learned pair (no manifest.json)")
    drafters = [d for d in args.drafters.split(",") if d]
    missing = [d for d in drafters if not (args.pair / d / "model.safetensors").is_file()]
    if missing or len(set(drafters)) != len(drafters):
        ap.error(f"--drafters: each once, each a drafter directory of the pair; not found: {missing}")
    try:
        budgets = [int(b) for b in args.budgets.split(",")]
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        ap.error("--budgets and --seeds take comma-separated integers")
    if any(b < 1 for b in budgets):
        ap.error("--budgets must be >= 1")
    result = run(args.pair, drafters, args.sampling.split(","), budgets, seeds, args.prompts, args.new_tokens,
                 args.device)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"{args.tag}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out_dir / f"{args.tag}.png")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
