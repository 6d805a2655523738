"""Tree-verify attention benchmark: every strategy over the DDTree verify shapes.

For each shape (``--attn mla``: absorbed MLA, Dqk 576, Dv 512, one KV head;
``--attn gqa``: 8 KV heads of 128, the Llama/Qwen3-8B layout) it times every
strategy (median of ``triton.testing.do_bench``), and reports TFLOP/s, GB/s,
the fraction of the roofline and the speedup over ``upstream_extend``. The
roofline uses the bf16 matmul rate and the HBM copy bandwidth measured in the
same run. ``fused`` runs with the current arch's configs and, as
``fused_sm120``, with the 12.x configs forced (what an RTX PRO 6000 would
select). ``flashinfer_dense`` (GQA) is upstream's FlashInfer MHA verify: FA2
over prefix + tree with the dense custom mask. Writes JSON and a PNG plot to
``benchmarks/results/``.

    python benchmarks/verify_attention.py               # full MLA matrix
    python benchmarks/verify_attention.py --quick       # the issue's target shapes
    python benchmarks/verify_attention.py --attn gqa    # GQA matrix, FlashInfer's path included
    python benchmarks/verify_attention.py --tune        # sweep MLA tile configs / splits
    python benchmarks/verify_attention.py --from-log run.log --tag T   # JSON + PNG from stdout
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys

import torch
import triton

from benchmarks.gpu_timing import bench, measure_peaks

from sglang.srt.layers.attention.tree_verify import (
    StrategyUnavailable,
    tree_mask_from_parents,
    tree_verify_attention,
)
from sglang.srt.layers.attention.tree_verify.configs import (
    TreeVerifyConfig,
    select_config,
)
from sglang.srt.layers.attention.tree_verify.prefix_split import (
    num_splits_for,
    tree_verify_fused,
)
from sglang.srt.layers.attention.tree_verify.reference import tree_verify_attention_ref

@dataclasses.dataclass(frozen=True)
class Heads:
    """The KV layout of one attention family: ``shared_kv`` when V is the first
    ``dv`` columns of K (absorbed MLA's latent cache)."""

    name: str
    hkv: int
    dqk: int
    dv: int
    shared_kv: bool
    query_heads: tuple  # H values of the full matrix


MLA = Heads("mla", 1, 576, 512, True, (16, 128))
GQA = Heads("gqa", 8, 128, 128, False, (32,))
HEADS = {h.name: h for h in (MLA, GQA)}
DQK, DV = MLA.dqk, MLA.dv
DEVICE = "cuda"
GRAPH = [True]  # time CUDA-graph replays (--no-graph: eager calls)
TARGET_SHAPES = [  # (H, N, P, bs) the issue's targets
    (16, 65, 16384, 1),
    (16, 17, 65536, 1),
    (128, 65, 65536, 1),
    (16, 4, 65536, 1),
]
GQA_QUICK_SHAPES = [(32, 65, 16384, 1), (32, 17, 65536, 1), (32, 65, 16384, 8)]


def full_matrix(heads=MLA):
    shapes = [
        (h, n, p, bs)
        for bs in (1, 8)
        for h in heads.query_heads
        for n in (17, 65, 129)
        for p in (1024, 4096, 16384, 65536)
    ]
    if heads is MLA:
        shapes += [(16, 4, 65536, 1), (16, 4, 65536, 8)]
    return shapes


def make_inputs(h, n, p, bs, dtype=torch.bfloat16, seed=0, heads=MLA):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    pool = bs * (p + n) + 64
    k = torch.randn(pool, heads.hkv, heads.dqk, device=DEVICE, dtype=dtype, generator=g)
    v = k[..., : heads.dv] if heads.shared_kv else torch.randn(
        pool, heads.hkv, heads.dv, device=DEVICE, dtype=dtype, generator=g
    )
    perm = torch.randperm(pool, device=DEVICE, generator=g).to(torch.int32)
    indptr = torch.arange(0, (bs + 1) * p, p, device=DEVICE, dtype=torch.int32)
    prefix_idx = perm[: bs * p].contiguous()
    tree_idx = perm[bs * p : bs * p + bs * n].view(bs, n).contiguous()
    cpu = torch.Generator().manual_seed(seed)
    parents = torch.full((bs, n), -1, dtype=torch.int64)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (bs,), generator=cpu)
    mask = tree_mask_from_parents(parents).to(DEVICE)
    q = torch.randn(bs * n, h, heads.dqk, device=DEVICE, dtype=dtype, generator=g)
    return (q, k, v, indptr, prefix_idx, tree_idx, mask, heads.dqk**-0.5)


def flops_bytes(h, n, p, bs, heads=MLA):
    """Score and value products; the KV read once (V inside K for MLA) plus Q and O."""
    flops = 2 * bs * n * h * (p + n) * (heads.dqk + heads.dv)
    kv_width = heads.dqk + (0 if heads.shared_kv else heads.dv)
    nbytes = 2 * (bs * (p + n) * heads.hkv * kv_width + bs * n * h * (heads.dqk + heads.dv))
    return flops, nbytes


def run_strategy(name, inputs, config_arch=None, heads=MLA):
    args = inputs
    if name.startswith("fused"):
        cfg = select_config(config_arch, heads.dqk, heads.dv, heads.shared_kv)
        return lambda: tree_verify_fused(*args, None, 0.0, cfg), cfg
    if name == "upstream_extend":
        # The dense mask is built ahead, as upstream's backend does before the
        # forward; the timed region is the gather of the tree KV + the kernel.
        from sglang.srt.layers.attention.tree_verify.upstream_extend import (
            dense_custom_mask,
            tree_verify_upstream_extend,
        )

        mask = dense_custom_mask(args[3], args[6], args[5].shape[1])
        return lambda: tree_verify_upstream_extend(*args, None, 0.0, custom_mask=mask), None
    if name == "flashinfer_split":
        # Planned ahead, as a FlashInfer backend plans before the forward: the
        # timed region (and the captured graph) holds device work only.
        from sglang.srt.layers.attention.tree_verify.flashinfer_split import (
            FlashInferPrefixPass,
            tree_verify_flashinfer_split,
        )

        cfg = select_config(config_arch, heads.dqk, heads.dv, heads.shared_kv)
        planned = FlashInferPrefixPass(*args[:5], args[5].shape[1], args[7])
        return lambda: tree_verify_flashinfer_split(*args, None, 0.0, cfg, prefix_pass=planned), None
    if name == "flashmla_split":
        # Staging sized ahead as the hook sizes it at start-up, and the forward's plan
        # (page layout, FlashMLA schedule) made ahead: the hook makes it once per forward
        # and every layer shares it, so one timed call is one layer's work.
        from sglang.srt.layers.attention.tree_verify.flashmla_split import (
            new_staging,
            plan_flashmla,
            staging_pages,
            tree_verify_flashmla_split,
        )

        cfg = select_config(config_arch, heads.dqk, heads.dv, heads.shared_kv)
        bs, n = args[5].shape
        p = int(args[3][1] - args[3][0]) if bs else 0
        staging = new_staging(staging_pages(bs, args[4].numel()), args[1])
        plan = plan_flashmla(args[3], n, args[0].shape[1], p, staging.shape[0])
        return lambda: tree_verify_flashmla_split(
            *args, None, 0.0, cfg, staging=staging, plan=plan
        ), None
    if name == "flashinfer_dense":
        return flashinfer_dense_mask(args, heads), None
    return lambda: tree_verify_attention(*args, strategy=name), None


def flashinfer_dense_mask(inputs, heads):
    """Upstream's FlashInfer MHA verify (``FlashInferAttnBackend`` TARGET_VERIFY):
    FA2 paged prefill over each request's prefix + tree slots with the dense
    ``N x (P + N)`` custom mask, planned ahead as its ``init_forward_metadata`` does."""
    if heads.shared_kv:
        raise StrategyUnavailable("flashinfer_dense: FlashInfer's MLA kernel takes no custom mask")
    try:
        import flashinfer
    except ImportError as e:
        raise StrategyUnavailable(f"flashinfer_dense needs flashinfer: {e}") from e
    from sglang.srt.layers.attention.tree_verify.upstream_extend import dense_custom_mask

    q, k, v, indptr, prefix_idx, tree_idx, mask, scale = inputs
    bs, n = tree_idx.shape
    starts = indptr.tolist()
    kv_indices = torch.cat(
        [torch.cat([prefix_idx[starts[b] : starts[b + 1]], tree_idx[b]]) for b in range(bs)]
    )
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=q.device)
    kv_indptr[1:] = torch.cumsum(indptr[1:] - indptr[:-1] + n, 0)
    qo_indptr = torch.arange(0, (bs + 1) * n, n, dtype=torch.int32, device=q.device)
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(
        qo_indptr, kv_indptr, kv_indices, torch.ones(bs, dtype=torch.int32, device=q.device),
        q.shape[1], heads.hkv, heads.dqk, 1, custom_mask=dense_custom_mask(indptr, mask, n),
        sm_scale=scale, q_data_type=q.dtype, kv_data_type=k.dtype,
    )  # fmt: skip
    paged = (k.unsqueeze(1), v.unsqueeze(1))  # page_size 1: [slots, 1, Hkv, D]
    return lambda: wrapper.run(q, paged)


def check(out, inputs, h, n, p, bs):
    """Max abs error vs the fp32 reference on request 0 (kept small to stay fast)."""
    if p > 16384 or h * n * p > 128 * 65 * 16384:
        return None
    q, k, v, indptr, pidx, tidx, mask, scale = inputs
    ref = tree_verify_attention_ref(
        q[:n], k, v, indptr[:2], pidx[: p], tidx[:1], mask[:1], scale
    ).float()
    return (out[:n].float() - ref).abs().max().item()


def run_matrix(shapes, strategies, peaks, arch, verbose=True, heads=MLA, dtype=torch.bfloat16):
    rows = []
    peak_tflops, peak_gbps = peaks
    for h, n, p, bs in shapes:
        inputs = make_inputs(h, n, p, bs, dtype=dtype, heads=heads)
        flops, nbytes = flops_bytes(h, n, p, bs, heads)
        floor_ms = max(flops / peak_tflops / 1e9, nbytes / peak_gbps / 1e6)
        base_ms = None
        for name in strategies:
            rec = dict(H=h, N=n, P=p, bs=bs, strategy=name)
            try:
                cfg_arch = (12, 0) if name == "fused_sm120" else arch
                fn, cfg = run_strategy(name, inputs, cfg_arch, heads)
                if cfg is not None:
                    rec["config"] = cfg.__dict__
                    rec["num_splits"] = num_splits_for(inputs[0], inputs[1], inputs[2], inputs[4], bs, n, cfg)
                out = fn()
                rec["max_err"] = check(out, inputs, h, n, p, bs)
                ms = bench(fn, slow=name == "upstream_extend", graph=GRAPH[0])
            except (StrategyUnavailable, ImportError) as e:
                rec["unavailable"] = str(e)
                rows.append(rec)
                continue
            except Exception as e:  # one strategy failing must not lose the rest of the matrix
                rec["error"] = f"{type(e).__name__}: {e}"[:500]
                rows.append(rec)
                print(json.dumps(rec), flush=True)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                continue
            rec.update(
                ms=round(ms, 4),
                tflops=round(flops / ms / 1e9, 1),
                gbps=round(nbytes / ms / 1e6, 1),
                roofline_frac=round(floor_ms / ms, 3),
            )
            if name == "upstream_extend":
                base_ms = ms
            if base_ms:
                rec["speedup_vs_upstream"] = round(base_ms / ms, 2)
            rows.append(rec)
            if verbose:
                print(json.dumps(rec), flush=True)
        del inputs
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


TUNE_CONFIGS = [
    # the default first (split factors apply to it)
    select_config((9, 0), DQK, DV),
    # Hopper, 8 warps over a 64 x 512 accumulator: both warpgroups compute
    # the score tile (narrow m64n16 MMAs); 3 or 4 stages
    TreeVerifyConfig(64, 32, 8, 3),
    TreeVerifyConfig(64, 32, 8, 4),
    # scores one tile ahead of PV: no duplicated score MMAs, the K tile
    # carried to the next iteration as its V tile
    TreeVerifyConfig(64, 32, 8, 3, qk_ahead=True),
    # value columns split over two one-warpgroup programs: m64n{16,32,64}
    # score MMAs with Q in shared memory, a 64 x 256 accumulator each
    TreeVerifyConfig(64, 16, 4, 2, dv_split=2, ctas_per_sm=2),
    TreeVerifyConfig(64, 16, 4, 3, dv_split=2),
    TreeVerifyConfig(64, 32, 4, 2, dv_split=2),
    TreeVerifyConfig(64, 32, 4, 3, dv_split=2),
    TreeVerifyConfig(64, 64, 4, 2, dv_split=2),
    # scores as K.Q^T in 64-key tiles with P (and the rescale) handed to the PV
    # product through a per-program global scratch: no dot chain, so the two
    # warpgroups split the score tile (m64n32) instead of both computing it
    TreeVerifyConfig(64, 64, 8, 2, scores_via_scratch=True),
    # sm_12x-sized (<= 99 KiB when compiled for sm_120); 32-row tiles are
    # mma.sync on the H200 as on sm_120
    select_config((12, 0), DQK, DV),
    TreeVerifyConfig(32, 32, 4, 2, q_as_b=True, ctas_per_sm=2),
    TreeVerifyConfig(32, 32, 4, 2, dv_split=2, ctas_per_sm=2),
    TreeVerifyConfig(32, 16, 4, 3, dv_split=2, ctas_per_sm=2),
]


def tune_configs(match: str = ""):
    """The default first, then the sweep's configs whose repr contains ``match``."""
    return [TUNE_CONFIGS[0]] + [c for c in TUNE_CONFIGS[1:] if match in repr(c)]


def tune(peaks, configs=TUNE_CONFIGS, shapes=None, split_factors=(1,)):
    """Sweep MLA tile configs (and split counts, as factors of the model's
    choice) on the target shapes; each row carries the max error where
    ``check`` can afford the reference."""
    rows = []
    for h, n, p, bs in shapes or TARGET_SHAPES:
        inputs = make_inputs(h, n, p, bs)
        flops, nbytes = flops_bytes(h, n, p, bs)
        for i, cfg in enumerate(configs):
            auto = num_splits_for(inputs[0], inputs[1], inputs[2], inputs[4], bs, n, cfg)
            factors = split_factors if cfg is configs[0] else (1,)
            if cfg in configs[:i]:
                continue  # the default again
            for s in sorted({max(1, int(auto * f)) for f in factors}):
                try:
                    fn = lambda: tree_verify_fused(*inputs, None, 0.0, cfg, num_splits=s)  # noqa: E731
                    err = check(fn(), inputs, h, n, p, bs)
                    ms = bench(fn)
                except Exception as e:  # a config that fails to compile is data here
                    print("FAIL", h, n, p, bs, cfg, str(e)[:200], flush=True)
                    break
                rec = dict(H=h, N=n, P=p, bs=bs, cfg=cfg.__dict__, splits=s, auto=s == auto,
                           ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
                           gbps=round(nbytes / ms / 1e6, 1), max_err=err)  # fmt: skip
                rows.append(rec)
                print(json.dumps(rec), flush=True)
        del inputs
        torch.cuda.empty_cache()
    return rows


def plot(rows, path, heads=MLA):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for ax, bs in zip(axes, (1, 8)):
        labels, series = [], {}
        for r in rows:
            if r["bs"] != bs or "ms" not in r:
                continue
            key = f"H{r['H']} N{r['N']} P{r['P'] // 1024}K"
            if key not in labels:
                labels.append(key)
            series.setdefault(r["strategy"], {})[key] = r["ms"]
        width = 0.8 / max(1, len(series))
        for i, (name, vals) in enumerate(series.items()):
            xs = [j + i * width for j, k in enumerate(labels) if k in vals]
            ax.bar(xs, [vals[k] for k in labels if k in vals], width, label=name)
        ax.set_yscale("log")
        ax.set_xticks([j + 0.4 for j in range(len(labels))])
        ax.set_xticklabels(labels, rotation=90, fontsize=7)
        ax.set_ylabel("ms (median, log)")
        ax.set_title(f"tree-verify attention, {heads.name.upper()} {heads.dqk}/{heads.dv} "
                     f"({heads.hkv} KV head{'s' if heads.hkv > 1 else ''}), batch {bs}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def rows_from_log(lines):
    """The run's metadata and rows from its stdout (one JSON object per line):
    a device run whose result files did not come back still has its numbers."""
    objs = []
    for line in lines:
        line = line.strip()
        if line.startswith("{"):
            try:
                objs.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a timeout
    metas = [o for o in objs if "peak_bf16_tflops" in o]
    if len(metas) != 1:
        raise ValueError(f"expected one metadata line in the log, found {len(metas)}")
    return metas[0], [o for o in objs if "strategy" in o]


def result_stem(heads, tag):
    return "verify_attention" + ("" if heads is MLA else f"_{heads.name}") + (f"_{tag}" if tag else "")


def write_results(meta, rows, out_dir, tag, heads):
    stem = result_stem(heads, tag)
    with open(os.path.join(out_dir, stem + ".json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    plot(rows, os.path.join(out_dir, stem + ".png"), heads)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the issue's target shapes")
    ap.add_argument("--tune", action="store_true", help="sweep tile configs and splits")
    ap.add_argument("--attn", choices=list(HEADS), default="mla", help="KV layout of the shapes")
    ap.add_argument("--strategies", default=None,
                    help="comma list (default: upstream_extend,fused,fused_sm120,flashinfer_split"
                         " and flashmla_split for mla, flashinfer_dense for gqa)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--no-graph", action="store_true", help="time eager calls, not graph replays")
    ap.add_argument("--shapes", default="", help="H:N:P:bs,... instead of the matrix")
    ap.add_argument("--split-factors", default="1", help="--tune: split counts as factors of the model's")
    ap.add_argument("--tune-match", default="",
                    help="--tune: only the configs whose repr contains this (e.g. dv_split=2), besides the default")
    ap.add_argument("--from-log", default=None, help="rebuild JSON + PNG from a run's stdout, measure nothing")
    args = ap.parse_args()
    if args.from_log:
        with open(args.from_log) as f:
            meta, rows = rows_from_log(f)
        meta["rebuilt_from_stdout"] = os.path.basename(args.from_log)
        os.makedirs(args.out, exist_ok=True)
        write_results(meta, rows, args.out, args.tag, HEADS[meta["attn"]["name"]])
        print_table(rows)
        return
    heads = HEADS[args.attn]
    if args.tune and heads is not MLA:
        ap.error("--tune sweeps the MLA tile configurations only")
    strategies = args.strategies or "upstream_extend,fused,fused_sm120,flashinfer_split" + (
        ",flashmla_split" if heads is MLA else ",flashinfer_dense")

    from sglang.srt.utils.gpu_arch import device_capability, kernel_arch

    os.makedirs(args.out, exist_ok=True)
    GRAPH[0] = not args.no_graph
    peaks = measure_peaks()
    meta = dict(
        date=datetime.date.today().isoformat(),
        gpu=torch.cuda.get_device_name(),
        capability=list(device_capability()),
        sms=torch.cuda.get_device_properties(0).multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        peak_bf16_tflops=round(peaks[0], 1),
        hbm_copy_gbps=round(peaks[1], 1),
        timing="cuda_graph_replay" if GRAPH[0] else "eager",
        attn=dataclasses.asdict(heads),
    )
    print(json.dumps(meta), flush=True)
    stem = result_stem(heads, args.tag)
    if args.tune:
        shapes = None
        if args.shapes:
            shapes = [tuple(int(x) for x in v.split(":")) for v in args.shapes.split(",")]
        factors = tuple(float(f) for f in args.split_factors.split(","))
        rows = tune(peaks, configs=tune_configs(args.tune_match), shapes=shapes, split_factors=factors)
        for r in rows:
            c = r["cfg"]
            name = f"{c['block_m']}x{c['block_n']}w{c['num_warps']}s{c['num_stages']}" + (
                "qb" if c["q_as_b"] else "") + ("ahead" if c.get("qk_ahead") else "") + (
                f"dv{c['dv_split']}" if c.get("dv_split", 1) > 1 else "") + (
                "scratch" if c.get("scores_via_scratch") else "")
            print(f"H{r['H']} N{r['N']} P{r['P']} bs{r['bs']} {name:<16} splits {r['splits']:>3} "
                  f"{r['ms']:.4f} ms {r['tflops']:6.1f} TF/s {r['gbps']:7.1f} GB/s err {r['max_err']}")
        with open(os.path.join(args.out, stem + "_tune.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        return
    quick = TARGET_SHAPES if heads is MLA else GQA_QUICK_SHAPES
    shapes = quick if args.quick else full_matrix(heads)
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]
    rows = run_matrix(shapes, strategies.split(","), peaks, kernel_arch(), heads=heads)
    write_results(meta, rows, args.out, args.tag, heads)
    print_table(rows)


def print_table(rows):
    print(f"{'H':>4} {'N':>4} {'P':>6} {'bs':>3} {'strategy':<17} {'ms':>9} {'TF/s':>7} {'GB/s':>7} {'roof':>6} {'x up':>7}")
    for r in rows:
        if "ms" not in r:
            continue
        print(
            f"{r['H']:>4} {r['N']:>4} {r['P']:>6} {r['bs']:>3} {r['strategy']:<17} "
            f"{r['ms']:>9.4f} {r['tflops']:>7.1f} {r['gbps']:>7.1f} {r['roofline_frac']:>6.3f} "
            f"{r.get('speedup_vs_upstream', float('nan')):>7.2f}"
        )


if __name__ == "__main__":
    sys.exit(main())
