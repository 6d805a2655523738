# SPDX-License-Identifier: Apache-2.0
"""A published server context (the pytorch sampling backend, as on a host without
FlashInfer) and upstream's real sampler, the reference the verify sampler must match."""

import json
from types import SimpleNamespace

import pytest

from _upstream import VOCAB

_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("verify_sampling_model")
    (d / "config.json").write_text(json.dumps(_LLAMA))
    return str(d)


@pytest.fixture
def published(model_dir):
    """ServerArgs published for the process (sampling backend pytorch), torch.compile off
    (upstream compiles its penalty and seeded-draw helpers; the CPU tier runs them eagerly)."""
    import torch._dynamo

    from sglang.srt.runtime_context import publish, reset_context
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path=model_dir, device="cuda", skip_tokenizer_init=True, sampling_backend="pytorch")
    publish(sa, role="test")
    saved = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    try:
        yield sa
    finally:
        torch._dynamo.config.disable = saved
        reset_context()


@pytest.fixture
def deterministic(published):
    from sglang.srt.runtime_context import get_exec

    with get_exec().deterministic.override(enable_deterministic_inference=True):
        yield


@pytest.fixture
def upstream_sampler(published, monkeypatch):
    """Upstream's ``Sampler`` on a single rank (its constructor asks for the TP group)."""
    from sglang.srt.layers import sampler as sampler_mod

    monkeypatch.setattr(sampler_mod, "get_tp_group", lambda: SimpleNamespace(device_group=None))
    return sampler_mod.Sampler()


@pytest.fixture
def single_rank(monkeypatch):
    from sglang.srt.speculative.verify_sampling import verify_sampler

    monkeypatch.setattr(verify_sampler, "get_tp_group", lambda: SimpleNamespace(world_size=1))
