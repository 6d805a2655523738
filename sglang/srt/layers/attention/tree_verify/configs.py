# SPDX-License-Identifier: Apache-2.0
"""Per-arch tile configurations for the fused tree-verify kernel.

Selection is keyed by :func:`sglang.srt.utils.gpu_arch.kernel_arch`, so
``SGLANG_DDTREE_KERNEL_ARCH=12.0`` runs the sm_120 tiles on any GPU. Every
config listed for 12.x must fit 99 KiB (101,376 B) of shared memory per block;
``tests/cpu/tree_verify/test_aot_sm120.py`` compiles each one for sm_120 and
checks that.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

import triton

from sglang.srt.utils import gpu_arch

Capability = Tuple[int, int]


@dataclasses.dataclass(frozen=True)
class TreeVerifyConfig:
    block_m: int  # query rows (node, head) per program
    block_n: int  # keys per KV tile
    num_warps: int
    num_stages: int
    # Compute K.Q^T instead of Q.K^T so the query tile stays in shared memory.
    q_as_b: bool = False
    # Prefix slices: compute the scores one tile ahead of the PV product
    # (always Q.K^T, q_as_b applies to the tail only; see
    # prefix_split._prefix_slice_qk_ahead). Opt-in until measured.
    qk_ahead: bool = False
    # Absorbed MLA: programs per row tile, each owning 1/dv_split of the value
    # columns (prefix_split.dv_split_for); 1 elsewhere or when V is separate.
    dv_split: int = 1
    # For absorbed MLA, feed the PV product from the K tile already in shared
    # memory (V = K[..., :512]) instead of loading V again.
    reuse_k_tile: bool = True
    # Programs resident per SM, for the split-count cost model.
    ctas_per_sm: int = 1
    # Fixed cost of one program (query load, partial store, combine read), in keys.
    split_overhead_keys: int = 256
    # Absorbed MLA prefix slices only: scores as K.Q^T, and P (and the
    # rescale factor) handed to the PV product through a small per-program
    # global scratch, so the score dot no longer feeds the PV dot and Triton
    # splits the score tile across the warpgroups (see
    # prefix_split._prefix_slice_via_scratch). Needs block_n == 64 and V = K[..., :512]
    # (prefix_split.check_scores_via_scratch); q_as_b then applies to the
    # tree tail only. The sm_90 MLA default since the H200 run of 2026-11-30.
    scores_via_scratch: bool = False
    # Prefix slices: load the next KV tile into registers while the current
    # one is computed, keeping one KV tile in shared memory (see
    # prefix_split._prefix_slice_register_prefetch). For 99 KiB parts, where
    # the query tile and two pipelined KV stages do not fit.
    register_prefetch: bool = False
    # The main head dims as this many column chunks: a score product per chunk
    # (independent MMA chains instead of one dependent chain over all dims,
    # which is what limits mma.sync), and a value accumulator per chunk (see
    # prefix_split._attend_chunks). Applies with one program per row tile and
    # power-of-two main dims equal to Dv (prefix_split.d_chunks_for).
    d_chunks: int = 1

    def __post_init__(self):
        if self.d_chunks > 1 and (self.scores_via_scratch or self.qk_ahead or self.dv_split > 1):
            raise ValueError(
                "d_chunks > 1 has a prefix loop of its own: it cannot be combined with "
                "scores_via_scratch, qk_ahead or dv_split > 1"
            )
        if self.register_prefetch and (
            self.scores_via_scratch or self.qk_ahead or self.dv_split > 1
        ):
            raise ValueError(
                "register_prefetch replaces the prefix loop: it cannot be combined "
                "with scores_via_scratch, qk_ahead or dv_split > 1"
            )
        if self.scores_via_scratch:
            if self.block_n != 64:
                raise ValueError(
                    f"scores_via_scratch needs block_n=64 (64-key tiles), got {self.block_n}"
                )
            if self.qk_ahead or self.dv_split > 1 or not self.reuse_k_tile:
                raise ValueError(
                    "scores_via_scratch replaces the prefix loop: it cannot be combined "
                    "with qk_ahead, dv_split > 1 or reuse_k_tile=False"
                )


# Head-shape classes: absorbed MLA, and (GQA/MHA) head dims.
MLA = "mla"  # Dqk 576 = 512 latent + 64 rope, Dv 512, V = K[..., :512]
MLA_SEPARATE_V = "mla_sep_v"  # the same dims with V in a buffer of its own


def head_class(dqk: int, dv: int, share_kv: bool = True) -> str:
    if (dqk, dv) == (576, 512):
        return MLA if share_kv else MLA_SEPARATE_V
    if dqk == dv and dqk in (64, 128, 256):
        return f"d{dqk}"
    return "generic"


def head_dim_blocks(dqk: int, dv: int):
    """Split Dqk into a power-of-two main part and a rope tail (576 = 512 + 64).

    Returns ``(d_main, d_pe, block_d, block_dpe, block_dv)``; a ``block_dpe``
    of 0 means there is no second part.
    """
    block_dv = triton.next_power_of_2(dv)
    if dqk == triton.next_power_of_2(dqk):
        return dqk, 0, dqk, 0, block_dv
    if dv == block_dv and dv < dqk <= 2 * dv:
        d_pe = dqk - dv
        return dv, d_pe, dv, triton.next_power_of_2(d_pe), block_dv
    return dqk, 0, triton.next_power_of_2(dqk), 0, block_dv


_C = TreeVerifyConfig

# Hopper (227 KiB smem per block, wgmma). MLA: 64 query rows per 64-key tile,
# the 64 x 512 fp32 accumulator over 8 warps, the scores handed to the PV
# product through a per-program scratch so the two warpgroups split the score
# tile (229,376 B). H200, 2026-11-30 (verify_attention_scores_via_scratch*_h200_2026-11-30_tune.json):
# 1.05-1.18x faster than the 64x32 3-stage tile at 8 of 9 shapes (16K/1K/4K,
# N 17-129, batch 1 and 8, H 16 and 128), 0.94x at the memory-bound N=4 one.
_SM90 = {
    MLA: _C(block_m=64, block_n=64, num_warps=8, num_stages=2, scores_via_scratch=True),
    MLA_SEPARATE_V: _C(block_m=64, block_n=16, num_warps=8, num_stages=3, q_as_b=True),
    "d64": _C(block_m=64, block_n=64, num_warps=4, num_stages=3, ctas_per_sm=2),
    "d128": _C(block_m=64, block_n=64, num_warps=4, num_stages=3, ctas_per_sm=2),
    "d256": _C(block_m=64, block_n=64, num_warps=8, num_stages=2),
    "generic": _C(block_m=64, block_n=32, num_warps=4, num_stages=2),
}

# A100 / Orin (163 KiB): the Hopper tiles, but the MLA tile of the 2026-11-29
# sweep (64 x 32 keys, 3 stages: 151,552 B compiled for sm_80), since the
# scratch tile needs 229,376 B.
_SM80 = {**_SM90, MLA: _C(block_m=64, block_n=32, num_warps=8, num_stages=3)}

# Workstation Blackwell, Ada, GA10x: 99 KiB smem per block, mma.sync.
# MLA: 64 rows x 16 keys over 8 warps (two per scheduler), K.Q^T with the
# query tile in shared memory, the head dims in 4 column chunks (independent
# score MMA chains) and the next KV tile loaded into registers while the
# current one is computed (one KV buffer: 92,416 B compiled for sm_120). The
# 32 x 32 tile it replaced (75,776 B) had room for one KV stage only and waited
# for every tile's gather. docs/verify-kernels.md has the sweep
# (benchmarks/results/verify_attention_sm12x_sweep_h200_2026-12-02.json).
_SM12X = {
    MLA: _C(
        block_m=64, block_n=16, num_warps=8, num_stages=1, q_as_b=True, d_chunks=4,
        register_prefetch=True,
    ),  # fmt: skip
    # Separate V: 2 stages (3 need 107,520 B with the V tiles, over the limit).
    MLA_SEPARATE_V: _C(block_m=32, block_n=16, num_warps=4, num_stages=2, q_as_b=True),
    "d64": _C(block_m=64, block_n=64, num_warps=4, num_stages=2, ctas_per_sm=2),
    "d128": _C(block_m=64, block_n=32, num_warps=4, num_stages=2, ctas_per_sm=2),
    "d256": _C(block_m=32, block_n=32, num_warps=4, num_stages=2),
    "generic": _C(block_m=32, block_n=32, num_warps=4, num_stages=1),
}


def _tiles(cap: Capability) -> Dict[str, TreeVerifyConfig]:
    """The table that serves ``cap``: tiles follow shared memory per block, not the
    arch family (8.6 and 8.9 have sm_12x's 99 KiB; datacenter Blackwell's 227 KiB
    takes the Hopper tiles; an unknown GPU the sm_12x tiles, which fit everywhere)."""
    try:
        smem = gpu_arch.max_shared_memory_per_block(cap)
    except ValueError:
        return _SM12X
    if smem >= 227 * 1024:
        return _SM90
    return _SM80 if smem >= 160 * 1024 else _SM12X


def configs_for_arch(cap: Capability) -> Dict[str, TreeVerifyConfig]:
    return dict(_tiles(cap))


def select_config(
    cap: Capability, dqk: int, dv: int, share_kv: bool = True
) -> TreeVerifyConfig:
    return _tiles(cap)[head_class(dqk, dv, share_kv)]


# Representative (Dqk, Dv) per class, for compile tests.
CLASS_HEAD_DIMS = {
    MLA: (576, 512),
    MLA_SEPARATE_V: (576, 512),
    "d64": (64, 64),
    "d128": (128, 128),
    "d256": (256, 256),
    "generic": (96, 96),
}
