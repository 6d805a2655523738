# SPDX-License-Identifier: Apache-2.0
"""The build, compile and step-commit kernels and the verify sampler's node-logits and Gumbel-draw kernels compile for real GPUs (sm_90, sm_120), not just under the
interpreter, which accepts code the compiler rejects. Runs in a subprocess
because TRITON_INTERPRET=1 (set for the CPU test run) changes how
``triton.jit`` decorates the kernel."""

import json
import os
import subprocess
import sys
from pathlib import Path

DOCKER = Path(__file__).resolve().parents[3] / "docker"

# The kernel sources are docker/compile_kernels.py's, the list the image compiles ahead of time.
_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
sys.path.insert(0, sys.argv[1])
from compile_kernels import ddtree_sources

out = []
for cap in (90, 120):
    for label, src, options in ddtree_sources():
        c = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=options)
        out.append(dict(cap=cap, kernel=label, shared=c.metadata.shared, ptx="ld.local" in c.asm["ptx"]))
print(json.dumps(out))
"""


def test_kernels_compile_for_sm90_and_sm120():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(DOCKER)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    kernels = {r["kernel"].split()[0] for r in results}
    assert kernels == {"ddtree_build", "ddtree_compile", "ddtree_commit", "verify_node_logits",
                       "verify_gumbel_draw", "verify_sampling_floors", "verify_sampling_whole_row_floors",
                       "verify_sampling_split_row_floors"}, results
    assert len(results) >= 2 * 16, results
    for r in results:
        assert r["shared"] <= 99 * 1024, r  # fits sm_120's per-block limit
        assert not r["ptx"], f"register spills to local memory: {r}"
