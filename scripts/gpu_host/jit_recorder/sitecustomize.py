# SPDX-License-Identifier: Apache-2.0
"""Record every JIT kernel module a process builds or loads (scripts/gpu_host/record_jit_modules.py).

On ``PYTHONPATH`` with ``DDTREE_JIT_RECORD=<file>``, every Python process appends one JSON line
per module it gets: FlashInfer's (``JitSpec.build_and_load``: the module name) and sglang's JIT
kernels (``load_jit``: the factory function that asked for it and that function's arguments,
which ``docker/compile_kernels.py`` calls again for sm_12x). Each line also names the first
sglang frame that led there. Without the variable nothing is patched. A ``sitecustomize`` that
this one shadows is still run.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import time

_OUT = os.environ.get("DDTREE_JIT_RECORD")
_HERE = os.path.dirname(os.path.abspath(__file__))


def _run_shadowed_sitecustomize():
    rest = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def _json_value(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if type(v).__module__ == "torch" and type(v).__name__ == "dtype":
        return {"dtype": str(v).split(".", 1)[1]}
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    return {"repr": repr(v)}


def _sglang_caller(frame):
    while frame is not None:
        f = frame.f_code.co_filename
        if "/sglang/" in f and "/kernels/jit/" not in f and "/jit_recorder/" not in f:
            return f"{f.split('/sglang/', 1)[1]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return None


def _write(record):
    record.update(pid=os.getpid(), time=round(time.time(), 3))
    line = json.dumps(record) + "\n"
    fd = os.open(_OUT, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _patch_flashinfer(core):
    original = core.JitSpec.build_and_load

    def build_and_load(self):
        cached = self.is_compiled
        t0 = time.time()
        result = original(self)
        _write({"kind": "flashinfer", "name": self.name, "cached": cached,
                "seconds": round(time.time() - t0, 1), "caller": _sglang_caller(sys._getframe(1))})
        return result

    core.JitSpec.build_and_load = build_and_load


def _patch_sglang_jit(utils):
    original = utils.load_jit

    def load_jit(*args, **kwargs):
        factory = sys._getframe(1)
        code = factory.f_code
        n_pos = code.co_argcount
        names = code.co_varnames[: n_pos + code.co_kwonlyargcount]
        local = factory.f_locals
        t0 = time.time()
        result = original(*args, **kwargs)
        _write({
            "kind": "sglang_jit",
            "factory": f"{factory.f_globals.get('__name__')}:{getattr(code, 'co_qualname', code.co_name)}",
            "args": [_json_value(local.get(n)) for n in names[:n_pos]],
            "kwargs": {n: _json_value(local.get(n)) for n in names[n_pos:]},
            "module": "_".join(str(a) for a in args),
            "seconds": round(time.time() - t0, 1),
            "caller": _sglang_caller(factory.f_back),
        })
        return result

    # Factories bind load_jit when their module is imported: patch it where they import it
    # from, before any of them is.
    utils.load_jit = load_jit
    sys.modules["sglang.kernels.jit.utils.compile"].load_jit = load_jit


_PATCHES = {"flashinfer.jit.core": _patch_flashinfer, "sglang.kernels.jit.utils": _patch_sglang_jit}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _PATCHES[name](module)

        spec.loader.exec_module = exec_and_patch
        return spec


if _OUT:
    sys.meta_path.insert(0, _PatchAfterImport())
_run_shadowed_sitecustomize()
