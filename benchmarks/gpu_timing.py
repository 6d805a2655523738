# SPDX-License-Identifier: Apache-2.0
"""Timing and ceilings shared by the GPU micro-benchmarks (median of CUDA-graph replays)."""

import torch
import triton
import triton.testing


def measure_peaks():
    """bf16 matmul rate (TFLOP/s) and D2D copy bandwidth (GB/s, read + write)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    tflops = 2 * n**3 / ms / 1e9
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=20, rep=200, return_mode="median")
    gbps = 2 * src.numel() * 2 / ms / 1e6
    del a, b, src, dst
    torch.cuda.empty_cache()
    return tflops, gbps



def bench(fn, slow=False, graph=True):
    """Median ms. With ``graph`` the call is captured once and its replays are
    timed: GPU time without Python/launch overhead, as in the server's
    CUDA-graph verify step."""
    fn()
    torch.cuda.synchronize()
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    if slow:
        return triton.testing.do_bench(fn, warmup=1, rep=30, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
