# SPDX-License-Identifier: Apache-2.0
"""Lossless acceptance of a verified DDTree.

Greedy: walk from the root while the target's argmax at the current node is one
of its children's tokens; the first unmatched argmax is the next bonus token.

Sampling (target-only): at each node draw one token from the target's
distribution (the request's temperature / top-k / top-p, penalties already in
the logits) and walk the same way. Each emitted token is therefore an exact
draw from the target's own decoding distribution. The draw at a node is an
inverse-CDF draw with that node's children's tokens ordered first, so a single
uniform ``coin`` per node decides which child (if any) is accepted, and the
bonus at the last accepted node is drawn from the target with its children's
tokens removed (``final_coin``) - the same semantics as sglang-kernel's
``tree_speculative_sampling_target_only`` with ``threshold_* = 1``.

Two implementations with one contract:

- pure torch, batched, no host sync, runs anywhere (tests, CPU, fallback);
- the sglang-kernel ops (``verify_tree_greedy`` /
  ``tree_speculative_sampling_target_only``) on CUDA when they load.

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
    """Greedy acceptance. ``target_predict`` is the target's argmax ``[bs, N]``.

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


def sample_accept(
    tree: CompiledTree,
    target_probs: torch.Tensor,
    coins: Optional[torch.Tensor] = None,
    final_coins: Optional[torch.Tensor] = None,
    *,
    generator: Optional[torch.Generator] = None,
    use_kernel: Optional[bool] = None,
) -> AcceptResult:
    """Target-only sampling acceptance.

    ``target_probs`` ``[bs, N, V]`` (or ``[bs * N, V]``) float32 is the target's
    sampling distribution at every node, after penalties, temperature, top-k
    and top-p (``target_probs_from_logits``). ``coins`` ``[bs, N]`` and
    ``final_coins`` ``[bs]`` are uniforms in (0, 1]; drawn here when omitted.
    """
    bs, n = tree.tokens.shape
    if target_probs.dim() == 2:
        target_probs = target_probs.view(bs, n, -1)
    if target_probs.shape[:2] != (bs, n):
        raise ValueError(
            f"target_probs must be [bs={bs}, N={n}, V], got {tuple(target_probs.shape)}"
        )
    device = target_probs.device
    if coins is None:
        coins = 1.0 - torch.rand((bs, n), device=device, generator=generator)
    if final_coins is None:
        final_coins = 1.0 - torch.rand((bs,), device=device, generator=generator)
    coins = _as_bn(coins, bs, n, "coins").float()
    if final_coins.shape != (bs,):
        raise ValueError(f"final_coins must be [bs={bs}], got {tuple(final_coins.shape)}")
    final_coins = final_coins.float()
    if _want_kernel(use_kernel, target_probs):
        return _sample_accept_kernel(tree, target_probs.float().contiguous(), coins, final_coins)
    return _sample_accept_torch(tree, target_probs, coins, final_coins)


def target_probs_from_logits(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: Optional[torch.Tensor] = None,
    top_ps: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-node sampling distribution in pure torch (reference / fallback).

    ``logits`` ``[bs, N, V]`` with penalties already applied; ``temperatures``,
    ``top_ks``, ``top_ps`` are per request ``[bs]`` (or ``[bs, 1]``). Top-k is
    applied first, then top-p over the renormalised top-k mass, as SGLang's
    sampler does. ``top_k <= 0`` means no top-k. The sort makes this slower
    than the sglang-kernel renorm ops at large vocabularies.
    """
    bs, n, v = logits.shape
    t = temperatures.reshape(bs, 1, 1).float()
    probs = torch.softmax(logits.float() / t, dim=-1)
    if top_ks is None and top_ps is None:
        return probs
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    rank = torch.arange(v, device=logits.device).view(1, 1, v)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_ks is not None:
        k = top_ks.reshape(bs, 1, 1).to(torch.int64)
        k = torch.where(k <= 0, v, k)
        keep &= rank < k
    sorted_p = torch.where(keep, sorted_p, 0.0)
    if top_ps is not None:
        sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep &= before < top_ps.reshape(bs, 1, 1).float()
        keep[..., 0] = True
        sorted_p = torch.where(keep, sorted_p, 0.0)
    sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


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
    return _path_from_matched(tree, matched, draws)


def _path_from_matched(
    tree: CompiledTree, matched: torch.Tensor, draws: torch.Tensor
) -> AcceptResult:
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


def _sample_accept_torch(
    tree: CompiledTree,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    final_coins: torch.Tensor,
) -> AcceptResult:
    bs, n = tree.tokens.shape
    v = target_probs.shape[-1]
    parent = tree.parent.clamp(min=0)
    has_parent = tree.parent >= 0

    # q_parent(token) for every child, then the running mass of the earlier
    # siblings (same parent, smaller index) and of itself.
    flat_rows = (parent + torch.arange(bs, device=parent.device).unsqueeze(1) * n).flatten()
    child_p = target_probs.reshape(bs * n, v)[flat_rows, tree.tokens.flatten()].view(bs, n).float()
    child_p = torch.where(has_parent, child_p, 0.0)
    idx = torch.arange(n, device=parent.device)
    same_parent = (tree.parent.unsqueeze(2) == tree.parent.unsqueeze(1)) & (
        idx.view(1, 1, n) <= idx.view(1, n, 1)
    )
    incl = torch.bmm(same_parent.float(), child_p.unsqueeze(-1)).squeeze(-1)
    excl = incl - child_p
    coin_at_parent = torch.gather(coins, 1, parent)
    matched = has_parent & (coin_at_parent > excl) & (coin_at_parent <= incl)
    matched[:, 0] = True

    # A node's draw is the token of its matched child; nodes without one get
    # a placeholder (-1) except the last accepted node, which gets the bonus.
    draws = torch.full((bs, n), -1, dtype=torch.int64, device=parent.device)
    child_rows = torch.where(matched & has_parent, parent, n)
    draws_ext = torch.cat([draws, draws[:, :1]], dim=1)
    draws_ext.scatter_(1, child_rows, torch.where(matched & has_parent, tree.tokens, -1))
    draws = draws_ext[:, :n]
    res = _path_from_matched(tree, matched, draws)

    last = torch.gather(res.accept_index, 1, res.num_accepted.to(torch.int64).unsqueeze(1))
    rows = (last.squeeze(1) + torch.arange(bs, device=parent.device) * n)
    residual = target_probs.reshape(bs * n, v)[rows].float()
    is_child = (tree.parent == last).to(torch.int32)
    hits = torch.zeros((bs, v), dtype=torch.int32, device=parent.device)
    hits.scatter_add_(1, tree.tokens, is_child)
    residual = torch.where(hits > 0, 0.0, residual)
    bonus = _inverse_cdf(residual, final_coins)

    width = res.accept_index.shape[1]
    col = torch.arange(width, device=parent.device).unsqueeze(0)
    at_bonus = col == res.num_accepted.to(torch.int64).unsqueeze(1)
    accept_tokens = torch.where(at_bonus, bonus.unsqueeze(1), res.accept_tokens)
    return AcceptResult(res.accept_index, res.num_accepted, accept_tokens, bonus)


def _inverse_cdf(weights: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """First index whose running sum exceeds ``coin * total`` (per row).

    Falls back to the last positive entry when rounding pushes the target past
    the total, like the sglang-kernel sampler.
    """
    v = weights.shape[-1]
    cdf = torch.cumsum(weights, dim=-1)
    u = (coins * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, u.contiguous(), right=True).squeeze(1)
    positive = weights > 0
    last_pos = torch.where(
        positive.any(-1),
        v - 1 - torch.flip(positive, dims=[-1]).to(torch.int8).argmax(-1),
        v - 1,
    )
    ok = idx < v
    safe = idx.clamp(max=v - 1)
    ok &= torch.gather(weights, 1, safe.unsqueeze(1)).squeeze(1) > 0
    return torch.where(ok, safe, last_pos).to(torch.int64)


# ---------------------------------------------------------------------------
# sglang-kernel path


@functools.lru_cache(maxsize=1)
def _kernel_ops():
    try:
        from sgl_kernel import tree_speculative_sampling_target_only, verify_tree_greedy
    except Exception:  # no GPU driver, no wheel, wrong arch
        return None
    return verify_tree_greedy, tree_speculative_sampling_target_only


def kernel_ops_available() -> bool:
    return _kernel_ops() is not None


def _want_kernel(use_kernel: Optional[bool], ref: torch.Tensor) -> bool:
    if use_kernel is None:
        return ref.is_cuda and kernel_ops_available()
    if use_kernel and not (ref.is_cuda and kernel_ops_available()):
        raise RuntimeError(
            "use_kernel=True needs CUDA tensors and a loadable sgl_kernel "
            "(verify_tree_greedy / tree_speculative_sampling_target_only)"
        )
    return use_kernel


def _kernel_buffers(tree: CompiledTree, fill: bool = True):
    bs, n = tree.tokens.shape
    device = tree.tokens.device
    # The ops write ``predicts`` at every accepted row and read none of it;
    # only accepted rows are read back (``_read_back``, or the commit kernel), so it needs no fill.
    predicts = torch.empty((bs * n,), dtype=torch.int32, device=device)
    if not fill:
        # verify_tree_greedy writes accept_token_num and the path's columns of
        # accept_index for every request, and the read-backs stop at the path.
        accept_index = torch.empty((bs, tree.max_depth + 1), dtype=torch.int32, device=device)
        return predicts, accept_index, torch.empty((bs,), dtype=torch.int32, device=device)
    accept_index = torch.full((bs, tree.max_depth + 1), -1, dtype=torch.int32, device=device)
    accept_num = torch.zeros((bs,), dtype=torch.int32, device=device)
    return predicts, accept_index, accept_num


def _from_kernel(tree: CompiledTree, predicts, accept_index, accept_num) -> AcceptResult:
    return _read_back(tree.tokens.shape[1], predicts, accept_index, accept_num)


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
    verify_tree_greedy, _ = _kernel_ops()
    predicts, accept_index, accept_num = _kernel_buffers(tree, fill=False)
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


def _sample_accept_kernel(
    tree: CompiledTree,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    final_coins: torch.Tensor,
) -> AcceptResult:
    _, tree_sampling = _kernel_ops()
    predicts, accept_index, accept_num = _kernel_buffers(tree)
    # The op writes rejected children's mass into draft_probs to form the
    # residual, so it must start at zero every call.
    draft_probs = torch.zeros_like(target_probs)
    tree_sampling(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_num,
        candidates=tree.tokens.contiguous(),
        retrive_index=tree.retrive_index.contiguous(),
        retrive_next_token=tree.retrive_next_token.contiguous(),
        retrive_next_sibling=tree.retrive_next_sibling.contiguous(),
        uniform_samples=coins.contiguous(),
        uniform_samples_for_final_sampling=final_coins.contiguous(),
        target_probs=target_probs,
        draft_probs=draft_probs,
        threshold_single=1.0,
        threshold_acc=1.0,
        deterministic=True,
    )
    return _from_kernel(tree, predicts, accept_index, accept_num)


def _as_bn(x: torch.Tensor, bs: int, n: int, name: str) -> torch.Tensor:
    if x.dim() == 1 and x.shape[0] == bs * n:
        x = x.view(bs, n)
    if tuple(x.shape) != (bs, n):
        raise ValueError(f"{name} must be [bs={bs}, N={n}] or [bs*N], got {tuple(x.shape)}")
    return x
