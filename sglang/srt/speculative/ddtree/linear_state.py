# SPDX-License-Identifier: Apache-2.0
"""DDTREE on hybrid linear-attention targets: the recurrent state of the
Gated DeltaNet layers.

During the tree verify, upstream's kernels (switched to tree mode by patches
0054 and 0055, see ``layers/attention/linear/tree_verify.py``) leave one conv
window and one gated-delta state per tree node in the pool's intermediate
buffers, each the state after that node's root path; the request's own slot
is left as it was. After acceptance the request's state must become the one
after its last accepted node, and, when the radix cache keeps state snapshots
(``extra_buffer``), the request's current track slot gets the state at the
step that crosses a track boundary: the scheduler records that snapshot when
it sees the committed length cross one (the worker rebuilds the track slots
before the verify with upstream's ``prepare_mamba_track_for_verify``, as
EAGLE does). Both are node indices into the verify's intermediate
buffers; upstream's ``update_mamba_state_after_mtp_verify`` copies them.

Startup refuses what this cannot serve, naming the reason and the way out.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

#: The linear-attention backend class DDTREE verifies trees with.
GDN_BACKEND = "GDNAttnBackend"
#: Largest tree budget on a hybrid target. Upstream's tree-mode causal-conv
#: kernel unrolls one step per tree node, so its compile time grows faster
#: than the square of the verify width (measured in docs/ddtree.md).
MAX_HYBRID_BUDGET = 64


def last_accepted_nodes(accept_index: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """``int64 [bs]``: each request's deepest accepted node (the root when
    nothing was accepted). ``accept_index`` ``[bs, D + 1]`` holds the path's
    node indices from the root, -1 after it."""
    depth = num_accepted.to(torch.int64).view(-1, 1)
    return torch.gather(accept_index.to(torch.int64), 1, depth).view(-1)


def track_nodes(
    accept_index: torch.Tensor,
    num_accepted: torch.Tensor,
    prefix_lens: torch.Tensor,
    interval: int,
) -> torch.Tensor:
    """``int64 [bs]``: the accepted node whose state covers a multiple of
    ``interval`` tokens, for requests whose committed length crosses one this
    step; -1 for the others.

    The root sits at position ``prefix_lens`` and the node at depth ``d`` of
    the accepted path at ``prefix_lens + d``, so the state after ``point``
    tokens is the one after the node at depth ``point - prefix_lens - 1``.
    """
    pre = prefix_lens.to(torch.int64).view(-1)
    post = pre + num_accepted.to(torch.int64).view(-1) + 1
    crosses = (pre // interval) != (post // interval)
    depth = torch.clamp(post // interval * interval - pre - 1, min=0)
    depth = torch.minimum(depth, num_accepted.to(torch.int64).view(-1))
    node = torch.gather(accept_index.to(torch.int64), 1, depth.view(-1, 1)).view(-1)
    return torch.where(crosses, node, torch.full_like(node, -1))


def commit_linear_state(
    attn_backend: Any,
    model: Any,
    req_pool_indices: torch.Tensor,
    mamba_track_indices: Optional[torch.Tensor],
    accept_index: torch.Tensor,
    num_accepted: torch.Tensor,
    prefix_lens: torch.Tensor,
    track_interval: Optional[int],
) -> None:
    """Copy each request's accepted state (conv windows and gated-delta state
    of every linear layer) into its slot, and the boundary snapshots into
    the track slots. Device work only, no host sync."""
    steps_to_track = None
    if mamba_track_indices is not None:
        steps_to_track = track_nodes(accept_index, num_accepted, prefix_lens, int(track_interval))
    attn_backend.update_mamba_state_after_mtp_verify(
        last_correct_step_indices=last_accepted_nodes(accept_index, num_accepted),
        mamba_track_indices=mamba_track_indices,
        mamba_steps_to_track=steps_to_track,
        model=model,
        req_pool_indices=req_pool_indices[: accept_index.shape[0]],
    )


def check_radix_strategy(server_args: Any) -> None:
    """The lazy snapshot strategy is refused, as upstream refuses it for DFLASH."""
    if server_args.enable_mamba_extra_buffer_lazy():
        raise ValueError(
            "DDTREE on a hybrid target does not support --mamba-radix-cache-strategy "
            "extra_buffer_lazy (nor does DFLASH): use --mamba-radix-cache-strategy extra_buffer."
        )


def linear_attention_backend(attn_backend: Any) -> Optional[Any]:
    """The linear-attention half of a hybrid target's backend, or None."""
    backend = attn_backend
    for _ in range(4):
        linear = getattr(backend, "linear_attn_backend", None)
        if linear is not None:
            return linear
        # A prefill/decode split: verify runs on the one speculation uses.
        split = "decode_backend" if getattr(backend, "spec_attn_is_decode", False) else "prefill_backend"
        backend = getattr(backend, split, None)
        if backend is None:
            return None
    return None


def check_tree_verify_support(model_runner: Any, verify_width: int) -> None:
    """Refuse, at startup, a hybrid target whose linear-attention state this
    tree verify cannot keep right."""
    arch = model_runner.model_config.hf_config.architectures[0]
    dflash = "use --speculative-algorithm DFLASH for this model"
    if verify_width - 1 > MAX_HYBRID_BUDGET:
        raise ValueError(
            f"DDTREE on a hybrid linear-attention target takes --speculative-ddtree-budget up to "
            f"{MAX_HYBRID_BUDGET}, got {verify_width - 1}: the tree-mode causal-conv kernel unrolls "
            "one step per tree node and takes minutes to compile past that width. Lower the "
            f"budget, or {dflash}."
        )
    linear = linear_attention_backend(model_runner.attn_backend)
    kind = type(linear).__name__ if linear is not None else type(model_runner.attn_backend).__name__
    if linear is None or GDN_BACKEND not in {c.__name__ for c in type(linear).__mro__}:
        raise ValueError(
            f"DDTREE verifies token trees on Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5, "
            f"Qwen3.6); {arch} keeps its recurrent state in {kind}, whose tree verify is not "
            f"wired: {dflash}."
        )
    if int(getattr(linear, "topk", 0)) <= 1:
        raise ValueError(
            "DDTREE on a hybrid target needs the linear-attention backend in tree mode "
            "(patch 0054-hybrid-linear-attn-tree-verify-topk); it is in chain mode, so the "
            f"patch series is not applied to this sglang: run scripts/apply_patches.sh, or {dflash}."
        )
    pool = getattr(model_runner.req_to_token_pool, "mamba_pool", None)
    cache = getattr(pool, "mamba_cache", None)
    if getattr(pool, "enable_linear_replayssm", False) or getattr(pool, "replayssm_spec_fold", False):
        raise ValueError(
            "DDTREE cannot verify a tree with --enable-linear-replayssm / "
            "--enable-linear-replayssm-spec: their ring state replays a draft chain, not a tree. "
            f"Drop the flag for DDTREE, or {dflash}."
        )
    ssm = getattr(cache, "intermediate_ssm", None)
    windows = getattr(cache, "intermediate_conv_window", None)
    if ssm is None or not windows:
        raise ValueError(
            "DDTREE on a hybrid target needs the per-node verify states of the mamba pool, "
            f"which this server did not allocate: {dflash}."
        )
    if ssm.shape[2] < verify_width or any(
        w.shape[2] < verify_width or not w.is_contiguous() for w in windows
    ):
        raise ValueError(
            "DDTREE on a hybrid target needs one dense conv window per tree node in the mamba "
            "pool (patch 0055-mamba-pool-tree-verify-conv-window); this pool shares windows "
            "between neighbouring draft tokens, which only a chain can: run "
            f"scripts/apply_patches.sh, or {dflash}."
        )
