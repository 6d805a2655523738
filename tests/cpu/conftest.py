# SPDX-License-Identifier: Apache-2.0
import os
import pathlib
import warnings

# Tests that run Triton kernels on the CPU need the interpreter; set it before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = pathlib.Path(__file__).resolve().parents[2]

#: The modules this project adds to sglang (the overlay), by import name.
OVERLAY_MODULES = frozenset(
    ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
    for p in (REPO / "sglang").rglob("*.py")
)


def _own_kernels_fail_on_runtime_warnings() -> None:
    """Make a RuntimeWarning (overflow, 0/0, ...) an error while one of this project's kernels runs.

    Under the interpreter a kernel's NumPy warnings are raised in Triton's own frames, so
    pytest.ini's per-module filter cannot tell whose kernel it was; the interpreter's launch is
    wrapped instead, and upstream's kernels keep the configured behaviour (reported, not raised).
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    launch = interpreter.GridExecutor.__call__
    if getattr(launch, "own_kernels_strict", False):
        return

    def __call__(self, *args, **kwargs):
        if getattr(self.fn, "__module__", None) not in OVERLAY_MODULES:
            return launch(self, *args, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            return launch(self, *args, **kwargs)

    __call__.own_kernels_strict = True
    interpreter.GridExecutor.__call__ = __call__


_own_kernels_fail_on_runtime_warnings()
