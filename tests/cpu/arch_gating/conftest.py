"""Fixtures for the arch-gating tests: tiny HF configs and a ServerArgs cell runner.

The cell runner executes ``_cells.py`` in a subprocess, once against the
patched venv and once against the pristine upstream tree, so each cell's
outcome under our series can be compared with upstream's on the same inputs.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[2]
PRISTINE_ROOT = REPO / ".cache" / "upstream" / "sglang-0.5.17"
GPU_NAME = "FAKE RTX PRO 6000 Blackwell"

_COMMON = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}

CONFIGS = {
    # Absorbed-MLA target (DeepSeek-V2 layout).
    "mla": {
        **_COMMON,
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "moe_intermediate_size": 128,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "kv_lora_rank": 64,
        "q_lora_rank": None,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 2,
        "tie_word_embeddings": False,
    },
    # Plain MHA/GQA target.
    "mha": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    # A model whose upstream override picks fa4 on every "Blackwell" (12.x too).
    "step3p5": {
        **_COMMON,
        "architectures": ["Step3p5ForCausalLM"],
        "model_type": "step3p5",
        "num_attention_heads": 4,
        "num_attention_groups": 2,
        "head_dim": 64,
        "max_seq_len": 4096,
        "moe_intermediate_size": 64,
        "moe_num_experts": 4,
        "moe_top_k": 2,
        "share_expert_dims": 64,
        "layer_types": ["full_attention", "sliding_attention"],
        "sliding_window": 512,
    },
    # DFlash drafter (an MHA model whatever the target is).
    "draft": {
        **_COMMON,
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "block_size": 16,
        "num_target_layers": 2,
        "dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": 2},
    },
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("arch_gating_models")
    dirs = {}
    for name, cfg in CONFIGS.items():
        d = root / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        dirs[name] = str(d)
    return dirs


def _launch(cells, models, tmp_path, tag, pristine):
    spec = {
        "gpu_name": GPU_NAME,
        "models": models,
        "cells": cells,
        "pristine_root": str(PRISTINE_ROOT) if pristine else None,
    }
    spec_path = tmp_path / f"{tag}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    return subprocess.Popen(
        [sys.executable, str(HERE / "_cells.py"), str(spec_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def run_cells(cells, models, tmp_path, compare_pristine=True):
    """Outcomes of ``cells`` on the patched venv (and on pristine upstream)."""
    if compare_pristine and not (PRISTINE_ROOT / "sglang").is_dir():
        pytest.fail(f"pristine upstream tree missing at {PRISTINE_ROOT}: run make setup")
    procs = {"patched": _launch(cells, models, tmp_path, "patched", False)}
    if compare_pristine:
        procs["pristine"] = _launch(cells, models, tmp_path, "pristine", True)
    results = {}
    for tag, proc in procs.items():
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{tag} cell runner failed:\n{err[-4000:]}"
        results[tag] = json.loads(out)
        assert len(results[tag]["cells"]) == len(cells)
    return results


@pytest.fixture(scope="session")
def cell_runner(model_dirs, tmp_path_factory):
    """``runner(cells, compare_pristine=True) -> {"patched": ..., "pristine": ...}``."""
    tmp = tmp_path_factory.mktemp("arch_gating_cells")
    counter = iter(range(1_000_000))

    def runner(cells, compare_pristine=True):
        d = tmp / f"run{next(counter)}"
        d.mkdir()
        return run_cells(cells, model_dirs, d, compare_pristine)

    return runner
