# SPDX-License-Identifier: Apache-2.0
"""``python -m sglang.cli.ddtree_doctor``: what this machine offers ddtree-sglang, and verdicts.

Reports the GPUs, driver and CUDA versions the process can see, the arch helpers' verdicts for
each GPU (or for ``--capability 12.0`` on a machine without one), the attention backends that
would be selected, and whether the patch series applied to the installed sglang is the one
this build ships and its files are still the ones the apply tool wrote. It needs only the
installed package (and, in the image, the shipped series under ``DDTREE_SRC``), and it never
raises: every probe that fails becomes a line in the report.

Exit status: 0 all good, 1 problems found, 2 no GPU visible (and no ``--capability`` given).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys
from typing import Optional

STAMP_NAME = ".ddtree-series.json"
BUILD_INFO = os.environ.get("DDTREE_BUILD_INFO", "/opt/ddtree/build.json")
SERIES_SRC = os.environ.get("DDTREE_SRC", "/opt/ddtree/src")
MIN_DRIVER_CUDA = {13: (13, 0), 12: (12, 0)}  # torch's CUDA major -> driver API it needs
NO_GPU_HELP = (
    "no NVIDIA GPU is visible. In a container, start it with --gpus all (NVIDIA Container "
    "Toolkit installed on the host); on the host, check nvidia-smi. CUDA 13 needs driver 580+."
)
ARCH_PREDICATES = (
    "is_sm120", "is_sm121", "is_sm12x", "is_datacenter_blackwell", "is_sm100", "is_hopper",
    "has_wgmma", "has_tcgen05",
)


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _read_json(path: pathlib.Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- probes


def probe_software() -> dict:
    info = {"python": sys.version.split()[0]}
    for dist in ("sglang", "torch", "triton", "flashinfer-python", "sglang-kernel", "transformers"):
        info[dist] = _version(dist)
    try:
        import torch

        info["torch_cuda"] = torch.version.cuda
    except Exception as e:  # noqa: BLE001 - a report, not a crash
        info["torch_cuda"] = None
        info["torch_error"] = f"{type(e).__name__}: {e}"
    cuda_home = os.environ.get("CUDA_HOME")
    nvcc = pathlib.Path(cuda_home, "bin", "nvcc") if cuda_home else None
    if nvcc and nvcc.exists():
        try:
            out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=30).stdout
            m = re.search(r"release (\d+\.\d+)", out)
            info["nvcc"] = m.group(1) if m else "unknown"
        except (OSError, subprocess.SubprocessError):
            info["nvcc"] = "not runnable"
    return info


def probe_nvml() -> dict:
    """Driver and GPUs as NVML reports them (works even when CUDA cannot initialise)."""
    try:
        import pynvml
    except ImportError:
        return {"ok": False, "error": "pynvml (nvidia-ml-py) is not installed"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return {"ok": False, "error": f"NVML unavailable ({e}): no NVIDIA driver is visible"}
    try:
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append({
                "index": i,
                "name": name.decode() if isinstance(name, bytes) else name,
                "capability": [major, minor],
                "memory_gib": round(mem.total / 2**30, 1),
            })
        driver = pynvml.nvmlSystemGetDriverVersion()
        return {
            "ok": True,
            "driver": driver.decode() if isinstance(driver, bytes) else driver,
            "driver_cuda": [cuda // 1000, (cuda % 1000) // 10],
            "gpus": gpus,
        }
    except pynvml.NVMLError as e:
        return {"ok": False, "error": f"NVML query failed: {e}"}
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def probe_torch_cuda() -> dict:
    try:
        import torch

        if not torch.cuda.is_available():
            return {"available": False, "devices": 0}
        return {
            "available": True,
            "devices": torch.cuda.device_count(),
            "capabilities": [list(torch.cuda.get_device_capability(i))
                             for i in range(torch.cuda.device_count())],
        }
    except Exception as e:  # noqa: BLE001
        return {"available": False, "devices": 0, "error": f"{type(e).__name__}: {e}"}


def arch_verdicts(cap: tuple[int, int]) -> dict:
    """The arch helpers' answers for `cap`; helpers missing from this build are skipped."""
    try:
        gpu_arch = importlib.import_module("sglang.srt.utils.gpu_arch")
    except Exception as e:  # noqa: BLE001
        return {"error": f"sglang.srt.utils.gpu_arch unavailable: {e}"}
    out = {}
    name = getattr(gpu_arch, "arch_name", None)
    out["arch"] = name(cap) if name else f"sm_{cap[0]}{cap[1]}"
    for pred in ARCH_PREDICATES:
        fn = getattr(gpu_arch, pred, None)
        if fn is not None:
            out[pred] = _call(fn, cap)
    smem = getattr(gpu_arch, "max_shared_memory_per_block", None)
    if smem is not None:
        out["max_shared_memory_per_block"] = _call(smem, cap)
    override = getattr(gpu_arch, "kernel_arch_override", None)
    if override is not None:
        ov = _call(override)
        out["kernel_arch_override"] = f"{ov[0]}.{ov[1]}" if isinstance(ov, tuple) else ov
    return out


def backend_verdicts(cap: tuple[int, int]) -> dict:
    """Backends the startup gating would pick or refuse for `cap`, from backend_support."""
    try:
        bs = importlib.import_module("sglang.srt.layers.attention.backend_support")
    except ModuleNotFoundError:
        return {"error": "backend_support is not part of this build"}
    except Exception as e:  # noqa: BLE001
        return {"error": f"backend_support failed to import: {type(e).__name__}: {e}"}
    needed = ("default_backend", "backends_for")
    missing = [n for n in needed if not hasattr(bs, n)]
    if missing:
        return {"error": f"backend_support lacks {', '.join(missing)}"}
    try:
        gpu_arch = importlib.import_module("sglang.srt.utils.gpu_arch")
        support = importlib.import_module("sglang.srt.layers.attention.tree_verify.support")
    except Exception as e:  # noqa: BLE001
        return {"error": f"the arch helpers failed to import: {type(e).__name__}: {e}"}
    if not hasattr(gpu_arch, "arch_family"):
        return {"error": "sglang.srt.utils.gpu_arch lacks arch_family"}
    family = _call(gpu_arch.arch_family, cap)
    if family not in getattr(bs, "GATED_FAMILIES", ()):
        return {"gating": f"{family or 'this GPU'} is not gated: upstream's own backend choice applies"}
    out = {}
    roles = getattr(bs, "ROLES", ("prefill", "decode", "target_verify", "draft"))
    for kind in ("mha", "mla"):
        verify = _call(bs.backends_for, cap, kind, "target_verify")
        tree = [b for b in verify if _call(support.supports_tree_verify, b, cap, kind) is True] \
            if isinstance(verify, tuple) else verify
        out[f"{kind} default"] = _call(bs.default_backend, cap, kind)
        for role in roles:
            got = _call(bs.backends_for, cap, kind, role)
            out[f"{kind} {role}"] = ", ".join(got) if isinstance(got, tuple) else got
        out[f"{kind} DDTree tree verify"] = ", ".join(tree) if isinstance(tree, list) else tree
    return out


def _call(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return f"error: {type(e).__name__}: {e}"


def series_digest(src: pathlib.Path, mode: str = "copy") -> str:
    """The digest of the patch series and overlay in a source tree (patches/, sglang/, upstream.lock).

    The same definition as the apply tool's (scripts/patchkit/series.py: Series.digest), kept here
    so that the installed package checks itself without the repository's scripts.
    """
    names = []
    for raw in (src / "patches" / "series").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            names.append(line)
    version = re.search(r'^version\s*=\s*"([^"]+)"', (src / "upstream.lock").read_text(), re.M)
    if not version:
        raise ValueError(f"{src / 'upstream.lock'} names no upstream version")
    h = hashlib.sha256()
    h.update(f"mode={mode}\nupstream={version.group(1)}\n".encode())
    for name in names:
        h.update(f"patch {name}\n".encode())
        h.update((src / "patches" / name).read_bytes())
    overlay = src / "sglang"
    for f in sorted(overlay.rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc":
            h.update(f"overlay {f.relative_to(src).as_posix()}\n".encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _changed_files(root: pathlib.Path, stamp: dict) -> list[str]:
    """Files the stamp records whose bytes (or link) are not what the apply tool wrote."""
    changed = []
    for rel, rec in stamp.get("files", {}).items():
        p = root / rel
        if "link" in rec:
            if not (p.is_symlink() and os.readlink(p) == rec["link"]):
                changed.append(rel)
            continue
        try:
            ok = hashlib.sha256(p.read_bytes()).hexdigest() == rec.get("applied")
        except OSError:
            ok = False
        if not ok:
            changed.append(rel)
    return changed


def probe_series(pkg: Optional[pathlib.Path] = None) -> dict:
    """The stamp in the installed sglang against its files, the build record and the shipped series."""
    if pkg is None:
        try:
            import sglang

            pkg = pathlib.Path(sglang.__file__).parent
        except Exception as e:  # noqa: BLE001
            return {"ok": False, "error": f"sglang does not import: {e}"}
    out: dict = {"package": str(pkg)}
    stamp = _read_json(pkg / STAMP_NAME)
    if stamp is None:
        out.update(ok=False, error=f"no patch stamp at {pkg / STAMP_NAME}: the series is not applied")
        return out
    out.update(
        digest=stamp.get("digest"),
        upstream_version=stamp.get("upstream_version"),
        applied_at=stamp.get("applied_at"),
        patches=len(stamp.get("patches", [])),
        overlay_files=len(stamp.get("overlay", [])),
        ok=True,
    )
    installed = _version("sglang")
    if installed and stamp.get("upstream_version") and installed != stamp["upstream_version"]:
        out.update(ok=False, error=f"series made for sglang {stamp['upstream_version']}, "
                                   f"installed sglang is {installed}")
    if "files" in stamp:
        changed = _changed_files(pkg.parent, stamp)
        out["changed_files"] = changed
        if changed:
            out.update(ok=False, error=f"{len(changed)} file(s) differ from what the series wrote "
                                       f"(reinstall sglang and apply again): {', '.join(changed[:5])}"
                                       + (" ..." if len(changed) > 5 else ""))
    build = _read_json(pathlib.Path(BUILD_INFO))
    if build and build.get("series_digest") and build["series_digest"] != stamp.get("digest"):
        out.update(ok=False, error=f"stamp {stamp.get('digest', '')[:12]} differs from the image's "
                                   f"recorded series {build['series_digest'][:12]}")
    src = pathlib.Path(SERIES_SRC)
    if (src / "patches" / "series").is_file() and (src / "upstream.lock").is_file():
        try:
            shipped = series_digest(src, stamp.get("mode", "copy"))
            out["shipped_digest"] = shipped
            if shipped != stamp.get("digest"):
                out.update(ok=False, error=f"stamp {stamp.get('digest', '')[:12]} differs from the "
                                           f"series in {src} ({shipped[:12]})")
        except (OSError, ValueError) as e:
            out["shipped_digest"] = f"error: {type(e).__name__}: {e}"
    return out


# --------------------------------------------------------------------------- report


def collect(capability: Optional[tuple[int, int]] = None) -> dict:
    report = {
        "build": _read_json(pathlib.Path(BUILD_INFO)),
        "software": probe_software(),
        "nvml": probe_nvml(),
        "torch_cuda": probe_torch_cuda(),
        "series": probe_series(),
    }
    problems, caps = [], []
    nvml, tc = report["nvml"], report["torch_cuda"]
    if nvml.get("ok"):
        caps = [tuple(g["capability"]) for g in nvml["gpus"]]
    elif tc.get("available"):
        caps = [tuple(c) for c in tc["capabilities"]]
    report["gpu_visible"] = bool(caps)
    if not caps:
        problems.append(NO_GPU_HELP)
    elif not tc.get("available"):
        problems.append("NVML sees a GPU but CUDA does not initialise in torch: "
                        f"{tc.get('error', 'torch.cuda.is_available() is False')}")
    torch_cuda = report["software"].get("torch_cuda")
    if nvml.get("ok") and torch_cuda:
        need = MIN_DRIVER_CUDA.get(int(torch_cuda.split(".")[0]))
        have = tuple(nvml["driver_cuda"])
        if need and have < need:
            problems.append(f"driver {nvml['driver']} supports CUDA {have[0]}.{have[1]}, torch needs "
                            f"{need[0]}.{need[1]}: upgrade the host driver (580+ for CUDA 13)")
    if not report["series"].get("ok"):
        problems.append(report["series"].get("error", "patch series problem"))
    build = report["build"] or {}
    built_for = build.get("gpu_arch", "")
    # Judge the visible GPUs, the one asked about, or else the ones this image was built for.
    targets = sorted(set(caps))
    if capability and capability not in targets:
        targets.append(capability)
    if not targets and built_for:
        targets = [tuple(int(x) for x in c.split(".")) for c in built_for.split(",")]
    report["verdicts"] = {}
    for cap in targets:
        key = f"{cap[0]}.{cap[1]}"
        report["verdicts"][key] = {
            "visible": cap in caps,
            "arch": arch_verdicts(cap),
            "backends": backend_verdicts(cap),
            "in_image_gpu_arch": (key in built_for.split(",")) if built_for else None,
        }
        if cap in caps and built_for and key not in built_for.split(","):
            problems.append(f"this image was built for compute capability {built_for}; "
                            f"a {key} GPU may lack kernels (rebuild with --build-arg GPU_ARCH=...)")
    report["problems"] = problems
    return report


def render(report: dict) -> str:
    lines = []
    add = lines.append
    if not report["gpu_visible"]:
        add("NO GPU VISIBLE: " + NO_GPU_HELP)
        add("")
    build = report["build"]
    if build:
        add(f"image        sglang {build.get('upstream_version')} + series "
            f"{str(build.get('series_digest'))[:12]}, GPU arch {build.get('gpu_arch')}, "
            f"built {build.get('built')} ({build.get('vcs_ref')})")
        if build.get("dropped"):
            add(f"             left out: {', '.join(build['dropped'])}")
    sw = report["software"]
    add("software     " + ", ".join(
        f"{k} {v}" for k, v in sw.items() if v and k not in ("torch_error",)))
    nvml = report["nvml"]
    if nvml.get("ok"):
        dc = nvml["driver_cuda"]
        add(f"driver       {nvml['driver']} (CUDA {dc[0]}.{dc[1]})")
        for g in nvml["gpus"]:
            add(f"gpu {g['index']}        {g['name']}, compute capability "
                f"{g['capability'][0]}.{g['capability'][1]}, {g['memory_gib']} GiB")
    else:
        add(f"driver       {nvml.get('error')}")
    tc = report["torch_cuda"]
    add(f"torch.cuda   available={tc.get('available')} devices={tc.get('devices')}"
        + (f" ({tc['error']})" if tc.get("error") else ""))
    s = report["series"]
    if s.get("digest"):
        add(f"patch stamp  {s['digest'][:12]}: {s.get('patches')} patches, {s.get('overlay_files')} "
            f"overlay files on sglang {s.get('upstream_version')}, applied {s.get('applied_at')}"
            + ("" if s.get("ok") else "  <-- MISMATCH"))
        if s.get("shipped_digest"):
            add(f"             shipped series {str(s['shipped_digest'])[:12]}: "
                + ("matches" if s["shipped_digest"] == s["digest"] else "DIFFERS"))
    else:
        add(f"patch stamp  {s.get('error')}")
    for key, v in report["verdicts"].items():
        arch = v["arch"]
        add(f"verdicts for compute capability {key} ({arch.get('arch', '?')})"
            + ("" if v["visible"] else ", a GPU not visible here") + ":")
        if "error" in arch:
            add(f"  arch helpers: {arch['error']}")
        else:
            flags = [k for k in ARCH_PREDICATES if arch.get(k) is True]
            add(f"  arch helpers: {', '.join(flags) or 'none true'}; max smem/block "
                f"{arch.get('max_shared_memory_per_block')} B"
                + (f"; kernel-arch override {arch['kernel_arch_override']}"
                   if arch.get("kernel_arch_override") else ""))
        b = v["backends"]
        if "error" in b:
            add(f"  backends: {b['error']}")
        else:
            for k, val in b.items():
                add(f"  {k}: {val}")
        if v["in_image_gpu_arch"] is not None:
            add(f"  built into this image: {'yes' if v['in_image_gpu_arch'] else 'NO'}")
    add("")
    if report["problems"]:
        add(f"{len(report['problems'])} problem(s):")
        for p in report["problems"]:
            add(f"  - {p}")
    else:
        add("all checks passed")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="ddtree_doctor", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--capability", help="also judge this compute capability, e.g. 12.0 "
                                         "(what-if on a machine without that GPU)")
    args = ap.parse_args(argv)
    cap = None
    if args.capability:
        m = re.fullmatch(r"(\d+)\.(\d)", args.capability.strip())
        if not m:
            ap.error(f"--capability must look like 12.0, got {args.capability!r}")
        cap = (int(m[1]), int(m[2]))
    report = collect(cap)
    print(json.dumps(report, indent=1, default=str) if args.json else render(report))
    if not report["gpu_visible"] and cap is None:
        return 2
    real_problems = [p for p in report["problems"] if p != NO_GPU_HELP]
    return 1 if real_problems else 0


if __name__ == "__main__":
    sys.exit(main())
