"""Image smoke test: the JIT toolchain compiles and links sm_120 code with FlashInfer's flags.

FlashInfer JIT-compiles its attention kernels on first use (nvcc from the pip CUDA packages
under $CUDA_HOME, -lcudart -lcuda). No GPU is needed to compile, so a CPU-only build host can
prove the image's toolchain works for FLASHINFER_CUDA_ARCH_LIST.
"""

import os
import pathlib
import re
import subprocess
import sys
import tempfile

SOURCE = r"""
#include <cuda_runtime.h>
#include <tvm/ffi/function.h>

__global__ void ddtree_smoke_kernel(float* x) { x[threadIdx.x] *= 2.0f; }

int ddtree_smoke_launch(int n) {
  ddtree_smoke_kernel<<<1, n>>>(nullptr);
  return static_cast<int>(cudaGetLastError());
}

TVM_FFI_DLL_EXPORT_TYPED_FUNC(ddtree_smoke, ddtree_smoke_launch);
"""


def main() -> int:
    from flashinfer.jit import env as jit_env
    from flashinfer.jit.core import gen_jit_spec

    work = pathlib.Path(tempfile.mkdtemp(prefix="ddtree-jit-"))
    src = work / "ddtree_smoke.cu"
    src.write_text(SOURCE)
    spec = gen_jit_spec("ddtree_smoke", [src])
    spec.build(verbose=False)
    lib = spec.get_library_path()
    if not lib.exists():
        print(f"FAIL: {lib} was not built", file=sys.stderr)
        return 1
    ninja = (lib.parent / "build.ninja").read_text()
    gencode = sorted(set(re.findall(r"-gencode=(\S+)", ninja)))
    want = os.environ.get("DDTREE_SMOKE_EXPECT_SM", "sm_120")
    if not any(want in g for g in gencode):
        print(f"FAIL: no {want} code generation in {gencode}", file=sys.stderr)
        return 1
    needed = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    print(f"built {lib} ({lib.stat().st_size} bytes) under {jit_env.FLASHINFER_WORKSPACE_DIR}")
    print("arch list:", os.environ.get("FLASHINFER_CUDA_ARCH_LIST"))
    print("gencode:", " ".join(gencode))
    print("\n".join(l.strip() for l in needed.splitlines() if "NEEDED" in l))
    return 0


if __name__ == "__main__":
    sys.exit(main())
