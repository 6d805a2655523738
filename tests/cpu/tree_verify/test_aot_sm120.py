# SPDX-License-Identifier: Apache-2.0
"""Every config the dispatcher can select on 12.x, and the hook's index kernel, compiles for
sm_120 on this CPU machine and fits 99 KiB (101,376 B) of shared memory per block.

Compilation runs in a child process without TRITON_INTERPRET: the CPU test
run interprets Triton (tests/cpu/conftest.py), and triton's own jit
helpers cannot be compiled once imported that way.
"""

import functools
import json
import os
import subprocess
import sys

import pytest

from sglang.srt.layers.attention.tree_verify.configs import MLA, MLA_SEPARATE_V, configs_for_arch
from sglang.srt.utils.gpu_arch import max_shared_memory_per_block

SM120_SMEM = 101376


@functools.lru_cache(maxsize=None)
def compile_report(arch: str):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.srt.layers.attention.tree_verify.aot", "--arch", arch],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_limit_is_99_kib():
    assert max_shared_memory_per_block((12, 0)) == SM120_SMEM
    assert max_shared_memory_per_block((12, 1)) == SM120_SMEM


def test_every_sm120_config_compiles_and_fits():
    records = compile_report("12.0")
    split = [r for r in records if r["kernel"] == "split"]
    # Every selectable class is covered, MLA in fp16/bf16, shared and separate V.
    assert {r["cls"] for r in split} == set(configs_for_arch((12, 0)))
    # bf16, fp16, logit cap, the merge of an external prefix pass (flashinfer_split), fp8 KV
    assert len([r for r in split if r["cls"] == MLA]) == 5
    # GQA/MHA classes also with a sliding window (gpt-oss, Gemma local layers)
    assert {r["cls"] for r in split if r["variant"].get("sliding")} == set(configs_for_arch((12, 0))) - {
        MLA, MLA_SEPARATE_V
    }
    # Dv 64..512, and Dv 64 with attention sinks (gpt-oss)
    assert len([r for r in records if r["kernel"] == "combine"]) == 5
    # The hook's per-verify indices: eager int64 inputs, a graph's int32 buffers, given row pointers
    assert {(r["index_dtype"], r["fill_indptr"]) for r in records if r["kernel"] == "verify_indices"} == {
        ("i64", True), ("i32", True), ("i32", False)
    }
    for r in records:
        assert 0 <= r["shared"] <= SM120_SMEM, r
    for r in split:
        assert r["mma"] == "mma.sync", r  # tensor cores (no wgmma on sm_120)
        assert r["shared"] > 0, r


@pytest.mark.skipif(os.environ.get("TREE_VERIFY_AOT_SM90") != "1", reason="opt-in (slow)")
def test_hopper_configs_compile():
    for r in compile_report("9.0"):
        assert r["shared"] <= max_shared_memory_per_block((9, 0)), r


def test_every_a100_class_config_compiles_and_fits_163_kib():
    """8.0 has a table of its own: the sm_90 MLA tile needs 229,376 B."""
    records = compile_report("8.0")
    assert {r["cls"] for r in records if r["kernel"] == "split"} == set(configs_for_arch((8, 0)))
    for r in records:
        assert 0 <= r["shared"] <= max_shared_memory_per_block((8, 0)), r
