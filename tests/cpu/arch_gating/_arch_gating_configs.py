# SPDX-License-Identifier: Apache-2.0
"""Tiny HF model configs (no weights) for the arch-gating tests (CPU and GPU tier)."""

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
    # Upstream's Olmo 2 override picks fa3 on any sm >= 80 (12.x too) and
    # refuses flashinfer.
    "olmo2": {
        **_COMMON,
        "architectures": ["Olmo2ForCausalLM"],
        "model_type": "olmo2",
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
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
