# SPDX-License-Identifier: Apache-2.0
"""DDTREE on hybrid linear-attention targets, the CPU-checkable parts on the
real patched upstream code: the tree switch of upstream's linear-attention
backend (patch 0054) and mamba pool (patch 0055), the commit's node choice
against a plain-Python walk, the commit call against upstream's signature,
and the startup refusals (each names the reason and the alternative)."""

from __future__ import annotations

import contextlib
import inspect
import random
from types import SimpleNamespace as NS

import pytest
import torch

from sglang.srt.layers.attention.hybrid_linear_attn_backend import (
    HybridLinearAttnBackend,
    MambaAttnBackendBase,
)
from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
from sglang.srt.layers.attention.linear.tree_verify import (
    linear_verify_topk,
    running_linear_verify_topk,
    verifies_token_tree,
)
from sglang.srt.mem_cache.memory_pool import MambaPool, conv_window_dedup_enabled
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.ddtree import linear_state
from sglang.srt.speculative.ddtree.linear_state import (
    check_tree_verify_support,
    last_accepted_nodes,
    track_nodes,
)


def _backend_topk(algorithm, eagle_topk):
    runner = NS(
        device="cpu",
        server_args=NS(
            speculative_algorithm=algorithm, speculative_eagle_topk=eagle_topk, enable_unified_memory=False
        ),
        is_draft_worker=False,
        req_to_token_pool=object(),
        token_to_kv_pool=object(),
    )
    return MambaAttnBackendBase(runner).topk


@pytest.mark.parametrize(
    "algorithm,eagle_topk,tree",
    [("DDTREE", 1, True), ("DDTREE", None, True), ("DFLASH", 1, False), (None, None, False),
     ("EAGLE", 1, False), ("EAGLE", 4, True), ("NGRAM", 8, True)],
)
def test_upstream_linear_backend_verifies_a_tree_for_ddtree(algorithm, eagle_topk, tree):
    """The real (patched) MambaAttnBackendBase: tree mode iff the verify is a tree;
    EAGLE's own topk passes through unchanged."""
    assert verifies_token_tree(algorithm, eagle_topk) is tree
    topk = _backend_topk(algorithm, eagle_topk)
    assert (topk > 1) is tree
    if algorithm != "DDTREE":
        assert topk == (eagle_topk or 0)


@contextlib.contextmanager
def _published(server_args):
    """This process's published server arguments (none: unpublished), restored after."""
    from sglang.srt.runtime_context import get_context, reset_context

    try:
        before = get_context().server_args
    except ValueError:
        before = None
    if server_args is None:
        reset_context()
    else:
        get_context().set_server_args(server_args)
    try:
        yield
    finally:
        if before is None:
            reset_context()
        else:
            get_context().set_server_args(before)


def test_mamba_pool_keeps_dense_windows_for_a_ddtree_server(model_dirs):
    """The pool asks ``running_linear_verify_topk`` (patch 0055), which reads the
    published server arguments: DDTREE gets the dense per-node layout, DFLASH
    keeps the shared chain windows."""

    def pool_dedups(algorithm):
        args = ServerArgs(
            model_path=model_dirs["mha"], speculative_algorithm=algorithm,
            speculative_draft_model_path=model_dirs["draft"], device="cuda", skip_tokenizer_init=True,
        )
        with _published(args):
            topk = running_linear_verify_topk(args.speculative_eagle_topk)
        return conv_window_dedup_enabled(False, False, topk, False)

    assert pool_dedups("DFLASH") is True
    assert pool_dedups("DDTREE") is False


@pytest.mark.parametrize("overlap", [False, True])
def test_ddtree_server_args_resolve_on_a_hybrid_target(model_dirs, overlap):
    """ServerArgs accept DDTREE on a Gated DeltaNet hybrid: verify width B + 1,
    EAGLE topk 1, and the mamba radix strategy upstream picks for the scheduler
    mode (no_buffer without overlap; extra_buffer with it, which the CPU
    machine cannot resolve: upstream asserts a CUDA device for it)."""
    kw = dict(
        model_path=model_dirs["hybrid"], speculative_algorithm="DDTREE",
        speculative_draft_model_path=model_dirs["draft"], speculative_ddtree_budget=24,
        attention_backend="triton", device="cuda", skip_tokenizer_init=True,
        disable_overlap_schedule=not overlap,
    )
    if overlap:
        with pytest.raises(AssertionError, match="extra_buffer needs CUDA"):
            ServerArgs(**kw)
        return
    args = ServerArgs(**kw)
    assert (args.speculative_num_draft_tokens, args.speculative_eagle_topk) == (25, 1)
    assert args.mamba_radix_cache_strategy == "no_buffer"
    assert linear_verify_topk(args.speculative_algorithm, args.speculative_eagle_topk) > 1


def test_running_topk_without_published_arguments():
    with _published(None):
        assert running_linear_verify_topk(3) == 3
        assert running_linear_verify_topk(None) == 0
    assert linear_verify_topk("bogus-name", 1) == 1


def _walk(accept_index, num_accepted, prefix, interval):
    """Plain-Python: the node on the accepted path whose state covers the last
    multiple of ``interval`` crossed this step, else -1."""
    last, track = [], []
    for row, k, p in zip(accept_index.tolist(), num_accepted.tolist(), prefix.tolist()):
        path = row[: k + 1]
        last.append(path[-1])
        crossed = [m for m in range(p + 1, p + k + 2) if m % interval == 0]
        # The state after m tokens is the one after position m - 1 = p + depth.
        track.append(path[crossed[-1] - 1 - p] if crossed else -1)
    return last, track


@pytest.mark.parametrize("seed", range(5))
def test_commit_nodes_match_a_walk_of_the_accepted_path(seed):
    rng = random.Random(seed)
    bs, width, n, interval = 16, 7, 17, rng.choice([1, 2, 4, 8, 16])
    accept_index = torch.full((bs, width), -1, dtype=torch.int64)
    num_accepted = torch.zeros(bs, dtype=torch.int32)
    for b in range(bs):
        k = rng.randrange(width)
        accept_index[b, : k + 1] = torch.tensor([0] + sorted(rng.sample(range(1, n), k)))
        num_accepted[b] = k
    prefix = torch.tensor([rng.randrange(1, 100) for _ in range(bs)])
    last, track = _walk(accept_index, num_accepted, prefix, interval)
    assert last_accepted_nodes(accept_index, num_accepted).tolist() == last
    assert track_nodes(accept_index, num_accepted, prefix, interval).tolist() == track
    assert any(t >= 0 for t in track) or interval > width


def test_commit_calls_upstream_with_parameters_it_takes():
    params = inspect.signature(HybridLinearAttnBackend.update_mamba_state_after_mtp_verify).parameters
    calls = []

    class Recorder:
        def update_mamba_state_after_mtp_verify(self, **kw):
            calls.append(kw)

    accept_index = torch.tensor([[0, 2, 5], [0, -1, -1]])
    num_accepted = torch.tensor([2, 0], dtype=torch.int32)
    linear_state.commit_linear_state(
        Recorder(), "model", torch.tensor([7, 3, 9]), torch.tensor([11, 12]), accept_index, num_accepted,
        torch.tensor([30, 40]), 32,
    )
    (kw,) = calls
    assert set(kw) <= set(params)
    assert kw["last_correct_step_indices"].tolist() == [5, 0]
    assert kw["mamba_steps_to_track"].tolist() == [2, -1]  # 30 + 3 tokens crosses 32 at depth 1
    assert kw["req_pool_indices"].tolist() == [7, 3]


# ----------------------------------------------------------------- refusals


def _gdn(topk=2):
    linear = object.__new__(GDNAttnBackend)
    linear.topk = topk
    hybrid = object.__new__(HybridLinearAttnBackend)
    hybrid.linear_attn_backend = linear
    return hybrid


def _pool(n=17, dense=True, ssm=True, **flags):
    layers, slots, dim, win = 2, 3, 8, 3
    if dense:
        windows = [torch.zeros(layers, slots, n, dim, win)]
    else:  # the chain layout: one shared [dim, N + W - 1] buffer, overlapping windows
        phys = torch.zeros(layers, slots, dim, n + win - 1)
        s = phys.stride()
        windows = [phys.as_strided((layers, slots, n, dim, win), (s[0], s[1], s[3], s[2], s[3]))]
    cache = MambaPool.SpeculativeState(
        conv=[torch.zeros(layers, slots, dim, win)],
        temporal=torch.zeros(layers, slots, 2, 4, 4),
        intermediate_ssm=torch.zeros(layers, slots, n, 2, 4, 4) if ssm else None,
        intermediate_conv_window=windows,
    )
    return NS(mamba_cache=cache, enable_linear_replayssm=flags.get("ring", False),
              replayssm_spec_fold=flags.get("fold", False))


def _runner(backend, pool, arch="Qwen3NextForCausalLM"):
    return NS(
        attn_backend=backend,
        req_to_token_pool=NS(mamba_pool=pool),
        model_config=NS(hf_config=NS(architectures=[arch])),
    )


def test_supported_hybrid_passes():
    check_tree_verify_support(_runner(_gdn(), _pool()), 17)
    check_tree_verify_support(_runner(_gdn(), _pool(n=65)), linear_state.MAX_HYBRID_BUDGET + 1)


def test_lazy_snapshot_strategy_is_refused(model_dirs):
    args = ServerArgs(model_path=model_dirs["mha"], device="cuda", skip_tokenizer_init=True)
    linear_state.check_radix_strategy(args)
    lazy = NS(enable_mamba_extra_buffer_lazy=lambda: True)
    with pytest.raises(ValueError, match="extra_buffer_lazy.*use --mamba-radix-cache-strategy extra_buffer"):
        linear_state.check_radix_strategy(lazy)


def test_budget_beyond_the_hybrid_limit_is_refused():
    width = linear_state.MAX_HYBRID_BUDGET + 2
    with pytest.raises(ValueError, match="budget up to 64, got 65.*DFLASH"):
        check_tree_verify_support(_runner(_gdn(), _pool(n=width)), width)


@pytest.mark.parametrize(
    "runner,match",
    [
        (_runner(object.__new__(HybridLinearAttnBackend), _pool(), "NemotronHForCausalLM"),
         "Gated DeltaNet hybrids .*NemotronHForCausalLM"),
        (_runner(_gdn(topk=1), _pool()), "chain mode.*apply_patches"),
        (_runner(_gdn(), _pool(ring=True)), "replayssm"),
        (_runner(_gdn(), _pool(fold=True)), "replayssm"),
        (_runner(_gdn(), _pool(ssm=False)), "per-node verify states"),
        (_runner(_gdn(), _pool(dense=False)), "dense conv window"),
        (_runner(_gdn(), _pool(n=9)), "dense conv window"),
    ],
)
def test_refusals_name_reason_and_alternative(runner, match):
    if not hasattr(runner.attn_backend, "linear_attn_backend"):
        runner.attn_backend.linear_attn_backend = object()  # a backend that is not GDN
    with pytest.raises(ValueError, match=match) as err:
        check_tree_verify_support(runner, 17)
    assert "--speculative-algorithm DFLASH" in str(err.value)
