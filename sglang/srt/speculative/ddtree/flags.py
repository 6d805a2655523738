# SPDX-License-Identifier: Apache-2.0
"""Server-argument resolution for ``--speculative-algorithm DDTREE``.

DDTREE rides on the DFlash drafter: the draft checkpoint, its block size and
its target-layer capture are DFlash's, so the DFlash startup handling runs
first. What differs is the verify width. DFlash verifies its whole draft block
as a chain; DDTREE verifies a tree of ``budget`` draft nodes plus the root, so
``speculative_num_draft_tokens`` (the width every generic piece of the server
sizes verify buffers, KV headroom and CUDA graphs by) becomes ``budget + 1``
and the draft block size moves to ``speculative_dflash_block_size``.

Everything DDTREE cannot serve correctly is refused here, at startup, rather
than at the first forward.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from sglang.srt.speculative.ddtree.budget import DEFAULT_BUDGET, TreeBudget

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

DDTREE_ALGORITHM = "DDTREE"


def _verify_backend(view) -> Optional[str]:
    """The attention backend TARGET_VERIFY runs on (see HybridAttnBackend)."""
    from sglang.srt.arg_groups.overrides import attention_backends_of

    prefill, decode = attention_backends_of(view)
    if getattr(view, "speculative_attention_mode", "prefill") == "decode":
        return decode
    return prefill


def _tree_capable_default(kind: str, has_attention_sinks: bool, sliding_window: bool = False) -> str:
    """The backend DDTREE verifies with when none was asked for: upstream's generic
    default where it can verify trees (MLA: triton; MHA: flashinfer, or triton for
    models with attention sinks or sliding-window layers, or without FlashInfer
    installed)."""
    import importlib.util

    from sglang.srt.layers.attention.backend_support import MLA

    if kind == MLA or has_attention_sinks or sliding_window or importlib.util.find_spec("flashinfer") is None:
        return "triton"
    return "flashinfer"


def has_sliding_window_layers(model_config) -> bool:
    """Whether the target has sliding-window attention layers (gpt-oss, Gemma 2-4,
    MiMo-V2...): its config names them in ``layer_types``, or upstream serves it
    with a hybrid SWA KV pool (DeepSeek-V4's compressed layers excepted)."""
    text = getattr(model_config, "hf_text_config", None)
    if "sliding_attention" in (getattr(text, "layer_types", None) or ()):
        return True
    return (
        bool(getattr(model_config, "is_hybrid_swa", False))
        and bool(getattr(model_config, "swa_attention_layer_ids", None))
        and not getattr(model_config, "is_deepseek_v4_arch", False)
    )


def _choose_tree_verify_backend(server_args: ServerArgs) -> None:
    """When no flag chose the verify backend and the GPU's default cannot verify a
    token tree (FA3, upstream's default on sm_90; trtllm_mha on sm_100 MHA; any but
    Triton for a target with sliding-window layers), declare the tree-capable
    default instead and say so, as upstream declares its own defaults. A backend the user asked for is left to ``_check_verify_backend``,
    which refuses it when it cannot verify trees."""
    from sglang.srt.arg_groups.overrides import resolved_view, run_post_process_pass
    from sglang.srt.layers.attention.backend_support import MHA, MLA, _nvidia_capability
    from sglang.srt.layers.attention.tree_verify.support import (
        supports_tree_verify,
        tree_verify_backends,
    )

    view = resolved_view(server_args)
    decode_mode = getattr(view, "speculative_attention_mode", "prefill") == "decode"
    split_field = "decode_attention_backend" if decode_mode else "prefill_attention_backend"
    if server_args.attention_backend is not None or getattr(server_args, split_field) is not None:
        return  # the user's choice
    backend = _verify_backend(view)
    kind = MLA if server_args.use_mla_backend() else MHA
    cap = _nvidia_capability()
    model_config = server_args.get_model_config()
    # A sliding-window target's tree is verified by depth on Triton only.
    windowed = has_sliding_window_layers(model_config)
    if backend is None or (
        (supports_tree_verify(backend, cap, kind) if cap is not None else backend in tree_verify_backends(kind))
        and not (windowed and backend != "triton")
    ):
        return
    sinks = bool(getattr(model_config, "has_attention_sinks", False))
    choice = _tree_capable_default(kind, sinks, windowed)
    declared = {"attention_backend": choice}
    if getattr(view, split_field) is not None:  # a model override split the roles
        declared[split_field] = choice

    def ddtree_tree_verify_backend(_view) -> dict:
        return declared

    run_post_process_pass(server_args, ddtree_tree_verify_backend)
    where = "" if cap is None else f" on compute capability {cap[0]}.{cap[1]}"
    what = "a token tree of a model with sliding-window layers" if windowed else "a token tree"
    logger.info(
        "DDTREE: the default attention backend %r%s cannot verify %s; "
        "using %r for %s models instead (--attention-backend chooses another).",
        backend, where, what, choice, kind.upper(),
    )  # fmt: skip


def _check_verify_backend(server_args: ServerArgs, backend: Optional[str]) -> None:
    """The verify backend must apply the tree mask; the fork's support table
    (``layers/attention/tree_verify/support.py``) says which do, per arch and
    attention kind. FlashInfer serves MLA trees only through the fork's
    tree-verify hook, which the upstream-strategy switch turns off."""
    from sglang.srt.layers.attention.backend_support import MHA, MLA, _nvidia_capability
    from sglang.srt.layers.attention.tree_verify.support import check_tree_verify_backend

    kind = MLA if server_args.use_mla_backend() else MHA
    check_tree_verify_backend(backend, kind, _nvidia_capability())
    if backend == "flashinfer" and kind == MLA:
        from sglang.srt.layers.attention.tree_verify.policy import (
            STRATEGY_ENV,
            UPSTREAM_STRATEGY,
            forced_strategy,
        )

        if forced_strategy() == UPSTREAM_STRATEGY:
            raise ValueError(
                f"DDTREE on --attention-backend flashinfer with an MLA model needs the "
                f"tree-verify hook, which {STRATEGY_ENV}={UPSTREAM_STRATEGY} turns off "
                f"(FlashInfer's MLA kernel takes no mask). Use --attention-backend triton."
            )


def _check_sliding_window_verify(server_args: ServerArgs, backend: Optional[str]) -> None:
    """On a target with sliding-window layers a tree verify is lossless only
    through the Triton backend's tree-verify path, which counts each node's window
    from its depth in the tree (``layers/attention/tree_verify/hook.py``). The
    dense-mask verify (upstream's Triton extend kernel, FlashInfer's paged prefill
    with ``window_left``) counts it from the node's index, right for a chain only.
    Refuse every combination that would take the dense-mask path."""
    from sglang.srt.arg_groups.overrides import resolved_view

    model_config = server_args.get_model_config()
    if not has_sliding_window_layers(model_config):
        return
    from sglang.srt.layers.attention.tree_verify.hook import FP8_KV_ENV, fp8_kv_enabled
    from sglang.srt.layers.attention.tree_verify.policy import (
        STRATEGY_ENV,
        UPSTREAM_STRATEGY,
        forced_strategy,
    )

    view = resolved_view(server_args)
    why, instead = None, "--attention-backend triton"
    if backend != "triton":
        why = f"the verify backend {backend!r} has no such path"
    elif forced_strategy() == UPSTREAM_STRATEGY:
        why = f"{STRATEGY_ENV}={UPSTREAM_STRATEGY} turns it off"
        instead = f"--attention-backend triton without {STRATEGY_ENV}={UPSTREAM_STRATEGY}"
    elif getattr(view, "enable_deterministic_inference", False):
        why = "--enable-deterministic-inference turns it off"
        instead = "--attention-backend triton without --enable-deterministic-inference"
    elif str(getattr(view, "kv_cache_dtype", "auto")).startswith("fp8") and not fp8_kv_enabled():
        why = f"{FP8_KV_ENV}=0 turns it off for the fp8 KV cache"
        instead = f"--attention-backend triton without {FP8_KV_ENV}=0"
    if why is None:
        return
    arch = ", ".join(getattr(model_config.hf_config, "architectures", None) or ()) or "this model"
    raise ValueError(
        f"DDTREE on a model with sliding-window layers ({arch}) verifies its tree "
        f"losslessly only through the Triton backend's tree-verify path, which counts "
        f"each node's window from its depth in the tree; {why}. The dense-mask verify "
        f"counts the window from the node's index, which is right for a chain only. "
        f"Use {instead}, or --speculative-algorithm DFLASH."
    )


def _check_supported_combination(server_args: ServerArgs) -> None:
    from sglang.srt.arg_groups.overrides import resolved_view

    _choose_tree_verify_backend(server_args)
    view = resolved_view(server_args)

    if view.page_size not in (None, 1):
        raise ValueError(
            "DDTREE requires --page-size 1: the accepted tree nodes' KV is kept by "
            f"remapping token slots, which needs one token per page (got page_size={view.page_size})."
        )
    if server_args.speculative_adaptive:
        raise ValueError("DDTREE does not support --speculative-adaptive.")
    if server_args.speculative_draft_window_size is not None:
        raise ValueError(
            "DDTREE does not support --speculative-draft-window-size yet "
            "(the compact draft cache is not wired into the tree step)."
        )

    _check_verify_backend(server_args, _verify_backend(view))
    _check_sliding_window_verify(server_args, _verify_backend(view))


#: ServerArgs fields that only DDTREE reads, with their flags.
DDTREE_ONLY_FLAGS = (
    ("speculative_ddtree_budget", "--speculative-ddtree-budget"),
    ("speculative_ddtree_topk", "--speculative-ddtree-topk"),
    ("speculative_ddtree_tree", "--speculative-ddtree-tree"),
    ("speculative_ddtree_budget_policy", "--speculative-ddtree-budget-policy"),
    ("speculative_ddtree_graph_budgets", "--speculative-ddtree-graph-budgets"),
)

#: What ``--speculative-ddtree-tree`` grows the tree from (the first is the default).
TREE_SOURCES = ("marginals", "transitions")
#: How each step's budget is chosen (``--speculative-ddtree-budget-policy``): always the
#: configured budget, per step (``budget_policy``), or ``auto``: per step between a wide tree
#: and a narrower CUDA-graphed one where this server can run that, else fixed
#: (``_resolve_auto``).
BUDGET_POLICIES = ("fixed", "adaptive", "auto")
#: The policy when neither it nor ``--speculative-ddtree-budget`` is given; a budget given
#: alone is fixed (the override a user reaches for).
DEFAULT_BUDGET_POLICY = "auto"
#: ``auto``'s budget (unless one is given) and graph budget. On the learned pair (H100,
#: 2026-12-07, docs/benchmarks.md) B=64 adaptive with verify graphs at 16 ran 1.10-1.26x a
#: fixed B=16 at batch 1 and 8, T=0 and 1, and 0.96-1.10x a fixed B=64.
AUTO_BUDGET = 64
AUTO_GRAPH_BUDGET = 16


def check_ddtree_flags_used(server_args: ServerArgs) -> None:
    """Refuse DDTREE's flags on a server that does not run DDTREE: they would be
    ignored, and a user who passed them believes a tree is being verified."""
    algorithm = server_args.speculative_algorithm
    if algorithm is not None and str(algorithm).upper() == DDTREE_ALGORITHM:
        return
    given = [flag for field, flag in DDTREE_ONLY_FLAGS if getattr(server_args, field, None) is not None]
    if not given:
        return
    running = f"--speculative-algorithm {algorithm}" if algorithm else "no speculative decoding"
    raise ValueError(
        f"{' and '.join(given)} only apply to --speculative-algorithm {DDTREE_ALGORITHM}, "
        f"but this server runs {running}. Remove {'them' if len(given) > 1 else 'it'}, "
        f"or pass --speculative-algorithm {DDTREE_ALGORITHM}."
    )


def _choice(flag: str, value, choices) -> str:
    if value is None:
        return choices[0]
    if value not in choices:
        raise ValueError(f"{flag} must be one of {', '.join(choices)}, got {value!r}.")
    return value


def handle_ddtree_server_args(server_args: ServerArgs) -> None:
    """Validate and resolve DDTREE flags in place (ServerArgs time)."""
    requested_width = server_args.speculative_num_draft_tokens
    _check_supported_combination(server_args)
    policy = server_args.speculative_ddtree_budget_policy
    if policy is None:
        policy = DEFAULT_BUDGET_POLICY if server_args.speculative_ddtree_budget is None else "fixed"
    server_args.speculative_ddtree_budget_policy = _choice("--speculative-ddtree-budget-policy", policy,
                                                           BUDGET_POLICIES)  # fmt: skip
    _resolve_auto(server_args)
    tree = TreeBudget.resolve(
        server_args.speculative_ddtree_budget,
        server_args.speculative_ddtree_topk,
        _checkpoint_block(server_args),
        int(server_args.get_model_config().vocab_size),
        server_args.speculative_ddtree_graph_budgets,
    )
    if requested_width is not None and int(requested_width) != tree.verify_width:
        raise ValueError(
            "For DDTREE, --speculative-num-draft-tokens is the verify width "
            f"(--speculative-ddtree-budget + 1 = {tree.verify_width}), got {requested_width}. "
            "Set --speculative-ddtree-budget instead."
        )
    if tree.draft_block != tree.max_depth + 1:
        logger.info(
            "DDTREE: budget %d limits the tree depth to %d; drafting %d-token blocks.",
            tree.budget,
            tree.budget,
            tree.draft_block,
        )
    server_args.speculative_ddtree_budget = tree.budget
    server_args.speculative_ddtree_topk = tree.topk
    server_args.speculative_ddtree_tree = _choice(
        "--speculative-ddtree-tree", server_args.speculative_ddtree_tree, TREE_SOURCES
    )
    _check_budget_policy(server_args)
    server_args.speculative_ddtree_graph_budgets = ",".join(map(str, tree.graph_budgets)) or None
    _check_graph_budgets(server_args)
    server_args.speculative_dflash_block_size = tree.draft_block
    server_args.speculative_num_draft_tokens = tree.verify_width
    logger.info(
        "DDTREE: budget=%d (verify width %d), topk=%d, draft block=%d, budget policy %s.",
        tree.budget,
        tree.verify_width,
        tree.topk,
        tree.draft_block,
        server_args.speculative_ddtree_budget_policy,
    )


def _resolve_auto(server_args: ServerArgs) -> None:
    """``--speculative-ddtree-budget-policy auto`` into a concrete policy, budget and graph
    budgets: the adaptive policy over ``AUTO_BUDGET`` (or the given budget) with verify graphs
    at ``AUTO_GRAPH_BUDGET`` (or the given ones) where one process serves the model and can
    capture a second set of graphs on a target without linear-attention layers; otherwise the
    fixed policy at the given budget or ``DEFAULT_BUDGET`` (smaller budgets run eagerly, which
    costs more than it saves on a small target: docs/ddtree.md). Logged with the reason."""
    if server_args.speculative_ddtree_budget_policy != "auto":
        return
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.ddtree_environ import ddtree_envs

    limits = _parallel_flags(server_args) + _graph_budget_limits(server_args)
    if ddtree_envs.SGLANG_DDTREE_STATS_INTERVAL.get() == 0:
        limits.append("SGLANG_DDTREE_STATS_INTERVAL=0 (the adaptive policy reads the statistics)")
    if mambaish_config(server_args.get_model_config()) is not None:
        # Its verify keeps a recurrent state per tree node and running request.
        limits.append("a target with linear-attention layers")
    budget = server_args.speculative_ddtree_budget
    graphs = server_args.speculative_ddtree_graph_budgets
    if limits and graphs is not None:
        raise ValueError(
            "--speculative-ddtree-graph-budgets: with --speculative-ddtree-budget-policy auto, "
            f"{', '.join(limits)} rule out the adaptive policy with verify graphs. Remove it: auto "
            "then runs a fixed budget."
        )
    if not limits:
        budget = AUTO_BUDGET if budget is None else budget
        if graphs is None and AUTO_GRAPH_BUDGET < int(budget):
            graphs = str(AUTO_GRAPH_BUDGET)
        if graphs is None:
            limits.append(f"no graph budget below budget {budget}")
    if limits:
        server_args.speculative_ddtree_budget_policy = "fixed"
        server_args.speculative_ddtree_budget = DEFAULT_BUDGET if budget is None else budget
        logger.info(
            "DDTREE budget policy auto: fixed budget %d (%s: no adaptive policy with verify graphs).",
            server_args.speculative_ddtree_budget, ", ".join(limits),
        )  # fmt: skip
        return
    server_args.speculative_ddtree_budget_policy = "adaptive"
    server_args.speculative_ddtree_budget = budget
    server_args.speculative_ddtree_graph_budgets = graphs
    logger.info("DDTREE budget policy auto: adaptive, budget %d, verify graphs at budgets %s.", budget, graphs)


def _parallel_flags(server_args: ServerArgs) -> list:
    """The flags that make more than one process serve the model, as given."""
    from sglang.srt.arg_groups.overrides import resolved_view

    view = resolved_view(server_args)
    parallel = [f"{flag} {value}" for flag, value in (
        ("--tp-size", server_args.tp_size), ("--pp-size", server_args.pp_size), ("--dp-size", server_args.dp_size))
        if int(value or 1) > 1]  # fmt: skip
    if getattr(view, "enable_dp_attention", False):
        parallel.append("--enable-dp-attention")
    return parallel


def _check_budget_policy(server_args: ServerArgs) -> None:
    """The adaptive policy decides each step's budget from this process's clock: ranks of
    one model would decide apart and then disagree on the verify's width."""
    if server_args.speculative_ddtree_budget_policy != "adaptive":
        return
    parallel = _parallel_flags(server_args)
    if parallel:
        raise ValueError(
            "--speculative-ddtree-budget-policy adaptive chooses each step's budget from this "
            "process's own step times; with " + ", ".join(parallel) + " the ranks would choose "
            "apart. Use --speculative-ddtree-budget alone (a fixed budget)."
        )


#: Features that keep one CUDA-graph state per process, which a second graph runner's capture
#: (``verify_graphs``) would overwrite under the first runner's graphs.
_GRAPH_BUDGET_CONFLICTS = (
    ("enable_lora", "--enable-lora"),
    ("enable_two_batch_overlap", "--enable-two-batch-overlap"),
    ("enable_pdmux", "--enable-pdmux"),
)


def _check_graph_budgets(server_args: ServerArgs) -> None:
    """Graph budgets serve the adaptive policy, need the target's CUDA graphs, and capture
    a second set of them, which LoRA, two-batch overlap and PD multiplexing cannot share."""
    if server_args.speculative_ddtree_graph_budgets is None:
        return
    flag = "--speculative-ddtree-graph-budgets"
    if server_args.speculative_ddtree_budget_policy != "adaptive":
        raise ValueError(
            f"{flag} gives the adaptive budget policy smaller budgets that replay CUDA graphs; "
            "with the fixed policy every step verifies the full budget. Add "
            "--speculative-ddtree-budget-policy adaptive, or remove it."
        )
    limits = _graph_budget_limits(server_args)
    if "--disable-cuda-graph" in limits:
        raise ValueError(f"{flag} captures CUDA graphs, which --disable-cuda-graph turns off. Remove one of them.")
    given = [name for name in limits if name != "--disable-cuda-graph"]
    if given:
        raise ValueError(
            f"{flag} captures a second set of target verify graphs, whose state "
            f"{' and '.join(given)} keep{'s' if len(given) == 1 else ''} once per process. "
            f"Remove {flag} (the adaptive policy then runs smaller budgets eagerly)."
        )


def _graph_budget_limits(server_args: ServerArgs) -> list:
    """The flags, as given, that rule out a second set of target verify graphs."""
    from sglang.srt.arg_groups.overrides import resolved_view

    view = resolved_view(server_args)
    limits = []
    if getattr(view, "disable_cuda_graph", False) or getattr(server_args, "disable_cuda_graph", False):
        limits.append("--disable-cuda-graph")
    return limits + [name for field, name in _GRAPH_BUDGET_CONFLICTS if getattr(view, field, False)]


def _checkpoint_block(server_args: ServerArgs) -> int:
    """The drafter checkpoint's block, through upstream's DFlash handling (device, dp
    attention, pp and drafter checks; the drafter's attention backend). Upstream's handler
    reads and writes ``speculative_num_draft_tokens`` as DFlash's block, so it gets a view
    where that field is unset and the block comes back in it."""
    from sglang.srt.arg_groups.speculative_hook import _handle_dflash

    server_args.speculative_num_draft_tokens = None
    _handle_dflash(server_args)
    return int(server_args.speculative_num_draft_tokens)
