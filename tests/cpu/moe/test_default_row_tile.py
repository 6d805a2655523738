# SPDX-License-Identifier: Apache-2.0
"""The fused-MoE default config's row tile on the real patched upstream module (patch 0060)."""

import importlib
import json
import subprocess
import sys

import pytest

from sglang.srt.layers.moe.moe_runner.triton_utils import default_row_tile
from sglang.srt.runtime_context import get_context
from sglang.srt.server_args import ServerArgs
from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import (
    get_default_config,
)

# DeepSeek-V2-Lite's MoE: 64 experts, top-6, intermediate 1408, hidden 2048.
E, N, K, TOPK = 64, 1408, 2048, 6


@pytest.fixture(scope="module", autouse=True)
def published_server_args(tmp_path_factory):
    """get_default_config reads the exec namespace (deterministic mode) of the published args."""
    d = tmp_path_factory.mktemp("moe_model")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
           "num_hidden_layers": 1, "vocab_size": 128, "max_position_embeddings": 256}
    (d / "config.json").write_text(json.dumps(cfg))
    get_context().set_server_args(ServerArgs(model_path=str(d), device="cuda", skip_tokenizer_init=True))


def block_m(m, rule=None, e=E, topk=TOPK):
    if rule is None:
        return get_default_config(m, e, N, K, topk, None, False)["BLOCK_SIZE_M"]
    old = default_row_tile.TILE_RULE
    default_row_tile.TILE_RULE = rule
    try:
        return get_default_config(m, e, N, K, topk, None, False)["BLOCK_SIZE_M"]
    finally:
        default_row_tile.TILE_RULE = old


@pytest.mark.parametrize("m", [1, 16, 17, 33, 64])
def test_batches_up_to_the_expert_count_keep_upstreams_small_tile(m):
    assert block_m(m) == 16
    assert block_m(m, "upstream") == 16


@pytest.mark.parametrize("m", [65, 130, 136, 170])
def test_tree_verify_batches_above_the_expert_count_keep_the_small_tile(m):
    """B=64 at batch 1 (65), 2 (130), B=16 at batch 8 (136): at most 16 rows per expert."""
    assert default_row_tile.rows_per_expert(m, E, TOPK) <= 16
    assert block_m(m) == 16
    assert block_m(m, "upstream") == 64  # what upstream 0.5.17 runs


@pytest.mark.parametrize("m", [171, 520, 4096])
def test_batches_that_fill_the_small_tile_get_upstreams_large_tile(m):
    assert block_m(m) == block_m(m, "upstream") == 64


def test_top1_routing_switches_as_early_as_upstream_when_rows_fill_the_tile():
    # top-1 over 8 experts: 72 tokens are 9 rows per expert, 136 are 17.
    assert block_m(72, e=8, topk=1) == 16
    assert block_m(136, e=8, topk=1) == 64


def test_quantized_defaults_are_untouched():
    for rule in default_row_tile.TILE_RULES:
        default_row_tile.TILE_RULE, old = rule, default_row_tile.TILE_RULE
        try:
            cfg = get_default_config(65, E, N, K, TOPK, "fp8_w8a8", False, [128, 128])
        finally:
            default_row_tile.TILE_RULE = old
        assert cfg["BLOCK_SIZE_M"] == 64


def _rule_in_fresh_interpreter(value):
    code = (
        "from sglang.srt.layers.moe.moe_runner.triton_utils import default_row_tile as d;"
        "print(d.TILE_RULE)"
    )
    env = {"SGLANG_MOE_DEFAULT_TILE_RULE": value, "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_env_selects_upstreams_rule():
    r = _rule_in_fresh_interpreter("upstream")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "upstream"


def test_env_with_an_unknown_rule_is_refused_with_the_choices():
    r = _rule_in_fresh_interpreter("bigger")
    assert r.returncode != 0
    assert "SGLANG_MOE_DEFAULT_TILE_RULE='bigger' is not a tile rule" in r.stderr
    assert "rows_per_expert, upstream" in r.stderr


def test_the_patched_function_calls_the_overlay():
    cfg_mod = importlib.import_module(
        "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config"
    )
    assert cfg_mod.fits_small_row_tile is default_row_tile.fits_small_row_tile
