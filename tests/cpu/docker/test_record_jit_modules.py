# SPDX-License-Identifier: Apache-2.0
"""scripts/gpu_host/record_jit_modules.py (run on the GPU host): its options, and the
config-only models it serves, which upstream's own config classes must accept."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "gpu_host" / "record_jit_modules.py"
_spec = importlib.util.spec_from_file_location("ddtree_record_jit", SCRIPT)
rec = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rec)


def test_help_and_bad_configs():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--configs" in proc.stdout
    proc = subprocess.run([sys.executable, str(SCRIPT), "--configs", "mha-nospec,gqa-x"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown configs ['gqa-x']" in proc.stderr


def test_the_models_are_what_sglang_reads(tmp_path):
    from transformers import AutoConfig

    models = rec.make_models(tmp_path)
    mha, draft = models["mha"]
    cfg = AutoConfig.from_pretrained(mha)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 128)
    assert (mha / "tokenizer.json").exists() or (mha / "tokenizer_config.json").exists()
    d = json.loads((draft / "config.json").read_text())
    assert d["architectures"] == ["DFlashDraftModel"] and d["hidden_size"] == cfg.hidden_size
    assert max(d["dflash_config"]["target_layer_ids"]) < cfg.num_hidden_layers - 1
    mla_target, mla_draft = models["mla"]
    assert json.loads((mla_target / "config.json").read_text())["kv_lora_rank"] == 512
    assert (mla_draft / "config.json").exists()
