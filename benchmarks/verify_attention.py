# SPDX-License-Identifier: Apache-2.0
"""Tree-verify attention benchmark: every strategy over the DDTree verify shapes.

For each shape (``--attn mla``: absorbed MLA, Dqk 576, Dv 512, one KV head;
``--attn gqa``: 8 KV heads of 128, the Llama/Qwen3-8B layout) it times every
strategy (median of ``triton.testing.do_bench``), and reports TFLOP/s, GB/s,
the fraction of the roofline and the speedup over ``upstream_extend``. The
roofline uses the bf16 matmul rate and the HBM copy bandwidth measured in the
same run. ``fused`` runs with the current arch's configs and, as
``fused_sm120``, with the 12.x configs forced (what an RTX PRO 6000 would
select). The sliding-window families (``--attn gptoss_swa`` etc.: gpt-oss-20B
and Gemma-4-31B layer shapes, with their windows and gpt-oss's attention sinks)
compare the fused kernels with upstream's dense-mask fallback (its Triton extend
kernel given the window and the sinks, as its backend runs a verify). ``flashinfer_dense`` (GQA) is upstream's FlashInfer MHA verify: FA2
over prefix + tree with the dense custom mask. Writes JSON and a PNG plot to
``benchmarks/results/``.

    python benchmarks/verify_attention.py               # full MLA matrix
    python benchmarks/verify_attention.py --quick       # the target shapes of the verify kernels
    python benchmarks/verify_attention.py --attn gqa    # GQA matrix, FlashInfer's path included
    python benchmarks/verify_attention.py --tune        # sweep MLA tile configs / splits
    python benchmarks/verify_attention.py --tune --tune-set sm12x --one-per-sm   # the 99 KiB tiles
    python benchmarks/verify_attention.py --from-log run.log --tag T   # JSON + PNG from stdout
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import sys

from typing import Optional

import torch
import triton
import triton.language as tl
import triton.testing

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
    window: Optional[int] = None  # upstream's sliding_window_size (config.sliding_window - 1)
    sinks: bool = False  # per-head attention sinks (gpt-oss)


MLA = Heads("mla", 1, 576, 512, True, (16, 128))
GQA = Heads("gqa", 8, 128, 128, False, (32,))
# gpt-oss-20B/120B (64 query heads, 8 KV heads of 64, sinks on every layer; a
# 128-token window on alternating layers) and Gemma-4-31B (sliding layers: 32
# query heads, 16 KV heads of 256, a 1,024-token window; full layers: 4 KV heads
# of 512), one GPU. Windows as upstream's models set them (sliding_window - 1).
GPTOSS_SWA = Heads("gptoss_swa", 8, 64, 64, False, (64,), window=127, sinks=True)
GPTOSS_FULL = Heads("gptoss_full", 8, 64, 64, False, (64,), sinks=True)
GEMMA4_SWA = Heads("gemma4_swa", 16, 256, 256, False, (32,), window=1023)
GEMMA4_FULL = Heads("gemma4_full", 4, 512, 512, False, (32,))
WINDOWED = (GPTOSS_SWA, GPTOSS_FULL, GEMMA4_SWA, GEMMA4_FULL)
HEADS = {h.name: h for h in (MLA, GQA, *WINDOWED)}
DQK, DV = MLA.dqk, MLA.dv
DEVICE = "cuda"
GRAPH = [True]  # time CUDA-graph replays (--no-graph: eager calls)
TARGET_SHAPES = [  # (H, N, P, bs) the shapes with stated time targets
    (16, 65, 16384, 1),
    (16, 17, 65536, 1),
    (128, 65, 65536, 1),
    (16, 4, 65536, 1),
]
GQA_QUICK_SHAPES = [(32, 65, 16384, 1), (32, 17, 65536, 1), (32, 65, 16384, 8)]


def full_matrix(heads=MLA):
    if heads in WINDOWED:
        return [(heads.query_heads[0], n, p, bs) for bs in (1, 8) for n in (17, 65)
                for p in (4096, 65536)]  # fmt: skip
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


@triton.jit
def _matmul_kernel(A, B, C, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(A + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(B + (k + rk)[:, None] * N + rn[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(C + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))


def measure_triton_matmul_tflops(n: int = 8192) -> float:
    """A plain Triton bf16 matmul (128 x 128 x 64 tiles, 8 warps, 3 stages): with
    DISABLE_MMA_V3=1 it runs mma.sync on sm_90, the rate the sm_12x tiles can
    reach there at best; without it, wgmma."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    grid = (n // 128, n // 128)
    fn = lambda: _matmul_kernel[grid](a, b, c, n, n, n, BM=128, BN=128, BK=64,  # noqa: E731
                                      num_warps=8, num_stages=3)  # fmt: skip
    ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
    return 2 * n**3 / ms / 1e9


def window_sink_args(heads, h):
    """The ``sliding_window`` / ``sinks`` keyword arguments of the family (seeded sinks)."""
    extra = {}
    if heads.window is not None:
        extra["sliding_window"] = heads.window
    if heads.sinks:
        g = torch.Generator(device=DEVICE).manual_seed(7)
        extra["sinks"] = torch.randn(h, device=DEVICE, generator=g).to(torch.bfloat16)
    return extra


def flops_bytes(h, n, p, bs, heads=MLA):
    """Score and value products; the KV read once (V inside K for MLA) plus Q and O.
    With a window, the prefix keys inside it (what each node may see at most)."""
    if heads.window is not None:
        p = min(p, heads.window)
    flops = 2 * bs * n * h * (p + n) * (heads.dqk + heads.dv)
    kv_width = heads.dqk + (0 if heads.shared_kv else heads.dv)
    nbytes = 2 * (bs * (p + n) * heads.hkv * kv_width + bs * n * h * (heads.dqk + heads.dv))
    return flops, nbytes


def run_strategy(name, inputs, config_arch=None, heads=MLA):
    args = inputs
    extra = window_sink_args(heads, inputs[0].shape[1])
    if extra:
        return run_windowed(name, inputs, config_arch, heads, extra)
    if name == "fused_sm120_prev":
        if not heads.shared_kv:
            raise StrategyUnavailable("fused_sm120_prev: the previous sm_12x tile is an absorbed-MLA tile")
        return lambda: tree_verify_fused(*args, None, 0.0, SM12X_PREV), SM12X_PREV
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


def run_windowed(name, inputs, config_arch, heads, extra):
    """A sliding-window / sink layer: the fused kernels given the window and the
    sinks, or upstream's dense-mask fallback as its Triton backend runs a verify on
    such a layer (the window's part of each prefix, ``window_kv_offsets``, the
    dense tree mask over the whole prefix, ``sliding_window_size`` and ``sinks``)."""
    args = inputs
    if name.startswith("fused"):
        cfg = select_config(config_arch, heads.dqk, heads.dv, heads.shared_kv)
        return lambda: tree_verify_fused(*args, None, 0.0, cfg, **extra), cfg
    if name == "reference":
        return lambda: tree_verify_attention(*args, strategy="reference", **extra), None
    if name != "upstream_extend":
        raise StrategyUnavailable(f"{name}: no sliding window / sinks")
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd as extend
    from sglang.srt.layers.attention.tree_verify.upstream_extend import dense_custom_mask

    q, k, v, indptr, prefix_idx, tree_idx, mask, scale = args
    bs, n = tree_idx.shape
    plens = (indptr[1:] - indptr[:-1]).long()
    window = extra.get("sliding_window", -1)
    keep = torch.minimum(plens, torch.tensor(window)) if window >= 0 else plens
    w_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=q.device)
    w_indptr[1:] = torch.cumsum(keep, 0)
    starts, lens = indptr[:-1].tolist(), plens.tolist()
    # int64, as upstream's backend builds window_kv_indices: the kernel multiplies the
    # slot by the row stride in the indices' type, and a pool of 2^31 elements
    # (Gemma-4 sliding layers, 8 x 64K tokens here) overflows int32.
    w_idx = torch.cat(
        [prefix_idx[s + l - kk : s + l] for s, l, kk in zip(starts, lens, keep.tolist())]
    ).long()
    offsets = (plens - keep).to(torch.int32)
    custom_mask = dense_custom_mask(indptr, mask, n)  # over the whole prefix, as upstream builds it
    mask_indptr = torch.zeros(bs + 1, dtype=torch.int64, device=q.device)
    mask_indptr[1:] = torch.cumsum(n * (plens + n), 0)
    qo_indptr = torch.arange(0, (bs + 1) * n, n, dtype=torch.int32, device=q.device)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    flat = tree_idx.reshape(-1).long()

    def run():
        extend(
            q, k[flat].contiguous(), v[flat].contiguous(), out, k, v, qo_indptr, w_indptr, w_idx,
            custom_mask, False, mask_indptr, n, 1.0, 1.0, sm_scale=scale, logit_cap=0.0,
            skip_prefix_custom_mask=True, sliding_window_size=window, sinks=extra.get("sinks"),
            window_kv_offsets=offsets if window >= 0 else None,
        )  # fmt: skip
        return out

    return run, None


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


def check(out, inputs, h, n, p, bs, heads=MLA):
    """Max abs error vs the fp32 reference on request 0 (kept small to stay fast)."""
    if p > 16384 or h * n * p > 128 * 65 * 16384:
        return None
    q, k, v, indptr, pidx, tidx, mask, scale = inputs
    ref = tree_verify_attention_ref(
        q[:n], k, v, indptr[:2], pidx[: p], tidx[:1], mask[:1], scale,
        **window_sink_args(heads, h),
    ).float()  # fmt: skip
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
            # "<strategy>@1sm": the split kernels launched one program per SM (one_program_per_sm)
            base, _, mode = name.partition("@")
            try:
                cfg_arch = (12, 0) if base == "fused_sm120" else arch
                fn, cfg = run_strategy(base, inputs, cfg_arch, heads)
                if cfg is not None:
                    rec["config"] = cfg.__dict__
                    rec["num_splits"] = num_splits_for(
                        inputs[0], inputs[1], inputs[2], inputs[4], bs, n, cfg, heads.window
                    )
                out = fn()
                rec["max_err"] = check(out, inputs, h, n, p, bs, heads)
                with one_program_per_sm(mode == "1sm"):
                    ms = bench(fn, slow=base == "upstream_extend", graph=GRAPH[0])
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


# The sm_12x MLA tile (99 KiB of shared memory per block) selected until 2026-12-02:
# the baseline the sm_12x candidates and the matrix's ``fused_sm120_prev`` rows are
# measured against.
SM12X_PREV = TreeVerifyConfig(32, 32, 4, 2, q_as_b=True)

# Tiles that fit sm_120's 101,376 B per block (tests/cpu/tree_verify/test_aot_sm120.py
# compiles the selected one; benchmarks/results/ has the sweep). The current default first.
SM12X_CONFIGS = [
    select_config((12, 0), DQK, DV),
    SM12X_PREV,
    # 16-key tiles: the query tile + three KV stages fit, so the gathers are pipelined
    TreeVerifyConfig(32, 16, 4, 4, q_as_b=True),
    # the head dims in column chunks: independent score MMA chains
    TreeVerifyConfig(32, 16, 4, 4, q_as_b=True, d_chunks=4),
    TreeVerifyConfig(32, 16, 4, 3, q_as_b=True, d_chunks=4),
    TreeVerifyConfig(32, 16, 4, 4, q_as_b=True, d_chunks=8),
    TreeVerifyConfig(32, 32, 4, 2, q_as_b=True, d_chunks=4),
    # 64 rows over 8 warps (two per scheduler), one KV buffer: the next tile in registers
    TreeVerifyConfig(64, 16, 8, 1, q_as_b=True, register_prefetch=True),
    TreeVerifyConfig(64, 16, 8, 1, q_as_b=True, d_chunks=4, register_prefetch=True),
    TreeVerifyConfig(64, 16, 8, 2, q_as_b=True, d_chunks=4),
]

TUNE_SETS = {"sm90": TUNE_CONFIGS, "sm12x": SM12X_CONFIGS}


def tune_configs(match: str = "", tune_set: str = "sm90"):
    """The set's default first, then its configs whose repr contains ``match``."""
    configs = TUNE_SETS[tune_set]
    return [configs[0]] + [c for c in configs[1:] if match in repr(c)]


@contextlib.contextmanager
def one_program_per_sm(enabled: bool = True):
    """Launch the split kernels compiled so far with their dynamic shared memory
    padded past half of an SM's, so that one program runs per SM as on sm_120
    (about 100 KB per SM): on an H200 (228 KB) two 75 KB programs would share an
    SM, which the RTX PRO 6000 cannot do. Only the launch reserves more; the
    kernels are the same. Call the kernel once before (to compile it) and capture
    graphs inside."""
    from sglang.srt.layers.attention.tree_verify import prefix_split

    if not enabled:
        yield
        return
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    pad = props.shared_memory_per_multiprocessor // 2 + 1024
    cache = prefix_split._tree_verify_split_kernel.device_caches[torch.cuda.current_device()][0]
    saved = {}
    for key, kernel in cache.items():
        warps, ctas, shared = kernel.packed_metadata
        if shared < pad:
            saved[key] = kernel.packed_metadata
            kernel.packed_metadata = (warps, ctas, pad)
    try:
        yield
    finally:
        for key, packed in saved.items():
            cache[key].packed_metadata = packed


def config_name(c: dict) -> str:
    return f"{c['block_m']}x{c['block_n']}w{c['num_warps']}s{c['num_stages']}" + (
        "qb" if c["q_as_b"] else "") + ("ahead" if c.get("qk_ahead") else "") + (
        f"dv{c['dv_split']}" if c.get("dv_split", 1) > 1 else "") + (
        "scratch" if c.get("scores_via_scratch") else "") + (
        f"c{c['d_chunks']}" if c.get("d_chunks", 1) > 1 else "") + (
        "rp" if c.get("register_prefetch") else "")  # fmt: skip


def tune(peaks, configs=TUNE_CONFIGS, shapes=None, split_factors=(1,), one_per_sm=(False,)):
    """Sweep MLA tile configs (and split counts, as factors of the model's
    choice) on the target shapes; each row carries the max error where
    ``check`` can afford the reference. ``one_per_sm``: the occupancy modes to
    time each config in (True: one program per SM, see ``one_program_per_sm``)."""
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
                for single in one_per_sm:
                    try:
                        fn = lambda: tree_verify_fused(*inputs, None, 0.0, cfg, num_splits=s)  # noqa: E731
                        err = check(fn(), inputs, h, n, p, bs)
                        with one_program_per_sm(single):
                            ms = bench(fn)
                    except Exception as e:  # a config that fails to compile is data here
                        print("FAIL", h, n, p, bs, cfg, str(e)[:200], flush=True)
                        break
                    rec = dict(H=h, N=n, P=p, bs=bs, cfg=cfg.__dict__, splits=s, auto=s == auto,
                               one_per_sm=single, ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
                               gbps=round(nbytes / ms / 1e6, 1), max_err=err)  # fmt: skip
                    rows.append(rec)
                    print(json.dumps(rec), flush=True)
        del inputs
        torch.cuda.empty_cache()
    return rows


def precompile(configs, shapes, workers: int):
    """Compile the sweep's kernels in ``workers`` processes first (they share
    Triton's on-disk cache, so the timed process only loads them): the kernel
    takes seconds to compile per specialization and the device has many cores."""
    import multiprocessing as mp

    jobs = [(cfg, shape) for shape in shapes for cfg in configs]
    with mp.get_context("spawn").Pool(workers) as pool:
        for line in pool.imap_unordered(_compile_one, jobs):
            if line:
                print(line, flush=True)


def precompile_matrix(family_shapes, strategies, arch, workers: int):
    """``precompile`` for the matrix: each (strategy, family, shape) run once in a worker."""
    import multiprocessing as mp

    jobs = [(name, shape, arch, fam.name) for fam, shape in family_shapes
            for name in dict.fromkeys(n.partition("@")[0] for n in strategies)
            if name not in ("reference", "flashinfer_dense")]  # fmt: skip
    with mp.get_context("spawn").Pool(workers) as pool:
        for line in pool.imap_unordered(_run_once, jobs):
            if line:
                print(line, flush=True)


def _run_once(job):
    name, (h, n, p, bs), arch, heads_name = job
    heads = HEADS[heads_name]
    try:
        inputs = make_inputs(h, n, p, bs, heads=heads)
        fn, _ = run_strategy(name, inputs, (12, 0) if name == "fused_sm120" else arch, heads)
        fn()
        torch.cuda.synchronize()
        return None
    except Exception as e:  # reported again by the timed matrix
        return f"precompile FAIL {name} {h} {n} {p} {bs}: {str(e)[:200]}"


def _compile_one(job):
    cfg, (h, n, p, bs) = job
    try:
        inputs = make_inputs(h, n, p, bs)
        tree_verify_fused(*inputs, None, 0.0, cfg)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # reported again, with the shape, by the timed sweep
        return f"precompile FAIL {h} {n} {p} {bs} {config_name(cfg.__dict__)}: {str(e)[:200]}"


def plot(rows, path, heads=MLA):
    from benchmarks.plotting import pyplot

    plt = pyplot()
    if plt is None:
        return

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
    ap.add_argument("--quick", action="store_true", help="only the shapes with time targets")
    ap.add_argument("--tune", action="store_true", help="sweep tile configs and splits")
    ap.add_argument("--attn", default="mla",
                    help=f"KV layout of the shapes, or a comma list of them: {', '.join(HEADS)}")
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
    ap.add_argument("--tune-set", choices=list(TUNE_SETS), default="sm90",
                    help="--tune: the sm_90 MLA tiles or the ones that fit sm_12x's 99 KiB")
    ap.add_argument("--one-per-sm", action="store_true",
                    help="--tune: also time each config with one program per SM, as sm_120 runs "
                         "the 99 KiB tiles (the launch reserves more than half an SM's shared memory)")
    ap.add_argument("--triton-matmul", action="store_true",
                    help="also measure a plain Triton bf16 matmul's rate (mma.sync with DISABLE_MMA_V3=1)")
    ap.add_argument("--precompile", type=int, default=0,
                    help="compile the run's kernels in this many processes first")
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
    families = [HEADS[name] for name in args.attn.split(",") if name in HEADS]
    if len(families) != len(args.attn.split(",")):
        ap.error(f"--attn: choose from {', '.join(HEADS)}; got {args.attn!r}")
    heads = families[0]
    if args.tune and (heads is not MLA or len(families) > 1):
        ap.error("--tune sweeps the MLA tile configurations only")
    strategies = args.strategies or "upstream_extend,fused,fused_sm120" + (
        ",flashinfer_split,flashmla_split" if heads is MLA else
        ",flashinfer_split,flashinfer_dense" if heads is GQA else "")  # fmt: skip

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
        disable_mma_v3=os.environ.get("DISABLE_MMA_V3", ""),
        triton_matmul_tflops=round(measure_triton_matmul_tflops(), 1) if args.triton_matmul else None,
        attn=dataclasses.asdict(heads),
    )
    print(json.dumps(meta), flush=True)
    stem = result_stem(heads, args.tag)
    if args.tune:
        shapes = None
        if args.shapes:
            shapes = [tuple(int(x) for x in v.split(":")) for v in args.shapes.split(",")]
        factors = tuple(float(f) for f in args.split_factors.split(","))
        configs = tune_configs(args.tune_match, args.tune_set)
        if args.precompile:
            precompile(configs, shapes or TARGET_SHAPES, args.precompile)
        rows = tune(peaks, configs=configs, shapes=shapes, split_factors=factors,
                    one_per_sm=(False, True) if args.one_per_sm else (False,))  # fmt: skip
        for r in rows:
            name = config_name(r["cfg"]) + (" 1/SM" if r.get("one_per_sm") else "")
            print(f"H{r['H']} N{r['N']} P{r['P']} bs{r['bs']} {name:<22} splits {r['splits']:>3} "
                  f"{r['ms']:.4f} ms {r['tflops']:6.1f} TF/s {r['gbps']:7.1f} GB/s err {r['max_err']}")
        with open(os.path.join(args.out, stem + "_tune.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        return
    def shapes_of(fam):
        if args.shapes:
            return [tuple(int(x) for x in v.split(":")) for v in args.shapes.split(",")]
        quick = TARGET_SHAPES if fam is MLA else GQA_QUICK_SHAPES
        return quick if args.quick else full_matrix(fam)

    names = strategies.split(",")
    if args.precompile:
        precompile_matrix([(fam, shape) for fam in families for shape in shapes_of(fam)],
                          names, kernel_arch(), args.precompile)  # fmt: skip
    for fam in families:
        if fam is not heads:
            meta = dict(meta, attn=dataclasses.asdict(fam))
            print(json.dumps(meta), flush=True)
        rows = run_matrix(shapes_of(fam), names, peaks, kernel_arch(), heads=fam)
        write_results(meta, rows, args.out, args.tag, fam)
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
