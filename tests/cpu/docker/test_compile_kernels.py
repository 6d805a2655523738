# SPDX-License-Identifier: Apache-2.0
"""The image's JIT toolchain check and kernel list: docker/cuda_home.py builds a toolkit tree from
the venv's pip CUDA packages and refuses an nvcc of another release than the runtime headers;
docker/jit_modules.json names modules that the real generators produce; compile_kernels.py fails
loudly on a broken toolchain and on a recording the list lacks; the GPU host's recorder
(scripts/gpu_host/jit_recorder) records what FlashInfer and sglang's load_jit are asked for.
The compiles themselves run in `make image-test` (minutes per module on this machine)."""

import importlib.metadata as md
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
DOCKER = REPO / "docker"
sys.path.insert(0, str(DOCKER))
import compile_kernels as ck  # noqa: E402
import cuda_home  # noqa: E402

SITE = Path(sysconfig.get_paths()["purelib"])


def _venv_site() -> Path:
    """The site-packages that holds the venv's nvidia/cu13 (the dev venv may chain to another)."""
    for p in map(Path, sys.path):
        if (p / "nvidia" / "cu13" / "bin" / "nvcc").exists():
            return p
    pytest.fail("no nvidia/cu13/bin/nvcc on sys.path: nvidia-cuda-nvcc is part of the lock")


def test_the_toolkit_tree_is_checked_against_the_installed_packages(tmp_path):
    out = tmp_path / "cuda"
    cuda_home.build(out, [_venv_site()], driver_lib="/nonexistent/libcuda.so.1")
    assert (out / "bin" / "nvcc").exists() and (out / "include" / "cuda_runtime_api.h").exists()
    assert (out / "lib64" / "libcudart.so").exists() and (out / "lib64" / "stubs" / "libcuda.so").exists()
    same = cuda_home.release_of(md.version("nvidia-cuda-nvcc")) == cuda_home.release_of(md.version("nvidia-cuda-runtime"))
    if same:
        assert "matches the CUDA runtime headers" in cuda_home.check(out)
    else:  # a venv set up before the compiler was pinned: exactly the image's old bug
        with pytest.raises(ValueError, match="CCCL refuses to compile"):
            cuda_home.check(out)


def _fake_toolkit(tmp_path, nvcc_release: str) -> Path:
    home = tmp_path / f"cuda-{nvcc_release}"
    (home / "bin").mkdir(parents=True)
    (home / "include").mkdir()
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {nvcc_release}, V{nvcc_release}.37'\n")
    nvcc.chmod(0o755)
    (home / "include" / "cuda_runtime_api.h").write_text("#define CUDART_VERSION  13000\n")
    return home


def test_a_mismatched_nvcc_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError) as e:
        cuda_home.check(_fake_toolkit(tmp_path, "13.5"))
    assert "nvcc 13.5" in str(e.value) and "headers 13.0" in str(e.value) and "nvidia-cuda-nvcc" in str(e.value)
    assert "nvcc 13.0 matches" in cuda_home.check(_fake_toolkit(tmp_path, "13.0"))


def test_compile_kernels_stops_loudly_on_a_broken_toolchain(tmp_path):
    env = {**os.environ, "CUDA_HOME": str(_fake_toolkit(tmp_path, "13.5"))}
    proc = subprocess.run([sys.executable, str(DOCKER / "compile_kernels.py"), "--only", "flashinfer"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1
    assert "FAIL  toolchain: nvcc 13.5" in proc.stdout


def _generate(workspace: Path):
    """Run the real FlashInfer generators (they write sources, they do not compile) in a child."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import compile_kernels as ck\n"
        "data = ck.load_modules()\n"
        "out = [ck.resolve(e['gen'])(*map(ck.decode_arg, e['args'])).name for e in data['flashinfer']]\n"
        "print(json.dumps(out))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(FLASHINFER_CUDA_ARCH_LIST="12.0f", FLASHINFER_WORKSPACE_BASE=str(workspace))
    proc = subprocess.run([sys.executable, "-c", code, str(DOCKER)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_listed_flashinfer_module_is_what_its_generator_makes(tmp_path):
    data = ck.load_modules()
    assert _generate(tmp_path) == [e["name"] for e in data["flashinfer"]]
    names = {e["name"] for e in data["flashinfer"]}
    assert {"norm", "sampling"} <= names  # every target: RMSNorm through sgl_kernel, sampling
    assert all(not n.endswith("_sm90") for n in names)  # sm_12x builds fa2, never fa3
    assert all(e["for"] and e["why"] for e in data["flashinfer"] + data["sglang_jit"])


def test_every_listed_sglang_factory_exists():
    for e in ck.load_modules()["sglang_jit"]:
        assert callable(ck.resolve(e["factory"])), e["factory"]
    assert set(ck.load_modules()["triton"]) == {"tree_verify", "ddtree"}


def test_a_recording_the_list_lacks_fails(tmp_path):
    data = ck.load_modules()
    prefill = next(e["name"] for e in data["flashinfer"] if e["name"].startswith("batch_prefill"))
    rec = tmp_path / "rec.jsonl"
    lines = [
        {"kind": "flashinfer", "name": prefill + "_sm90", "caller": "x"},  # sm_90's fa3 twin: listed
        {"kind": "flashinfer", "name": "norm"},
        {"kind": "sglang_jit", "factory": data["sglang_jit"][0]["factory"], "args": data["sglang_jit"][0]["args"]},
    ]
    rec.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert ck.compare_recorded(data, rec) == 0
    rec.write_text(rec.read_text() + json.dumps({"kind": "flashinfer", "name": "page", "caller": "memory_pool.py:1"}) + "\n")
    assert ck.compare_recorded(data, rec) == 1


_RECORDED_SCRIPT = r"""
import sys
import flashinfer.jit.core as core
from sglang.kernels.jit.utils import load_jit
import sglang.kernels.ops.attention.rope as rope

assert rope.load_jit is load_jit, "factories must see the recording load_jit"
# Not under test: FlashInfer's build and load, tvm-ffi's compile (minutes each here).
core.JitSpec.build = lambda self, verbose, need_lock=True: None
core.JitSpec.load = lambda self, path: "module"
import tvm_ffi.cpp
tvm_ffi.cpp.load_inline = lambda *a, **k: "module"

spec = core.gen_jit_spec("ddtree_recorder_probe", [])
assert spec.build_and_load() == "module"

import torch
from sglang.kernels.jit.utils.arch import override_jit_cuda_arch

def probe_factory(width, dtype, *, fast=True):
    return load_jit("probe", str(width), cuda_files=["add_constant.cuh"], cuda_wrappers=[("f", "g")])

with override_jit_cuda_arch(12, 0):
    assert probe_factory(64, torch.bfloat16, fast=False) == "module"
"""


def test_the_recorder_records_flashinfer_and_sglang_modules(tmp_path):
    rec = tmp_path / "rec.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO / "scripts" / "gpu_host" / "jit_recorder"), env.get("PYTHONPATH", "")]),
               DDTREE_JIT_RECORD=str(rec), FLASHINFER_CUDA_ARCH_LIST="12.0f",
               FLASHINFER_WORKSPACE_BASE=str(tmp_path), TVM_FFI_CACHE_DIR=str(tmp_path / "tvm"))
    proc = subprocess.run([sys.executable, "-c", _RECORDED_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x) for x in rec.read_text().splitlines()]
    assert [r["kind"] for r in records] == ["flashinfer", "sglang_jit"]
    assert records[0]["name"] == "ddtree_recorder_probe"
    assert records[1]["factory"] == "__main__:probe_factory"
    assert records[1]["args"] == [64, {"dtype": "bfloat16"}] and records[1]["kwargs"] == {"fast": False}
    assert records[1]["module"] == "probe_64"


def test_without_the_variable_nothing_is_patched(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DDTREE_JIT_RECORD")}
    env.update(PYTHONPATH=str(REPO / "scripts" / "gpu_host" / "jit_recorder"), FLASHINFER_CUDA_ARCH_LIST="12.0f",
               FLASHINFER_WORKSPACE_BASE=str(tmp_path))
    code = "import flashinfer.jit.core as c; print(c.JitSpec.build_and_load.__qualname__)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.stdout.strip() == "JitSpec.build_and_load", proc.stderr[-2000:]
