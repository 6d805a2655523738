# SPDX-License-Identifier: Apache-2.0
"""The warning policy, run for real: a RuntimeWarning raised in this project's code, or in one of
its kernels running under the Triton interpreter, fails the test that raised it; one raised in
upstream's code or kernels does not; the interpreter's NumPy deprecation warning is not
reported. Each case is a small test file run by pytest with the repository's configuration and
the CPU tier's conftest."""

import configparser
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.cpu.conftest import OVERLAY_MODULES

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

    @triton.jit
    def _ratio_own(x_ptr, y_ptr, out_ptr):
        tl.store(out_ptr, tl.load(x_ptr) / tl.load(y_ptr))

    @triton.jit
    def _ratio_upstream(x_ptr, y_ptr, out_ptr):
        tl.store(out_ptr, tl.load(x_ptr) / tl.load(y_ptr))

    def ratio_of_zeros(kernel, module):
        """0/0 in `kernel` as if it were defined in `module`: the interpreter rewrites a kernel at
        its first launch in the globals of its definition, whose __name__ becomes its module."""
        globs = kernel.fn.__globals__
        name = globs["__name__"]
        globs["__name__"] = module
        try:
            out = torch.zeros(1)
            kernel[(1,)](torch.zeros(1), torch.zeros(1), out)
            return out
        finally:
            globs["__name__"] = name

    def test_own_kernel_0_by_0():
        ratio_of_zeros(_ratio_own, "sglang.srt.layers.attention.tree_verify.prefix_split")

    def test_upstream_kernel_0_by_0():
        assert ratio_of_zeros(_ratio_upstream, "sglang.kernels.ops.attention.extend_attention").isnan().all()
''')


DEPRECATION = "Conversion of an array with ndim > 0 to a scalar is deprecated"


def run(tmp_path, *extra):
    (tmp_path / "test_cases.py").write_text(CASES)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO / "pytest.ini"), "--rootdir", str(REPO),
         "-p", "tests.cpu.conftest", "-p", "no:cacheprovider", "-rf", *extra, str(tmp_path / "test_cases.py")],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def test_the_configured_warning_filters(tmp_path):
    rc, out = run(tmp_path)
    assert rc == 1, out
    for name in ("test_in_a_ddtree_module", "test_in_a_tree_verify_module", "test_in_a_benchmark"):
        assert f"::{name} - RuntimeWarning: overflow" in out, out
    assert "::test_own_kernel_0_by_0 - triton.runtime.errors.InterpreterError" in out, out
    assert "InterpreterError: RuntimeWarning('invalid value encountered in divide')" in out
    assert "4 failed, 3 passed" in out, out
    assert "RuntimeWarning: overflow encountered in exp" in out.split("warnings summary")[1]  # upstream's: reported
    assert DEPRECATION not in out


def test_the_interpreter_deprecation_is_there_to_filter(tmp_path):
    """Without the configured filter (overridden on the command line) the kernel's loop does emit it."""
    rc, out = run(tmp_path, "-W", "always::DeprecationWarning", "-k", "interpreted")
    assert rc == 0 and DEPRECATION in out, out


def test_every_overlay_module_is_under_the_configured_filter():
    """pytest.ini names the overlay's packages in its error filter: a module added elsewhere must
    be added there too (its kernels are covered by tests/cpu/conftest.py either way)."""
    ini = configparser.ConfigParser()
    ini.read(REPO / "pytest.ini")
    lines = [l.strip() for l in ini["pytest"]["filterwarnings"].splitlines() if l.strip() and not l.strip().startswith("#")]
    module_re = next(l.split(":", 3)[3] for l in lines if l.startswith("error::RuntimeWarning:"))
    assert "sglang.srt.speculative.ddtree.worker" in OVERLAY_MODULES
    missing = sorted(m for m in OVERLAY_MODULES if not re.match(module_re, m))
    assert not missing, f"overlay modules outside pytest.ini's RuntimeWarning filter: {missing}"
