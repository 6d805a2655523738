# SPDX-License-Identifier: Apache-2.0
"""The DFlash 2 drafter built by the real (patched) SGLang 0.5.17 on a CPU machine.

``published`` publishes ``ServerArgs`` for ``--speculative-algorithm DFLASH`` with the
fixture's DFlash 2 drafter and a tiny Qwen3 target written for it (config only), as a
server's start-up does, and holds a one-rank parallel state (its TP group a stand-in of one rank); ``build_drafter`` builds
a drafter through upstream's model registry (architecture -> class, as the model
loader resolves it) inside that context.
"""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from tests.cpu.dflash2 import harness
from tests.cpu.dflash2._drafter import build_drafter

TARGET_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": harness.CONFIG["vocab_size"],
    "hidden_size": harness.CONFIG["hidden_size"],
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    from sglang.srt.layers import linear
    from sglang.srt.runtime_context import get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    target = tmp_path_factory.mktemp("dflash2_target")
    (target / "config.json").write_text(json.dumps(TARGET_CONFIG))
    sa = ServerArgs(
        model_path=str(target),
        speculative_algorithm="DFLASH",
        speculative_draft_model_path=str(harness.FIXTURES),
        device="cuda",
        skip_tokenizer_init=True,
        attention_backend="triton",
    )
    publish(sa, role="test")
    with contextlib.ExitStack() as stack:
        stack.callback(reset_context)
        stack.enter_context(get_parallel().override(tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0))
        # The linear layers ask the TP group only whether to use symmetric memory.
        stack.enter_context(mock.patch.object(linear, "get_tp_group", lambda: SimpleNamespace(world_size=1)))
        yield sa


@pytest.fixture(scope="module")
def reference():
    from safetensors.torch import load_file

    return load_file(str(harness.FIXTURES / "reference.safetensors"))


@pytest.fixture(scope="module")
def reference_inputs(reference):
    return {k[len("input."):]: v for k, v in reference.items() if k.startswith("input.")}


@pytest.fixture(scope="module")
def drafter(published):
    torch.manual_seed(0)
    return build_drafter(harness.FIXTURES)
