# SPDX-License-Identifier: Apache-2.0
"""A hybrid sliding-window target's pools are sized with the DFlash draft pool counted.

Upstream's ``HybridSWAPoolConfigurator`` (patched by 0072) is run on the real
``ServerArgs`` and ``KVCacheConfigurator`` of a gpt-oss-20b-shaped target (12 full and
12 sliding layers, 8 KV heads of 64) with a 5-layer DFlash drafter in its attention
shape, as the target's model runner makes them for a hybrid SWA model; its per-token
cost is checked against the bytes upstream's real pools allocate (``SWAKVPool`` and the
drafter's ``MHATokenToKVPool``, built on the CPU), and the pool sizes it gives from a
GPU's memory against the budget that memory leaves.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest

from tests.cpu.pool_sizing._pools import GIB, allocated_bytes_per_token, draft_pool
from tests.cpu.pool_sizing.conftest import _generator

H200_MIB = 143771
RTX_PRO_6000_MIB = 97887
TOKENS = 64
PAIR = "gptoss-20b-shape"


@pytest.fixture(scope="session")
def shape_models(tmp_path_factory):
    """The config-only pairs, the gpt-oss-20b-shaped one included (for ``configured``)."""
    out = tmp_path_factory.mktemp("swa_shape_models")
    _generator().generate(out, which=("shapes", "swa-shapes"))
    return out


def hybrid(c):
    """The target's ``KVCacheConfigurator`` as its model runner makes it for a hybrid
    SWA model: the SWA pool on, and gpt-oss's window (``sliding_window - 1``)."""
    mc = c.kvc.model_config
    assert mc.is_hybrid_swa and mc.swa_attention_layer_ids == list(range(0, 24, 2))
    c.kvc = dataclasses.replace(c.kvc, is_hybrid_swa=True, sliding_window_size=mc.hf_text_config.sliding_window - 1)
    return c


def configurator(c):
    from sglang.srt.model_executor.pool_configurator import (
        HybridSWAPoolConfigurator,
        create_memory_pool_configurator,
    )

    conf = create_memory_pool_configurator(c.kvc)
    assert type(conf) is HybridSWAPoolConfigurator
    return conf


def measured(c, tokens=TOKENS):
    """(full-pool row, SWA-pool row, draft-pool row): bytes per token slot that the
    real pools allocate for this server."""
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

    sizes = c.kvc._derive_pool_sizes(
        config=MemoryPoolConfig(
            max_total_num_tokens=tokens, max_running_requests=8,
            full_max_total_num_tokens=tokens, swa_max_total_num_tokens=tokens // 2,
        )  # fmt: skip
    )
    pool = dataclasses.replace(c.kvc, device="cpu")._build_token_to_kv_pool(
        sizes=sizes, is_dsa_model=False, is_dsv4_model=False, req_to_token_pool=None
    )
    assert type(pool).__name__ == "SWAKVPool"
    full = allocated_bytes_per_token(pool.full_kv_pool, tokens)
    swa = allocated_bytes_per_token(pool.swa_kv_pool, tokens // 2)
    return full, swa, allocated_bytes_per_token(draft_pool(c.server_args, c.tp, tokens), tokens)


CASES = [
    ("DDTREE", 1, dict(attention_backend="triton")),
    ("DFLASH", 1, dict(attention_backend="triton")),
    ("DDTREE", 1, dict(attention_backend="triton", kv_cache_dtype="fp8_e4m3")),
    ("DDTREE", 2, dict(attention_backend="triton")),
]
IDS = ["ddtree", "dflash", "ddtree-fp8", "ddtree-tp2"]


@pytest.mark.parametrize("algorithm,tp,kw", CASES, ids=IDS)
def test_cost_per_token_counts_the_draft_pool(configured, algorithm, tp, kw):
    """Per token of max_total_num_tokens (the full pool's count): a full-pool row,
    ``swa_full_tokens_ratio`` SWA-pool rows and a draft-pool row."""
    c = hybrid(configured(PAIR, algorithm, tp=tp, **kw))
    full, swa, draft = measured(c)
    conf = configurator(c)
    ratio = c.server_args.swa_full_tokens_ratio
    assert conf._cell_size == pytest.approx(full + ratio * swa + draft, rel=1e-12)
    assert conf._dflash_draft_per_token == draft


@pytest.mark.parametrize("algorithm", [None, "EAGLE"])
def test_other_algorithms_keep_upstreams_accounting(configured, algorithm):
    c = hybrid(configured(PAIR, None, attention_backend="triton"))
    if algorithm is not None:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        c.kvc = dataclasses.replace(c.kvc, spec_algorithm=SpeculativeAlgorithm.from_string(algorithm))
    full, swa, _ = measured(c)
    conf = configurator(c)
    assert conf._dflash_draft_per_token == 0
    assert conf._cell_size == pytest.approx(full + c.server_args.swa_full_tokens_ratio * swa, rel=1e-12)


@pytest.mark.parametrize(
    "algorithm,gpu_mib,free_gib",
    [("DDTREE", RTX_PRO_6000_MIB, 81.0), ("DDTREE", H200_MIB, 126.0), ("DFLASH", RTX_PRO_6000_MIB, 81.0)],
    ids=["ddtree-rtx6000", "ddtree-h200", "dflash-rtx6000"],
)  # fmt: skip
def test_profiled_pools_fit_the_budget(configured, gpu_after_weights, algorithm, gpu_mib, free_gib):
    """Upstream's whole profiling path at the default memory flags (the fraction
    upstream picks for the GPU; gpt-oss-20b's weights and the drafter's take about 14
    GiB): the full, SWA and draft pools it sizes fit the budget the fraction leaves.
    Without the draft pool counted, its bytes would come out of the headroom kept for
    activations and CUDA graphs, and exceed all of it."""
    c = hybrid(configured(PAIR, algorithm, gpu_mib=gpu_mib, attention_backend="triton"))
    assert 0.8 < c.server_args.mem_fraction_static < 0.95
    gpu_after_weights(free_gib)
    pre_load_gib = gpu_mib / 1024 - 1.0
    budget = c.kvc._profile_available_bytes(pre_load_gib)
    config = c.kvc._resolve_memory_pool_config(pre_load_gib)
    full, swa, draft = measured(c)
    full_tokens, swa_tokens = config.full_max_total_num_tokens, config.swa_max_total_num_tokens
    assert config.max_total_num_tokens == full_tokens
    ratio = c.server_args.swa_full_tokens_ratio
    used = full_tokens * (full + draft) + swa_tokens * swa
    # Less than a token's bytes to spare, and the SWA pool's count rounded down.
    assert used <= budget < used + (full + ratio * swa + draft) + swa
    # Upstream's count: the same budget over the target pools alone.
    upstream_full = int(budget // (full + ratio * swa))
    overshoot = upstream_full * draft
    headroom = pre_load_gib * (1 - c.server_args.mem_fraction_static) * GIB
    assert overshoot > headroom, (overshoot / GIB, headroom / GIB)


def test_the_draft_cost_is_logged_once(configured, caplog, monkeypatch):
    from sglang.srt.model_executor import pool_token_bytes

    monkeypatch.setattr(pool_token_bytes, "_logged", set())
    c = hybrid(configured(PAIR, "DDTREE", attention_backend="triton"))
    _, _, draft = measured(c)
    with caplog.at_level(logging.INFO, logger="sglang.srt.model_executor.pool_token_bytes"):
        configurator(c)
        configurator(c)
    lines = [r.getMessage() for r in caplog.records if "hybrid SWA target" in r.getMessage()]
    assert len(lines) == 1 and f"{draft:,} bytes (5 layers x 8 KV heads x 64+64" in lines[0]
