# SPDX-License-Identifier: Apache-2.0
"""Ahead-of-time compilation of the tree-verify kernels for a chosen target.

Triton compiles for a GPU it is not running on, which lets a CPU machine prove
that every sm_120 config builds and fits 99 KiB of shared memory per block
(``metadata.shared``), and lets a developer read register use and spills of
any config without a GPU.
"""

from __future__ import annotations

import argparse
import json
from typing import Optional, Tuple

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from sglang.srt.layers.attention.tree_verify import flashmla_split, prefix_split, verify_indices
from sglang.srt.layers.attention.tree_verify.configs import (
    CLASS_HEAD_DIMS,
    MLA,
    MLA_SEPARATE_V,
    TreeVerifyConfig,
    configs_for_arch,
    head_dim_blocks,
)
from sglang.srt.utils.gpu_arch import parse_capability

_DIV16 = [["tt.divisibility", 16]]


def _compiled_kernels():
    """The package's kernels, which must be compiled ``@triton.jit`` functions."""
    if not isinstance(prefix_split._tree_verify_split_kernel, JITFunction):
        raise RuntimeError(
            "ahead-of-time compilation needs triton imported without "
            "TRITON_INTERPRET=1; run it in a separate process, e.g. "
            "`python -m sglang.srt.layers.attention.tree_verify.aot --arch 12.0`"
        )
    return prefix_split


def cuda_target(cap: Tuple[int, int]) -> GPUTarget:
    return GPUTarget("cuda", cap[0] * 10 + cap[1], 32)


def _source(fn, types: dict, constexprs: dict, aligned: set) -> ASTSource:
    names = fn.arg_names
    signature = {n: ("constexpr" if n in constexprs else types[n]) for n in names}
    attrs = {(names.index(n),): _DIV16 for n in aligned}
    return ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)


def split_kernel_source(
    config: TreeVerifyConfig,
    dqk: int,
    dv: int,
    dtype: str = "bf16",
    share_kv: bool = True,
    has_cap: bool = False,
    kv_dtype: Optional[str] = None,
    merge_ext: bool = False,
    sliding: bool = False,
) -> ASTSource:
    """``merge_ext``: the tail-only launch that merges an external prefix pass
    and writes the output in ``dtype`` (flashinfer_split, flashmla_split)."""
    if merge_ext:
        config = _compiled_kernels().tail_only_config(config)
    d_main, d_pe, block_d, block_dpe, block_dv = head_dim_blocks(dqk, dv)
    share_kv = share_kv and config.reuse_k_tile and dv == d_main
    dv_split = _compiled_kernels().dv_split_for(config, dqk, dv, share_kv)
    _compiled_kernels().check_scores_via_scratch(config, dqk, dv, share_kv)
    ints = [
        "num_nodes", "group", "num_heads", "num_kv_heads", "num_splits",
        "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt",
        "stride_vh", "stride_ps", "stride_pt", "stride_ph", "stride_ls", "stride_tib",
        "stride_mb", "stride_mn", "stride_eob", "stride_eoq", "stride_eoh",
        "stride_elb", "stride_elq", "stride_elh",
    ]  # fmt: skip
    types = {n: "i32" for n in ints}
    types.update(
        Q=f"*{dtype}", K=f"*{kv_dtype or dtype}", V=f"*{kv_dtype or dtype}",
        O_part=f"*{dtype}" if merge_ext else "*fp32",
        Lse_part="*fp32", prefix_indptr="*i32", prefix_indices="*i32",
        tree_indices="*i32", tree_mask="*i32", P_scratch=f"*{dtype}",
        A_scratch="*fp32", Ext_o=f"*{dtype}", Ext_lse="*fp32", qk_scale="fp32",
        logit_cap="fp32", v_scale="fp32", ext_lse_scale="fp32", window="i32",
    )  # fmt: skip
    constexprs = dict(
        D_MAIN=d_main, D_PE=d_pe, D_V=dv, BLOCK_D=block_d, BLOCK_DPE=block_dpe,
        BLOCK_DV=block_dv, HAS_CAP=has_cap,
        SHARE_KV=share_kv,
        Q_AS_B=config.q_as_b, QK_AHEAD=config.qk_ahead,
        SCORES_VIA_SCRATCH=config.scores_via_scratch,
        REGISTER_PREFETCH=config.register_prefetch,
        DV_SPLIT=dv_split, BLOCK_DV_PROG=block_dv // dv_split,
        D_CHUNKS=_compiled_kernels().d_chunks_for(config, dqk, dv, share_kv),
        SLIDING=sliding,
        KV_CAST=kv_dtype is not None and kv_dtype != dtype, MERGE_EXT=merge_ext,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        NUM_STAGES=config.num_stages,
    )  # fmt: skip
    aligned = {"Q", "K", "V", "O_part", "Lse_part", "prefix_indptr",
               "prefix_indices", "tree_indices", "tree_mask", "P_scratch", "A_scratch",
               "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt",
               "stride_vh", "stride_ps", "stride_pt", "stride_ph"}  # fmt: skip
    return _source(
        _compiled_kernels()._tree_verify_split_kernel, types, constexprs, aligned
    )


def combine_kernel_source(
    dv: int, dtype: str = "bf16", parts: int = 257, sinks: bool = False
) -> ASTSource:
    types = {n: "i32" for n in ("total_rows", "num_parts", "num_heads", "stride_ps",
                                "stride_pr", "stride_ls", "stride_ot", "stride_oh")}  # fmt: skip
    types.update(O_part="*fp32", Lse_part="*fp32", Out=f"*{dtype}", Sinks=f"*{dtype}")
    block_dv, parts_per_step, _ = _compiled_kernels().combine_tiles(dv, parts)
    constexprs = dict(
        D_V=dv,
        BLOCK_P=triton.next_power_of_2(parts),
        BLOCK_DV=block_dv,
        PARTS_PER_STEP=parts_per_step,
        HAS_SINK=sinks,
    )
    aligned = {"O_part", "Lse_part", "Out", "stride_ps", "stride_pr", "stride_ot"}
    return _source(
        _compiled_kernels()._tree_verify_combine_kernel, types, constexprs, aligned
    )


def compile_split_kernel(config: TreeVerifyConfig, dqk: int, dv: int, cap, **kw):
    """Compile the split kernel for compute capability ``cap``; returns the
    compiled kernel (``.metadata.shared`` is its static shared memory)."""
    src = split_kernel_source(config, dqk, dv, **kw)
    if kw.get("merge_ext"):
        config = _compiled_kernels().tail_only_config(config)
    return triton.compile(
        src,
        target=cuda_target(cap),
        options={"num_warps": config.num_warps, "num_stages": config.num_stages},
    )


def compile_combine_kernel(dv: int, cap, dtype: str = "bf16", parts: int = 257, sinks: bool = False):
    src = combine_kernel_source(dv, dtype, parts, sinks)
    warps = _compiled_kernels().combine_tiles(dv, parts)[2]
    return triton.compile(src, target=cuda_target(cap), options={"num_warps": warps})


def compile_page_gather_kernel(cap, dtype: str = "bf16"):
    """flashmla_split's prefix-to-pages copy, for the archs FlashMLA serves."""
    fn = flashmla_split._tree_verify_page_gather_kernel
    types = dict(kv=f"*{dtype}", indptr="*i32", indices="*i32", page_start="*i32",
                 staging=f"*{dtype}", stride_kv_row="i32", stride_staging_row="i32")  # fmt: skip
    constexprs = dict(D=576, BLOCK_D=64, PAGE_ROWS=flashmla_split.PAGE)
    src = _source(fn, types, constexprs, {"kv", "staging", "stride_kv_row", "stride_staging_row"})
    return triton.compile(src, target=cuda_target(cap), options={"num_warps": 4})


def compile_merge_chunks_kernel(cap, dtype: str = "bf16", chunks: int = 8):
    """flashmla_split's merge of FlashMLA's KV chunks with the tail, for FlashMLA's archs."""
    fn = flashmla_split._tree_verify_merge_chunks_kernel
    ints = ["total_rows", "num_nodes", "num_heads", "chunks", "stride_eob", "stride_eoq",
            "stride_eoh", "stride_elb", "stride_elq", "stride_elh", "stride_tr", "stride_ot",
            "stride_oh"]  # fmt: skip
    types = {n: "i32" for n in ints}
    types.update(Ext_o=f"*{dtype}", Ext_lse="*fp32", Tail_o="*fp32", Tail_lse="*fp32",
                 prefix_indptr="*i32", Out=f"*{dtype}")  # fmt: skip
    constexprs = dict(D_V=512, PAGE_ROWS=flashmla_split.PAGE, BLOCK_R=16,
                      BLOCK_C=triton.next_power_of_2(chunks), BLOCK_DV=128)
    src = _source(fn, types, constexprs, {"Ext_o", "Tail_o", "Out", "stride_eob", "stride_tr"})
    return triton.compile(src, target=cuda_target(cap), options={"num_warps": 4})


def compile_verify_indices_kernel(cap, index_dtype: str = "i64", fill_indptr: bool = True):
    """The hook's per-verify KV indices (``verify_indices.py``): ``index_dtype`` is the pool
    rows' and lengths' (int64 eagerly, int32 in a CUDA graph's buffers)."""
    fn = verify_indices._verify_indices_kernel
    types = dict(req_to_token="*i32", req_pool_indices=f"*{index_dtype}", seq_lens=f"*{index_dtype}",
                 indptr="*i32", prefix_out="*i32", tree_src="*i64", tree_out="*i32", bs="i32", rows="i32",
                 width="i32", r2t_stride="i32")  # fmt: skip
    constexprs = dict(BS_BLOCK=verify_indices._MIN_BS_BLOCK, COPY_BLOCK=verify_indices._COPY_BLOCK, TREE_BLOCK=32,
                      FILL_INDPTR=fill_indptr, FILL_TREE=True)  # fmt: skip
    src = _source(fn, types, constexprs, {"req_to_token", "r2t_stride"})
    return triton.compile(src, target=cuda_target(cap), options={"num_warps": 4})


def compile_arch_report(cap) -> list:
    """Compile every selectable config for ``cap``; one record per kernel."""
    records = []
    for cls, cfg in sorted(configs_for_arch(cap).items()):
        dqk, dv = CLASS_HEAD_DIMS[cls]
        variants = [dict(share_kv=cls != MLA_SEPARATE_V)]
        if cls not in (MLA, MLA_SEPARATE_V):
            variants.append(dict(share_kv=False, sliding=True))  # gpt-oss, Gemma local layers
        if cls == MLA:
            variants += [dict(dtype="fp16"), dict(has_cap=True), dict(merge_ext=True)]
            if tuple(cap) >= (8, 9):  # e4m3 KV caches need sm_89+ (Triton refuses it below)
                variants.append(dict(kv_dtype="fp8e4nv"))
        for kw in variants:
            k = compile_split_kernel(cfg, dqk, dv, cap, **kw)
            records.append(dict(kernel="split", cls=cls, config=cfg.__dict__, variant=kw,
                                shared=k.metadata.shared, mma=_mma_kind(k.asm["ptx"])))  # fmt: skip
    for dv in (64, 128, 256, 512):
        k = compile_combine_kernel(dv, cap)
        records.append(dict(kernel="combine", dv=dv, shared=k.metadata.shared, mma=None))
    k = compile_combine_kernel(64, cap, sinks=True)  # gpt-oss: head dim 64, attention sinks
    records.append(dict(kernel="combine", dv=64, sinks=True, shared=k.metadata.shared, mma=None))
    for index_dtype, fill in (("i64", True), ("i32", True), ("i32", False)):
        k = compile_verify_indices_kernel(cap, index_dtype, fill)
        records.append(dict(kernel="verify_indices", index_dtype=index_dtype, fill_indptr=fill,
                            shared=k.metadata.shared, mma=None))  # fmt: skip
    if cap[0] in flashmla_split.FLASHMLA_MAJORS:
        k = compile_page_gather_kernel(cap)
        records.append(dict(kernel="page_gather", shared=k.metadata.shared, mma=None))
        k = compile_merge_chunks_kernel(cap)
        records.append(dict(kernel="merge_chunks", shared=k.metadata.shared, mma=None))
    return records


def _mma_kind(ptx: str) -> str:
    if "wgmma" in ptx:
        return "wgmma"
    if "mma.sync" in ptx:
        return "mma.sync"
    return "none"


def main(argv=None):
    ap = argparse.ArgumentParser(description="compile the tree-verify kernels for a GPU arch")
    ap.add_argument("--arch", default="12.0", help="compute capability, e.g. 12.0 or 9.0")
    args = ap.parse_args(argv)
    for rec in compile_arch_report(parse_capability(args.arch)):
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
