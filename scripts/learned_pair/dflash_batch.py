# SPDX-License-Identifier: Apache-2.0
"""DFlash training batches: random anchors, one draft block of ``block_size`` per anchor,
the attention mask that keeps the blocks apart, and the position-decayed loss weights.

Per sequence of S tokens (target-generated, with the target's hidden states at every
position), an anchor ``a`` makes the block ``[x[a], MASK x (block_size - 1)]`` at positions
``a .. a + block_size - 1``; block offset ``k`` is trained to predict ``x[a + k]`` (k >= 1).
The block sees the context features of positions ``< a`` (the target has not yet run on
``x[a]`` when the drafter drafts from it: it is the bonus token) and its own block, without
a causal mask; blocks of one sequence are invisible to each other, so many anchors train in
one forward. Offset ``k`` weighs ``exp(-(k - 1) / gamma)``: an early miss ends the accepted
run, so early offsets matter more (the DFlash paper's weighting).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Blocks:
    ids: torch.Tensor  # [B, N * bs] block token ids (anchor token, then MASK)
    pos: torch.Tensor  # [B, N * bs] positions
    labels: torch.Tensor  # [B, N, bs] x[a + k] (k = 0 is the anchor itself, weight 0)
    weights: torch.Tensor  # [B, N, bs] loss weight per block offset
    mask: torch.Tensor  # [B, 1, N * bs, S + N * bs] True = visible


def sample_anchors(n_seq: int, lo: int, hi: int, n_anchors: int, generator: torch.Generator,
                   device="cpu") -> torch.Tensor:
    """``n_anchors`` distinct positions in ``[lo, hi]`` per sequence, sorted. [n_seq, n_anchors]"""
    span = hi - lo + 1
    if lo < 1 or span < n_anchors:
        raise ValueError(f"cannot place {n_anchors} anchors in [{lo}, {hi}] (an anchor needs context before it)")
    keys = torch.rand(n_seq, span, generator=generator, device=device)
    return keys.argsort(dim=1)[:, :n_anchors].sort(dim=1).values + lo


def position_weights(block_size: int, gamma: float, device="cpu") -> torch.Tensor:
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1).clamp(min=0) / gamma)
    w[0] = 0.0  # the anchor is given, not predicted
    return w


def make_blocks(seqs: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int,
                gamma: float) -> Blocks:
    b, s = seqs.shape
    n = anchors.shape[1]
    dev = seqs.device
    offsets = torch.arange(block_size, device=dev)
    pos = anchors.unsqueeze(-1) + offsets  # [B, N, bs]
    in_range = pos < s
    labels = seqs.gather(1, pos.clamp(max=s - 1).view(b, -1)).view(b, n, block_size)
    ids = torch.full_like(labels, mask_token_id)
    ids[..., 0] = seqs.gather(1, anchors)
    weights = position_weights(block_size, gamma, dev).expand(b, n, block_size) * in_range
    return Blocks(ids=ids.view(b, -1), pos=pos.view(b, -1), labels=labels, weights=weights,
                  mask=block_mask(anchors, s, block_size))


def block_mask(anchors: torch.Tensor, s: int, block_size: int) -> torch.Tensor:
    """[B, 1, N * bs, S + N * bs]: context key j is visible to block i iff j < anchor_i; a block key
    is visible iff it belongs to the same block."""
    b, n = anchors.shape
    dev = anchors.device
    q_block = torch.arange(n * block_size, device=dev) // block_size  # [Q]
    ctx = torch.arange(s, device=dev).view(1, 1, s) < anchors.repeat_interleave(block_size, dim=1).unsqueeze(-1)
    kv_block = torch.arange(n * block_size, device=dev) // block_size
    own = (q_block.view(-1, 1) == kv_block.view(1, -1)).expand(b, -1, -1)
    return torch.cat([ctx, own], dim=-1).unsqueeze(1)


def soft_labels(target_logits: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """The target's own next-token distribution (temperature 1) for every block slot: slot
    ``a + k`` is predicted by the target at position ``a + k - 1``, whose context is the
    sequence itself. target_logits [B, S, V] -> probabilities [B, N * bs, V]."""
    s = target_logits.shape[1]
    src = (blocks.pos - 1).clamp(0, s - 1)  # out-of-range slots weigh 0
    picked = target_logits.gather(1, src.unsqueeze(-1).expand(-1, -1, target_logits.shape[-1]))
    return torch.softmax(picked.float(), dim=-1)


def weighted_loss(logits: torch.Tensor, blocks: Blocks, soft: torch.Tensor | None = None,
                  soft_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, N * bs, V] -> (weighted mean cross-entropy, top-1 accuracy per block offset [bs]).

    With ``soft`` (``soft_labels``), ``soft_weight`` of the cross-entropy is taken against the
    target's whole distribution instead of the one token the sequence holds: the same optimum
    (a sampled token is a draw from it), with far less variance, which is what a drafter that
    serves sampled requests must match."""
    b, n, bs = blocks.labels.shape
    logp = torch.log_softmax(logits.float().view(-1, logits.shape[-1]), dim=-1)
    ce = -logp.gather(-1, blocks.labels.reshape(-1, 1)).view(b, n, bs)
    if soft is not None and soft_weight > 0:
        soft_ce = -(soft.view_as(logp) * logp).sum(-1).view(b, n, bs)
        ce = (1.0 - soft_weight) * ce + soft_weight * soft_ce
    w = blocks.weights
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        hit = (logits.argmax(-1).view(b, n, bs) == blocks.labels) & (w > 0)
        acc = hit.float().sum(dim=(0, 1)) / (w > 0).float().sum(dim=(0, 1)).clamp(min=1)
    return loss, acc
