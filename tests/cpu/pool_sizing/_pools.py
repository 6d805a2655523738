# SPDX-License-Identifier: Apache-2.0
"""What upstream's KV pool classes allocate, measured on the CPU."""

from __future__ import annotations

from typing import Any

import torch

GIB = 1 << 30


def allocated_bytes_per_token(pool: Any, tokens: int) -> int:
    """Bytes a real KV pool allocated per token slot (its buffers over ``tokens`` plus
    the padding page), exactly."""
    size = pool.get_kv_size_bytes()
    total = int(sum(size)) if isinstance(size, tuple) else int(size)
    rows = tokens + pool.page_size
    assert total % rows == 0, (total, rows)
    return total // rows


def draft_pool(server_args: Any, tp: int, tokens: int):
    """The draft worker's KV pool as upstream's ``_build_mha_kv_pool`` makes it for a
    DFlash drafter: the draft model's KV heads per attention-TP rank, its head dims and
    layers, in the KV dtype the draft worker resolves (no model quantization here)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    dmc = ModelConfig.from_server_args(
        server_args, model_path=server_args.speculative_draft_model_path, is_draft_model=True
    )
    kv_dtype = {"auto": dmc.dtype, "fp8_e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16}[
        server_args.kv_cache_dtype
    ]
    return MHATokenToKVPool(
        tokens, page_size=server_args.page_size, dtype=kv_dtype,
        head_num=dmc.get_num_kv_heads(tp), head_dim=dmc.head_dim, v_head_dim=dmc.v_head_dim,
        layer_num=dmc.num_hidden_layers, device="cpu", enable_memory_saver=False,
        enable_kv_cache_copy=False,
    )  # fmt: skip


def target_pool(kvc: Any, tokens: int):
    """The target's KV pool, built by upstream's own pool builder for ``kvc``."""
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

    sizes = kvc._derive_pool_sizes(config=MemoryPoolConfig(max_total_num_tokens=tokens, max_running_requests=8))
    pool_kvc = kvc
    if str(kvc.device) != "cpu":
        import dataclasses

        pool_kvc = dataclasses.replace(kvc, device="cpu")
    return pool_kvc._build_token_to_kv_pool(
        sizes=sizes, is_dsa_model=False, is_dsv4_model=False, req_to_token_pool=None
    )
