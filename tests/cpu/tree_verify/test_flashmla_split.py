# SPDX-License-Identifier: Apache-2.0
"""flashmla_split's page gather and chunk merge (the Triton kernels, interpreted,
against their torch references and the attention reference), its KV-chunk layout,
and what the strategy refuses. FlashMLA itself runs on the GPU host only
(tests/gpu/tree_verify)."""

import math
import os
import subprocess
import sys

import pytest
import torch

from sglang.srt.layers.attention.tree_verify import StrategyUnavailable
from sglang.srt.layers.attention.tree_verify.configs import TreeVerifyConfig
from sglang.srt.layers.attention.tree_verify.flashmla_split import (
    PAGE,
    check_supported,
    chunk_layout,
    gather_prefix_pages_ref,
    kv_chunks,
    merge_chunks_ref,
    page_starts,
    pages_for,
    sm_parts,
    staging_pages,
)
from sglang.srt.layers.attention.tree_verify.reference import tree_verify_attention_ref

from _interp import interpreted_flashmla_split, interpreted_prefix_split
from test_fused_interpreter import make_case


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
    page_start = mod.page_starts(indptr)
    table, _ = chunk_layout(page_start, indptr[1:] - indptr[:-1], 1, pages_for(max(lens)), pages)
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
    page_start = mod.page_starts(indptr)
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
def test_page_gather_and_merge_compile_for_flashmla_archs(arch):
    """Compiled (not interpreted) for the archs FlashMLA serves, in a child process
    without TRITON_INTERPRET (tests/cpu/conftest.py sets it for this one)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cap = arch.replace(".", ", ")
    code = (
        "from sglang.srt.layers.attention.tree_verify import aot\n"
        f"for k in (aot.compile_page_gather_kernel(({cap})), aot.compile_merge_chunks_kernel(({cap}))):\n"
        "    assert 'ld.global' in k.asm['ptx'] and 'st.global' in k.asm['ptx']\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-3000:]


def test_sm_parts_and_chunks():
    # H200 (132 SMs): 65 nodes x 16 heads = 1,040 rows -> 17 row tiles -> 7 parts.
    assert sm_parts(132, 65, 16) == 7
    assert sm_parts(132, 65, 128) == 1  # 130 row tiles: one part
    assert sm_parts(170, 17, 16) == 34
    assert [kv_chunks(bs, 7) for bs in (1, 2, 3, 8)] == [7, 1, 1, 1]  # a batch stays whole
    assert kv_chunks(1, 1) == 1


@pytest.mark.parametrize("chunks", [1, 3, 7])
def test_chunks_cover_each_prefix_in_order(chunks):
    """What FlashMLA reads as request ``b * chunks + c`` (its block table over the
    staging, its length) are request b's prefix keys, chunk after chunk, in order."""
    lens = [200, 0, 1, 64, 65, 63, 1000]
    kv, indptr, indices = ragged(lens)
    total = staging_pages(len(lens), sum(lens))
    max_pages = pages_for(max(lens))
    page_start = page_starts(indptr)
    staging = gather_prefix_pages_ref(kv, indptr, indices, total).view(-1, 576)
    table, chunk_len = chunk_layout(page_start, indptr[1:] - indptr[:-1], chunks, max_pages, total)
    assert table.shape == (len(lens) * chunks, -(-max_pages // chunks))
    assert table.dtype == chunk_len.dtype == torch.int32
    assert int(table.max()) < total and int(table.min()) >= 0
    for b, n in enumerate(lens):
        keys = []
        for c in range(chunks):
            r = b * chunks + c
            length = int(chunk_len[r])
            rows = torch.cat([staging[int(p) * PAGE : (int(p) + 1) * PAGE] for p in table[r]])
            keys.append(rows[:length])
            if c and length:  # whole pages in every chunk a later one follows
                assert int(chunk_len[r - 1]) % PAGE == 0
        want = kv.view(-1, 576)[indices[indptr[b] : indptr[b + 1]].long()]
        assert torch.equal(torch.cat(keys), want), (b, n)


def _chunked_prefix_pass(q, k, indptr, pidx, n, h, dv, scale, chunks):
    """What flashmla_prefix_pass returns, computed in torch: o ``[bs * chunks, N, H,
    Dv]`` and a head-major natural-log LSE view ``[bs * chunks, N, H]``; NaN and +inf
    where a chunk is empty (FlashMLA leaves such values undefined)."""
    bs = indptr.numel() - 1
    o = torch.full((bs * chunks, n, h, dv), float("nan"))
    lse = torch.full((bs * chunks, h, n), float("inf"))
    for b in range(bs):
        keys = k[pidx[indptr[b] : indptr[b + 1]].long(), 0].float()
        span = -(-(-(-keys.shape[0] // PAGE)) // chunks) * PAGE
        for c in range(chunks):
            part = keys[c * span : (c + 1) * span]
            if part.shape[0] == 0:
                continue
            s = torch.einsum("thd,pd->thp", q[b * n : (b + 1) * n].float(), part) * scale
            o[b * chunks + c] = torch.softmax(s, -1) @ part[:, :dv]
            lse[b * chunks + c] = torch.logsumexp(s, -1).transpose(0, 1)
    return o.to(q.dtype), lse.transpose(1, 2)


@pytest.mark.parametrize("prefix_lens,chunks", [([300, 0, 5], 3), ([64], 7), ([130, 70], 1)])
def test_merge_chunks_with_the_tail_is_the_whole_attention(prefix_lens, chunks):
    """The tail's partial (run alone, as beside FlashMLA) merged with the prefix's
    chunks by the merge kernel is the whole attention; what FlashMLA leaves for an
    empty chunk never reaches the output; the kernel matches its torch reference."""
    n, h, dv = 5, 3, 64
    q, k, v, indptr, pidx, tidx, mask = make_case(11, prefix_lens, n, h, 1, 80, dv, True)
    scale = 0.125
    o_ext, lse_ext = _chunked_prefix_pass(q, k, indptr, pidx, n, h, dv, scale, chunks)
    assert lse_ext.stride(1) == 1  # head-major, as FlashMLA returns it
    rows = q.shape[0] * h
    tail_o = torch.full((rows, dv), float("nan"))
    tail_lse = torch.full((rows,), float("nan"))
    cfg = TreeVerifyConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    interpreted_prefix_split().tail_partials(
        q, k, v, indptr, pidx, tidx, mask, scale, cfg, tail_o, tail_lse
    )
    assert not tail_o.isnan().any() and not tail_lse.isnan().any()  # every row written
    wide = torch.full((q.shape[0], h, dv + 16), float("nan"), dtype=q.dtype)
    out = wide[..., 8 : 8 + dv]
    got = interpreted_flashmla_split().merge_chunks(o_ext, lse_ext, tail_o, tail_lse, indptr, chunks, out)
    assert got is out
    ref = tree_verify_attention_ref(q, k, v, indptr, pidx, tidx, mask, scale).float()
    assert (out.float() - ref).abs().max().item() < 4e-3
    assert torch.isnan(wide[..., :8]).all() and torch.isnan(wide[..., 8 + dv :]).all()
    want = merge_chunks_ref(o_ext, lse_ext, tail_o, tail_lse, indptr, chunks, torch.empty_like(out))
    assert (out.float() - want.float()).abs().max().item() < 2e-3
    assert math.isfinite(want.float().abs().max().item())
