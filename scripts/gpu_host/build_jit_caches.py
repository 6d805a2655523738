#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Build, on the GPU host, the JIT kernel modules the servers build on their first start, into
the caches the servers read (docs/GPU_HOST.md, step 2).

A server compiles FlashInfer's modules (RMSNorm, which every layer goes through; sampling, which
the first sampled request needs; attention) and sglang's JIT kernels with nvcc the first time it
needs them, so on a freshly installed host the first servers wait minutes for nvcc and the first
sampled request waits for it too. This builds the modules of ``docker/jit_modules.json``
(FlashInfer's through their own generators, several at once; sglang's through their factories)
for the GPUs this process sees, in this process's environment, which is the servers': the same
cache folders and the same target archs, so a server finds them built. Modules the list does not
name (other head sizes, the test models' own shapes) and Triton kernels still compile on first
use. ``install.sh`` runs it when it finds a GPU.

  python3 scripts/gpu_host/build_jit_caches.py            # every listed module
  python3 scripts/gpu_host/build_jit_caches.py --for mla  # those an MLA target needs
  python3 scripts/gpu_host/build_jit_caches.py --list

One line per module (``built``, ``cached`` or ``FAIL``, seconds); exit 1 if any failed (a server
then builds that module itself, as without this step).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGETS = ("mha", "mla")


def _kernel_list():
    """``docker/compile_kernels.py`` (the list's reader and its argument decoding)."""
    spec = importlib.util.spec_from_file_location("compile_kernels", REPO / "docker" / "compile_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def selected(data: dict, targets) -> tuple:
    """The list's FlashInfer and sglang entries that any of ``targets`` needs."""
    wanted = set(targets)
    return ([e for e in data["flashinfer"] if wanted & set(e["for"])],
            [e for e in data["sglang_jit"] if wanted & set(e["for"])])  # fmt: skip


def made_here(entries, make) -> list:
    """``(entry, make(entry), None)``, or ``(entry, None, why not)``, for each entry: made in this
    thread before any build starts. FlashInfer's generators and sglang's kernel factories import
    their modules on first use, and threads importing the same package at once can deadlock on
    Python's import locks (``_DeadlockError``)."""
    out = []
    for entry in entries:
        try:
            out.append((entry, make(entry), None))
        except Exception as ex:  # the generator's or the import's message is the report
            out.append((entry, None, f"{type(ex).__name__}: {ex}"))
    return out


def build_flashinfer(spec, error=None) -> tuple:
    """``(status, seconds, error)`` of one FlashInfer module: built here, or already cached
    (``error``: why ``made_here`` has no spec for it)."""
    t0 = time.monotonic()
    if spec is None:
        return "FAIL", 0.0, error
    try:
        if spec.is_compiled:
            return "cached", time.monotonic() - t0, None
        spec.build(verbose=False)  # under the module's file lock, as a server's build is
        if not spec.is_compiled:
            raise RuntimeError(f"{spec.get_library_path()} was not built")
        return "built", time.monotonic() - t0, None
    except Exception as ex:  # the compiler's message is the report
        return "FAIL", time.monotonic() - t0, f"{type(ex).__name__}: {ex}"


def build_sglang_jit(ck, entry: dict, factory) -> tuple:
    """``(status, seconds, error)`` of one sglang JIT kernel, built (or found) and loaded by its
    own ``factory`` (resolved beforehand, in the main thread) for the GPU this process sees."""
    t0 = time.monotonic()
    try:
        kwargs = {k: ck.decode_arg(v) for k, v in entry.get("kwargs", {}).items()}
        factory(*map(ck.decode_arg, entry["args"]), **kwargs)
        return "ready", time.monotonic() - t0, None
    except Exception as ex:
        return "FAIL", time.monotonic() - t0, f"{type(ex).__name__}: {ex}"


def label_of(entry: dict) -> str:
    if "name" in entry:
        return f"flashinfer  {entry['name']}"
    return f"sglang_jit  {entry['factory'].split(':')[1]}{tuple(entry['args'])}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--for", dest="targets", default=",".join(TARGETS),
                    help=f"comma list of the targets whose modules to build ({', '.join(TARGETS)})")
    ap.add_argument("--jobs", type=int, default=8, help="FlashInfer modules built at once")
    ap.add_argument("--modules", type=Path, default=REPO / "docker" / "jit_modules.json")
    ap.add_argument("--list", action="store_true", help="print the modules and exit")
    args = ap.parse_args(argv)
    targets = [t for t in args.targets.replace(",", " ").split() if t]
    if not targets or set(targets) - set(TARGETS):
        ap.error(f"--for takes {', '.join(TARGETS)}, got {args.targets!r}")
    if args.jobs < 1:
        ap.error("--jobs takes a positive number")
    ck = _kernel_list()
    try:
        data = ck.load_modules(args.modules)
    except (OSError, ValueError) as e:
        ap.error(str(e))
    flashinfer, sglang_jit = selected(data, targets)
    if args.list:
        for e in flashinfer + sglang_jit:
            print(f"{label_of(e)}  ({', '.join(e['for'])})")
        return 0

    import torch

    if not torch.cuda.is_available():
        print("build_jit_caches.py: no GPU visible: the servers' target archs are unknown here, nothing built",
              file=sys.stderr)
        return 2
    t_all = time.monotonic()
    specs = made_here(flashinfer, ck.flashinfer_spec)
    factories = made_here(sglang_jit, lambda e: ck.resolve(e["factory"]))

    def sglang_all():
        return [(e, build_sglang_jit(ck, e, f) if f is not None else ("FAIL", 0.0, err))
                for e, f, err in factories]  # fmt: skip

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        # nvcc runs in child processes: the threads only wait. sglang's kernels one at a time,
        # beside the FlashInfer builds.
        fi = [(e, pool.submit(build_flashinfer, spec, err)) for e, spec, err in specs]
        sg = pool.submit(sglang_all)
        results = [(e, f.result()) for e, f in fi] + sg.result()
    failed = 0
    for entry, (status, seconds, err) in results:
        print(f"{status:7s} {seconds:6.1f} s  {label_of(entry)}", flush=True)
        if err is not None:
            failed += 1
            print("\n".join("        | " + line for line in err.rstrip().splitlines()[-20:]), flush=True)
    print(f"build_jit_caches.py: {len(results) - failed} of {len(results)} modules ready in "
          f"{time.monotonic() - t_all:.0f} s" + (f", {failed} failed (the servers build those themselves)"
                                                 if failed else ""))  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
