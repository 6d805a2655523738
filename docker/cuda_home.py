# SPDX-License-Identifier: Apache-2.0
"""A CUDA toolkit tree for the JIT compilers, made of the pip CUDA packages, and its check.

FlashInfer, sglang's own JIT kernels and torch extensions compile with ``$CUDA_HOME/bin/nvcc``
against ``$CUDA_HOME/include`` at run time. In the image both come from pip packages
(``nvidia-cuda-nvcc``, ``-crt``, ``nvidia-nvvm``, ``-cccl`` for the compiler, ``-runtime`` and
the library packages for the headers), which pip resolves independently: nothing stops a
13.5 nvcc from landing next to 13.0 runtime headers, and CCCL then stops every real kernel
at ``#error "CUDA compiler and CUDA toolkit headers are incompatible"``. ``check`` catches that
before any kernel is compiled.

  build --out DIR --site SITE [--site SITE ...]
      DIR/bin, include, nvvm: one symlink per entry of SITE/nvidia/cu13/{bin,include,nvvm}
      (a later SITE's entry replaces an earlier one's of the same name); DIR/lib64: the
      libraries, libcudart.so, libcuda.so pointing at the driver library the NVIDIA Container
      Toolkit mounts at run time, and stubs/libcuda.so for linking where no driver is.
  check [--cuda-home DIR]
      nvcc's release must equal the runtime headers' CUDART_VERSION (major.minor); exit 1
      saying which packages to pin otherwise.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys

#: pip distributions that make up the compiler: pinned to the runtime's CUDA version.
COMPILER_DISTS = ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-cccl")
#: the distribution whose headers and libcudart the kernels build and link against.
RUNTIME_DIST = "nvidia-cuda-runtime"


def release_of(version: str) -> tuple[int, int]:
    """'13.0.88' -> (13, 0): the CUDA release a pip CUDA package belongs to."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def nvcc_release(cuda_home: pathlib.Path) -> tuple[int, int]:
    nvcc = cuda_home / "bin" / "nvcc"
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise ValueError(f"cannot run {nvcc} --version: {e}") from e
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise ValueError(f"no 'release X.Y' in the output of {nvcc} --version:\n{out}")
    return int(m[1]), int(m[2])


def header_release(cuda_home: pathlib.Path) -> tuple[int, int]:
    header = cuda_home / "include" / "cuda_runtime_api.h"
    try:
        text = header.read_text(errors="replace")
    except OSError as e:
        raise ValueError(f"cannot read the runtime headers: {e}") from e
    m = re.search(r"^#define\s+CUDART_VERSION\s+(\d+)", text, re.M)
    if not m:
        raise ValueError(f"{header} defines no CUDART_VERSION")
    v = int(m[1])
    return v // 1000, (v % 1000) // 10


def check(cuda_home: pathlib.Path) -> str:
    """One line describing a consistent toolkit; ValueError saying what to pin otherwise."""
    nvcc = nvcc_release(cuda_home)
    headers = header_release(cuda_home)
    if nvcc != headers:
        raise ValueError(
            f"nvcc {nvcc[0]}.{nvcc[1]} in {cuda_home}/bin does not match the CUDA runtime headers "
            f"{headers[0]}.{headers[1]} in {cuda_home}/include: CCCL refuses to compile any kernel "
            f"(\"CUDA compiler and CUDA toolkit headers are incompatible\"). Pin "
            f"{', '.join(COMPILER_DISTS)} to the {headers[0]}.{headers[1]} release of "
            f"{RUNTIME_DIST} (constraints/dev.txt)."
        )
    return f"nvcc {nvcc[0]}.{nvcc[1]} matches the CUDA runtime headers {headers[0]}.{headers[1]} in {cuda_home}"


def _link_entries(out: pathlib.Path, sites: list[pathlib.Path], sub: str) -> None:
    dest = out / sub
    dest.mkdir(parents=True, exist_ok=True)
    for site in sites:
        src = site / "nvidia" / "cu13" / sub
        if not src.is_dir():
            continue
        for entry in sorted(src.iterdir()):
            link = dest / entry.name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(entry)


def build(out: pathlib.Path, sites: list[pathlib.Path], driver_lib: str | None) -> None:
    sites = [s.resolve() for s in sites]
    if not any((s / "nvidia" / "cu13" / "bin" / "nvcc").exists() for s in sites):
        raise ValueError(f"no nvidia/cu13/bin/nvcc under {', '.join(map(str, sites))}: "
                         "is nvidia-cuda-nvcc installed?")
    if out.exists():
        shutil.rmtree(out)
    for sub in ("bin", "include", "nvvm"):
        _link_entries(out, sites, sub)
    lib64 = out / "lib64"
    (lib64 / "stubs").mkdir(parents=True)
    for site in sites:
        libdir = site / "nvidia" / "cu13" / "lib"
        for f in sorted(libdir.glob("*")) if libdir.is_dir() else []:
            link = lib64 / f.name
            if link.is_symlink():
                link.unlink()
            link.symlink_to(f)
    (lib64 / "libcudart.so").symlink_to("libcudart.so.13")
    if driver_lib is None:
        arch = subprocess.run(["gcc", "-print-multiarch"], capture_output=True, text=True).stdout.strip()
        driver_lib = f"/usr/lib/{arch or 'x86_64-linux-gnu'}/libcuda.so.1"
    (lib64 / "libcuda.so").symlink_to(driver_lib)
    # An empty library with the driver's soname: links resolve -lcuda where no driver is.
    subprocess.run(["gcc", "-x", "c", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1",
                    "-o", str(lib64 / "stubs" / "libcuda.so"), "-"], input="", text=True, check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cuda_home.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="make the toolkit tree from pip CUDA packages")
    b.add_argument("--out", type=pathlib.Path, required=True)
    b.add_argument("--site", type=pathlib.Path, action="append", required=True,
                   help="a site-packages holding nvidia/cu13 (repeatable; later ones win)")
    b.add_argument("--driver-lib", help="what lib64/libcuda.so points at "
                   "(default /usr/lib/<multiarch>/libcuda.so.1)")
    c = sub.add_parser("check", help="nvcc's release must match the runtime headers'")
    c.add_argument("--cuda-home", type=pathlib.Path,
                   default=pathlib.Path(os.environ.get("CUDA_HOME", "/opt/cuda")))
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build":
            build(args.out, args.site, args.driver_lib)
            print(f"CUDA toolkit tree in {args.out}")
            print(check(args.out))
        else:
            print(check(args.cuda_home))
    except (ValueError, OSError, subprocess.CalledProcessError) as e:
        print(f"cuda_home.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
