# SPDX-License-Identifier: Apache-2.0
"""DDTREE on targets with sliding-window layers (gpt-oss, Gemma 3) at ServerArgs time:
with no backend flag the Triton backend is chosen (its tree-verify path counts a
tree node's window from its depth); every combination that would verify the tree
through a dense-mask path (which counts the window from the node's index) is refused
with the reason and the alternatives, before any weight loads. DFLASH chains are left
alone. The real patched ``ServerArgs`` on this CPU machine; only the GPU is faked.
"""

from __future__ import annotations

import json

import pytest

from test_ddtree_backend_choice import H200, RTX_PRO_6000, _server_args, serve

GPT_OSS = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 512,
    "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 8,
    "num_local_experts": 4, "num_experts_per_tok": 2, "experts_per_token": 2,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "attention_bias": True,
    "swiglu_limit": 7.0, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False,
}  # fmt: skip
GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 512,
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    "sliding_window": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def imported(model_dirs):
    """What ServerArgs imports lazily is imported before a GPU is faked (some modules
    probe CUDA at import time, which must see this machine's: none)."""
    _server_args(model_dirs, "mha", "DDTREE")


@pytest.fixture(scope="module")
def windowed_dirs(tmp_path_factory, model_dirs):
    root = tmp_path_factory.mktemp("windowed_models")
    dirs = dict(model_dirs)
    for name, cfg in (("gptoss", GPT_OSS), ("gemma3", GEMMA3)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
        dirs[name] = str(root / name)
    return dirs


@pytest.mark.parametrize("gpu", [H200, RTX_PRO_6000], ids=["sm90", "sm120"])
@pytest.mark.parametrize("target", ["gptoss", "gemma3"])
def test_unset_backend_is_triton(windowed_dirs, gpu, target):
    """gpt-oss's own default on sm_90 is FA3 (no tree mask); Gemma 3 would get
    FlashInfer as an MHA model: both take Triton for DDTREE."""
    sa = serve(windowed_dirs, gpu, target)
    assert sa.get_attention_backends() == ("triton", "triton")


@pytest.mark.parametrize(
    "kw,env,why,instead",
    [
        (dict(attention_backend="flashinfer"), {}, "the verify backend 'flashinfer' has no such path",
         "Use --attention-backend triton, or"),
        (dict(attention_backend="triton"), {"SGLANG_DDTREE_VERIFY_STRATEGY": "upstream_extend"},
         "SGLANG_DDTREE_VERIFY_STRATEGY=upstream_extend turns it off",
         "without SGLANG_DDTREE_VERIFY_STRATEGY=upstream_extend"),
        (dict(attention_backend="triton", enable_deterministic_inference=True), {},
         "--enable-deterministic-inference turns it off", "without --enable-deterministic-inference"),
        (dict(attention_backend="triton", kv_cache_dtype="fp8_e4m3"), {"SGLANG_DDTREE_FP8_KV_VERIFY": "0"},
         "SGLANG_DDTREE_FP8_KV_VERIFY=0 turns it off", "without SGLANG_DDTREE_FP8_KV_VERIFY=0"),
    ],
    ids=["flashinfer", "upstream-strategy", "deterministic", "fp8-kv-off"],
)  # fmt: skip
def test_dense_mask_verify_of_a_windowed_tree_is_refused(windowed_dirs, monkeypatch, kw, env, why, instead):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError) as err:
        serve(windowed_dirs, RTX_PRO_6000, "gemma3", **kw)
    message = str(err.value)
    assert "sliding-window layers (Gemma3ForCausalLM)" in message and why in message
    assert instead in message and "--speculative-algorithm DFLASH" in message


def test_windowed_chains_and_plain_models_are_left_alone(windowed_dirs, monkeypatch):
    """DFLASH verifies a chain, which the dense-mask path serves exactly; a model
    without sliding windows keeps FlashInfer for DDTREE."""
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", "upstream_extend")
    sa = serve(windowed_dirs, RTX_PRO_6000, "gemma3", algorithm="DFLASH", attention_backend="flashinfer")
    assert sa.get_attention_backends() == ("flashinfer", "flashinfer")
    monkeypatch.delenv("SGLANG_DDTREE_VERIFY_STRATEGY")
    sa = serve(windowed_dirs, RTX_PRO_6000, "mha", attention_backend="flashinfer")
    assert sa.get_attention_backends() == ("flashinfer", "flashinfer")


def test_windowed_model_detection():
    """What counts as a sliding-window target: ``layer_types`` naming sliding layers,
    or a hybrid SWA pool (not DeepSeek-V4's compressed layers)."""
    from types import SimpleNamespace

    from sglang.srt.speculative.ddtree.flags import has_sliding_window_layers

    def mc(**kw):
        text = SimpleNamespace(layer_types=kw.pop("layer_types", None))
        return SimpleNamespace(hf_text_config=text, **kw)

    assert has_sliding_window_layers(mc(layer_types=["full_attention", "sliding_attention"]))
    assert not has_sliding_window_layers(mc(layer_types=["full_attention", "linear_attention"]))
    assert has_sliding_window_layers(mc(is_hybrid_swa=True, swa_attention_layer_ids=[0, 2]))
    assert not has_sliding_window_layers(
        mc(is_hybrid_swa=True, swa_attention_layer_ids=[0], is_deepseek_v4_arch=True)
    )
    assert not has_sliding_window_layers(mc())


def test_gptoss_verify_plans_no_prefix_pass(windowed_dirs):
    """The tree-verify routes learn from the model config that every gpt-oss layer
    has sinks (so no FlashInfer/FlashMLA prefix pass is planned for its verify);
    other models, Gemma 3 included, keep the policy's choice per layer."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.attention.tree_verify.backends import every_layer_has_sinks

    assert every_layer_has_sinks(ModelConfig(model_path=windowed_dirs["gptoss"]))
    assert not every_layer_has_sinks(ModelConfig(model_path=windowed_dirs["gemma3"]))
    assert not every_layer_has_sinks(ModelConfig(model_path=windowed_dirs["mha"]))
