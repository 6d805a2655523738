# SPDX-License-Identifier: Apache-2.0
"""DDTREE is registered in the real (patched) upstream spec registry and answers
every question the scheduler asks an algorithm."""

import inspect

import pytest

from sglang.srt.runtime_context import get_context
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative import spec_registry
from sglang.srt.speculative.ddtree.spec_algo import DDTreeSpecAlgo, register
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm


def test_resolves_by_name():
    algo = SpeculativeAlgorithm.from_string("DDTREE")
    assert isinstance(algo, DDTreeSpecAlgo)
    assert SpeculativeAlgorithm.from_string("ddtree") is algo
    assert algo.supports_overlap


def test_dflash_family_member_but_not_dflash():
    algo = SpeculativeAlgorithm.from_string("DDTREE")
    assert algo.is_speculative() and algo.is_some() and not algo.is_none()
    assert algo.is_dflash_family()
    assert algo.supports_target_verify_for_draft()
    assert not algo.is_dflash() and not algo.is_dspark() and not algo.is_eagle()
    assert not algo.need_topk()
    assert not algo.carries_draft_hidden_states()


def test_every_enum_method_exists():
    # from_string hands the scheduler either type; any method the enum has and
    # DDTREE lacks is an AttributeError somewhere in the server.
    algo = SpeculativeAlgorithm.from_string("DDTREE")
    enum_methods = {
        name
        for name, value in vars(SpeculativeAlgorithm).items()
        if not name.startswith("_")
        and inspect.isfunction(value)
        and name not in ("from_string", "register")
    }
    missing = sorted(m for m in enum_methods if not hasattr(algo, m))
    assert not missing, missing
    spec_registry._assert_custom_spec_algo_conforms(DDTreeSpecAlgo)


def test_register_is_idempotent_and_name_is_taken():
    register()
    assert spec_registry.get_spec("DDTREE") is SpeculativeAlgorithm.from_string("DDTREE")
    with pytest.raises(ValueError, match="already registered"):
        SpeculativeAlgorithm.register("DDTREE")(lambda server_args: None)


def test_verify_widths(model_dirs):
    sa = ServerArgs(
        model_path=model_dirs["mla"],
        speculative_algorithm="DDTREE",
        speculative_draft_model_path=model_dirs["draft"],
        speculative_ddtree_budget=24,
        device="cuda",
        skip_tokenizer_init=True,
    )
    get_context().set_server_args(sa)
    algo = SpeculativeAlgorithm.from_string("DDTREE")
    # Target: the 25-token tree. Drafter: its 16-token DFlash block.
    assert algo.get_num_tokens_per_req_for_target_verify(25, False) == 25
    assert algo.get_num_tokens_per_req_for_target_verify(25, True) == 16


def test_future_map_is_built_for_ddtree():
    import torch

    from sglang.srt.managers.overlap_utils import FutureMap

    class _Pool:
        size = 4
        req_to_token = torch.zeros((4, 8), dtype=torch.int32)

    algo = SpeculativeAlgorithm.from_string("DDTREE")
    fm = algo.create_future_map(torch.device("cpu"), _Pool(), needs_cpu_seq_lens=False)
    assert isinstance(fm, FutureMap)
    assert fm.spec_algo is algo


def test_factory_returns_the_ddtree_worker(model_dirs):
    from sglang.srt.speculative.ddtree.worker import DDTreeWorker
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    algo = SpeculativeAlgorithm.from_string("DDTREE")
    for overlap_off in (False, True):
        sa = ServerArgs(
            model_path=model_dirs["mla"],
            speculative_algorithm="DDTREE",
            speculative_draft_model_path=model_dirs["draft"],
            disable_overlap_schedule=overlap_off,
            device="cuda",
            skip_tokenizer_init=True,
        )
        worker_cls = algo.create_worker(sa)
        assert worker_cls is DDTreeWorker and issubclass(worker_cls, DFlashWorkerV2)
