# SPDX-License-Identifier: Apache-2.0
"""Where one layer of ``flashmla_split`` spends its time.

Times, per shape (CUDA-graph replay medians, as ``verify_attention.py``): the page
copy; the chunks' query copy; FlashMLA over whole requests (its own KV splits and
combine) and over KV chunks (``kv_chunks``: nothing to split), with zero-stride
shared queries and with a copy per chunk; the tail alone; the chunk merge; the
whole-request path (FlashMLA's own KV splits, the merge in the tail's epilogue); the
strategy as it runs, serial and with the tail on a side stream; and the fused kernel.
Every composite is checked against the reference first.

    python benchmarks/flashmla_split_parts.py --tag h200 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch

from benchmarks.gpu_timing import bench
from benchmarks.verify_attention import make_inputs

from sglang.srt.layers.attention.tree_verify import flashmla_split as fm
from sglang.srt.layers.attention.tree_verify.configs import select_config
from sglang.srt.layers.attention.tree_verify.prefix_split import (
    merge_external_prefix,
    tail_partials,
    tree_verify_fused,
)
from sglang.srt.layers.attention.tree_verify.reference import tree_verify_attention_ref

SHAPES = [(16, 17, 1024, 1), (16, 17, 16384, 1), (16, 65, 1024, 1), (16, 65, 16384, 1),
          (16, 65, 16384, 2), (16, 65, 16384, 8), (16, 129, 16384, 1), (128, 65, 16384, 1)]  # fmt: skip


def checked(name, out, ref, row, tol=2e-2):
    err = (out.float() - ref).abs().max().item()
    if not err < tol:
        raise AssertionError(f"{name} at {row}: max error {err}")


def measure(h, n, p, bs):
    args = make_inputs(h, n, p, bs)
    q, k, v, indptr, pidx, tidx, mask, scale = args
    base = select_config(torch.cuda.get_device_capability(), 576, 512, True)
    staging = fm.new_staging(fm.staging_pages(bs, pidx.numel()), k)
    plan = fm.plan_flashmla(indptr, n, h, p, staging.shape[0])
    whole = fm.plan_flashmla(indptr, n, h, p, staging.shape[0], chunks=1)
    flash_mla_with_kvcache, _ = fm._flash_mla()
    row = dict(H=h, N=n, P=p, bs=bs, chunks=plan.chunks,
               flashmla_splits_chunked=int(plan.splits[-1]), flashmla_splits_whole=int(whole.splits[-1]))  # fmt: skip
    ref = tree_verify_attention_ref(*args).float()
    out = torch.empty(bs * n, h, 512, dtype=q.dtype, device=q.device)
    row["gather_ms"] = bench(
        lambda: fm.gather_prefix_pages(k, indptr, pidx, plan.page_start, plan.max_pages, staging)
    )
    q5 = q.reshape(bs, 1, n, h, 576)
    row["query_copy_ms"] = bench(lambda: q5.expand(bs, plan.chunks, n, h, 576).contiguous())

    def flashmla(pl, qx):
        return flash_mla_with_kvcache(
            qx, staging, pl.page_table, pl.lengths, 512, pl.schedule, pl.splits,
            softmax_scale=scale, causal=False,
        )  # fmt: skip

    q_chunks = q5.expand(bs, plan.chunks, n, h, 576).reshape(bs * plan.chunks, n, h, 576)
    row["flashmla_whole_ms"] = bench(lambda: flashmla(whole, q.reshape(bs, n, h, 576)))
    # As the strategy runs it: a lone request's chunks share its queries (zero stride).
    row["flashmla_chunked_ms"] = bench(lambda: flashmla(plan, q_chunks if bs == 1 else q_chunks.contiguous()))
    if bs == 1 and plan.chunks > 1:
        o_copy = flashmla(plan, q_chunks.contiguous())[0]
        o_shared = flashmla(plan, q_chunks)[0]
        row["shared_queries_max_diff"] = (o_copy.float() - o_shared.float()).abs().max().item()
        row["flashmla_chunked_copied_queries_ms"] = bench(lambda: flashmla(plan, q_chunks.contiguous()))

    tail_o = torch.empty(bs * n * h, 512, dtype=torch.float32, device=q.device)
    tail_lse = torch.empty(bs * n * h, dtype=torch.float32, device=q.device)
    row["tail_ms"] = bench(
        lambda: tail_partials(q, k, v, indptr, pidx, tidx, mask, scale, base, tail_o, tail_lse)
    )
    o_pre, lse_pre = fm.flashmla_prefix_pass(q, k, indptr, pidx, scale, plan, staging)
    row["merge_ms"] = bench(
        lambda: fm.merge_chunks(o_pre, lse_pre, tail_o, tail_lse, indptr, plan.chunks, out)
    )
    checked("merge", out, ref, row)

    def whole_requests():  # FlashMLA's own KV splits, the merge in the tail's epilogue
        o_w, lse_w = fm.flashmla_prefix_pass(q, k, indptr, pidx, scale, whole, staging)
        return merge_external_prefix(
            q, k, v, indptr, pidx, tidx, mask, scale, base, o_w, lse_w, out, lse_scale=fm._LOG2E
        )

    whole_requests()
    checked("whole requests", out, ref, row)
    row["whole_requests_ms"] = bench(whole_requests)
    for name, overlap in (("serial_ms", False), ("overlap_ms", True)):
        run = lambda overlap=overlap: fm.tree_verify_flashmla_split(  # noqa: E731
            *args, out, 0.0, base, staging=staging, plan=plan, overlap=overlap
        )
        out.fill_(float("nan"))
        run()
        checked(name, out, ref, row)
        row[name] = bench(run)
    row["flashmla_split_ms"] = row["overlap_ms"]
    row["fused_ms"] = bench(lambda: tree_verify_fused(*args, out, 0.0, base))
    return row


def plot(rows, path):
    from benchmarks.plotting import pyplot

    plt = pyplot()
    if plt is None:
        return

    labels = [f"H{r['H']} N{r['N']} P{r['P'] // 1024}K bs{r['bs']}" for r in rows]
    parts = {
        "page copy": "gather_ms", "FlashMLA as run": "flashmla_chunked_ms",
        "tail": "tail_ms", "merge": "merge_ms",
    }  # fmt: skip
    fig, ax = plt.subplots(figsize=(11, 4.8))
    bottom = [0.0] * len(rows)
    for name, key in parts.items():
        vals = [r[key] for r in rows]
        ax.bar(range(len(rows)), vals, bottom=bottom, label=f"{name} (alone)")
        bottom = [b + v for b, v in zip(bottom, vals)]
    marks = {"whole_requests_ms": ("kx", "whole requests, epilogue merge"), "serial_ms": ("bv", "KV chunks, serial"),
             "overlap_ms": ("k^", "KV chunks, tail beside FlashMLA"), "fused_ms": ("rs", "fused kernel")}  # fmt: skip
    for key, (style, label) in marks.items():
        ax.plot(range(len(rows)), [r[key] for r in rows], style, label=label)
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
