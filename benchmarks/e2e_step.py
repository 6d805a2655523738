#!/usr/bin/env python3
"""Decode step time of the whole server on the DeepSeek-V2-Lite-shaped dummy model.

One server start per configuration (120-250 s with CUDA graphs at this shape), then for
every (context, batch) point: ``batch`` concurrent streaming /generate requests of
``context`` random prompt tokens. The step time is the median gap between consecutive
stream chunks (one chunk per decode or verify step with the default stream interval)
inside the window where every request of the batch is decoding; the accept length is
``completion_tokens / spec_verify_ct`` from the final meta info. Dummy weights make a
DFlash drafter useless (accept length 1), so for speculative configurations the step time,
not tokens/s, is the number to compare; it is what upstream's reference run reports
(../shared/reference/e2e_baseline_h200.jsonl).

Run on the GPU host after scripts/gpu_host/install.sh (source scripts/gpu_host/env.sh):
  python3 benchmarks/e2e_step.py --models /tmp/ddtree-models --configs nospec,dflash \\
      --backend triton --ctx 16384 --batch 1 --tag h200_16k_b1
Subsets are chosen by flags so that each group fits one <=10-minute device call.
Writes benchmarks/results/e2e_step_<tag>.json (+ .png when matplotlib is present).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "gpu"))
from conftest import launch_server  # noqa: E402  (the GPU tier's server launcher)

CONFIGS = {
    "nospec": [],
    "dflash": ["--speculative-algorithm", "DFLASH"],
    "ddtree16": ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "16"],
    "ddtree64": ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "64"],
    "ddtree128": ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "128"],
}


def server_args(config: str, backend: str, drafter: str, max_ctx: int, max_batch: int) -> list[str]:
    args = [
        "--load-format", "dummy",
        "--attention-backend", backend,
        "--disable-radix-cache",
        "--skip-tokenizer-init",
        "--context-length", str(max_ctx + 1024),
        "--max-running-requests", str(max(8, max_batch)),
        "--cuda-graph-max-bs", str(max_batch),
        "--mem-fraction-static", "0.8",
        "--chunked-prefill-size", "16384",
    ] + CONFIGS[config]
    if config != "nospec":
        args += ["--speculative-draft-model-path", drafter]
    return args


def one_request(server, ids, new_tokens, out: dict) -> None:
    stamps = []
    payload = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens,
                                                     "ignore_eos": True}}
    last = None
    try:
        for ev in server.stream("/generate", payload, timeout=900):
            stamps.append(time.perf_counter())
            last = ev
    except Exception as e:  # surfaced by measure(), not lost in the thread
        out["error"] = repr(e)
    out["stamps"], out["meta"] = stamps, (last or {}).get("meta_info", {})


def measure(server, ctx: int, batch: int, new_tokens: int, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(16, vocab) for _ in range(ctx)] for _ in range(batch)]
    results = [{} for _ in range(batch)]
    threads = [threading.Thread(target=one_request, args=(server, p, new_tokens, r)) for p, r in zip(prompts, results)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    errors = [r.get("error", "no tokens streamed") for r in results if "error" in r or not r["stamps"]]
    if errors:
        raise RuntimeError(f"requests failed at ctx={ctx} batch={batch}: {errors}")
    start = max(r["stamps"][0] for r in results)  # every request has its first token
    end = min(r["stamps"][-1] for r in results)  # no request has finished yet
    gaps = []
    for r in results:
        s = [x for x in r["stamps"] if start <= x <= end]
        gaps += [b - a for a, b in zip(s, s[1:])]
    if len(gaps) < 8:
        raise RuntimeError(f"too few decode steps in the common window ({len(gaps)}); raise --new-tokens")
    metas = [r["meta"] for r in results]
    verify = sum(m.get("spec_verify_ct", 0) or 0 for m in metas)
    tokens = sum(m.get("completion_tokens", 0) for m in metas)
    return {
        "ctx": ctx,
        "batch": batch,
        "ms_per_step": 1000 * statistics.median(gaps),
        "ms_per_step_p90": 1000 * sorted(gaps)[int(0.9 * (len(gaps) - 1))],
        "steps_measured": len(gaps),
        "accept_length": (tokens / verify) if verify else 1.0,
        "completion_tokens": tokens,
        "wall_s": wall,
    }


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = sorted({(r["config"], r["backend"], r["verify"], r["batch"]) for r in rows})
    for key in keys:
        pts = sorted((r["ctx"], r["ms_per_step"]) for r in rows if (r["config"], r["backend"], r["verify"], r["batch"]) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label="%s %s %s bs%d" % key)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("ms per decode/verify step (median)")
    ax.set_title("DeepSeek-V2-Lite shape, dummy weights")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=Path, default=Path(os.environ.get("DDTREE_TEST_MODELS", "/tmp/ddtree-models")))
    ap.add_argument("--configs", default="nospec,dflash", help=f"comma list of {list(CONFIGS)}")
    ap.add_argument("--backend", default="triton", choices=["triton", "flashinfer"])
    ap.add_argument("--verify", default="default", help="SGLANG_DDTREE_VERIFY_STRATEGY for DDTREE (fused, upstream_extend, ...)")
    ap.add_argument("--ctx", default="16384", help="comma list, e.g. 1024,4096,16384,32768")
    ap.add_argument("--batch", default="1", help="comma list, e.g. 1,8")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--tag", default=time.strftime("%Y%m%d-%H%M%S"))
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/ddtree-bench-logs"))
    args = ap.parse_args(argv)

    ctxs = [int(x) for x in args.ctx.split(",")]
    batches = [int(x) for x in args.batch.split(",")]
    configs = args.configs.split(",")
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        ap.error(f"unknown configs {bad}; choose from {list(CONFIGS)}")
    target, drafter = args.models / "v2lite-shape", args.models / "v2lite-shape-dflash"
    if not (target / "config.json").exists():
        ap.error(f"{target} missing: run scripts/make_test_models.py {args.models} --only shapes")
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    args.log_dir.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    rows = []
    for config in configs:
        env = {"SGLANG_DDTREE_VERIFY_STRATEGY": args.verify} if args.verify != "default" else {}
        t0 = time.time()
        with launch_server(config, str(target), server_args(config, args.backend, str(drafter), max(ctxs), max(batches)),
                           args.log_dir, timeout=600, env=env) as server:
            start_s = time.time() - t0
            print(f"[{config}] healthy after {start_s:.0f} s", flush=True)
            measure(server, 256, 1, 24, vocab, seed=0)  # warm-up outside the numbers
            for ctx in ctxs:
                for batch in batches:
                    r = measure(server, ctx, batch, args.new_tokens, vocab, seed=ctx + batch)
                    r.update(config=config, backend=args.backend, verify=args.verify, server_start_s=start_s)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    result = {
        "what": "decode step time, DeepSeek-V2-Lite-shaped target (dummy weights), benchmarks/e2e_step.py",
        "date": time.strftime("%Y-%m-%d"),
        "device": device,
        "argv": sys.argv[1:],
        "rows": rows,
    }
    out = args.out_dir / f"e2e_step_{args.tag}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, out.with_suffix(".png"))
    print(f"{'config':10} {'ctx':>6} {'bs':>3} {'ms/step':>8} {'accept':>6}")
    for r in rows:
        print(f"{r['config']:10} {r['ctx']:>6} {r['batch']:>3} {r['ms_per_step']:>8.2f} {r['accept_length']:>6.2f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
