# SPDX-License-Identifier: Apache-2.0
"""Training loops: the target on the corpus, then the drafter on the target's own outputs.

Both loops run a warmup-stable-decay learning-rate schedule whose decay starts either at a
given step (replaying a recorded run) or when the wall clock says the remaining decay steps
just fit the phase's time (``WSD.decide``); the step where decay began is recorded, so a
run can be repeated step for step with ``--target-steps/--target-decay-start``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from . import dflash_batch
from .model import Drafter, KVCache, Target


@dataclass
class WSD:
    """Linear warmup, constant, linear decay to ``min_frac`` of the peak over the last
    ``decay_frac`` of the steps."""

    peak_lr: float
    warmup: int
    decay_frac: float = 0.25
    min_frac: float = 0.05
    total: Optional[int] = None  # known once decay has started (or given)
    decay_start: Optional[int] = None

    def lr(self, step: int) -> float:
        if step < self.warmup:
            return self.peak_lr * (step + 1) / self.warmup
        if self.decay_start is None or step < self.decay_start:
            return self.peak_lr
        n = max(1, self.total - self.decay_start)
        frac = min(1.0, (step - self.decay_start) / n)
        return self.peak_lr * (1.0 - (1.0 - self.min_frac) * frac)

    def decide(self, step: int, now: float, end: float, step_s: float) -> None:
        """Start the decay at ``step`` if the decay it implies would not end before ``end``."""
        if self.decay_start is not None or step < self.warmup:
            return
        decay_steps = math.ceil(step * self.decay_frac / (1.0 - self.decay_frac))
        if now + decay_steps * step_s >= end:
            self.decay_start, self.total = step, step + decay_steps

    def done(self, step: int) -> bool:
        return self.total is not None and step >= self.total

    @classmethod
    def for_config(cls, cfg: "TargetTrainConfig | DrafterTrainConfig") -> "WSD":
        """The phase's schedule: with ``cfg.steps`` (a replay) the decay starts at
        ``cfg.decay_start``, or at the default fraction when that is not given."""
        sched = cls(cfg.lr, cfg.warmup)
        if cfg.steps is not None:
            sched.total = cfg.steps
            sched.decay_start = (
                cfg.decay_start if cfg.decay_start is not None else int(cfg.steps * (1 - sched.decay_frac))
            )
        return sched


def _optimizer(params, lr, wd):
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    fused = all(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def _optimizer_step(opt: torch.optim.Optimizer, params: list, loss: torch.Tensor, lr: float,
                    grad_clip: float) -> None:
    """Backward ``loss`` and take one clipped step at ``lr``."""
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@dataclass
class TargetTrainConfig:
    seq_len: int = 1024
    batch: int = 96
    lr: float = 3e-3
    warmup: int = 150
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_steps: int = 100_000
    steps: Optional[int] = None  # replay: total steps ...
    decay_start: Optional[int] = None  # ... and the step where decay began
    log_every: int = 100


def lm_loss(model: Target, x: torch.Tensor) -> torch.Tensor:
    logits, _ = model(x[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def random_windows(tokens: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, tokens.numel() - length, (batch,), generator=gen, device=tokens.device)
    idx = starts.unsqueeze(1) + torch.arange(length, device=tokens.device)
    return tokens[idx].long()


def train_target(model: Target, tokens: torch.Tensor, cfg: TargetTrainConfig, seconds: float, seed: int,
                 log: Callable[[str], None] = print) -> dict:
    """Next-token training on random windows of ``tokens`` (1-D, on the model's device)."""
    dev = tokens.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    params = list(model.parameters())
    opt = _optimizer(params, cfg.lr, cfg.weight_decay)
    sched = WSD.for_config(cfg)
    t0 = time.monotonic()
    end = t0 + seconds
    step, losses, step_s = 0, [], None
    model.train()
    while step < cfg.max_steps and not sched.done(step):
        x = random_windows(tokens, cfg.batch, cfg.seq_len + 1, gen)
        with _autocast(dev):
            loss = lm_loss(model, x)
        _optimizer_step(opt, params, loss, sched.lr(step), cfg.grad_clip)
        step += 1
        if step % 10 == 0 or step == 1:
            losses.append((step, float(loss.detach())))  # a sync every 10 steps keeps the timing honest
            now = time.monotonic()
            step_s = (now - t0) / step
            if cfg.steps is None:
                sched.decide(step, now, end, step_s)
        if step % cfg.log_every == 0:
            log(f"target step {step} loss {losses[-1][1]:.3f} lr {sched.lr(step):.2e} "
                f"{cfg.batch * cfg.seq_len / step_s / 1e6:.2f} M tok/s")
    model.eval()
    wall = time.monotonic() - t0
    return {"steps": step, "decay_start": sched.decay_start, "wall_s": wall,
            "tokens": step * cfg.batch * cfg.seq_len, "tokens_per_s": step * cfg.batch * cfg.seq_len / wall,
            "final_loss": losses[-1][1] if losses else None, "loss_curve": losses[:: max(1, len(losses) // 50)]}


@torch.no_grad()
def generate(model: Target, prompts: torch.Tensor, new_tokens: int, temperature: torch.Tensor,
             gen: torch.Generator) -> torch.Tensor:
    """Continue every prompt (equal lengths) by ``new_tokens``; row i samples at
    ``temperature[i]`` (0 = greedy). Returns [N, P + new_tokens]."""
    n, p = prompts.shape
    dtype = next(model.parameters()).dtype
    cache = KVCache(model.shape, n, p + new_tokens, prompts.device, dtype)
    out = torch.empty(n, p + new_tokens, dtype=torch.long, device=prompts.device)
    out[:, :p] = prompts
    logits, _ = model(prompts, cache=cache)
    last = logits[:, -1].float()
    greedy = temperature <= 0
    inv_t = torch.where(greedy, torch.ones_like(temperature), 1.0 / temperature.clamp(min=1e-6)).unsqueeze(1)
    for i in range(new_tokens):
        probs = torch.softmax(last * inv_t, dim=-1)
        sampled = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        tok = torch.where(greedy, last.argmax(-1), sampled)
        out[:, p + i] = tok
        if i + 1 < new_tokens:
            logits, _ = model(tok.unsqueeze(1), cache=cache)
            last = logits[:, -1].float()
    return out


@dataclass
class DrafterTrainConfig:
    batch: int = 48  # sequences per step
    anchors: int = 64  # blocks per sequence
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    max_steps: int = 100_000
    steps: Optional[int] = None
    decay_start: Optional[int] = None
    log_every: int = 100
    # Share of the loss taken against the target's whole next-token distribution rather than
    # the sequence's token (dflash_batch.weighted_loss); 0 is how the reference pair trained.
    soft_labels: float = 0.0


def drafter_step_loss(drafter: Drafter, target: Target, seqs: torch.Tensor, prompt_len: int, anchors: int,
                      mask_token_id: int, gen: torch.Generator, soft_labels: float = 0.0):
    """One DFlash training forward on ``seqs`` [B, S] (target-generated after ``prompt_len``)."""
    b, s = seqs.shape
    bs = drafter.shape.block_size
    with torch.no_grad():
        out, captured = target(seqs, capture=drafter.shape.target_layer_ids, logits=soft_labels > 0)
        anchor_pos = dflash_batch.sample_anchors(b, max(1, prompt_len - 1), s - bs, anchors, gen, seqs.device)
        blocks = dflash_batch.make_blocks(seqs, anchor_pos, bs, mask_token_id, drafter.shape.loss_decay_gamma)
        soft = dflash_batch.soft_labels(out, blocks) if soft_labels > 0 else None
        embeds = target.model.embed_tokens(blocks.ids)
    ctx = drafter.context({i: h.to(embeds.dtype) for i, h in captured.items()})
    hidden = drafter(embeds, blocks.pos, ctx, torch.arange(s, device=seqs.device), blocks.mask)
    logits = F.linear(hidden, target.lm_head_weight.to(hidden.dtype))
    loss, acc = dflash_batch.weighted_loss(logits, blocks, soft, soft_labels)
    if drafter.shape.dflash2:
        loss = loss + selector_loss(drafter, hidden, logits, blocks)
    return loss, acc


def selector_loss(drafter: Drafter, hidden: torch.Tensor, logits: torch.Tensor, blocks) -> torch.Tensor:
    """DFlash 2's selector, trained with the true previous token: at every mask slot, the
    cross-entropy of the transition scores (the candidates' logits plus the pair term)
    over the slot's top-K candidates against the true token; where the true token is not
    among them it takes the K-th candidate's place, so every slot teaches the selector.
    The anchor precedes the first slot. Weighted by the block offsets' DFlash weights."""
    b, n, bs = blocks.labels.shape
    k = drafter.shape.selector_top_k
    slot_logits = logits.view(b, n, bs, -1)[:, :, 1:].detach().float()
    slot_hidden = hidden.view(b, n, bs, -1)[:, :, 1:]
    truth, previous = blocks.labels[:, :, 1:], blocks.labels[:, :, :-1]
    candidates = slot_logits.topk(k, dim=-1).indices
    present = (candidates == truth.unsqueeze(-1)).any(-1)
    candidates[..., -1] = torch.where(present, candidates[..., -1], truth)
    unary = slot_logits.gather(-1, candidates)
    scores = unary + drafter.candidate_selector.pair(previous, slot_hidden, candidates).float()
    index = (candidates == truth.unsqueeze(-1)).float().argmax(-1)
    weights = blocks.weights[:, :, 1:]
    ce = F.cross_entropy(scores.reshape(-1, k), index.reshape(-1), reduction="none")
    return (ce.view_as(weights) * weights).sum() / weights.sum().clamp(min=1e-6)


def train_drafter(drafter: Drafter, target: Target, seqs: torch.Tensor, prompt_len: int, mask_token_id: int,
                  cfg: DrafterTrainConfig, seconds: float, seed: int, log: Callable[[str], None] = print) -> dict:
    dev = seqs.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    for p in target.parameters():
        p.requires_grad_(False)
    params = list(drafter.parameters())
    opt = _optimizer(params, cfg.lr, cfg.weight_decay)
    sched = WSD.for_config(cfg)
    t0 = time.monotonic()
    end = t0 + seconds
    step, curve, acc = 0, [], None
    drafter.train()
    while step < cfg.max_steps and not sched.done(step):
        rows = torch.randint(0, seqs.shape[0], (cfg.batch,), generator=gen, device=dev)
        with _autocast(dev):
            loss, acc = drafter_step_loss(drafter, target, seqs[rows], prompt_len, cfg.anchors, mask_token_id, gen,
                                          cfg.soft_labels)
        _optimizer_step(opt, params, loss, sched.lr(step), cfg.grad_clip)
        step += 1
        if step % 10 == 0 or step == 1:
            curve.append((step, float(loss.detach())))
            now = time.monotonic()
            if cfg.steps is None:
                sched.decide(step, now, end, (now - t0) / step)
        if step % cfg.log_every == 0:
            log(f"drafter step {step} loss {curve[-1][1]:.3f} acc@1..4 "
                + " ".join(f"{a:.2f}" for a in acc[1:5].tolist()))
    drafter.eval()
    return {"steps": step, "decay_start": sched.decay_start, "wall_s": time.monotonic() - t0,
            "final_loss": curve[-1][1] if curve else None,
            "accuracy_by_offset": [round(a, 4) for a in acc.tolist()] if acc is not None else None,
            "loss_curve": curve[:: max(1, len(curve) // 50)]}
