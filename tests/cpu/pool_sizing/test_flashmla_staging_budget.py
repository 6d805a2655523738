# SPDX-License-Identifier: Apache-2.0
"""When the KV pool's per-token budget counts flashmla_split's page staging: the
decision, ``pool_token_bytes.flashmla_staging_layers``, over the server's arguments
and the GPU. The bytes it adds to the real patched pool configurator (patch 0071,
``model_executor/pool_token_bytes.py``) are tested in test_pool_token_bytes.py."""

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.model_executor import pool_token_bytes
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.utils import gpu_arch

LAYERS = 27  # DeepSeek-V2-Lite


def kvc(algorithm="DDTREE", width=65, heads=16, tp=1, backends=("triton", "triton"), **over):
    """Upstream's KVCacheConfigurator, the fields the budget reads."""
    fields = dict(
        device="cuda", gpu_id=0, is_draft_worker=False,
        spec_algorithm=SpeculativeAlgorithm.from_string(algorithm),
        model_config=SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=heads,
                                     context_len=32768),
        use_mla_backend=True, page_size=1, kv_cache_dtype=torch.bfloat16, model_dtype=torch.bfloat16,
        server_args=SimpleNamespace(get_attention_backends=lambda: backends, speculative_num_draft_tokens=width,
                                    max_total_tokens=None, dcp_size=1),
        ps=SimpleNamespace(attn_tp_size=tp, pp_size=1),
        layer_info=SimpleNamespace(num_effective_layers=LAYERS),
        spec_aux_config=SimpleNamespace(dflash_draft_num_layers=5),
        kv_cache_dtype_str="bfloat16",
    )  # fmt: skip
    fields.update(over)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize(
    "case,layers",
    [(dict(), 1),  # DDTREE B=64 at 16 heads: 1,040 query rows
     (dict(width=64), 1),  # B=63: 1,024
     (dict(width=17), 0),  # the default B=16
     (dict(tp=2), 0),  # 8 heads per rank
     (dict(algorithm="DFLASH", width=16, heads=128), 1),  # a 128-head chain
     (dict(algorithm="DFLASH", width=16), 0),
     (dict(is_draft_worker=True), 0),
     (dict(kv_cache_dtype=torch.float8_e4m3fn), 0),  # FlashMLA's dense kernel reads bf16/fp16
     (dict(page_size=64), 0),  # the hook is off
     (dict(use_mla_backend=False), 0),
     (dict(backends=("fa3", "flashmla")), 0),  # no hook on these backends
     (dict(backends=("triton", "flashmla")), 1)],
)  # fmt: skip
def test_staging_is_counted_when_the_default_takes_flashmla(hopper, rule_only, case, layers):
    assert pool_token_bytes.flashmla_staging_layers(kvc(**case)) == layers


@pytest.mark.parametrize("case", [dict(width=17), dict(algorithm="DFLASH", width=16)])
def test_the_shipped_table_counts_staging_for_the_default_tree(hopper, case):
    """The shipped sm90 section sends a 16-head verify of 16 or 17 nodes through FlashMLA at
    batch 8 (the rule kept the fused kernel below 1,024 query rows), so such a server's
    pool counts the staging too."""
    from sglang.srt.layers.attention.tree_verify.policy import VerifyShape, choose_strategy

    width = case["width"]
    assert choose_strategy((9, 0), VerifyShape(16, width, 8), {"fused", "flashinfer_split", "flashmla_split"}) \
        == "flashmla_split"
    assert pool_token_bytes.flashmla_staging_layers(kvc(**case)) == 1


def test_staging_follows_the_gpu_and_the_strategy_variable(hopper, monkeypatch):
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", "fused")
    assert pool_token_bytes.flashmla_staging_layers(kvc()) == 0
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", "flashmla_split")  # forced: any width
    assert pool_token_bytes.flashmla_staging_layers(kvc(width=17)) == 1
    monkeypatch.delenv("SGLANG_DDTREE_VERIFY_STRATEGY")
    monkeypatch.setattr(gpu_arch, "device_capability", lambda device=None: (12, 0))
    assert pool_token_bytes.flashmla_staging_layers(kvc()) == 0
    monkeypatch.setattr(gpu_arch, "device_capability", lambda device=None: (9, 0))
    assert pool_token_bytes.flashmla_staging_layers(kvc(algorithm="EAGLE")) == 0


def test_the_stand_in_reads_only_upstreams_fields():
    """What the budget reads exists on the pinned upstream's configurator, its parallel
    state and its server arguments, so the stand-in above cannot drift from them."""
    import dataclasses

    from sglang.srt.distributed.parallel_state_wrapper import ParallelState
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.server_args import ServerArgs

    k = kvc()
    assert set(vars(k)) <= {f.name for f in dataclasses.fields(KVCacheConfigurator)}
    assert set(vars(k.ps)) <= {f.name for f in dataclasses.fields(ParallelState)}
    args = set(vars(k.server_args)) - {"get_attention_backends"}
    assert args <= set(ServerArgs.__dataclass_fields__) and callable(ServerArgs.get_attention_backends)
