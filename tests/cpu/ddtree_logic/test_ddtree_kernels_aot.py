# SPDX-License-Identifier: Apache-2.0
"""The build (marginals and DFlash 2 selector), compile and step-commit kernels and the verify sampler's node-logits and Gumbel-draw kernels compile for real GPUs (sm_90, sm_120), not just under the
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
    assert kernels == {"ddtree_build", "ddtree_selector_tree", "ddtree_compile", "ddtree_commit", "verify_node_logits",
                       "verify_gumbel_draw", "verify_sampling_floors", "verify_sampling_whole_row_floors",
                       "verify_sampling_split_row_floors"}, results
    assert len(results) >= 2 * 16, results
    for r in results:
        assert r["shared"] <= 99 * 1024, r  # fits sm_120's per-block limit
        assert not r["ptx"], f"register spills to local memory: {r}"


#: Triton kernels that never run on sm_12x: FlashMLA's prefix route is sm_90/sm_100 only.
NOT_ON_SM12X = {"_tree_verify_page_gather_kernel", "_tree_verify_merge_chunks_kernel"}


def test_every_overlay_kernel_is_in_the_images_list():
    """Every Triton kernel of the overlay (a ``@triton.jit`` function named ``*_kernel``; the
    others are helpers inlined into them) is compiled ahead of time for sm_12x by the image's
    list: docker/compile_kernels.py or, for the verify attention, tree_verify/aot.py."""
    import ast

    repo = DOCKER.parent
    listed = (DOCKER / "compile_kernels.py").read_text() + (
        repo / "sglang/srt/layers/attention/tree_verify/aot.py").read_text()
    kernels = {}
    for path in sorted((repo / "sglang").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel")
                    and any("triton.jit" in ast.unparse(d) for d in node.decorator_list)):  # fmt: skip
                kernels[node.name] = path.relative_to(repo)
    assert len(kernels) >= 15, kernels
    missing = {name: str(path) for name, path in kernels.items()
               if name not in NOT_ON_SM12X and name not in listed}  # fmt: skip
    assert not missing, f"kernels the image does not compile for sm_12x: {missing}"
