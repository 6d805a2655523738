# SPDX-License-Identifier: Apache-2.0
"""The target's KV pool is sized so that every pool sized by its token count fits.

Upstream's pool configurator (patched by 0071) is run on the real ``ServerArgs`` and
``KVCacheConfigurator`` of DeepSeek-V2-Lite- and Qwen3-8B-shaped targets with their
5-layer DFlash drafters; its per-token cost is checked against the bytes the real
pools allocate (upstream's pool classes, built on the CPU), and the token count it
gives from a GPU's memory against the budget that memory leaves.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.cpu.pool_sizing._pools import GIB, allocated_bytes_per_token, draft_pool, target_pool

H200_MIB = 143771  # what an H200 reports (nvidia-smi)
RTX_PRO_6000_MIB = 97887  # what an RTX PRO 6000 Blackwell reports
TOKENS = 64  # pool size for measuring what the real pools allocate per token


def measured(c, tokens=TOKENS):
    """(target, draft) bytes per token slot that the real pools allocate."""
    return (
        allocated_bytes_per_token(target_pool(c.kvc, tokens), tokens),
        allocated_bytes_per_token(draft_pool(c.server_args, c.tp, tokens), tokens),
    )


def configurator(c):
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator

    return DefaultPoolConfigurator(c.kvc)


def upstream_cell(c, target):
    """Upstream 0.5.17's DFLASH accounting: the target's cost scaled by layer count."""
    from sglang.srt.speculative.dflash_utils import scale_kv_cell_size_per_token_for_dflash

    return scale_kv_cell_size_per_token_for_dflash(
        target_cell_size_per_token=target,
        target_num_layers=c.kvc.layer_info.num_effective_layers,
        draft_num_layers=c.kvc.spec_aux_config.dflash_draft_num_layers,
    )


CASES = [
    # pair, algorithm, tp, server args
    ("v2lite-shape", "DDTREE", 1, dict(attention_backend="triton")),
    ("v2lite-shape", "DFLASH", 1, dict(attention_backend="triton")),
    ("v2lite-shape", "DDTREE", 1, dict(attention_backend="triton", kv_cache_dtype="fp8_e4m3")),
    ("v2lite-shape", "DDTREE", 2, dict(attention_backend="triton")),
    ("qwen3-8b-shape", "DDTREE", 1, dict(attention_backend="flashinfer")),
    ("qwen3-8b-shape", "DFLASH", 2, dict(attention_backend="flashinfer", kv_cache_dtype="fp8_e4m3")),
]
IDS = ["mla-ddtree", "mla-dflash", "mla-ddtree-fp8", "mla-ddtree-tp2", "gqa-ddtree", "gqa-dflash-fp8-tp2"]


@pytest.mark.parametrize("pair,algorithm,tp,kw", CASES, ids=IDS)
def test_cost_per_token_is_what_the_pools_allocate(configured, pair, algorithm, tp, kw):
    c = configured(pair, algorithm, tp=tp, **kw)
    target, draft = measured(c)
    assert configurator(c)._cell_size == target + draft


def test_mla_target_with_gqa_drafter_upstream_undercounts(configured):
    """The bug: upstream counts a drafter layer as a 576-wide MLA latent; the drafter
    stores K and V of its GQA heads: 4 KV heads of 128 here, 1.8x the count (a drafter
    with 8 KV heads, 3.6x)."""
    c = configured("v2lite-shape", "DDTREE", attention_backend="triton")
    target, draft = measured(c)
    upstream_draft = upstream_cell(c, target) - target
    assert draft * 10 >= upstream_draft * 17
    assert configurator(c)._cell_size > upstream_cell(c, target)


def test_gqa_target_with_its_own_shape_drafter_matches_upstream(configured):
    """A drafter in the target's attention shape costs what upstream's scaling says:
    there the exact count and upstream's agree to the byte."""
    c = configured("qwen3-8b-shape", "DDTREE", attention_backend="flashinfer")
    target, draft = measured(c)
    assert configurator(c)._cell_size == upstream_cell(c, target) == target + draft


def test_tensor_parallel_shards_the_drafters_heads(configured):
    """Attention TP splits the drafter's KV heads (and an MLA target not at all)."""
    one = configured("v2lite-shape", "DDTREE", tp=1, attention_backend="triton")
    t1, d1 = measured(one)
    cell1 = configurator(one)._cell_size
    two = configured("v2lite-shape", "DDTREE", tp=2, attention_backend="triton")
    t2, d2 = measured(two)
    assert (t2, d2 * 2) == (t1, d1)
    assert configurator(two)._cell_size == cell1 - d1 // 2


def test_fp8_kv_halves_both_pools(configured):
    bf16 = configured("v2lite-shape", "DDTREE", attention_backend="triton")
    cell = configurator(bf16)._cell_size
    fp8 = configured("v2lite-shape", "DDTREE", attention_backend="triton", kv_cache_dtype="fp8_e4m3")
    assert configurator(fp8)._cell_size * 2 == cell
    assert draft_pool(fp8.server_args, 1, TOKENS).store_dtype == torch.uint8  # fp8 stored as bytes


@pytest.mark.parametrize(
    "pair,algorithm,gpu_mib,free_gib,kw",
    [
        # automatic --mem-fraction-static on an H200 (the default the issue measured)
        ("v2lite-shape", "DDTREE", H200_MIB, 109.0, dict(attention_backend="triton")),
        ("v2lite-shape", "DFLASH", H200_MIB, 109.0, dict(attention_backend="triton")),
        # automatic on an RTX PRO 6000, and an explicit fraction
        ("v2lite-shape", "DDTREE", RTX_PRO_6000_MIB, 64.0, dict(attention_backend="triton")),
        ("v2lite-shape", "DDTREE", RTX_PRO_6000_MIB, 64.0,
         dict(attention_backend="triton", mem_fraction_static=0.8)),
        ("qwen3-8b-shape", "DDTREE", H200_MIB, 122.0, dict(attention_backend="flashinfer")),
        ("qwen3-8b-shape", "DFLASH", RTX_PRO_6000_MIB, 78.0,
         dict(attention_backend="flashinfer", mem_fraction_static=0.85)),
    ],
    ids=["mla-ddtree-h200-auto", "mla-dflash-h200-auto", "mla-ddtree-rtx6000-auto",
         "mla-ddtree-rtx6000-0.8", "gqa-ddtree-h200-auto", "gqa-dflash-rtx6000-0.85"],
)  # fmt: skip
def test_profiled_pool_fits_the_budget(configured, gpu_after_weights, pair, algorithm, gpu_mib, free_gib, kw):
    """Upstream's whole profiling path (``_resolve_memory_pool_config``): the token count
    it gives times what the target and draft pools allocate per token fits the budget
    the memory fraction leaves, with less than one token's bytes to spare."""
    c = configured(pair, algorithm, gpu_mib=gpu_mib, **kw)
    if "mem_fraction_static" in kw:
        assert c.server_args.mem_fraction_static == kw["mem_fraction_static"]
    else:  # upstream chose it from the GPU's capacity
        assert 0.8 < c.server_args.mem_fraction_static < 0.95
    gpu_after_weights(free_gib)
    pre_load_gib = gpu_mib / 1024 - 1.0
    budget = c.kvc._profile_available_bytes(pre_load_gib)
    # the verify sampling's workspace stays out of the KV pool (512 MiB by default)
    assert budget == int((free_gib - pre_load_gib * (1 - c.server_args.mem_fraction_static) - 0.5) * GIB)
    tokens = c.kvc._resolve_memory_pool_config(pre_load_gib).max_total_num_tokens
    target, draft = measured(c)
    used = tokens * (target + draft)
    assert used <= budget < used + target + draft
    # Upstream's count would have placed the pools past the budget.
    assert budget // upstream_cell(c, target) * (target + draft) > budget or pair == "qwen3-8b-shape"


def test_flashmla_staging_is_one_target_layer_more(configured, hopper, rule_only):
    """On an sm_90 GPU whose sgl_kernel has FlashMLA, a DDTREE tree of 64 nodes (1,040
    query rows at 16 heads) verifies through flashmla_split, whose page staging holds
    one more target KV layer per pool token: 576 latent values of the KV dtype (the
    default budget policy, auto, runs B=64 there too). Under the policy's rule a tree of
    16 (17 rows x 16 heads) keeps the fused kernel and no staging."""
    wide = configured("v2lite-shape", "DDTREE", attention_backend="triton", speculative_ddtree_budget=64)
    target, draft = measured(wide)
    assert configurator(wide)._cell_size == target + draft + 576 * 2
    default = configured("v2lite-shape", "DDTREE", attention_backend="triton")
    assert configurator(default)._cell_size == target + draft + 576 * 2
    narrow = configured("v2lite-shape", "DDTREE", attention_backend="triton", speculative_ddtree_budget=16)
    assert configurator(narrow)._cell_size == target + draft


@pytest.mark.parametrize("algorithm", [None, "EAGLE"])
def test_other_algorithms_keep_upstreams_accounting(configured, algorithm):
    from sglang.srt.model_executor import pool_token_bytes

    c = configured("v2lite-shape", None, attention_backend="triton")
    if algorithm is not None:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        c.kvc.spec_algorithm = SpeculativeAlgorithm.from_string(algorithm)
    assert pool_token_bytes.pool_token_bytes(c.kvc, 1000) is None
    assert configurator(c)._cell_size == allocated_bytes_per_token(target_pool(c.kvc, TOKENS), TOKENS)


def test_draft_worker_keeps_upstreams_accounting(configured):
    import dataclasses

    from sglang.srt.model_executor import pool_token_bytes

    c = configured("v2lite-shape", "DDTREE", attention_backend="triton")
    assert pool_token_bytes.pool_token_bytes(dataclasses.replace(c.kvc, is_draft_worker=True), 1000) is None


def test_the_cost_is_logged_once(configured, caplog, monkeypatch):
    from sglang.srt.model_executor import pool_token_bytes

    monkeypatch.setattr(pool_token_bytes, "_logged", set())  # a fresh server process
    c = configured("v2lite-shape", "DDTREE", attention_backend="triton")
    target, draft = measured(c)
    with caplog.at_level(logging.INFO, logger="sglang.srt.model_executor.pool_token_bytes"):
        configurator(c)
        configurator(c)
    lines = [r.getMessage() for r in caplog.records if "KV pool per token" in r.getMessage()]
    assert len(lines) == 1
    assert f"target KV {target:,}" in lines[0] and f"draft KV {draft:,}" in lines[0]
    assert f"= {target + draft:,} bytes per token" in lines[0]


@pytest.mark.parametrize("algorithm,workspace_mb,kept_gib", [
    (None, None, 0.0), ("DFLASH", None, 0.5), ("DDTREE", None, 0.5), ("DDTREE", 2048, 2.0),
])  # fmt: skip
def test_the_verify_sampling_workspace_is_kept_out_of_the_pool(configured, gpu_after_weights, algorithm,
                                                              workspace_mb, kept_gib):
    """The KV budget leaves the workspace the verify's per-node draws are chunked into
    (``SGLANG_DDTREE_SAMPLING_WORKSPACE_MB``) free; a server without DFLASH/DDTREE keeps it all."""
    from sglang.srt.ddtree_environ import ddtree_envs

    c = configured("qwen3-8b-shape", algorithm, gpu_mib=H200_MIB, attention_backend="flashinfer",
                   mem_fraction_static=0.85)  # fmt: skip
    gpu_after_weights(100.0)
    pre_load_gib = H200_MIB / 1024 - 1.0
    slack = pre_load_gib * (1 - 0.85)
    with ddtree_envs.SGLANG_DDTREE_SAMPLING_WORKSPACE_MB.override(workspace_mb or 512):
        assert c.kvc._profile_available_bytes(pre_load_gib) == int((100.0 - slack - kept_gib) * GIB)
