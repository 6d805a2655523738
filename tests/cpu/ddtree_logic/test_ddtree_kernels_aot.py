"""The build and compile kernels compile for real GPUs (sm_90, sm_120), not just under the
interpreter, which accepts code the compiler rejects. Runs in a subprocess
because TRITON_INTERPRET=1 (set for this test session) changes how
``triton.jit`` decorates the kernel."""

import json
import os
import subprocess
import sys

_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sglang.srt.speculative.ddtree.tree_build import MAX_BUDGET, _ddtree_build_kernel, _launch_config

fn = _ddtree_build_kernel
ints = ["stride_lp_b", "stride_lp_d", "stride_ids_b", "stride_ids_d", "stride_out_b",
        "num_depths", "k", "budget"]
types = {n: "i32" for n in ints}
types.update(lp_ptr="*fp32", ids_ptr="*i64", out_token_ptr="*i64", out_parent_ptr="*i32",
             out_depth_ptr="*i32", out_rank_ptr="*i32", out_score_ptr="*fp32", out_num_ptr="*i32")
out = []
for cap in (90, 120):
    for budget in (1, 64, 128, MAX_BUDGET):
        frontier, num_warps = _launch_config(budget)
        sig = {n: ("constexpr" if n == "FRONTIER" else types[n]) for n in fn.arg_names}
        src = ASTSource(fn, sig, constexprs={"FRONTIER": frontier})
        c = triton.compile(src, target=GPUTarget("cuda", cap, 32), options={"num_warps": num_warps})
        out.append(dict(cap=cap, budget=budget, shared=c.metadata.shared, ptx="ld.local" in c.asm["ptx"]))
from sglang.srt.speculative.ddtree.tree_compile import _ddtree_compile_kernel, mask_words

fn = _ddtree_compile_kernel
types = {n: "*i64" for n in ("node_token_ptr", "bonus_ptr", "committed_ptr", "tokens_ptr",
                             "positions_ptr", "parent_ptr", "retrive_index_ptr",
                             "next_token_ptr", "next_sibling_ptr")}
types.update(node_parent_ptr="*i32", node_depth_ptr="*i32", depth_ptr="*i32", mask_ptr="*i32",
             budget="i32", max_depth="i32")
for cap in (90, 120):
    for budget in (1, 64, MAX_BUDGET):
        words = mask_words(budget + 1)
        consts = dict(BLOCK_I=32, BLOCK_J=64, WORDS=words, WORDS_PAD=triton.next_power_of_2(words))
        sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
        c = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", cap, 32),
                           options={"num_warps": 4})
        out.append(dict(cap=cap, budget=budget, shared=c.metadata.shared, ptx="ld.local" in c.asm["ptx"]))
print(json.dumps(out))
"""


def test_kernels_compile_for_sm90_and_sm120():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 8 + 6
    for r in results:
        assert r["shared"] <= 99 * 1024, r  # fits sm_120's per-block limit
        assert not r["ptx"], f"register spills to local memory: {r}"
