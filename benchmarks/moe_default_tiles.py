#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Fused-MoE time per call under upstream's default row-tile rule and this fork's (patch 0060).

Without a tuned config file, upstream 0.5.17 switches the fused-MoE kernel from its 16-row to
its 64-row tile as soon as a batch has more tokens than the model has experts; patch 0060
keeps the 16-row tile while an expert's share of the batch (tokens * top_k / experts rows)
fits it. Tree-verify batches (batch x (B+1) tokens) are where the two differ. For each MoE
shape and token count this times upstream's real ``fused_experts`` (bf16, CUDA-graph replay,
median) with the config each rule picks, routed the way a trained router spreads tokens
(top-k distinct experts per token, uniformly at random), and reports the ratio and the
fraction of the weight-streaming roofline (bytes of the experts the batch touches over the
copy bandwidth measured in the same run). JSON + PNG.

GPU host, after scripts/gpu_host/install.sh and ``source scripts/gpu_host/env.sh``:
  python3 benchmarks/moe_default_tiles.py --tag h200 --out-dir DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch

from benchmarks.gpu_timing import bench, measure_peaks

from sglang.srt.layers.moe.moe_runner.triton_utils import default_row_tile  # noqa: E402
from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import (  # noqa: E402
    get_default_config,
)


@dataclass(frozen=True)
class MoeShape:
    name: str
    experts: int
    top_k: int
    intermediate: int  # per expert (N of w2)
    hidden: int


SHAPES = {
    "deepseek-v2-lite": MoeShape("deepseek-v2-lite", 64, 6, 1408, 2048),
    "qwen3-30b-a3b": MoeShape("qwen3-30b-a3b", 128, 8, 768, 2048),
}

#: Token counts: decode and DFLASH blocks, then DDTREE verifies (batch x (B+1)).
TOKENS = (1, 16, 17, 33, 64, 65, 96, 128, 130, 136, 160, 192, 256, 264, 520, 1032)
NAMED = {16: "DFLASH bs1", 17: "B=16 bs1", 33: "B=32 bs1", 64: "B=63 bs1", 65: "B=64 bs1",
         128: "DFLASH bs8", 130: "B=64 bs2", 136: "B=16 bs8", 264: "B=32 bs8",
         520: "B=64 bs8", 1032: "B=128 bs8"}
RULES = default_row_tile.TILE_RULES  # ("rows_per_expert", "upstream")


def publish_minimal_server_args():
    """get_default_config reads the exec namespace of the process's published ServerArgs."""
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    d = tempfile.mkdtemp(prefix="moe_bench_model_")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
           "num_hidden_layers": 1, "vocab_size": 128, "max_position_embeddings": 256}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    get_context().set_server_args(ServerArgs(model_path=d, device="cuda", skip_tokenizer_init=True))


def config_for(shape: MoeShape, tokens: int, rule: str) -> dict:
    """The default config the given rule picks (upstream's function, patched, with the rule set)."""
    saved = default_row_tile.TILE_RULE
    default_row_tile.TILE_RULE = rule
    try:
        return get_default_config(tokens, shape.experts, shape.intermediate, shape.hidden,
                                  shape.top_k, None, False)
    finally:
        default_row_tile.TILE_RULE = saved


def uniform_routing(tokens: int, shape: MoeShape, gen: torch.Generator):
    logits = torch.rand(tokens, shape.experts, device="cuda", generator=gen)
    weights, ids = torch.topk(logits, shape.top_k, dim=-1)
    return torch.softmax(weights, dim=-1), ids.to(torch.int32)


def weight_bytes(shape: MoeShape, experts_touched: int) -> int:
    """gate+up (2N x K) and down (K x N), bf16, of each expert the batch reaches."""
    return experts_touched * 3 * shape.intermediate * shape.hidden * 2


def weight_roofline(shape: MoeShape, experts_touched: int, ms: float, copy_gbps: float) -> float:
    """Fraction of the time the touched experts' weights take to stream at the copy rate
    (``copy_gbps`` counts a copy's reads and writes: the rate HBM moves bytes at)."""
    return weight_bytes(shape, experts_touched) / (copy_gbps * 1e6) / ms


def measure(shape: MoeShape, tokens_list, copy_gbps: float, seed: int = 0):
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_experts, override_config
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    gen = torch.Generator(device="cuda").manual_seed(seed)
    e, n, k = shape.experts, shape.intermediate, shape.hidden
    w1 = torch.randn(e, 2 * n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    # In place, as the server runs it (out of place needs a tensor-parallel group); each call
    # works on a copy of the activations (<= 8.5 MB), timed with it.
    runner = MoeRunnerConfig(num_experts=e, num_local_experts=e, top_k=shape.top_k, inplace=True)
    rows = []
    for tokens in tokens_list:
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        weights, ids = uniform_routing(tokens, shape, gen)
        topk = StandardTopKOutput(weights, ids, torch.empty(0, device="cuda"))
        touched = int(torch.unique(ids).numel())
        row = dict(shape=shape.name, tokens=tokens, what=NAMED.get(tokens, ""),
                   expert_rows=default_row_tile.rows_per_expert(tokens, e, shape.top_k),
                   experts_touched=touched)
        outs = {}
        for rule in RULES:
            cfg = config_for(shape, tokens, rule)

            def call(cfg=cfg):
                with override_config(cfg):
                    return fused_experts(x.clone(), w1, w2, topk, runner)

            outs[rule] = call()
            ms = bench(call)
            row[rule] = dict(ms=ms, block_m=cfg["BLOCK_SIZE_M"], config=cfg,
                             roofline=weight_roofline(shape, touched, ms, copy_gbps))
        # Same math, other tiling: only the accumulation order differs.
        row["max_abs_diff"] = float((outs[RULES[0]].float() - outs[RULES[1]].float()).abs().max())
        row["speedup"] = row["upstream"]["ms"] / row["rows_per_expert"]["ms"]
        rows.append(row)
        print(f"{shape.name:18s} M={tokens:5d} rows/expert={row['expert_rows']:3d} "
              f"upstream {row['upstream']['ms']:.3f} ms (BM {row['upstream']['block_m']}) "
              f"rows_per_expert {row['rows_per_expert']['ms']:.3f} ms "
              f"(BM {row['rows_per_expert']['block_m']})  x{row['speedup']:.2f}", flush=True)
    del w1, w2
    torch.cuda.empty_cache()
    return rows


def plot(rows, path):
    from benchmarks.plotting import pyplot

    plt = pyplot()
    if plt is None:
        return

    names = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.5), squeeze=False)
    for ax, name in zip(axes[0], names):
        rs = [r for r in rows if r["shape"] == name]
        m = [r["tokens"] for r in rs]
        for rule, style in zip(RULES, ("o-", "s--")):
            ax.plot(m, [r[rule]["ms"] for r in rs], style, label=f"{rule} rule")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per MoE call (batch x verify width)")
        ax.set_ylabel("ms per call (CUDA-graph replay, median)")
        ax.set_title(f"fused MoE, default config: {name}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(rows) -> str:
    out = ["| shape | tokens | case | rows/expert | upstream ms (BLOCK_M) | this fork ms (BLOCK_M) "
           "| speed-up | fork's fraction of weight roofline |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        up, ours = r["upstream"], r["rows_per_expert"]
        out.append(f"| {r['shape']} | {r['tokens']} | {r['what']} | {r['expert_rows']} | "
                   f"{up['ms']:.3f} ({up['block_m']}) | {ours['ms']:.3f} ({ours['block_m']}) | "
                   f"{r['speedup']:.2f}x | {ours['roofline']:.2f} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--tag", default=datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; choose from {list(SHAPES)}")
    tokens = [int(t) for t in args.tokens.split(",")]
    if any(t < 1 for t in tokens):
        ap.error("--tokens must be positive integers")

    publish_minimal_server_args()
    tflops, copy_gbps = measure_peaks()
    rows = []
    for name in args.shapes.split(","):
        rows += measure(SHAPES[name], tokens, copy_gbps)
    meta = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, host=platform.node(), copy_gbps=copy_gbps,
                matmul_tflops=tflops, timing="cuda_graph_replay_median", dtype="bfloat16",
                routing="uniform top-k", shapes={k: asdict(v) for k, v in SHAPES.items()})
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"moe_default_tiles_{args.tag}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    plot(rows, stem + ".png")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
