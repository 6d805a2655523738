# SPDX-License-Identifier: Apache-2.0
"""The real patched KV-pool configurator on a CPU machine.

``configured(...)`` builds ``ServerArgs`` from the test-model generator's config-only
pairs (the shapes of DeepSeek-V2-Lite and Qwen3-8B with their 5-layer DFlash
drafters), publishes it, and makes the ``KVCacheConfigurator`` the target's model
runner makes, with upstream's own ``resolve_spec_aux_hidden_state_config``. Only
what a GPU machine would report is supplied: its memory capacity (which decides
the automatic ``--mem-fraction-static``) and the free memory after the weights
loaded (which the budget is taken from).
"""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
from dataclasses import dataclass
from typing import Any

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]


def _generator():
    spec = importlib.util.spec_from_file_location("make_test_models", REPO / "scripts" / "make_test_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def shape_models(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("shape_models")
    _generator().generate(out, which=("shapes",))
    return out


@pytest.fixture
def hopper(monkeypatch):
    """An sm_90 GPU whose sgl_kernel loads FlashMLA, the strategy variable unset."""
    from sglang.srt.layers.attention.tree_verify import flashmla_split
    from sglang.srt.utils import gpu_arch

    monkeypatch.delenv("SGLANG_DDTREE_VERIFY_STRATEGY", raising=False)
    monkeypatch.setattr(gpu_arch, "device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(flashmla_split, "_flash_mla", lambda: (None, None))


@pytest.fixture
def rule_only(monkeypatch, tmp_path):
    """A strategy table without sections: the policy's rule alone (on sm_90, FlashMLA's
    prefix pass from 1,024 query rows per request), not the shipped measurements."""
    empty = tmp_path / "strategy_table.json"
    empty.write_text('{"sections": []}')
    monkeypatch.setenv("SGLANG_DDTREE_STRATEGY_TABLE", str(empty))


@dataclass
class Configured:
    server_args: Any
    kvc: Any  # upstream's KVCacheConfigurator of the target worker
    tp: int


@pytest.fixture
def configured(shape_models, monkeypatch):
    """``configured(pair, algorithm, tp=1, gpu_mib=None, **server_args)`` inside a
    published runtime context and a parallel state of ``tp`` attention ranks."""
    from sglang.srt import server_args as server_args_module
    from sglang.srt.distributed.parallel_state_wrapper import ParallelState
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.runtime_context import get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    stack = contextlib.ExitStack()

    def make(pair, algorithm, tp=1, gpu_mib=None, **kw):
        if gpu_mib is not None:  # the GPU's capacity, which the automatic fraction reads
            monkeypatch.setattr(server_args_module, "get_device_memory_capacity", lambda device=None: gpu_mib)
        args = dict(model_path=str(shape_models / pair), device="cuda", skip_tokenizer_init=True, tp_size=tp)
        if algorithm is not None:
            args.update(speculative_algorithm=algorithm,
                        speculative_draft_model_path=str(shape_models / f"{pair}-dflash"))
        sa = ServerArgs(**args, **kw)
        publish(sa, role="test")
        stack.callback(reset_context)
        stack.enter_context(get_parallel().override(attn_tp_size=tp, tp_size=tp))
        mc = sa.get_model_config()
        algo = SpeculativeAlgorithm.from_string(sa.speculative_algorithm)
        resolved, kv_dtype = configure_kv_cache_dtype(
            server_args_kv_cache_dtype=sa.kv_cache_dtype, model=None, model_dtype=mc.dtype,
            is_draft_worker=False, is_dflash=algorithm is not None,
            speculative_draft_attention_backend=sa.speculative_draft_attention_backend,
        )  # fmt: skip
        layers = mc.num_hidden_layers
        kvc = KVCacheConfigurator(
            device="cuda", gpu_id=0, ps=ParallelState.trivial(tp_size=tp, attn_tp_size=tp), pp_group=None,
            model=None, model_config=mc, server_args=sa, kv_cache_dtype=kv_dtype,
            kv_cache_dtype_str=resolved or sa.kv_cache_dtype, model_dtype=mc.dtype, page_size=sa.page_size,
            sliding_window_size=None, spec_algorithm=algo, is_draft_worker=False, post_capture_kv_active=False,
            spec_aux_config=resolve_spec_aux_hidden_state_config(
                server_args=sa, model_config=mc, spec_algorithm=algo, is_draft_worker=False),
            is_hybrid_swa=False, is_hybrid_swa_compress=False,
            use_mla_backend=mc.attention_arch == AttentionArch.MLA,
            layer_info=ModelLayerInfo(start_layer=0, end_layer=layers, num_effective_layers=layers),
            forward_stream=None, req_to_token_pool=None, token_to_kv_pool_allocator=None,
            memory_pool_config=None,
        )  # fmt: skip
        return Configured(sa, kvc, tp)

    yield make
    stack.close()


@pytest.fixture
def gpu_after_weights(monkeypatch):
    """``gpu_after_weights(free_gib)``: the free GPU memory the profiler reads once the
    weights are loaded, on a single-process world."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache import kv_cache_configurator

    def set_free(free_gib: float):
        monkeypatch.setattr(kv_cache_configurator, "get_available_gpu_memory", lambda *a, **k: free_gib)
        monkeypatch.setattr(kv_cache_configurator, "get_world_group",
                            lambda: SimpleNamespace(world_size=1, cpu_group=None))

    return set_free
