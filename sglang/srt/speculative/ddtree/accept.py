# SPDX-License-Identifier: Apache-2.0
"""Lossless acceptance of a verified DDTree.

Walk from the root while the target's token at the current node is one of its
children's tokens; the first unmatched target token is the next bonus token.
The target's token at a node is its argmax (greedy) or one draw from the
server's sampler for that node's context (``speculative/verify_sampling``): with
one independent draw per node the walk emits exactly what the target samples
alone, so a single rule serves greedy and sampled requests alike.

Two implementations with one contract:

- pure torch, batched, no host sync, runs anywhere (tests, CPU, fallback);
- sglang-kernel's ``verify_tree_greedy`` on CUDA when it loads.

Trees must have distinct tokens among siblings (``build_tree`` guarantees it:
siblings are distinct ranks of one depth's top-K).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Union

import torch

from sglang.srt.speculative.ddtree.tree_compile import CompiledTree, pack_bits


@dataclass
class AcceptResult:
    #: ``[bs, D + 1]`` int64 node indices of the accepted path in depth order,
    #: root first, ``-1`` after the path. D = ``CompiledTree.max_depth``.
    accept_index: torch.Tensor
    #: ``[bs]`` int32 accepted draft nodes (root excluded); the step commits
    #: ``num_accepted + 1`` tokens (the accepted drafts, then the bonus).
    num_accepted: torch.Tensor
    #: ``[bs, D + 1]`` int64 tokens to emit: the accepted drafts' tokens, then
    #: the new bonus at column ``num_accepted``; ``-1`` after it.
    accept_tokens: torch.Tensor
    #: ``[bs]`` int64 the new bonus token (the root of the next tree).
    next_bonus: torch.Tensor

    def flat_accept_index(self, num_tokens: int) -> torch.Tensor:
        """Accepted rows into ``[bs * N]`` flattened verify outputs (-1 padded)."""
        bs = self.accept_index.shape[0]
        off = torch.arange(bs, device=self.accept_index.device).unsqueeze(1) * num_tokens
        return torch.where(self.accept_index >= 0, self.accept_index + off, -1)


@dataclass
class KernelAccept:
    """sglang-kernel's greedy outputs as the op leaves them, not yet read back.

    ``step_io.commit_accepted`` reads them back inside its own launch (and
    returns the ``AcceptResult``); ``to_result`` is the same read-back in torch.
    """

    #: ``[bs * N]`` int32: the emitted token at every accepted row, garbage elsewhere.
    predicts: torch.Tensor
    #: ``[bs, D + 1]`` int32 flat rows ``b * N + node`` of the path in columns
    #: ``0..accept_num``; the columns after it are never read (the greedy op
    #: leaves them as they were, and its buffers are not filled).
    accept_index: torch.Tensor
    #: ``[bs]`` int32 accepted draft nodes (root excluded).
    accept_num: torch.Tensor

    def to_result(self, num_tokens: int) -> AcceptResult:
        return _read_back(num_tokens, self.predicts, self.accept_index, self.accept_num)


# ---------------------------------------------------------------------------
# public entry points


def greedy_accept(
    tree: CompiledTree,
    target_predict: torch.Tensor,
    *,
    use_kernel: Optional[bool] = None,
    read_back: bool = True,
) -> Union[AcceptResult, KernelAccept]:
    """Acceptance of the target's tokens ``target_predict`` ``[bs, N]`` (argmaxes or draws).

    ``use_kernel=None`` uses sglang-kernel's ``verify_tree_greedy`` on CUDA when
    it loads, else the torch path; ``True``/``False`` forces a path.
    ``read_back=False`` returns the kernel path's raw ``KernelAccept`` (for
    ``step_io.commit_accepted`` to read back in its launch); the torch path
    always returns an ``AcceptResult``.
    """
    bs, n = tree.tokens.shape
    target_predict = _as_bn(target_predict, bs, n, "target_predict").to(torch.int64)
    if _want_kernel(use_kernel, target_predict):
        raw = _greedy_accept_kernel(tree, target_predict)
        return raw.to_result(n) if read_back else raw
    return _accept_from_draws(tree, target_predict)


# ---------------------------------------------------------------------------
# torch path


def _accept_from_draws(tree: CompiledTree, draws: torch.Tensor) -> AcceptResult:
    """Walk given one target token per node (argmax, or a sample).

    A node is on the accepted path iff each node on its root path (itself
    included, root excluded) carries the token drawn at its parent; with
    distinct sibling tokens that set is a single path, one node per depth.
    """
    parent = tree.parent.clamp(min=0)
    drawn_at_parent = torch.gather(draws, 1, parent)
    matched = (tree.tokens == drawn_at_parent) & (tree.parent >= 0)
    matched[:, 0] = True
    bs, n = matched.shape
    width = tree.max_depth + 1
    unmatched = pack_bits(~matched)  # [bs, W]
    blocked = (tree.tree_mask & unmatched.unsqueeze(1)) != 0
    accepted = ~blocked.any(-1)  # [bs, N]

    node = torch.arange(n, device=matched.device).expand(bs, n)
    slot = torch.where(accepted, tree.depth.to(torch.int64), width)
    accept_index = torch.full((bs, width + 1), -1, dtype=torch.int64, device=matched.device)
    accept_index.scatter_(1, slot, node)
    accept_index = accept_index[:, :width]
    num_accepted = (accepted.sum(1) - 1).to(torch.int32)

    valid = accept_index >= 0
    accept_tokens = torch.where(valid, torch.gather(draws, 1, accept_index.clamp(min=0)), -1)
    last = torch.gather(accept_index, 1, num_accepted.to(torch.int64).unsqueeze(1))
    next_bonus = torch.gather(draws, 1, last).squeeze(1)
    return AcceptResult(accept_index, num_accepted, accept_tokens, next_bonus)


# ---------------------------------------------------------------------------
# sglang-kernel path


@functools.lru_cache(maxsize=1)
def _kernel_ops():
    try:
        from sgl_kernel import verify_tree_greedy
    except Exception:  # no GPU driver, no wheel, wrong arch
        return None
    return verify_tree_greedy


def kernel_ops_available() -> bool:
    return _kernel_ops() is not None


def _want_kernel(use_kernel: Optional[bool], ref: torch.Tensor) -> bool:
    if use_kernel is None:
        return ref.is_cuda and kernel_ops_available()
    if use_kernel and not (ref.is_cuda and kernel_ops_available()):
        raise RuntimeError(
            "use_kernel=True needs CUDA tensors and a loadable sgl_kernel (verify_tree_greedy)"
        )
    return use_kernel


def _kernel_buffers(tree: CompiledTree):
    bs, n = tree.tokens.shape
    device = tree.tokens.device
    # verify_tree_greedy writes ``predicts`` at every accepted row, accept_token_num
    # and the path's columns of accept_index for every request; the read-backs
    # (``_read_back``, or the commit kernel) stop at the path, so nothing is filled.
    return (
        torch.empty((bs * n,), dtype=torch.int32, device=device),
        torch.empty((bs, tree.max_depth + 1), dtype=torch.int32, device=device),
        torch.empty((bs,), dtype=torch.int32, device=device),
    )


def _read_back(n: int, predicts, accept_index, accept_num) -> AcceptResult:
    # The path's entries are columns 0..accept_num; what follows is not read.
    col = torch.arange(accept_index.shape[1], device=accept_index.device)
    valid = col.unsqueeze(0) <= accept_num.to(torch.int64).unsqueeze(1)
    flat = torch.where(valid, accept_index.to(torch.int64), 0)
    local = torch.where(valid, flat.remainder(n), -1)
    tokens = torch.where(valid, predicts[flat].to(torch.int64), -1)
    next_bonus = torch.gather(tokens, 1, accept_num.to(torch.int64).unsqueeze(1)).squeeze(1)
    return AcceptResult(local, accept_num, tokens, next_bonus)


def _greedy_accept_kernel(tree: CompiledTree, target_predict: torch.Tensor) -> KernelAccept:
    verify_tree_greedy = _kernel_ops()
    predicts, accept_index, accept_num = _kernel_buffers(tree)
    verify_tree_greedy(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_num,
        candidates=tree.tokens.contiguous(),
        retrive_index=tree.retrive_index.contiguous(),
        retrive_next_token=tree.retrive_next_token.contiguous(),
        retrive_next_sibling=tree.retrive_next_sibling.contiguous(),
        target_predict=target_predict.contiguous(),
    )
    return KernelAccept(predicts, accept_index, accept_num)


def _as_bn(x: torch.Tensor, bs: int, n: int, name: str) -> torch.Tensor:
    if x.dim() == 1 and x.shape[0] == bs * n:
        x = x.view(bs, n)
    if tuple(x.shape) != (bs, n):
        raise ValueError(f"{name} must be [bs={bs}, N={n}] or [bs*N], got {tuple(x.shape)}")
    return x
