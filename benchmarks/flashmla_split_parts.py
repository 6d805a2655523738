"""Where one layer of ``flashmla_split`` spends its time, and which tail tile is fastest.

Times, per shape (CUDA-graph replay medians, as ``verify_attention.py``): the page
copy alone, FlashMLA alone over the copied pages, the tail kernel with the
prefix pass merged in its epilogue for several tiles, the whole strategy as the
hook runs it (plan made ahead, once per forward), and the fused kernel. The
tail is latency-bound (a few 64-key tiles per program), so the sweep varies the
rows per program and the warps rather than the prefix tiling.

    python benchmarks/flashmla_split_parts.py --tag s8 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_timing import bench  # noqa: E402
from verify_attention import make_inputs  # noqa: E402

from sglang.srt.layers.attention.tree_verify import flashmla_split as fm
from sglang.srt.layers.attention.tree_verify.configs import select_config
from sglang.srt.layers.attention.tree_verify.prefix_split import (
    merge_external_prefix,
    tree_verify_fused,
)
from sglang.srt.layers.attention.tree_verify.reference import tree_verify_attention_ref

SHAPES = [(16, 17, 1024, 1), (16, 17, 16384, 1), (16, 65, 16384, 1), (16, 65, 16384, 8),
          (16, 129, 16384, 1), (128, 65, 16384, 1)]  # fmt: skip
TAIL_TILES = [  # (block_m, num_warps, dv_split)
    (64, 8, 1), (64, 4, 1), (64, 8, 2), (64, 4, 2), (32, 4, 1), (32, 4, 2), (16, 4, 1), (16, 4, 2),
]  # fmt: skip


def tail_config(base, block_m, warps, dv_split):
    return dataclasses.replace(
        base, block_m=block_m, num_warps=warps, dv_split=dv_split, scores_via_scratch=False,
        q_as_b=False, qk_ahead=False, num_stages=1,
    )  # fmt: skip


def measure(h, n, p, bs):
    args = make_inputs(h, n, p, bs)
    q, k, v, indptr, pidx, tidx, mask, scale = args
    base = select_config(torch.cuda.get_device_capability(), 576, 512, True)
    staging = fm.new_staging(fm.staging_pages(bs, pidx.numel()), k)
    plan = fm.plan_flashmla(indptr, n, h, p, staging.shape[0])
    flash_mla_with_kvcache, _ = fm._flash_mla()
    row = dict(H=h, N=n, P=p, bs=bs)
    row["gather_ms"] = bench(
        lambda: fm.gather_prefix_pages(k, indptr, pidx, plan.page_start, plan.max_pages, staging)
    )
    q4 = q.reshape(bs, n, h, 576)
    row["flashmla_ms"] = bench(
        lambda: flash_mla_with_kvcache(
            q4, staging, plan.page_table, plan.lengths, 512, plan.schedule, plan.splits,
            softmax_scale=scale, causal=False,
        )  # fmt: skip
    )
    o_pre, lse_pre = fm.flashmla_prefix_pass(q, k, indptr, pidx, scale, plan, staging)
    ref = tree_verify_attention_ref(*args).float()
    out = torch.empty(bs * n, h, 512, dtype=q.dtype, device=q.device)
    row["tail_merge_ms"] = {}
    for tile in TAIL_TILES:
        cfg = tail_config(base, *tile)

        def run(cfg=cfg):
            return merge_external_prefix(
                q, k, v, indptr, pidx, tidx, mask, scale, cfg, o_pre, lse_pre, out,
                lse_scale=fm._LOG2E,
            )  # fmt: skip

        run()
        err = (out.float() - ref).abs().max().item()
        if err > 2e-2:
            raise AssertionError(f"tail tile {tile} at {row}: max error {err}")
        row["tail_merge_ms"]["m%d_w%d_dv%d" % tile] = bench(run)
    row["flashmla_split_ms"] = bench(
        lambda: fm.tree_verify_flashmla_split(
            *args, out, 0.0, base, staging=staging, plan=plan
        )  # fmt: skip
    )
    row["fused_ms"] = bench(lambda: tree_verify_fused(*args, out, 0.0, base))
    return row


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"H{r['H']} N{r['N']} P{r['P'] // 1024}K bs{r['bs']}" for r in rows]
    parts = {
        "page copy": [r["gather_ms"] for r in rows],
        "FlashMLA": [r["flashmla_ms"] for r in rows],
        "best tail + merge": [min(r["tail_merge_ms"].values()) for r in rows],
    }
    fig, ax = plt.subplots(figsize=(10, 4.5))
    bottom = [0.0] * len(rows)
    for name, vals in parts.items():
        ax.bar(range(len(rows)), vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(range(len(rows)), [r["flashmla_split_ms"] for r in rows], "k^", label="flashmla_split")
    ax.plot(range(len(rows)), [r["fused_ms"] for r in rows], "rs", label="fused")
    ax.set_xticks(range(len(rows)), labels, rotation=20, fontsize=8)
    ax.set_ylabel("ms per layer")
    ax.set_title(f"flashmla_split per layer, {torch.cuda.get_device_name()}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tag", default="run")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = ap.parse_args()
    rows = []
    for shape in SHAPES:
        rows.append(measure(*shape))
        print(json.dumps(rows[-1]), flush=True)
    meta = dict(date=str(datetime.date.today()), gpu=torch.cuda.get_device_name(),
                capability=list(torch.cuda.get_device_capability()), timing="cuda_graph_replay")  # fmt: skip
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"flashmla_split_parts_{a.tag}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    plot(rows, stem + ".png")
    print("wrote", stem + ".json")


if __name__ == "__main__":
    main()
