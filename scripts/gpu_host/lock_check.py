#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""One lock for the image and the GPU host: constraints/dev.txt.

The image installs exactly the lock (docker/Dockerfile, scripts/build_wheelhouse.sh). The GPU
host runs the GPU tier on what its own image provides (scripts/gpu_host/host_provided.txt:
torch, triton, ...) plus the wheels carried to it (scripts/gpu_host/wheels.txt). For the tier
to test what the image ships, every one of those must be at the lock's version.

  files      (CPU tier) wheels.txt and host_provided.txt pin the lock's versions, share no
             package, and with the packages left out on purpose they cover sglang's whole
             dependency closure for the host (python 3.12, linux); the CUDA compiler packages
             are pinned to the runtime's CUDA release.
  installed  (GPU host, after the install) every carried and host-provided package is
             installed at the lock's version (a local label such as +cu130 is ignored), and the
             host's nvcc (its JIT compiler there) is the lock's CUDA release; exits 1 naming
             each drift and what to do about it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "constraints" / "dev.txt"
UPSTREAM = REPO / "upstream.lock"  # sglang itself: pinned (and hash-checked) there
WHEELS = REPO / "scripts" / "gpu_host" / "wheels.txt"
HOST = REPO / "scripts" / "gpu_host" / "host_provided.txt"
#: The pip packages of the CUDA compiler: their release must be the runtime's (docker/cuda_home.py).
COMPILER = ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-cccl")
RUNTIME = "nvidia-cuda-runtime"
HOST_PYTHON = "3.12"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """``name==version`` lines (comments and blanks ignored); '!name' lines are returned as None."""
    pins: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("!"):
            pins[normalize(line[1:])] = None
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
        if not m:
            raise ValueError(f"{path}:{n}: expected 'name==version' or '!name', got {raw!r}")
        name = normalize(m[1])
        if name in pins:
            raise ValueError(f"{path}:{n}: {m[1]} is listed twice")
        pins[name] = m[2]
    return pins


def load_lock() -> dict[str, str]:
    import tomllib

    lock = read_pins(LOCK)
    with open(UPSTREAM, "rb") as f:
        lock["sglang"] = tomllib.load(f)["upstream"]["version"]
    return lock


def release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def closure(root: str = "sglang", python: str = HOST_PYTHON) -> set[str]:
    """Every distribution ``root`` requires, transitively, on linux x86_64 with ``python``,
    read from the installed metadata (the dev venv holds the whole lock)."""
    import importlib.metadata as md

    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    env = default_environment()
    env.update(python_version=python, python_full_version=f"{python}.0", sys_platform="linux",
               platform_system="Linux", platform_machine="x86_64")
    seen: set[tuple[str, frozenset]] = set()
    stack = [(root, frozenset())]
    while stack:
        name, extras = stack.pop()
        if (normalize(name), extras) in seen:
            continue
        seen.add((normalize(name), extras))
        for text in md.requires(name) or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""})):
                stack.append((req.name, frozenset(req.extras)))
    return {name for name, _ in seen}


def check_files(with_closure: bool = True) -> list[str]:
    lock, wheels, host = load_lock(), read_pins(WHEELS), read_pins(HOST)
    errors = []
    for name, version in read_pins(LOCK).items():
        if version is None:
            errors.append(f"{LOCK.name}: '!{name}' has no meaning in the lock")
    for path, pins in ((WHEELS, wheels), (HOST, host)):
        for name, version in pins.items():
            if version is None:
                continue
            if name not in lock:
                errors.append(f"{path.name}: {name} is not in the lock ({LOCK.name})")
            elif version != lock[name]:
                errors.append(f"{path.name}: {name}=={version}, the lock pins {lock[name]}")
    left_out = {n for n, v in host.items() if v is None}
    carried, provided = {n for n, v in wheels.items() if v}, {n for n, v in host.items() if v}
    for name in sorted(carried & (provided | left_out)):
        errors.append(f"{name} is both carried (wheels.txt) and listed in host_provided.txt")
    runtime = lock.get(RUNTIME)
    for name in COMPILER:
        if runtime is None or name not in lock:
            errors.append(f"the lock must pin {name} and {RUNTIME}")
        elif release(lock[name]) != release(runtime):
            errors.append(f"the lock pins {name}=={lock[name]} but {RUNTIME}=={runtime}: nvcc and the "
                          f"runtime headers must be one CUDA release")
    if with_closure:
        need = closure()
        for name in sorted(need - carried - provided - left_out):
            errors.append(f"{name} (needed by sglang on the host) is neither carried, host-provided nor left out")
        for name in sorted((carried | provided | left_out) - need - {"sglang"}):
            errors.append(f"{name} is listed for the GPU host but sglang does not need it")
    return errors


def check_installed() -> tuple[list[str], int, list[str]]:
    """The drifts, the number of checks, and the packages installed more than once."""
    lock, wheels, host = load_lock(), read_pins(WHEELS), read_pins(HOST)
    errors, checked, shadowed = [], 0, []
    for source, pins in (("carried", wheels), ("host image", host)):
        for name, version in sorted(pins.items()):
            if version is None:
                continue
            checked += 1
            # Every copy on sys.path, first one first: the first is what importlib.metadata reports
            # (md.version) and, for a carried package shadowing the host's, what must be imported.
            dists = _copies(name)
            if not dists:
                errors.append(f"{name}: not installed ({source}); the lock pins {lock.get(name)}")
                continue
            have = dists[0].version
            if have.split("+", 1)[0] != lock.get(name):
                errors.append(f"{name}: {have} installed ({source}), the lock pins {lock.get(name)}")
            elif len(dists) > 1:
                shadowed.append(f"{name} {have} over {', '.join(d.version for d in dists[1:])}")
                errors.extend(f"{name}: {have} is the installed version but {problem}"
                              for problem in _imports_elsewhere(dists))
    nvcc = _nvcc_release()
    if nvcc is None:
        errors.append("no nvcc found (CUDA_HOME, PATH, /usr/local/cuda): the JIT kernels cannot compile")
    elif nvcc != release(lock["nvidia-cuda-nvcc"]):
        errors.append(f"nvcc {nvcc[0]}.{nvcc[1]} on the host, the lock pins nvidia-cuda-nvcc=="
                      f"{lock['nvidia-cuda-nvcc']}")
    return errors, checked + 1, shadowed


def _copies(name: str) -> list:
    """The distributions named ``name`` in sys.path order (a directory listed twice counts once)."""
    import importlib.metadata as md
    import os

    copies, seen = [], set()
    for dist in md.distributions(name=name):
        where = os.path.realpath(dist.locate_file(""))
        if where not in seen:
            seen.add(where)
            copies.append(dist)
    return copies


def _import_names(dist) -> dict[str, str]:
    """The importable top-level names of ``dist`` (a namespace directory such as ``google/``
    stands for its shallowest regular packages, ``google.protobuf``), each with the file that
    defines it, relative to the distribution's location; read from its RECORD."""
    found: dict[str, tuple[int, str]] = {}
    for f in dist.files or []:
        parts = f.parts
        if not parts or parts[0] == ".." or parts[0].endswith((".dist-info", ".egg-info", ".data")):
            continue
        if len(parts) == 1 and parts[0].endswith((".py", ".so")):
            module, depth = parts[0].split(".", 1)[0], 0
        elif parts[-1] == "__init__.py":
            module, depth = ".".join(parts[:-1]), len(parts) - 1
        else:
            continue
        if not all(p.isidentifier() for p in module.split(".")):
            continue
        top = module.split(".", 1)[0]
        if top not in found or depth < found[top][0]:
            found[top] = (depth, "/".join(parts))
    return {path.rsplit("/", 1)[0].replace("/", ".") if path.endswith("/__init__.py") else top: path
            for top, (_, path) in found.items()}


def _imports_elsewhere(dists) -> list[str]:
    """For a package installed more than once on sys.path: the modules of the first copy (the
    version importlib.metadata reports) that Python would import from another copy."""
    import importlib.util
    import os

    first, rest = dists[0], dists[1:]
    problems = []
    for module, path in sorted(_import_names(first).items()):
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        origin = os.path.realpath(spec.origin) if spec is not None and spec.origin else None
        if origin == os.path.realpath(first.locate_file(path)):
            continue
        other = next((d for d in rest if origin == os.path.realpath(d.locate_file(path))), None)
        if other is not None:
            problems.append(f"`import {module}` loads the {other.version} copy ({origin})")
        elif origin is None:
            problems.append(f"`import {module}` finds nothing")
    return problems


def _nvcc_release():
    import os
    import shutil
    import subprocess

    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = os.path.join(home, "bin", "nvcc") if home else (shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m[1]), int(m[2])) if m else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lock_check.py", description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["files", "installed"])
    ap.add_argument("--no-closure", action="store_true", help="files: skip the dependency closure check")
    args = ap.parse_args(argv)
    try:
        if args.mode == "files":
            errors = check_files(with_closure=not args.no_closure)
            ok = f"wheels.txt and host_provided.txt pin the lock's versions ({LOCK.relative_to(REPO)})"
        else:
            errors, n, shadowed = check_installed()
            ok = f"{n} packages installed at the lock's versions ({LOCK.relative_to(REPO)})"
            if shadowed:
                print(f"{len(shadowed)} packages are installed more than once; the first copy on "
                      f"sys.path is the one imported and reported: {'; '.join(shadowed)}")
    except (OSError, ValueError) as e:
        print(f"lock_check.py: error: {e}", file=sys.stderr)
        return 2
    for e in errors:
        print(f"DRIFT  {e}")
    if errors:
        if args.mode == "installed":
            print("The GPU tier would not test the image's wheel set. Bring the drifted packages in the "
                  "wheel set (add them, at the lock's version, to scripts/gpu_host/wheels.txt and remove them "
                  "from host_provided.txt), rebuild it (scripts/gpu_host/build_wheelhouse.sh), and install again.")
        return 1
    print(ok)
    return 0


if __name__ == "__main__":
    sys.exit(main())
