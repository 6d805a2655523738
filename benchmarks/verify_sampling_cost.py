# SPDX-License-Identifier: Apache-2.0
"""What sampling costs a DDTREE verify step: the verify sampler against the path it replaced.

Before: upstream DFlash's logit adjustments and target probabilities
(``apply_dflash_verify_logits_adjustments`` + ``build_dflash_verify_target_probs``: top-k
renormalised before top-p, penalties from the step's committed state) and sglang-kernel's
``tree_speculative_sampling_target_only`` with its zeroed ``[bs, N, V]`` draft-probability
scratch. After: ``VerifySampler.target_tokens`` (per-node penalties and bias, one draw per node
by the fused filtered draw, the default; and with ``SGLANG_DDTREE_VERIFY_DRAW=sampler``, by the
sampling backend's kernels) and sglang-kernel's ``verify_tree_greedy`` over the draws. All on the
same random logits and DDTree trees, eager as the step runs them; the time is wall time per
call with the GPU synchronised at the end of each batch of calls (launches included), the
median of several batches, and the peak GPU memory a call allocates beyond the logits (the
sampling temporaries: ``[bs * N, V]`` float32 copies before, a bounded workspace after).
Requires a CUDA GPU with the series applied.

    python3 -m benchmarks.verify_sampling_cost --tag verify_sampling_cost_h200_2026-12-03 --out-dir DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.plotting import pyplot

SETTINGS = {
    "T0.7 top_k20 top_p0.8": dict(temperature=0.7, top_k=20, top_p=0.8),
    "T1": dict(temperature=1.0),
    "T1 top_p0.95": dict(temperature=1.0, top_p=0.95),
    "T1 repetition1.1": dict(temperature=1.0, repetition_penalty=1.1),
}


class _Req:
    """The request fields the penalty table reads."""

    def __init__(self, params, i):
        self.sampling_params, self.tokenizer = params, None
        self.origin_input_ids, self.output_ids = [1, 2, 3], [5, 6, 7, 8]
        self.full_untruncated_fill_ids = [1, 2, 3, 5, 6, 7]
        self.req_pool_idx, self.retraction_count = i, 0
        self.return_sampling_mask, self.custom_logit_processor = False, None

    def finished(self):
        return False


class _Batch:
    def __init__(self, reqs):
        self.reqs, self.device = reqs, "cuda"


def _context(vocab: int):
    """A published server context (the GPU's default sampling backend) and upstream's sampler."""
    from sglang.srt.layers import sampler as sampler_mod
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    d = Path(tempfile.mkdtemp(prefix="verify_sampling_cost_"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}))
    sa = ServerArgs(model_path=str(d), device="cuda", skip_tokenizer_init=True)
    publish(sa, role="test")
    sampler_mod.get_tp_group = lambda: SimpleNamespace(device_group=None)
    # One process, no model-parallel group: the verify's TP broadcast sees a group of one.
    from sglang.srt.speculative.verify_sampling import verify_sampler

    verify_sampler.get_tp_group = lambda: SimpleNamespace(world_size=1)
    return sa, sampler_mod.Sampler()


def _step_inputs(bs: int, budget: int, vocab: int, seed: int):
    from sglang.srt.speculative.ddtree.tree_build import build_tree
    from sglang.srt.speculative.ddtree.tree_compile import compile_tree, max_tree_depth

    g = torch.Generator(device="cuda").manual_seed(seed)
    depths = 15
    k = min(budget, vocab)
    lp = torch.log_softmax(torch.randn(bs, depths, vocab, device="cuda", generator=g), -1)
    vals, ids = lp.topk(k, dim=-1)
    tree = build_tree(vals, ids, budget)
    bonus = torch.randint(0, vocab, (bs,), device="cuda", generator=g)
    committed = torch.full((bs,), 300, dtype=torch.int64, device="cuda")
    ct = compile_tree(tree, bonus, committed, max_tree_depth(budget, depths))
    logits = torch.randn(bs * (budget + 1), vocab, device="cuda", generator=g) * 3
    return ct, logits


def _peak_mib(fn) -> float:
    """GPU memory one call allocates beyond what is live before it (its temporaries' peak)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / (1 << 20)


def _wall_ms(fn, iters: int, batches: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(batches):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3 / iters)
    return statistics.median(out)


def measure(vocab: int, bs: int, budget: int, setting: str, sampler, iters: int) -> dict:
    from sgl_kernel import tree_speculative_sampling_target_only

    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.ddtree.accept import greedy_accept
    from sglang.srt.speculative.dflash_utils import (
        apply_dflash_verify_logits_adjustments,
        build_dflash_verify_target_probs,
    )
    from sglang.srt.speculative.verify_sampling.node_logits import NodePaths
    from sglang.srt.speculative.verify_sampling.verify_sampler import VerifySampler

    n = budget + 1
    ct, logits = _step_inputs(bs, budget, vocab, seed=bs * 1000 + budget)
    reqs = [_Req(SamplingParams(max_new_tokens=64, **SETTINGS[setting]), i) for i in range(bs)]
    info = SamplingBatchInfo.from_schedule_batch(_Batch(reqs), vocab).copy_for_forward()
    work = torch.empty_like(logits)

    def before():
        work.copy_(logits)
        apply_dflash_verify_logits_adjustments(next_token_logits=work, sampling_info=info, draft_token_num=n)
        probs = build_dflash_verify_target_probs(next_token_logits=work, sampling_info=info, draft_token_num=n,
                                                 bs=bs)  # fmt: skip
        g = torch.rand(bs, n, device="cuda")
        tree_speculative_sampling_target_only(
            predicts=torch.empty(bs * n, dtype=torch.int32, device="cuda"),
            accept_index=torch.full((bs, ct.max_depth + 1), -1, dtype=torch.int32, device="cuda"),
            accept_token_num=torch.zeros(bs, dtype=torch.int32, device="cuda"),
            candidates=ct.tokens, retrive_index=ct.retrive_index, retrive_next_token=ct.retrive_next_token,
            retrive_next_sibling=ct.retrive_next_sibling, uniform_samples=g,
            uniform_samples_for_final_sampling=torch.rand(bs, device="cuda"), target_probs=probs,
            draft_probs=torch.zeros_like(probs), threshold_single=1.0, threshold_acc=1.0, deterministic=True)

    runner = SimpleNamespace(model_config=SimpleNamespace(vocab_size=vocab), device="cuda", sampler=sampler)
    vs = VerifySampler.for_target(runner)
    os.environ["SGLANG_DDTREE_VERIFY_DRAW"] = "sampler"
    try:
        vs_sampler = VerifySampler.for_target(runner)
    finally:
        del os.environ["SGLANG_DDTREE_VERIFY_DRAW"]
    paths = NodePaths(ct.tokens, ct.parent, ct.depth, ct.max_depth)

    def after(v=vs):
        work.copy_(logits)
        verify = v.target_tokens(work, info, reqs, paths, ct.positions)
        greedy_accept(ct, verify.tokens, read_back=False)

    def after_sampler():
        after(vs_sampler)

    def copy_only():
        work.copy_(logits)

    copy_ms = _wall_ms(copy_only, iters)
    row = {"vocab": vocab, "bs": bs, "budget": budget, "setting": setting,
           "before_ms": _wall_ms(before, iters) - copy_ms, "after_ms": _wall_ms(after, iters) - copy_ms,
           "after_sampler_ms": _wall_ms(after_sampler, iters) - copy_ms,
           "logits_copy_ms": copy_ms, "logits_mib": logits.numel() * 4 / (1 << 20),
           "before_peak_mib": _peak_mib(before), "after_peak_mib": _peak_mib(after),
           "after_sampler_peak_mib": _peak_mib(after_sampler)}  # fmt: skip
    row["ratio_after_before"] = row["after_ms"] / row["before_ms"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", default="8192,151936")
    ap.add_argument("--bs", default="1,8,64")
    ap.add_argument("--budget", default="16,64")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--tag", default="verify_sampling_cost")
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    vocabs = [int(v) for v in args.vocab.split(",")]
    rows = []
    result = {"what": "verify sampling cost per DDTREE step (benchmarks/verify_sampling_cost.py)",
              "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0), "rows": rows}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"{args.tag}.json"
    for vocab in vocabs:
        _, sampler = _context(vocab)
        for bs in (int(b) for b in args.bs.split(",")):
            for budget in (int(b) for b in args.budget.split(",")):
                for setting in args.settings.split(","):
                    rows.append(measure(vocab, bs, budget, setting, sampler, args.iters))
                    print(json.dumps(rows[-1]), flush=True)
                    out.write_text(json.dumps(result, indent=1) + "\n")  # a cut-off run keeps its rows
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(11, 4.5))
        labels = [f"V{r['vocab'] // 1000}k bs{r['bs']} B{r['budget']}\n{r['setting']}" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.27 for i in x], [r["before_ms"] for r in rows], 0.27, label="before (upstream helpers + tree op)")
        ax.bar(list(x), [r["after_sampler_ms"] for r in rows], 0.27, label="verify sampler, backend kernels + walk")
        ax.bar([i + 0.27 for i in x], [r["after_ms"] for r in rows], 0.27, label="verify sampler, fused draw + walk")
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=5, rotation=90)
        ax.set_ylabel("ms per step (wall, launches included)")
        ax.legend(fontsize=7)
        fig.suptitle(f"{result['what']} ({result['device']}, {result['date']})", fontsize=8)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
