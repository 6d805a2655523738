"""flashmla_split's page gather (the Triton kernel, interpreted, against its torch
reference) and what the strategy refuses. FlashMLA itself runs on the GPU host only
(tests/gpu/tree_verify)."""

import os
import subprocess
import sys

import pytest
import torch

from sglang.srt.layers.attention.tree_verify import StrategyUnavailable
from sglang.srt.layers.attention.tree_verify.flashmla_split import (
    PAGE,
    check_supported,
    gather_prefix_pages_ref,
    pages_for,
    staging_pages,
)

from _interp import interpreted_flashmla_split


def ragged(lens, pool_extra=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool = sum(lens) + pool_extra
    kv = torch.randn(pool, 1, 576, generator=gen).half()
    indptr = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    indices = torch.randperm(pool, generator=gen)[: sum(lens)].to(torch.int32)
    return kv, indptr, indices


@pytest.mark.parametrize("lens", [[200, 0, 1, 64, 65, 63], [128], [0, 0]])
def test_gather_copies_each_prefix_into_its_pages_exactly(lens):
    mod = interpreted_flashmla_split()
    kv, indptr, indices = ragged(lens)
    pages = staging_pages(len(lens), sum(lens)) + 2  # room to see nothing is written past the end
    page_start, table = mod.page_layout(indptr, pages_for(max(lens)), pages)
    sentinel = torch.full((pages, PAGE, 1, 576), 7.0).half()
    got = mod.gather_prefix_pages(kv, indptr, indices, page_start, pages_for(max(lens)), sentinel.clone())
    want = gather_prefix_pages_ref(kv, indptr, indices, pages)
    written = ~want.isnan()
    assert torch.equal(got[written], want[written])  # a copy: bit for bit, zeros after each end
    assert (got[~written] == 7.0).all()  # nothing else is touched
    # FlashMLA's block table walks each request's own pages.
    for b, n in enumerate(lens):
        first = int(page_start[b])
        assert table[b, : -(-n // PAGE)].tolist() == list(range(first, first + -(-n // PAGE)))


def test_staging_pages_hold_any_split_of_the_tokens():
    for lens in ([1] * 7, [63, 65, 1], [64, 64], [0, 0, 0], [4096, 1, 1]):
        need = sum(-(-n // PAGE) for n in lens)
        assert need <= staging_pages(len(lens), sum(lens)), lens


def test_gather_refuses_a_staging_of_the_wrong_shape():
    mod = interpreted_flashmla_split()
    kv, indptr, indices = ragged([100, 10])
    page_start, _ = mod.page_layout(indptr, 2, 4)
    with pytest.raises(ValueError, match=r"staging must be \[pages, 64, 1, 576\]"):
        mod.gather_prefix_pages(kv, indptr, indices, page_start, 2, torch.empty(4, 32, 1, 576).half())


def test_pages_for():
    assert [pages_for(p) for p in (0, 1, 64, 65, 16384)] == [1, 1, 1, 2, 256]


@pytest.mark.parametrize("q_dims,kv_dims,kv_dtype,cap,match", [
    ((8, 16, 576), (100, 1, 576), torch.float16, 30.0, "logit cap"),
    ((8, 16, 128), (100, 8, 128), torch.float16, 0.0, "absorbed MLA"),
    ((8, 16, 576), (100, 1, 576), torch.float8_e4m3fn, 0.0, "fp8 KV: use the fused strategy"),
])
def test_refusals_say_why(q_dims, kv_dims, kv_dtype, cap, match):
    q = torch.zeros(q_dims, dtype=torch.float16)
    k = torch.zeros(kv_dims).to(kv_dtype)
    v = k[..., :512] if kv_dims[-1] == 576 else k
    with pytest.raises(StrategyUnavailable, match=match):
        check_supported(q, k, v, cap)


@pytest.mark.parametrize("arch", ["9.0", "10.0"])
def test_page_gather_compiles_for_flashmla_archs(arch):
    """Compiled (not interpreted) for the archs FlashMLA serves, in a child process
    without TRITON_INTERPRET (tests/cpu/conftest.py sets it for this one)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "from sglang.srt.layers.attention.tree_verify.aot import compile_page_gather_kernel\n"
        f"k = compile_page_gather_kernel(({arch.replace('.', ', ')}))\n"
        "assert 'ld.global' in k.asm['ptx'] and 'st.global' in k.asm['ptx']\n"
        "print('ok', k.metadata.shared)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-3000:]
