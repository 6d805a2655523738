# SPDX-License-Identifier: Apache-2.0
"""Upstream's linear-attention kernels in tree mode, as a DDTREE verify launches
them on a Qwen3.5/3.6-sized Gated DeltaNet layer (conv dim 10240; 16 key and
48 value heads of 128), compile for sm_120 and sm_90 at the tree widths DDTREE
allows there (up to ``linear_state.MAX_HYBRID_BUDGET + 1``) within sm_120's
99 KiB of shared memory per block and without register spills. Runs in a
subprocess: TRITON_INTERPRET=1 (this pytest run's setting) changes what
``triton.jit`` returns."""

import json
import os
import subprocess
import sys

from sglang.srt.speculative.ddtree.linear_state import MAX_HYBRID_BUDGET

_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sglang.kernels.ops.mamba.causal_conv1d_triton import _causal_conv1d_update_kernel as conv
from sglang.kernels.ops.attention.fla.fused_sigmoid_gating_recurrent import (
    fused_sigmoid_gating_delta_rule_update_kernel as gdn,
)

DIM, W, SLOTS, H, HV, K, V = 10240, 4, 64, 16, 48, 128, 128


def conv_source(n):
    # As gdn_backend.forward_extend calls causal_conv1d_update for TARGET_VERIFY
    # with tree links: x viewed [bs, dim, N] from [bs * N, dim], bf16 states.
    w1 = W - 1
    ptrs = dict(x_ptr="*bf16", w_ptr="*bf16", conv_state_ptr="*bf16", conv_state_indices_ptr="*i32",
                intermediate_conv_window_ptr="*bf16", intermediate_state_indices_ptr="*i32",
                retrieve_next_token_ptr="*i32", retrieve_next_sibling_ptr="*i32",
                retrieve_parent_token_ptr="*i32", o_ptr="*bf16", batch="i32")
    consts = dict(
        bias_ptr=None, cache_seqlens_ptr=None, num_accept_tokens_ptr=None, dim=DIM, seqlen=n,
        state_len=w1, num_cache_lines=SLOTS + 1, stride_x_seq=n * DIM, stride_x_dim=1, stride_x_token=DIM,
        stride_w_dim=W, stride_w_width=1, stride_conv_state_seq=DIM * w1, stride_conv_state_dim=w1,
        stride_conv_state_tok=1, stride_state_indices=1, stride_inter_seq=n * DIM * w1,
        stride_inter_step=DIM * w1, stride_inter_dim=w1, stride_inter_win=1,
        stride_intermediate_state_indices=1, stride_retrieve_next_token_seq=n,
        stride_retrieve_next_token_token=1, stride_retrieve_next_sibling_seq=n,
        stride_retrieve_next_sibling_token=1, stride_retrieve_parent_token_seq=n,
        stride_retrieve_parent_token_token=1, stride_o_seq=DIM * n, stride_o_dim=n, stride_o_token=1,
        pad_slot_id=-1, HAS_BIAS=False, KERNEL_WIDTH=W, SILU_ACTIVATION=True, IS_CONTINUOUS_BATCHING=True,
        IS_SPEC_DECODING=False, NP2_STATELEN=triton.next_power_of_2(w1), NP2_SEQLEN=triton.next_power_of_2(n),
        USE_PAD_SLOT=True, BLOCK_N=256, SAVE_INTERMEDIATE=True, HAS_EAGLE_TREE_CUSTOM_ATTN_MASK=True,
        USE_GDC=True)
    return ASTSource(conv, {a: ("constexpr" if a in consts else ptrs[a]) for a in conv.arg_names}, constexprs=consts)


def gdn_source(n):
    # As TritonGDNKernel.target_verify calls fused_sigmoid_gating_delta_rule_update.
    ptrs = dict(A_log="*fp32", a="*bf16", dt_bias="*bf16", softplus_beta="fp32", softplus_threshold="fp32",
                lower_bound="fp32", q="*bf16", k="*bf16", v="*bf16", b="*bf16", o="*bf16", h0_source="*fp32",
                h0_indices="*i32", stride_h0_source="i32", cu_seqlens="*i32",
                intermediate_states_buffer="*fp32", intermediate_state_indices="*i32", cache_steps="i32",
                retrieve_parent_token_ptr="*i32", scale="fp32", T="i32", stride_a="i32", stride_q="i32",
                stride_k="i32", stride_v="i32", stride_b="i32")
    consts = dict(
        stride_retrieve_parent_token_seq=n, stride_retrieve_parent_token_token=1,
        NP2_T=triton.next_power_of_2(n), B=1, H=H, HV=HV, K=K, V=V, BK=K, BV=32, USE_INITIAL_STATE=True,
        USE_QK_L2NORM_IN_KERNEL=True, IS_VARLEN=True, IS_KDA=False, USE_LOWER_BOUND=False,
        DISABLE_STATE_UPDATE=True, CACHE_INTERMEDIATE_STATES=True, HAS_EAGLE_TREE_CUSTOM_ATTN_MASK=True,
        replayssm_rawv=None, replayssm_rawk=None, replayssm_g=None, replayssm_beta=None,
        stride_rawv_slot=0, stride_rawk_slot=0, stride_g_slot=0, stride_beta_slot=0, MAX_CACHE_LEN=0,
        CACHE_RING=False)
    return ASTSource(gdn, {a: ("constexpr" if a in consts else ptrs[a]) for a in gdn.arg_names}, constexprs=consts)


out = []
for cap, n in json.loads(sys.argv[1]):
    for kernel, src, opts in (("conv", conv_source(n), {"num_warps": 4}),
                              ("gdn", gdn_source(n), {"num_warps": 1, "num_stages": 3})):
        c = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=opts)
        out.append(dict(kernel=kernel, cap=cap, n=n, shared=c.metadata.shared, spills="ld.local" in c.asm["ptx"]))
print(json.dumps(out))
"""


def test_tree_mode_kernels_compile_for_sm120_and_sm90():
    points = [(120, 17), (120, MAX_HYBRID_BUDGET + 1), (90, 17)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(points)], env=env, capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 2 * len(points)
    for r in results:
        assert r["shared"] <= 99 * 1024, r
        assert not r["spills"], r
