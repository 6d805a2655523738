# SPDX-License-Identifier: Apache-2.0
"""pytest.ini's warning filters, run for real: a RuntimeWarning raised in this project's code fails
the test that raised it, one raised elsewhere does not, and the Triton interpreter's NumPy
deprecation warning is not reported. Each case is a small test file run by pytest with the
repository's configuration."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CASES = textwrap.dedent('''
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    def overflow_in(module):
        g = {"__name__": module, "np": np}
        exec("def f():\\n    return np.exp(np.array([1000.0]))\\n", g)
        return g["f"]()

    def test_in_a_ddtree_module():
        overflow_in("sglang.srt.speculative.ddtree.accept")

    def test_in_a_tree_verify_module():
        overflow_in("sglang.srt.layers.attention.tree_verify.reference")

    def test_in_a_benchmark():
        overflow_in("benchmarks.verify_attention")

    def test_in_upstream_code():
        overflow_in("sglang.srt.layers.attention.triton_backend")

    @triton.jit
    def _count(n_ptr, out_ptr):
        n = tl.load(n_ptr)
        acc = 0.0
        for _ in range(n):  # a loaded bound: the interpreter converts it with the deprecated call
            acc += 1.0
        tl.store(out_ptr, acc)

    def test_interpreted_kernel():
        out = torch.zeros(1)
        _count[(1,)](torch.tensor([3], dtype=torch.int32), out)
        assert out.item() == 3.0
''')


DEPRECATION = "Conversion of an array with ndim > 0 to a scalar is deprecated"


def run(tmp_path, *extra):
    (tmp_path / "test_cases.py").write_text(CASES)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO / "pytest.ini"), "--rootdir", str(REPO),
         "-p", "no:cacheprovider", "-rf", *extra, str(tmp_path / "test_cases.py")],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def test_the_configured_warning_filters(tmp_path):
    rc, out = run(tmp_path)
    assert rc == 1, out
    for name in ("test_in_a_ddtree_module", "test_in_a_tree_verify_module", "test_in_a_benchmark"):
        assert f"::{name} - RuntimeWarning: overflow" in out, out
    assert "3 failed, 2 passed" in out, out
    assert "RuntimeWarning: overflow encountered in exp" in out.split("warnings summary")[1]  # upstream's: reported
    assert DEPRECATION not in out


def test_the_interpreter_deprecation_is_there_to_filter(tmp_path):
    """Without the configured filter (overridden on the command line) the kernel's loop does emit it."""
    rc, out = run(tmp_path, "-W", "always::DeprecationWarning", "-k", "interpreted")
    assert rc == 0 and DEPRECATION in out, out
