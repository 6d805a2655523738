# SPDX-License-Identifier: Apache-2.0
"""The fused kernel at the layer shapes the hook now sends it for gpt-oss and Gemma 4
compiles for sm_120 on this CPU machine and fits 99 KiB of shared memory per block:
the config the dispatcher selects for each head size (gpt-oss's 64; Gemma 4's 256 on
its sliding layers and 512 on its full ones, the latter outside the per-class
representatives of tests/cpu/tree_verify/test_aot_sm120.py), with the window where
the layer has one, and the combine kernel with sinks at each head size.

Compilation runs in a child process without TRITON_INTERPRET (the CPU test run
interprets Triton).
"""

import json
import os
import subprocess
import sys

SM120_SMEM = 101376

SCRIPT = r"""
import json
from sglang.srt.layers.attention.tree_verify import aot
from sglang.srt.layers.attention.tree_verify.configs import select_config

for name, d, sliding in (("gptoss-sliding", 64, True), ("gptoss-full", 64, False),
                         ("gemma4-sliding", 256, True), ("gemma4-full", 512, False)):
    cfg = select_config((12, 0), d, d, False)
    k = aot.compile_split_kernel(cfg, d, d, (12, 0), share_kv=False, sliding=sliding)
    print(json.dumps(dict(kernel="split", layer=name, shared=k.metadata.shared, ptx=aot._mma_kind(k.asm["ptx"]))))
for d in (64, 256, 512):
    k = aot.compile_combine_kernel(d, (12, 0), sinks=True)
    print(json.dumps(dict(kernel="combine", layer=d, shared=k.metadata.shared, ptx=None)))
"""


def test_window_and_sink_layer_shapes_compile_for_sm120():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["layer"] for r in records] == ["gptoss-sliding", "gptoss-full", "gemma4-sliding", "gemma4-full",
                                             64, 256, 512]  # fmt: skip
    for r in records:
        assert 0 < r["shared"] <= SM120_SMEM or (r["kernel"] == "combine" and r["shared"] == 0), r
        if r["kernel"] == "split":
            assert r["ptx"] == "mma.sync", r
