#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Decode step time of the whole server on a dummy model of a real shape.

One server start per configuration (60-190 s at this shape: CUDA-graph capture for the
measured batch sizes only, Triton JIT shared through one cache directory), then for every
(context, batch) point ``batch`` concurrent streaming /generate requests of ``context``
random prompt tokens. The step time is the median gap between consecutive stream chunks
(one chunk per decode or verify step) inside the window where every request of the batch
is decoding; a point stops after ``--new-tokens`` tokens or ``--point-max-s`` seconds,
whichever comes first, so slow paths cost bounded time. The accept length is
``completion_tokens / spec_verify_ct``. Dummy weights make a DFlash drafter useless
(accept length ~1), so the step time, not tokens/s, is the number to compare; it is what
upstream's reference run reports (benchmarks/reference/e2e_baseline_h200.jsonl).

The target is DeepSeek-V2-Lite's shape (``--target v2lite``, absorbed MLA, 16 heads),
Qwen3-8B's (``--target qwen3-8b``, GQA 32/8 heads of 128), Qwen3.6-35B-A3B's
(``--target qwen36-a3b``: 30 Gated DeltaNet and 10 gated full-attention layers, 256 experts;
DDTREE budgets up to 64, one recurrent-state slot per running request) or gpt-oss-20b's
(``--target gptoss-20b``: alternating 128-token sliding windows, attention sinks, 32
experts; triton backend only, the experts on upstream's own runner choice), each with
its drafter's shape; scripts/make_test_models.py writes the config-only pairs when missing.
Configurations the target's server would refuse at startup are refused before any server
starts. On the hybrid target the profile also gives the share of the step that the linear
layers' tree verify takes (``linear_verify``).

A configuration is ``CONFIG[@VERIFY][:BACKEND][+sm120]``: ``ddtree64@upstream_extend`` runs
DDTREE B=64 with SGLANG_DDTREE_VERIFY_STRATEGY=upstream_extend (the fork's hook off:
upstream's verify path), ``dflash:flashinfer`` the DFLASH chain on the FlashInfer backend,
``ddtree16@auto+sm120`` DDTREE B=16 with the server's own strategy choice as the sm_120
proxy (SGLANG_DDTREE_SM120_PROXY=1: sm_120 tiles, the sm_12x policy, no FlashMLA,
FlashInfer's fa2 kernels), labelled ``sm120-proxy`` in every row. Without a suffix,
``--verify`` / ``--backend`` apply. Per server, one point (``--profile-at``, default the
largest context at batch 1) is traced with the server's profiler (benchmarks/e2e_profile.py)
to measure the verify attention's share of the step. ``--expert-routing uniform`` spreads the
MoE routing the way a trained router does (dummy routers send near-identical tokens, such as a
dummy DFLASH block, to the same few experts); ``--expert-routing tree`` spreads it the same way
except that a DDTREE tree's siblings share their experts (``layers/moe/tree_routing.py``: the
other end of what a trained router may do with alternatives for one position); a run and its
merges keep one routing.
``--moe-tile-rule upstream`` runs upstream's fused-MoE default tile switch instead of patch
0060's (the rule is recorded; runs of different rules do not merge either).

The JSON is rewritten after every point, so a killed run keeps what it measured; with
``--deadline-s`` a server or point that would not fit the remaining time is skipped and
listed under ``skipped``. ``--report A.json B.json`` merges runs (a matrix split over several host commands) and
recomputes the ratios against the reference run, the PNG and the README table.

GPU host, after scripts/gpu_host/install.sh and ``source scripts/gpu_host/env.sh`` (the test
models are generated into $DDTREE_TEST_MODELS when missing):
  python3 benchmarks/e2e_step.py --configs dflash,dflash@upstream_extend,ddtree64 \\
      --ctx 1024,4096,16384,32768 --batch 1,8 --deadline-s 520 --tag h200_a --out-dir DIR
  python3 benchmarks/e2e_step.py --configs dflash@auto+sm120,ddtree16@auto+sm120,dflash@auto,ddtree16@auto \\
      --strategy-table DIR/strategy_table.json --ctx 16384 --batch 1 --deadline-s 560 \\
      --tag h200_sm120_proxy --out-dir DIR
  python3 benchmarks/e2e_step.py --target qwen3-8b --backend flashinfer \\
      --configs dflash@upstream_extend,dflash@auto,ddtree16@auto --ctx 16384 --tag h200_qwen3 --out-dir DIR
  python3 benchmarks/e2e_step.py --target qwen36-a3b --configs dflash,ddtree16,nospec,ddtree64 \\
      --ctx 1024,16384 --batch 1,8 --deadline-s 560 --tag qwen36_a3b_h200_<date> --out-dir DIR
Here:  python3 benchmarks/e2e_step.py --report results/e2e_step_h200_*.json --tag h200 --markdown
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
from benchmarks import e2e_profile

#: Named configurations; ``ddtree<B>`` (any budget the server takes, e.g. ddtree63) is
#: parsed by config_args. A configuration name may end in one of ``VARIANTS``.
CONFIGS = {
    "nospec": [],
    "dflash": ["--speculative-algorithm", "DFLASH"],
}
#: A/B variants of one server, by the suffix that names them, with the environment each sets
#: and the configurations it applies to: the DDTREE step's tree build and tail run eagerly
#: instead of as CUDA graphs; the attention backend's own verify buffers refilled before every
#: graph replay, which the tree-verify path does not read (TreeVerifyHook.claims_replay_indptr);
#: a verify's KV indices built with torch ops instead of one launch (tree_verify/verify_indices.py).
EAGER_SEGMENTS = "-eager-segments"
REFILL_VERIFY_BUFFERS = "-refill-verify-buffers"
TORCH_VERIFY_INDICES = "-torch-verify-indices"
VARIANTS = {
    EAGER_SEGMENTS: ({"SGLANG_DDTREE_STEP_GRAPHS": "0"}, ("ddtree",)),
    REFILL_VERIFY_BUFFERS: ({"SGLANG_DDTREE_VERIFY_REFILL_UPSTREAM": "1"}, ("dflash", "ddtree")),
    TORCH_VERIFY_INDICES: ({"SGLANG_DDTREE_VERIFY_INDICES_TORCH": "1"}, ("dflash", "ddtree")),
}
DDTREE_CONFIG = re.compile(r"ddtree([1-9][0-9]*)(" + "|".join(map(re.escape, VARIANTS)) + ")?")
DDTREE_BUDGETS = range(1, 257)  # --speculative-ddtree-budget's range (speculative/ddtree/budget.py)


def split_variant(config: str) -> tuple:
    """``(configuration, variant suffix or "")``."""
    for suffix in VARIANTS:
        if config.endswith(suffix):
            return config[: -len(suffix)], suffix
    return config, ""


def config_args(config: str) -> list[str]:
    """Server flags of a configuration name; ValueError for names the server would refuse."""
    base, variant = split_variant(config)
    b = ddtree_budget(base)
    family = "ddtree" if b is not None else base
    if variant and family not in VARIANTS[variant][1]:
        raise ValueError(f"{config!r}: {variant} applies to {', '.join(VARIANTS[variant][1])} only")
    if base in CONFIGS:
        return list(CONFIGS[base])
    if b in DDTREE_BUDGETS:
        return ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", str(b)]
    raise ValueError(f"unknown configuration {config!r}; choose from {list(CONFIGS)} or ddtree<B> with "
                     f"B in {DDTREE_BUDGETS.start}..{DDTREE_BUDGETS.stop - 1} (e.g. ddtree16, ddtree64), "
                     f"optionally ending in one of {list(VARIANTS)}")


def ddtree_budget(config: str) -> Optional[int]:
    m = DDTREE_CONFIG.fullmatch(config)
    return int(m.group(1)) if m else None


def config_env(config: str) -> dict:
    """Server environment a configuration name sets."""
    variant = split_variant(config)[1]
    return dict(VARIANTS[variant][0]) if variant else {}


def config_order(config: str) -> tuple:
    """Table order: nospec, dflash, then DDTREE by budget; each plain before its variants."""
    base, variant = split_variant(config)
    rank = list(VARIANTS).index(variant) + 1 if variant else 0
    b = ddtree_budget(base)
    if b is not None:
        return (len(CONFIGS), b, rank)
    return (list(CONFIGS).index(base), 0, rank)


BACKENDS = ("triton", "flashinfer")
#: SGLANG_DDTREE_VERIFY_STRATEGY values (tree_verify/registry.py STRATEGIES), each set
#: explicitly, and "auto": the variable unset, the server's own choice (tree_verify/policy.py:
#: per arch and batch size from the measured strategy table).
VERIFY_PATHS = ("fused", "upstream_extend", "flashinfer_split", "flashmla_split", "reference", "auto")
DEFAULT_REFERENCE = REPO / "benchmarks" / "reference" / "e2e_baseline_h200.jsonl"
BASELINE = ("dflash", "fused", "triton")  # the "x DFLASH-fused" column divides by this


#: Serving policies: the GPU's own, or the sm_120 proxy (suffix ``+sm120``).
NATIVE, SM120_PROXY = "native", "sm120-proxy"
POLICIES = {NATIVE: "", SM120_PROXY: "+sm120"}


@dataclass(frozen=True)
class Spec:
    config: str
    verify: str  # "-" for no speculation
    backend: str
    policy: str = NATIVE

    @property
    def label(self) -> str:
        return f"{self.config}@{self.verify}:{self.backend}{POLICIES[self.policy]}"

    @property
    def key(self) -> tuple:
        return (self.config, self.verify, self.backend, self.policy)


def parse_spec(text: str, verify: str = "fused", backend: str = "triton") -> Spec:
    """``CONFIG[@VERIFY][:BACKEND][+sm120]`` with the run's defaults for what is left out."""
    m = re.fullmatch(r"([a-z0-9]+(?:-[a-z-]+)?)(?:@([a-z_0-9]+))?(?::([a-z0-9_]+))?(\+sm120)?", text.strip())
    if not m:
        raise ValueError(f"bad configuration {text!r}: expected CONFIG[@VERIFY][:BACKEND][+sm120], "
                         f"e.g. ddtree64@upstream_extend or ddtree16@auto+sm120")
    config, v, b = m.group(1), m.group(2) or verify, m.group(3) or backend
    policy = SM120_PROXY if m.group(4) else NATIVE
    try:
        config_args(config)
    except ValueError as e:
        raise ValueError(f"{e} (in {text!r})") from None
    if v not in VERIFY_PATHS:
        raise ValueError(f"unknown verify path {v!r} in {text!r}; choose from {list(VERIFY_PATHS)}")
    if b not in BACKENDS:
        raise ValueError(f"unknown backend {b!r} in {text!r}; choose from {list(BACKENDS)}")
    if config == "nospec":
        if m.group(2):
            raise ValueError(f"{text!r}: no speculation has no verify path")
        v = "-"
    return Spec(config, v, b, policy)


def row_key(r: dict) -> tuple:
    """A result row's configuration, runs before the policy field included (native)."""
    return (r["config"], r["verify"], r["backend"], r.get("policy", NATIVE))


#: --target: the model directories under --models (target, drafter), the
#: scripts/make_test_models.py ``--only`` kind that writes them, their architecture, and how
#: plots name them. ``linear_attention``: a Gated DeltaNet hybrid; ``sliding_window``:
#: sliding-window layers with attention sinks; ``ddtree_goals``: the step-time goals of
#: DDTREE B / DFLASH on that target (DDTREE_GOALS otherwise).
TARGETS = {
    "v2lite": {"dirs": ("v2lite-shape", "v2lite-shape-dflash"), "kind": "shapes",
               "architecture": "DeepseekV2ForCausalLM", "title": "DeepSeek-V2-Lite"},
    "qwen3-8b": {"dirs": ("qwen3-8b-shape", "qwen3-8b-shape-dflash"), "kind": "shapes",
                 "architecture": "Qwen3ForCausalLM", "title": "Qwen3-8B"},
    "qwen36-a3b": {"dirs": ("qwen36-a3b-shape", "qwen36-a3b-shape-dflash"), "kind": "hybrid-shapes",
                   "architecture": "Qwen3NextForCausalLM", "title": "Qwen3.6-35B-A3B", "linear_attention": True,
                   "ddtree_goals": {16: 1.3}, "weights_gib": 65.3},
    "gptoss-20b": {"dirs": ("gptoss-20b-shape", "gptoss-20b-shape-dflash"), "kind": "swa-shapes",
                   "architecture": "GptOssForCausalLM", "title": "gpt-oss-20b", "sliding_window": True,
                   "ddtree_goals": {16: 1.3}},
    # The learned pair (docs/learned-pair.md) at its own shape: --models is the unpacked pair.
    "learned": {"dirs": ("target", "drafter"), "kind": None, "context_length": 4096,
                "architecture": "Qwen3ForCausalLM", "title": "learned pair (12.6M Qwen3)"},
}  # fmt: skip
#: The targets scripts/make_test_models.py writes (the others are given with --models).
GENERATED_TARGETS = [t for t, info in TARGETS.items() if info["kind"] is not None]


def check_target(target: str, specs: list[Spec], expert_routing: str = "model") -> None:
    """Refuse, before any server starts, a configuration the target's server would refuse
    at startup (minutes of GPU time each) or would run without the asked-for condition."""
    info = TARGETS[target]
    for spec in specs:
        b = ddtree_budget(spec.config)
        if info.get("linear_attention") and b is not None:
            from sglang.srt.speculative.ddtree.linear_state import MAX_HYBRID_BUDGET

            if b > MAX_HYBRID_BUDGET:
                raise ValueError(
                    f"{spec.label}: DDTREE on the hybrid target {target} takes budgets up to "
                    f"{MAX_HYBRID_BUDGET} (the server refuses more: speculative/ddtree/linear_state.py); "
                    f"use ddtree{MAX_HYBRID_BUDGET} or less")
        if info.get("sliding_window"):
            if spec.backend != "triton":
                raise ValueError(
                    f"{spec.label}: {target} runs on the triton backend only here: upstream serves "
                    f"GptOssForCausalLM on triton, fa3 or trtllm_mha, not {spec.backend}, and DDTREE "
                    f"verifies sliding-window layers only through Triton's tree-verify path")
            if b is not None and spec.verify == "upstream_extend":
                raise ValueError(
                    f"{spec.label}: DDTREE on a target with sliding-window layers refuses the upstream "
                    f"verify path (its dense mask counts a node's window from its index, not its depth: "
                    f"speculative/ddtree/flags.py); use @fused or @auto")
    if info.get("sliding_window") and expert_routing != "model":
        raise ValueError(
            f"--expert-routing {expert_routing}: upstream runs {target}'s experts with triton_kernels "
            f"(moe_runner_backend triton_kernel), whose routing ignores SGLANG_SIMULATE_UNIFORM_EXPERTS; "
            f"use --expert-routing model")


def table_summary(path: Optional[Path]) -> Optional[dict]:
    """What the servers' verify policy read: the table's path and its sections."""
    if path is None:
        return None
    data = json.loads(Path(path).read_text())
    return {"path": str(path), "sections": [{k: s.get(k) for k in ("arch", "date", "hardware", "proxy")}
                                            for s in data.get("sections", [])]}  # fmt: skip


def shape_models(models: Path, target: str) -> tuple[Path, Path]:
    """The config-only target and drafter of ``target`` for ``--load-format dummy``, from
    scripts/make_test_models.py (its ``--only`` kind for the pair, run when missing; the
    pairs come with a tokenizer, which only has to load: the server skips tokenizer init)."""
    info = TARGETS[target]
    target_dir, drafter_dir = (models / d for d in info["dirs"])
    present = all((d / "config.json").exists() for d in (target_dir, drafter_dir))
    if not present and info["kind"] is None:
        raise SystemExit(f"--target {target}: {target_dir} and {drafter_dir} need a config.json each; give "
                         "--models the unpacked pair (python3 -m scripts.learned_pair unpack ... --to DIR)")
    if not present:
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_test_models.py"), str(models),
                        "--only", info["kind"]], check=True)  # fmt: skip
    return target_dir, drafter_dir


def context_length(target: str, max_ctx: int) -> int:
    """The servers' context: the longest prompt and room to decode, within what the target has."""
    wanted = max_ctx + CONTEXT_MARGIN
    return min(wanted, TARGETS[target].get("context_length", wanted))


def prefill_chunk(max_ctx: int) -> int:
    """Chunked-prefill size that takes the longest prompt in one pass (at least upstream's 16K)."""
    return max(16384, max_ctx + CONTEXT_MARGIN)


#: The static pool's share of GPU memory, unless the target's weights need more.
MEM_FRACTION_STATIC = 0.8
#: What a large target's static pool holds beyond its weights (KV at 16K, recurrent states at
#: batch 1), and the most the pool may take (CUDA graphs and activations live outside it).
STATIC_ROOM_GIB, MAX_MEM_FRACTION_STATIC = 8.0, 0.93


def mem_fraction_static(target: str, gpu_gib: Optional[float]) -> float:
    """``MEM_FRACTION_STATIC``, or more where the target's weights fill most of the GPU (the
    Qwen3.6-35B-A3B shape's 65 GiB of bf16 weights are 0.82 of an 80 GB card)."""
    weights = TARGETS[target].get("weights_gib")
    if weights is None or not gpu_gib:
        return MEM_FRACTION_STATIC
    return round(max(MEM_FRACTION_STATIC, min(MAX_MEM_FRACTION_STATIC, (weights + STATIC_ROOM_GIB) / gpu_gib)), 3)


def server_args(spec: Spec, drafter: str, max_ctx: int, batches: list[int], target: str = "v2lite",
                gpu_gib: Optional[float] = None) -> list[str]:
    """Capture CUDA graphs for exactly the measured batch sizes: each extra size costs start time.
    ``gpu_gib``: the GPU's memory, for targets whose weights fill most of it."""
    # A hybrid target's recurrent-state slots each hold a state per tree node: no more
    # slots than the largest batch measured.
    max_running = max(batches) if TARGETS[target].get("linear_attention") else max(8, *batches)
    args = [
        "--load-format", "dummy",
        "--attention-backend", spec.backend,
        "--disable-radix-cache",
        "--skip-tokenizer-init",
        "--context-length", str(context_length(target, max_ctx)),
        "--max-running-requests", str(max_running),
        "--cuda-graph-bs-decode", *[str(b) for b in sorted(set(batches))],
        "--mem-fraction-static", str(mem_fraction_static(target, gpu_gib)),
        # Every prompt prefills alone and in one chunk. A prompt split into chunks holds a
        # request slot while it is chunked; the pinned scheduler then marks the batch full
        # when it looks at the next queued request and clears that only when a request
        # finishes, so at 32K the 8th request of a batch waited for the others to end. A
        # budget of one prompt is not enough: the scheduler fills what is left of a prefill
        # batch with the head of the next prompt, hence one request per batch.
        "--chunked-prefill-size", str(prefill_chunk(max_ctx)),
        "--max-prefill-tokens", str(prefill_chunk(max_ctx)),
        "--prefill-max-requests", "1",
        # Upstream's DFlash admission batching (on for DFLASH and DDTREE) holds a
        # new prefill until two request slots are free: with batch == max running
        # requests the last request would wait for the others to finish, and the
        # batch would never decode together (what batch 8 at 16K hit).
        "--min-free-slots-delay", "1",
    ] + config_args(spec.config)
    if TARGETS[target].get("linear_attention"):
        # One recurrent-state slot per running request, whatever the radix-cache branch of
        # upstream's pool sizing: its per-node verify scratch (intermediate_ssm, conv
        # windows) is sized by these slots times the verify width, and must leave the
        # dummy weights and the KV pool room on the GPU.
        args += ["--max-mamba-cache-size", str(max_running)]
    if spec.config != "nospec":
        args += ["--speculative-draft-model-path", drafter]
    return args


#: --expert-routing: "model" routes by the (dummy) router weights; "uniform" uses
#: upstream's benchmark switch that spreads every token over the experts the way a
#: trained router does on real text. With dummy weights a DFLASH block of nearly
#: identical draft tokens reaches only a few experts, so "model" flatters a narrow
#: verify against a wide DDTREE tree on an MoE target.
EXPERT_ROUTING = {"model": {}, "uniform": {"SGLANG_SIMULATE_UNIFORM_EXPERTS": "1"},
                  "tree": {"SGLANG_DDTREE_SIMULATE_TREE_ROUTING": "1"}}
#: Fused-MoE default row-tile rule (patch 0060, default_row_tile.py): the fork's, or upstream's.
MOE_TILE_RULES = {"rows_per_expert": {}, "upstream": {"SGLANG_MOE_DEFAULT_TILE_RULE": "upstream"}}
#: What a run holds fixed, with the value of runs that predate the option: runs that differ
#: in one of these cannot share a table.
RUN_CONDITIONS = {"expert_routing": "model", "moe_tile_rule": "upstream", "target": "v2lite", "sampling": "greedy"}


def parse_sampling(text: str) -> dict:
    """``T[/top_k[/top_p]]`` (``0``: greedy) -> the sampling parameters every request of a run
    sends: a sampled step also draws per node and builds the filters, which a greedy step does
    not, so its time is measured apart."""
    parts = text.split("/")
    try:
        t = float(parts[0])
        top_k = int(parts[1]) if len(parts) > 1 else 0
        top_p = float(parts[2]) if len(parts) > 2 else 1.0
    except ValueError:
        raise ValueError(f"--sampling {text!r}: expected T[/top_k[/top_p]], e.g. 1 or 0.7/20/0.8") from None
    if len(parts) > 3 or t < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"--sampling {text!r}: expected T >= 0, top_k >= 0 (0: none), 0 < top_p <= 1")
    return sampling_params(t, top_p, top_k)


def sampling_params(t: float, top_p: float = 1.0, top_k: int = 0) -> dict:
    """The request's sampling parameters for T, top_p, top_k (greedy at T=0; a filter that
    cuts nothing left out)."""
    if t == 0:
        return {"temperature": 0.0}
    out = {"temperature": float(t)}
    if top_k:
        out["top_k"] = top_k
    if top_p < 1:
        out["top_p"] = top_p
    return out


def sampling_label(sampling: Optional[dict]) -> str:
    """``greedy``, or ``T=1``, ``T=0.7 top_k=20 top_p=0.8``: how a run's sampling is recorded."""
    if not sampling or not sampling.get("temperature"):
        return "greedy"
    return " ".join([f"T={sampling['temperature']:g}"] + [f"{k}={sampling[k]:g}" for k in ("top_k", "top_p")
                                                          if k in sampling])  # fmt: skip


def request_payload(ids: list[int], new_tokens: int, sampling: Optional[dict] = None) -> dict:
    return {"input_ids": ids, "sampling_params": {"temperature": 0.0, **(sampling or {}),
                                                  "max_new_tokens": new_tokens, "ignore_eos": True}}


def server_env(spec: Spec, triton_cache: Path, routing: str = "model", moe_tile_rule: str = "rows_per_expert",
               strategy_table: Optional[Path] = None) -> dict:
    env = {"TRITON_CACHE_DIR": str(triton_cache), **EXPERT_ROUTING[routing], **MOE_TILE_RULES[moe_tile_rule],
           **config_env(spec.config)}
    if strategy_table is not None:
        env["SGLANG_DDTREE_STRATEGY_TABLE"] = str(strategy_table)
    if spec.verify not in ("-", "auto"):
        env["SGLANG_DDTREE_VERIFY_STRATEGY"] = spec.verify
    if spec.policy == SM120_PROXY:
        env["SGLANG_DDTREE_SM120_PROXY"] = "1"
    return env


def step_stats(stamps: list[list[float]], min_gaps: int = 5) -> dict:
    """Median/p90 chunk gap over the window where every request is decoding."""
    if not stamps or any(not s for s in stamps):
        raise ValueError("a request streamed no tokens")
    start = max(s[0] for s in stamps)  # every request has its first token
    end = min(s[-1] for s in stamps)  # no request has finished yet
    gaps = []
    for s in stamps:
        w = [x for x in s if start <= x <= end]
        gaps += [b - a for a, b in zip(w, w[1:])]
    if len(gaps) < min_gaps:
        raise ValueError(f"too few decode steps in the common window ({len(gaps)} < {min_gaps}); "
                         "raise --new-tokens or --point-max-s")
    gaps.sort()
    return {
        "ms_per_step": 1000 * statistics.median(gaps),
        "ms_per_step_p90": 1000 * gaps[int(0.9 * (len(gaps) - 1))],
        "steps_measured": len(gaps),
    }


class Budget:
    """Wall-clock guard: start a server or a point only if its estimate fits what is left."""

    def __init__(self, deadline_s: Optional[float], start_estimate_s: float, margin_s: float = 25.0,
                 clock=time.monotonic):
        self.clock = clock
        self.t0 = clock()
        self.deadline_s, self.margin_s = deadline_s, margin_s
        self.start_estimate_s = start_estimate_s
        self.starts: list[float] = []

    def left(self) -> float:
        if self.deadline_s is None:
            return float("inf")
        return self.deadline_s - (self.clock() - self.t0) - self.margin_s

    def start_estimate(self) -> float:
        """The first start pays Triton JIT; later ones reuse its cache (worst seen + 15 %)."""
        return 1.15 * max(self.starts) if self.starts else self.start_estimate_s

    def point_estimate(self, ctx: int, batch: int, point_max_s: float) -> float:
        # prefill (~40K tokens/s at this shape, conservatively) + the bounded decode window
        return 5.0 + ctx * batch / 40000.0 + point_max_s

    def fits(self, seconds: float) -> bool:
        return self.left() >= seconds


def one_request(server, ids, new_tokens, stop_at: list, out: dict, sampling: Optional[dict] = None) -> None:
    """Stream one request; ``out["stamps"]`` grows live so measure() can see the first token."""
    stamps = out["stamps"] = []
    payload = request_payload(ids, new_tokens, sampling)
    last = None
    events = server.stream("/generate", payload, timeout=900)
    try:
        for ev in events:
            stamps.append(time.perf_counter())
            last = ev
            if stop_at[0] is not None and stamps[-1] > stop_at[0]:
                break  # closing the stream aborts the request
    except Exception as e:  # surfaced by measure(), not lost in the thread
        out["error"] = repr(e)
    finally:
        events.close()
    out["meta"] = (last or {}).get("meta_info", {})
    out["error_event"] = (last or {}).get("error")


def request_timelines(results: list[dict], t0: float) -> list[dict]:
    """Per request: chunks streamed, first/last chunk (s after the batch was sent), how it ended."""
    out = []
    for r in results:
        stamps, meta = r.get("stamps") or [], r.get("meta") or {}
        out.append({"chunks": len(stamps),
                    "first_s": round(stamps[0] - t0, 3) if stamps else None,
                    "last_s": round(stamps[-1] - t0, 3) if stamps else None,
                    "finish_reason": meta.get("finish_reason"),
                    "completion_tokens": meta.get("completion_tokens"),
                    "error": r.get("error_event")})
    return out


def random_prompts(ctx: int, batch: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(ctx)] for _ in range(batch)]


# Generation cap per request of a batch > 1 (the server's context leaves room
# for it): requests are prefilled one after another, so the first ones must keep
# decoding until the last one has caught up; the point ends on the window rule.
BATCH_TOKEN_CAP = 3000
CONTEXT_MARGIN = 4096


def measure(server, ctx: int, batch: int, new_tokens: int, vocab: int, seed: int, point_max_s: float,
            sampling: Optional[dict] = None) -> dict:
    """``batch`` concurrent requests (greedy, or sampled with ``sampling``: ``parse_sampling``);
    the point ends once every request has streamed ``new_tokens`` chunks inside the common
    window (all decoding), or ``point_max_s`` after that window opened."""
    prompts = random_prompts(ctx, batch, vocab, seed)
    results = [{} for _ in range(batch)]
    stop_at = [None]  # set once the window is long enough or has lasted point_max_s
    max_new = new_tokens if batch == 1 else max(new_tokens, BATCH_TOKEN_CAP)
    threads = [threading.Thread(target=one_request, args=(server, p, max_new, stop_at, r, sampling))
               for p, r in zip(prompts, results)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(0.02)
        firsts = [r["stamps"][0] for r in results if r.get("stamps")]
        if len(firsts) < batch:
            continue
        opened = max(firsts)  # the decode window starts when all stream
        limit = opened + point_max_s if point_max_s > 0 else float("inf")
        if batch > 1 and all(sum(x >= opened for x in r["stamps"]) > new_tokens for r in results):
            limit = min(limit, time.perf_counter())
        if limit < float("inf"):
            stop_at[0] = limit if stop_at[0] is None else min(stop_at[0], limit)
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    errors = [r.get("error", "no tokens streamed") for r in results if "error" in r or not r["stamps"]]
    if errors:
        raise RuntimeError(f"requests failed at ctx={ctx} batch={batch}: {errors}")
    metas = [r["meta"] for r in results]
    verify = sum(m.get("spec_verify_ct", 0) or 0 for m in metas)
    tokens = sum(m.get("completion_tokens", 0) for m in metas)
    try:
        stats = step_stats([r["stamps"] for r in results])
    except ValueError as e:  # say which request left the window, and how it ended
        raise ValueError(f"{e}; requests: {request_timelines(results, t0)}") from None
    return {
        "ctx": ctx,
        "batch": batch,
        **stats,
        "accept_length": (tokens / verify) if verify else 1.0,
        "completion_tokens": tokens,
        "wall_s": wall,
    }


def profile_point(server, ctx: int, vocab: int, steps: int, trace_dir: Path, profile_id: str,
                  new_tokens: Optional[int] = None, host: bool = False, sampling: Optional[dict] = None) -> dict:
    """Trace ``steps`` forwards of one decoding request at ``ctx`` and break the GPU time down."""
    prompt = random_prompts(ctx, 1, vocab, seed=ctx + 7)[0]
    new_tokens = new_tokens or 3 * steps + 48  # several tokens per step only with a real drafter
    payload = request_payload(prompt, new_tokens, sampling)
    path, chunks, chunks_at_start = None, 0, 0
    events = server.stream("/generate", payload, timeout=900)
    try:
        for _ in events:
            chunks += 1
            if chunks == 4:  # decoding, past the prefill
                path = e2e_profile.start_profile(server, trace_dir, profile_id, steps, host=host)
                chunks_at_start = chunks
            elif path is not None and path.exists():
                break  # the profiler stopped by itself after `steps` forwards
    finally:
        events.close()
    if path is None:
        raise RuntimeError("the profiling request ended before decoding started")
    counted = steps
    if not e2e_profile.wait_for_trace(path, timeout=20 if path.exists() else 3):
        # The request ended first: stop by hand, count the steps from the stream.
        e2e_profile._post_text(server, "/stop_profile", {})
        counted = max(1, chunks - chunks_at_start)
        if not e2e_profile.wait_for_trace(path, timeout=60):
            raise RuntimeError(f"no trace at {path}")
    out = e2e_profile.breakdown(e2e_profile.load_trace(path), counted)
    out.update(ctx=ctx, batch=1, trace=str(path), steps_from="profiler num_steps" if counted == steps else "stream")
    return out


# -- ratios, report ------------------------------------------------------------------------

def load_reference(path: Path) -> list[dict]:
    """Rows of upstream's reference run: {config, ctx, batch, ms_per_step}."""
    rows = []
    if not path or not Path(path).exists():
        return rows
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if "config" not in rec:
            continue
        for key, val in rec.items():
            m = re.fullmatch(r"ctx(\d+)_ms_per_step", key)
            if m:
                rows.append({"config": rec["config"], "ctx": int(m.group(1)), "batch": 1, "ms_per_step": val})
    return rows


def _reference_kind(label: str) -> Optional[str]:
    low = label.lower()
    if low.startswith("no speculation"):
        return "nospec"
    if "dflash" in low and "flashinfer" in low:
        return "dflash_flashinfer"
    if "dflash" in low and "triton" in low:
        return "dflash_triton"
    return None


#: Step-time goal of DDTREE B=<budget> fused / DFLASH fused, unless the target names its own.
DDTREE_GOALS = {64: 1.25}


def ratios(rows: list[dict], reference: list[dict], goals: Optional[dict] = None) -> list[dict]:
    """Per (ctx, batch): the DDTREE-to-DFLASH step ratios of this run, then against the reference run.
    ``goals``: the target's DDTREE B / DFLASH step-time goals by budget (DDTREE_GOALS)."""
    goals = DDTREE_GOALS if goals is None else goals
    ms = {(*row_key(r), r["ctx"], r["batch"]): r["ms_per_step"] for r in rows}
    ref = {(_reference_kind(r["config"]), r["ctx"], r["batch"]): r["ms_per_step"] for r in reference}
    out = []
    for ctx, batch in sorted({(r["ctx"], r["batch"]) for r in rows}):
        def get(config, verify, backend="triton", policy=NATIVE):
            return ms.get((config, verify, backend, policy, ctx, batch))

        def add(name, num, den, source="this run", target=None):
            if num is not None and den is not None and den > 0:
                rec = {"ctx": ctx, "batch": batch, "ratio": name, "value": num / den, "source": source}
                if target is not None:
                    rec["target"] = target
                out.append(rec)

        fused = get("dflash", "fused")
        add("DFLASH upstream-triton / DFLASH fused (speedup)", get("dflash", "upstream_extend"), fused)
        add("DFLASH upstream-flashinfer / DFLASH fused", get("dflash", "upstream_extend", "flashinfer"), fused)
        for b in sorted({ddtree_budget(r["config"]) for r in rows} - {None}):
            add(f"DDTREE B={b} fused / DFLASH fused", get(f"ddtree{b}", "fused"), fused, target=goals.get(b))
            # The server's default verify route (FlashMLA's prefix pass where it serves).
            add(f"DDTREE B={b} default / DFLASH fused", get(f"ddtree{b}", "auto"), fused, target=goals.get(b))
            add(f"DDTREE B={b} flashmla_split / DFLASH fused", get(f"ddtree{b}", "flashmla_split"), fused,
                target=goals.get(b))
            add(f"DDTREE B={b} upstream / DDTREE B={b} fused (speedup)", get(f"ddtree{b}", "upstream_extend"),
                get(f"ddtree{b}", "fused"))
        for b in sorted({ddtree_budget(r["config"]) for r in rows} - {None}):
            for verify in ("auto", "fused"):
                add(f"DDTREE B={b} eager segments / DDTREE B={b}, {verify} (step graphs' speedup)",
                    get(f"ddtree{b}{EAGER_SEGMENTS}", verify), get(f"ddtree{b}", verify))
                add(f"DDTREE B={b} refilling the verify buffers / DDTREE B={b}, {verify} (the skipped "
                    f"refill's speedup)", get(f"ddtree{b}{REFILL_VERIFY_BUFFERS}", verify), get(f"ddtree{b}", verify))
                add(f"DDTREE B={b} torch verify indices / DDTREE B={b}, {verify} (the one-launch indices' "
                    f"speedup)", get(f"ddtree{b}{TORCH_VERIFY_INDICES}", verify), get(f"ddtree{b}", verify))
        for verify in ("auto", "fused"):
            add(f"DFLASH refilling the verify buffers / DFLASH, {verify} (the skipped refill's speedup)",
                get(f"dflash{REFILL_VERIFY_BUFFERS}", verify), get("dflash", verify))
            add(f"DFLASH torch verify indices / DFLASH, {verify} (the one-launch indices' speedup)",
                get(f"dflash{TORCH_VERIFY_INDICES}", verify), get("dflash", verify))
        add("DFLASH fused / no speculation", fused, get("nospec", "-"))
        ref_note = "reference run, not this run (benchmarks/reference/e2e_baseline_h200.jsonl)"
        add("DFLASH fused / reference DFLASH flashinfer (causal, sm_90)", fused,
            ref.get(("dflash_flashinfer", ctx, batch)), ref_note, target=1.3)
        add("DDTREE B=64 fused / reference DFLASH flashinfer (causal, sm_90)", get("ddtree64", "fused"),
            ref.get(("dflash_flashinfer", ctx, batch)), ref_note)
        add("reference DFLASH upstream triton / DFLASH fused (speedup)", ref.get(("dflash_triton", ctx, batch)),
            fused, ref_note)
        add("no speculation / reference no speculation (host check)", get("nospec", "-"),
            ref.get(("nospec", ctx, batch)), ref_note)
        # The DFLASH chain through the hook on FlashInfer (MHA) against upstream's FlashInfer verify.
        hooked = get("dflash", "auto", "flashinfer") or get("dflash", "fused", "flashinfer")
        add("DFLASH flashinfer hook / DFLASH flashinfer upstream", hooked,
            get("dflash", "upstream_extend", "flashinfer"), target=0.9)
        # The sm_120 proxy: the server's own choices as an sm_120 GPU would make them.
        for backend in BACKENDS:
            proxied = get("dflash", "auto", backend, SM120_PROXY)
            for b in sorted({ddtree_budget(r["config"]) for r in rows} - {None}):
                add(f"DDTREE B={b} default / DFLASH default, {backend}, sm120 proxy",
                    get(f"ddtree{b}", "auto", backend, SM120_PROXY), proxied, target=1.3 if b == 16 else None)
    return out


def verify_shares(profiles: list[dict]) -> list[dict]:
    """The verify attention's ms and share of the step per profiled server; on a hybrid
    target also the linear-attention layers' tree verify (``linear_verify_ms``,
    ``linear_share``). ``verify_attention_ms`` and ``share`` are None where the verify
    attention cannot be separated (the upstream path without its fused twin)."""
    def twin_key(p):
        return (p["config"], p["backend"], p.get("policy", NATIVE), p["ctx"])

    fused = {twin_key(p): p for p in profiles if p["verify"] == "fused"}
    out = []
    for p in profiles:
        ms = e2e_profile.verify_attention_ms(p, p["verify"], fused.get(twin_key(p)))
        linear = e2e_profile.linear_verify_ms(p, p["verify"])
        if ms is None and linear is None:
            continue
        step = p["gpu_ms_per_step"]
        rec = {"config": p["config"], "verify": p["verify"], "backend": p["backend"],
               "policy": p.get("policy", NATIVE), "ctx": p["ctx"], "batch": p["batch"],
               "verify_attention_ms": ms, "gpu_ms_per_step": step,
               "share": None if ms is None else ms / step}
        if linear is not None:
            rec.update(linear_verify_ms=linear, linear_share=linear / step)
        out.append(rec)
    return out


def markdown(rows: list[dict], shares: list[dict] = ()) -> str:
    base = {(r["ctx"], r["batch"], r.get("policy", NATIVE)): r["ms_per_step"] for r in rows
            if (r["config"], r["verify"], r["backend"]) == BASELINE}
    share = {(*row_key(s), s["ctx"], s["batch"]): s["share"] for s in shares}
    linear = {(*row_key(s), s["ctx"], s["batch"]): s["linear_share"] for s in shares if "linear_share" in s}
    head = "| config | verify path | backend | ctx | bs | ms/step | x DFLASH-fused | accept len | verify attn share |"
    rule = "|---|---|---|---:|---:|---:|---:|---:|---:|"
    if linear:  # a hybrid target: its linear-attention layers verify the tree too
        head, rule = head + " linear verify share |", rule + "---:|"
    lines = [head, rule]
    for r in sorted(rows, key=lambda r: (r["ctx"], r["batch"], r.get("policy", NATIVE),
                                         config_order(r["config"]), r["verify"], r["backend"])):
        policy = r.get("policy", NATIVE)
        b = base.get((r["ctx"], r["batch"], policy))
        s = share.get((*row_key(r), r["ctx"], r["batch"]))
        rel = f"{r['ms_per_step'] / b:.2f}" if b else "-"
        pct = f"{100 * s:.0f} %" if s is not None else "-"
        line = (f"| {r['config']}{POLICIES[policy]} | {r['verify']} | {r['backend']} | {r['ctx']} | {r['batch']} | "
                f"{r['ms_per_step']:.2f} | {rel} | {r['accept_length']:.2f} | {pct} |")
        if linear:
            lin = linear.get((*row_key(r), r["ctx"], r["batch"]))
            line += f" {100 * lin:.0f} % |" if lin is not None else " - |"
        lines.append(line)
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    from benchmarks.plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    profiles = sorted(result.get("profiles", []), key=lambda p: (p["ctx"], config_order(p["config"]), p["verify"]))
    if not rows:
        return
    fig, axes = plt.subplots(1, 2 if profiles else 1, figsize=(13 if profiles else 7.5, 4.8), squeeze=False)
    ax = axes[0][0]
    for key in sorted({(*row_key(r), r["batch"]) for r in rows}, key=lambda k: (config_order(k[0]), k[1:])):
        pts = sorted((r["ctx"], r["ms_per_step"]) for r in rows if (*row_key(r), r["batch"]) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linestyle="-" if key[4] == 1 else "--",
                label="%s @%s %s%s bs%d" % (key[0], key[1], key[2], POLICIES[key[3]], key[4]))
    from matplotlib.ticker import FuncFormatter

    ctxs = sorted({r["ctx"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ctxs, [f"{c // 1024}K" if c >= 1024 else str(c) for c in ctxs])
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.set_xlabel("context tokens")
    ax.set_ylabel("ms per decode/verify step (median)")
    routing = {"model": "", "uniform": ", uniform expert routing",
               "tree": ", uniform expert routing, tree siblings together"}[result.get("expert_routing", "model")]
    routing += ", upstream's MoE tiles" if result.get("moe_tile_rule", "upstream") == "upstream" else ""
    target = TARGETS[result.get("target", "v2lite")]["title"]
    ax.set_title(f"{target} shape, dummy weights{routing}, {result.get('device', '')}")
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    if profiles:
        ax = axes[0][1]
        names = [f"{p['config']}@{p['verify']}{POLICIES[p.get('policy', NATIVE)]}\n{p['backend']} {p['ctx'] // 1024}K"
                 for p in profiles]
        bottom = [0.0] * len(profiles)
        for cat in e2e_profile.ORDER:
            vals = [p["categories"].get(cat, {}).get("ms_per_step", 0.0) for p in profiles]
            if any(vals):
                ax.bar(names, vals, bottom=bottom, label=cat)
                bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_ylabel("GPU ms per step (profiler)")
        ax.set_title("where the step goes (bs 1)")
        ax.tick_params(axis="x", labelsize=6)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def finish(result: dict, reference: list[dict]) -> dict:
    if result.get("expert_routing", "model") != "model":
        reference = []  # the reference run routes by the dummy router: not comparable
    target = result.get("target", "v2lite")
    if target != "v2lite":
        reference = []  # the reference run is of the DeepSeek-V2-Lite shape
    result["ratios"] = ratios(result["rows"], reference, TARGETS[target].get("ddtree_goals"))
    result["verify_attention"] = verify_shares(result.get("profiles", []))
    return result


def write(result: dict, out: Path) -> None:
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)


def _gpu_harness():
    """tests/gpu/conftest.py by path (a plain ``import conftest`` may find another one)."""
    spec = importlib.util.spec_from_file_location("ddtree_gpu_harness", REPO / "tests" / "gpu" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(args, specs: list[Spec], ctxs: list[int], batches: list[int], out: Path, reference: list[dict]) -> dict:
    target, drafter = shape_models(args.models, args.target)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    args.log_dir.mkdir(parents=True, exist_ok=True)
    args.triton_cache.mkdir(parents=True, exist_ok=True)
    launch_server = _gpu_harness().launch_server
    import torch

    budget = Budget(args.deadline_s, args.start_estimate_s)
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else None
    profile_at = _parse_point(args.profile_at, ctxs) if args.profile_steps > 0 else None
    result = {
        "what": f"decode step time, {TARGETS[args.target]['title']}-shaped target (dummy weights), "
                "benchmarks/e2e_step.py",
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "argv": sys.argv[1:],
        "triton_cache": str(args.triton_cache),
        "expert_routing": args.expert_routing,
        "moe_tile_rule": args.moe_tile_rule,
        "target": args.target,
        "sampling": sampling_label(args.sampling),
        "strategy_table": table_summary(args.strategy_table),
        "servers": [],
        "rows": [],
        "profiles": [],
        "skipped": [],
    }
    points = [(c, b) for c in ctxs for b in batches]
    for spec in specs:
        need = budget.start_estimate() + budget.point_estimate(ctxs[0], batches[0], args.point_max_s)
        if not budget.fits(need):
            result["skipped"].append({"config": spec.label, "what": "server",
                                      "reason": f"{budget.left():.0f} s left < {need:.0f} s estimated"})
            write(finish(result, reference), out)
            continue
        t0 = time.monotonic()
        sargs = server_args(spec, str(drafter), max(ctxs), batches, args.target, gpu_gib)
        try:
            with launch_server(spec.label.replace(":", "-").replace("@", "-"), str(target), sargs, args.log_dir,
                               timeout=max(60.0, min(600.0, budget.left())), env=server_env(spec, args.triton_cache, args.expert_routing, args.moe_tile_rule,
                                              args.strategy_table)) as server:
                start_s = time.monotonic() - t0
                budget.starts.append(start_s)
                result["servers"].append({"config": spec.label, "start_s": start_s, "log": str(server.log_path)})
                print(f"[{spec.label}] healthy after {start_s:.0f} s", flush=True)
                measure(server, 256, 1, 16, vocab, seed=0, point_max_s=5, sampling=args.sampling)  # warm-up
                for ctx, batch in points:
                    need = budget.point_estimate(ctx, batch, args.point_max_s)
                    if not budget.fits(need):
                        result["skipped"].append({"config": spec.label, "what": f"ctx {ctx} bs {batch}",
                                                  "reason": f"{budget.left():.0f} s left < {need:.0f} s"})
                        continue
                    try:
                        r = measure(server, ctx, batch, args.new_tokens, vocab, seed=ctx + batch,
                                    point_max_s=args.point_max_s, sampling=args.sampling)
                    except Exception as e:  # one bad point must not lose the others
                        result["skipped"].append({"config": spec.label, "what": f"ctx {ctx} bs {batch}",
                                                  "reason": f"failed: {e}"[:2000]})
                        print(f"[{spec.label}] ctx {ctx} bs {batch} failed: {e}", flush=True)
                        if not server.alive():
                            raise
                        continue
                    r.update(config=spec.config, verify=spec.verify, backend=spec.backend, policy=spec.policy,
                             server_start_s=start_s)
                    result["rows"].append(r)
                    print(json.dumps(r), flush=True)
                    write(finish(result, reference), out)
                if profile_at and (spec.config != "nospec" or args.profile_nospec):
                    _profile(server, spec, profile_at, vocab, args, budget, result)
        except Exception as e:
            result["skipped"].append({"config": spec.label, "what": "server", "reason": f"failed: {e}"[-3000:]})
            print(f"[{spec.label}] failed: {e}", flush=True)
        write(finish(result, reference), out)
    return result


def _profile(server, spec: Spec, at: tuple, vocab: int, args, budget: Budget, result: dict) -> None:
    ctx, _ = at
    need = budget.point_estimate(ctx, 1, 10.0) + 20
    if not budget.fits(need):
        result["skipped"].append({"config": spec.label, "what": f"profile ctx {ctx}",
                                  "reason": f"{budget.left():.0f} s left < {need:.0f} s"})
        return
    pid = f"e2e-{spec.label.replace(':', '-').replace('@', '-')}-{ctx}"
    try:
        prof = profile_point(server, ctx, vocab, args.profile_steps, args.log_dir / "traces", pid,
                             host=args.profile_host, sampling=args.sampling)
    except Exception as e:
        result["skipped"].append({"config": spec.label, "what": f"profile ctx {ctx}", "reason": f"failed: {e}"})
        print(f"[{spec.label}] profile failed: {e}", flush=True)
        return
    prof.update(config=spec.config, verify=spec.verify, backend=spec.backend, policy=spec.policy,
                host_traced=args.profile_host)
    result["profiles"].append(prof)
    cats = ", ".join(f"{c} {v['ms_per_step']:.2f}" for c, v in prof["categories"].items())
    h = prof["host"]
    print(f"[{spec.label}] profile ctx {ctx}: {prof['gpu_ms_per_step']:.2f} GPU ms/step ({cats}); "
          f"GPU idle {prof['gpu_idle_ms_per_step']:.2f} ms/step; per step {h['graph_launches_per_step']:.1f} graph "
          f"launches, {h['kernel_launches_per_step']:.0f} kernel launches, {h['host_syncs_per_step']:.1f} host "
          f"syncs ({h['host_sync_ms_per_step']:.2f} ms blocked)", flush=True)
    if prof.get("phases"):
        print(f"[{spec.label}] step phases, host / GPU ms per step: " + ", ".join(
            f"{n} {v['host_ms_per_step']:.2f} / {v['gpu_ms_per_step']:.2f}" for n, v in prof["phases"].items()),
            flush=True)  # fmt: skip


def _parse_point(text: Optional[str], ctxs: list[int]) -> tuple:
    if not text:
        return (max(ctxs), 1)
    m = re.fullmatch(r"(\d+)x(\d+)", text)
    if not m or int(m.group(2)) != 1:
        raise SystemExit(f"--profile-at {text!r}: expected CTXx1, e.g. 16384x1")
    return (int(m.group(1)), 1)


def report(paths: list[Path], out: Path, reference: list[dict]) -> dict:
    """Merge split runs; a later file's row for the same point replaces an earlier one."""
    merged: dict = {"what": None, "date": None, "device": None, "argv": [], "servers": [], "rows": [],
                    "profiles": [], "skipped": [], "merged_from": [str(p) for p in paths]}
    rows, profiles = {}, {}
    conditions: dict = {k: {} for k in RUN_CONDITIONS}
    for p in paths:
        data = json.loads(Path(p).read_text())
        for key, old_runs in RUN_CONDITIONS.items():
            seen = conditions[key]
            seen[str(p)] = data.get(key, old_runs)
            if len(set(seen.values())) > 1:
                raise ValueError(f"--report: runs with different --{key.replace('_', '-')} cannot share a table: {seen}")
            merged[key] = seen[str(p)]
        for k in ("what", "date", "device"):
            merged[k] = data.get(k) or merged[k]
        merged["argv"].append(data.get("argv", []))
        merged["servers"] += data.get("servers", [])
        merged["skipped"] += data.get("skipped", [])
        for r in data.get("rows", []):
            r.setdefault("backend", "triton")
            if r.get("verify") in (None, "default"):  # runs before configuration specs
                r["verify"] = "-" if r["config"] == "nospec" else "fused"
            rows[(*row_key(r), r["ctx"], r["batch"])] = r
        for q in data.get("profiles", []):
            profiles[(*row_key(q), q["ctx"])] = q
    merged["rows"], merged["profiles"] = list(rows.values()), list(profiles.values())
    measured = {(Spec(*k[:4]).label, f"ctx {k[4]} bs {k[5]}") for k in rows}
    started = {label for label, _ in measured}
    merged["skipped"] = [s for s in merged["skipped"]  # drop what a later run measured
                         if (s["config"], s["what"]) not in measured
                         and not (s["what"] == "server" and s["config"] in started)]
    return finish(merged, reference)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=Path, default=Path(os.environ.get("DDTREE_TEST_MODELS", "/tmp/ddtree-models")))
    ap.add_argument("--configs", default="nospec,dflash",
                    help=f"comma list of CONFIG[@VERIFY][:BACKEND]; CONFIG in {list(CONFIGS)} or ddtree<B>, VERIFY in {list(VERIFY_PATHS)}")
    ap.add_argument("--backend", default="triton", choices=BACKENDS, help="for configurations without :BACKEND")
    ap.add_argument("--verify", default="fused", choices=VERIFY_PATHS, help="for configurations without @VERIFY")
    ap.add_argument("--ctx", default="16384", help="comma list, e.g. 1024,4096,16384,32768")
    ap.add_argument("--batch", default="1", help="comma list, e.g. 1,8")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--sampling", default="0",
                    help="T[/top_k[/top_p]] every request sends (0: greedy, the default; e.g. 1 or 0.7/20/0.8): "
                         "a sampled step draws per node, so it is measured apart; runs of different "
                         "sampling do not merge in --report")
    ap.add_argument("--point-max-s", type=float, default=12.0, help="decode window per point (0: no limit)")
    ap.add_argument("--deadline-s", type=float, default=None, help="wall budget of the whole run")
    ap.add_argument("--start-estimate-s", type=float, default=200.0, help="first server start, for --deadline-s")
    ap.add_argument("--profile-steps", type=int, default=16, help="forwards traced per server (0: no profile)")
    ap.add_argument("--profile-at", default=None, help="CTXx1 (default: the largest context, batch 1)")
    ap.add_argument("--profile-nospec", action="store_true", help="also profile the no-speculation server")
    ap.add_argument("--profile-host", action="store_true",
                    help="trace the host's ops too: DDTREE's step phases, host and GPU ms each (the host's read high)")
    ap.add_argument("--triton-cache", type=Path,
                    default=Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache"),
                    help="TRITON_CACHE_DIR of every server (default: Triton's own, which the GPU tests warm)")
    ap.add_argument("--reference", type=Path, default=DEFAULT_REFERENCE)
    ap.add_argument("--report", type=Path, nargs="+", help="merge these result JSONs instead of measuring")
    ap.add_argument("--markdown", action="store_true", help="print the README table")
    ap.add_argument("--tag", default=time.strftime("%Y%m%d-%H%M%S"))
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/ddtree-bench-logs"))
    ap.add_argument("--moe-tile-rule", choices=list(MOE_TILE_RULES), default="rows_per_expert",
                    help="fused-MoE default row tile: this fork's rule (patch 0060) or upstream's M <= E switch")
    ap.add_argument("--strategy-table", type=Path, default=None,
                    help="a measured verify-strategy table for every server (SGLANG_DDTREE_STRATEGY_TABLE; "
                         "benchmarks/verify_strategy_table.py writes one); default: the shipped table")
    ap.add_argument("--target", choices=list(TARGETS), default="v2lite",
                    help="model shape: DeepSeek-V2-Lite (MLA), Qwen3-8B (GQA), Qwen3.6-35B-A3B (Gated DeltaNet "
                         "hybrid, MoE) or gpt-oss-20b (sliding windows, sinks, MoE); config-only, dummy weights")
    ap.add_argument("--expert-routing", choices=list(EXPERT_ROUTING), default="model",
                    help="MoE routing of the dummy target: its router (model), spread over the experts (uniform), "
                    "or spread with a DDTREE tree's siblings sent to the same experts (tree)")
    args = ap.parse_args(argv)
    try:
        args.sampling = parse_sampling(args.sampling)
    except ValueError as e:
        ap.error(str(e))

    reference = load_reference(args.reference)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"e2e_step_{args.tag}.json"
    if args.report:
        try:
            result = report(args.report, out, reference)
        except ValueError as e:
            ap.error(str(e))
        write(result, out)
    else:
        if args.strategy_table is not None:
            try:
                from sglang.srt.layers.attention.tree_verify.policy import StrategyTable

                StrategyTable.from_json(json.loads(args.strategy_table.read_text()), str(args.strategy_table))
            except (OSError, ValueError) as e:
                ap.error(f"--strategy-table: {e}")
        try:
            specs = [parse_spec(s, args.verify, args.backend) for s in args.configs.split(",") if s]
            ctxs = [int(x) for x in args.ctx.split(",")]
            batches = [int(x) for x in args.batch.split(",")]
        except ValueError as e:
            ap.error(str(e))
        if len({s.key for s in specs}) != len(specs):
            ap.error("a configuration is listed twice")
        try:
            check_target(args.target, specs, args.expert_routing)
        except ValueError as e:
            ap.error(str(e))
        if max(ctxs) + BATCH_TOKEN_CAP > context_length(args.target, max(ctxs)):
            ap.error(f"--ctx {max(ctxs)}: {args.target} holds {context_length(args.target, max(ctxs))} tokens, and a "
                     f"point decodes up to {BATCH_TOKEN_CAP} past its prompt")
        result = run(args, specs, ctxs, batches, out, reference)
    plot(result, out.with_suffix(".png"))
    print(f"{'config':36} {'ctx':>6} {'bs':>3} {'ms/step':>8} {'accept':>6}")
    for r in result["rows"]:
        label = Spec(*row_key(r)).label
        print(f"{label:36} {r['ctx']:>6} {r['batch']:>3} {r['ms_per_step']:>8.2f} {r['accept_length']:>6.2f}")
    for s in result["skipped"]:
        print(f"skipped {s['config']} {s['what']}: {s['reason'][:200]}")
    for q in result["ratios"]:
        print(f"ratio ctx {q['ctx']} bs {q['batch']}: {q['ratio']} = {q['value']:.2f}"
              + (f" (target <= {q['target']})" if "target" in q else "")
              + ("" if q["source"] == "this run" else f"  [{q['source']}]"))
    for v in result["verify_attention"]:
        if v["verify_attention_ms"] is not None:
            print(f"verify attention {Spec(*row_key(v)).label} ctx {v['ctx']}: "
                  f"{v['verify_attention_ms']:.2f} of {v['gpu_ms_per_step']:.2f} GPU ms/step ({100 * v['share']:.0f} %)")
        if "linear_verify_ms" in v:
            print(f"linear-attention tree verify {Spec(*row_key(v)).label} ctx {v['ctx']}: "
                  f"{v['linear_verify_ms']:.2f} of {v['gpu_ms_per_step']:.2f} GPU ms/step "
                  f"({100 * v['linear_share']:.0f} %)")
    if args.markdown:
        print(markdown(result["rows"], result["verify_attention"]))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
