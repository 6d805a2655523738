# SPDX-License-Identifier: Apache-2.0
"""What the pair is, measured offline with the torch models: held-out loss and next-token
entropy of the target, the held-out prompts, and the accept length a DFLASH chain and a
DDTREE tree of each budget would reach on the target's own continuations: greedy at T=0, or
sampled as SGLang's sampler samples (temperature, then top-k and top-p jointly on the
distribution, then min-p) for a sampling setting, where the verify accepts a path exactly
when it spells the target's draws.

The offline accept length replays what the server does per step: from anchor ``a`` (the
bonus token), the drafter's per-depth distributions over ``a + 1 .. a + L``; the chain
accepts the leading depths whose argmax equals the target's greedy token, a tree of budget
B (built best-first as DDTree builds it) accepts the longest root path that spells the greedy
continuation; either way the step commits the accepted tokens plus one from the target.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from . import dflash_batch
from .model import Drafter, KVCache, Target
from .train import generate


# ---------------------------------------------------------------------------------------------
# DDTree's tree and the accepted length of one step (plain Python: small, and the reference).


@dataclass(frozen=True)
class Node:
    parent: int  # -1 = the root (the bonus token)
    depth: int  # 1-based
    rank: int  # rank of its token in its depth's distribution
    score: float  # accumulated log-prob of the path


def build_tree(logp: Sequence[Sequence[float]], budget: int) -> list[Node]:
    """Best-first tree of at most ``budget`` nodes over per-depth sorted log-probs
    (``logp[d][r]``: depth d + 1, rank r, descending in r). A popped candidate becomes a node
    and pushes its next sibling and its first child; pop order numbers the nodes. Scores add
    in float32 and ties go to the smaller depth, then parent, then rank: the server's rule
    (``sglang/srt/speculative/ddtree/tree_build.py``), so the trees are the server's."""
    depths, k = len(logp), min(len(logp[0]), budget) if logp else 0
    nodes: list[Node] = []
    if budget <= 0 or depths == 0 or k == 0:
        return nodes
    lp = [[np.float32(logp[d][r]) for r in range(k)] for d in range(depths)]
    # (-score, depth, parent + 1, rank, parent's score): parent + 1 numbers the root 0
    heap = [(-lp[0][0], 1, 0, 0, np.float32(0.0))]
    while heap and len(nodes) < budget:
        neg, d, parent1, r, base = heapq.heappop(heap)
        score = np.float32(-neg)
        nodes.append(Node(parent1 - 1, d, r, float(score)))
        if r + 1 < k:
            heapq.heappush(heap, (-np.float32(base + lp[d - 1][r + 1]), d, parent1, r + 1, base))
        if d < depths:
            heapq.heappush(heap, (-np.float32(score + lp[d][0]), d + 1, len(nodes), 0, score))
    return nodes


def tree_accept(nodes: list[Node], tokens: Sequence[Sequence[int]], truth: Sequence[int]) -> int:
    """Accepted draft tokens: walk from the root while a child's token is the next true token.
    ``tokens[d][r]`` is the token of depth d + 1, rank r; ``truth[d]`` the true token at depth d + 1."""
    children: dict[int, list[int]] = {}
    for i, n in enumerate(nodes):
        children.setdefault(n.parent, []).append(i)
    at, accepted = -1, 0
    while accepted < len(truth):
        nxt = [c for c in children.get(at, []) if tokens[nodes[c].depth - 1][nodes[c].rank] == truth[accepted]]
        if not nxt:
            break
        at, accepted = nxt[0], accepted + 1
    return accepted


def chain_accept(argmax: Sequence[int], truth: Sequence[int]) -> int:
    n = 0
    while n < min(len(argmax), len(truth)) and argmax[n] == truth[n]:
        n += 1
    return n


# ---------------------------------------------------------------------------------------------
# Torch-side measurements.


@torch.no_grad()
def heldout_stats(target: Target, tokens: torch.Tensor, windows: int, length: int, seed: int) -> dict:
    """Cross-entropy and next-token entropy of the target on held-out windows."""
    gen = torch.Generator(device=tokens.device).manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - length - 1, (windows,), generator=gen, device=tokens.device)
    x = tokens[starts.unsqueeze(1) + torch.arange(length + 1, device=tokens.device)].long()
    ce, ent = [], []
    for i in range(0, windows, 8):
        logits, _ = target(x[i : i + 8, :-1])
        logp = torch.log_softmax(logits.float(), dim=-1)
        ce.append(-logp.gather(-1, x[i : i + 8, 1:].unsqueeze(-1)).squeeze(-1).flatten())
        ent.append(-(logp.exp() * logp).sum(-1).flatten())
    ce, ent = torch.cat(ce), torch.cat(ent)
    q = torch.quantile(ent, torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9], device=ent.device)).tolist()
    return {
        "tokens": int(ce.numel()),
        "loss": float(ce.mean()),
        "perplexity": float(math.exp(ce.mean())),
        "entropy_mean": float(ent.mean()),
        "entropy_quantiles": dict(zip(["p10", "p25", "p50", "p75", "p90"], [round(v, 4) for v in q])),
        "frac_entropy_below_0.1": float((ent < 0.1).float().mean()),
        "frac_entropy_above_2": float((ent > 2.0).float().mean()),
    }


def pick_prompts(tok, docs: Sequence, n: int, prompt_len: int, min_tail: int) -> list[dict]:
    """One prompt per held-out document (documents in an order hashed from their names, so the
    prompts span packages): ``prompt_len`` tokens ending at a line break, with at least
    ``min_tail`` tokens of the document after it."""
    from .corpus import unit_hash

    out = []
    line_end = {i for i in range(tok.get_vocab_size()) if tok.decode([i]).endswith("\n")}
    for d in sorted(docs, key=lambda d: (unit_hash("prompt", d.name), d.name)):
        ids = tok.encode(d.text, add_special_tokens=False).ids
        if len(ids) < prompt_len + min_tail:
            continue
        want = prompt_len + (int(d.sha256[:8], 16) % (len(ids) - prompt_len - min_tail + 1))
        cuts = [c for c in range(prompt_len, len(ids) - min_tail + 1) if ids[c - 1] in line_end]
        if not cuts:
            continue
        c = min(cuts, key=lambda c: (abs(c - want), c))
        prompt_ids = ids[c - prompt_len : c]
        out.append({"source": d.name, "prompt": tok.decode(prompt_ids), "prompt_ids": prompt_ids})
        if len(out) == n:
            break
    return out


def _greedy(target: Target, prompts: list[list[int]], new_tokens: int, seed: int) -> list[torch.Tensor]:
    """Greedy continuations, prompts of one length in one batch."""
    dev = next(target.parameters()).device
    out: dict[int, torch.Tensor] = {}
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for idx in by_len.values():
        p = torch.tensor([prompts[i] for i in idx], device=dev)
        seqs = generate(target, p, new_tokens, torch.zeros(len(idx), device=dev),
                        torch.Generator(device=dev).manual_seed(seed))
        out.update(zip(idx, seqs))
    return [out[i] for i in range(len(prompts))]


@dataclass(frozen=True)
class Sampling:
    """A request's sampling setting; temperature 0 is greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0
    min_p: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> "Sampling":
        """``T[/top_k[/top_p[/min_p]]]``, e.g. ``0.7/20/0.8``."""
        parts = spec.split("/")
        kinds = (float, int, float, float)
        return cls(*(kind(x) for kind, x in zip(kinds, parts)))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution SGLang's sampler draws from (its torch path: top-k and top-p masks on
        the sorted original probabilities, then min-p relative to the top one)."""
        p = torch.softmax(logits.float() / self.temperature, dim=-1)
        ps, idx = p.sort(dim=-1, descending=True)
        rank = torch.arange(p.shape[-1], device=p.device)
        keep = (ps.cumsum(-1) - ps) <= self.top_p
        if self.top_k > 0:
            keep &= rank < self.top_k
        ps = torch.where(keep, ps, 0.0)
        if self.min_p > 0:
            ps = torch.where(ps >= ps[..., :1] * self.min_p, ps, 0.0)
        out = torch.zeros_like(p).scatter_(-1, idx, ps)
        return out / out.sum(-1, keepdim=True)


@torch.no_grad()
def sampled_continuations(target: Target, prompts: list[list[int]], new_tokens: int, sampling: Sampling,
                          seed: int) -> list[torch.Tensor]:
    """The target's own continuations under ``sampling`` (greedy at temperature 0)."""
    if sampling.temperature <= 0:
        return _greedy(target, prompts, new_tokens, seed)
    dev = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    gen = torch.Generator(device=dev).manual_seed(seed)
    out = []
    for prompt in prompts:
        cache = KVCache(target.shape, 1, len(prompt) + new_tokens, dev, dtype)
        logits, _ = target(torch.tensor([prompt], device=dev), cache=cache)
        seq = list(prompt)
        for i in range(new_tokens):
            tok = int(torch.multinomial(sampling.probs(logits[0, -1]), 1, generator=gen))
            seq.append(tok)
            if i + 1 < new_tokens:
                logits, _ = target(torch.tensor([[tok]], device=dev), cache=cache)
        out.append(torch.tensor(seq, device=dev))
    return out


#: How a tree is scored from the drafter's per-depth distributions: ``raw`` its own (what the
#: server does), ``matched`` the drafter's distribution put through the request's sampling.
SCORINGS = ("raw", "matched")


def tree_logprobs(logits: torch.Tensor, scoring: str, sampling: Sampling) -> torch.Tensor:
    """Per-depth log-probs a tree is built from, ``[..., V]`` from the drafter's logits."""
    if scoring == "raw" or sampling.temperature <= 0:
        return torch.log_softmax(logits.float(), dim=-1)
    if scoring == "matched":
        p = sampling.probs(logits)
        return torch.where(p > 0, p.clamp(min=1e-30).log(), torch.tensor(float("-inf"), device=p.device))
    raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")


@torch.no_grad()
def draft_logits(drafter: Drafter, target: Target, seq: torch.Tensor, anchors: torch.Tensor,
                 mask_token_id: int) -> torch.Tensor:
    """Per anchor, the drafter's logits at depths 1..L. seq [1, S], anchors [1, N] -> [N, L, V]."""
    bs = drafter.shape.block_size
    s = seq.shape[1]
    _, captured = target(seq, capture=drafter.shape.target_layer_ids, logits=False)
    blocks = dflash_batch.make_blocks(seq, anchors, bs, mask_token_id, drafter.shape.loss_decay_gamma)
    embeds = target.model.embed_tokens(blocks.ids)
    ctx = drafter.context(captured)
    hidden = drafter(embeds.to(ctx.dtype), blocks.pos, ctx, torch.arange(s, device=seq.device), blocks.mask)
    logits = torch.nn.functional.linear(hidden, target.lm_head_weight.to(hidden.dtype)).float()
    return logits.view(anchors.shape[1], bs, -1)[:, 1:]


@torch.no_grad()
def offline_accept_sampled(drafter: Drafter, target: Target, prompts: list[list[int]], new_tokens: int,
                           budgets: Sequence[int], mask_token_id: int, seed: int, sampling: Sampling,
                           scorings: Sequence[str] = SCORINGS) -> dict:
    """Mean accept length of the DFLASH chain (the drafter's argmax per depth; and how often it
    reaches each depth) and of DDTREE trees per budget and scoring, replayed on the target's
    continuations under ``sampling``."""
    bs = drafter.shape.block_size
    kmax = max(budgets)
    steps: dict = {}
    depth_hits = np.zeros(bs - 1)
    for prompt, seq in zip(prompts, sampled_continuations(target, prompts, new_tokens, sampling, seed)):
        seq = seq.unsqueeze(0)
        plen, last = len(prompt), seq.shape[1] - bs
        anchors = torch.arange(plen, last + 1, device=seq.device).unsqueeze(0)
        logits = draft_logits(drafter, target, seq, anchors, mask_token_id)
        x = seq[0].tolist()
        tops = {sc: tree_logprobs(logits, sc, sampling).topk(kmax, dim=-1) for sc in scorings}
        argmax = logits.argmax(-1).tolist()
        names = ["dflash"] + [f"ddtree{b}" + ("" if sc == "raw" else f"_{sc}") for sc in scorings for b in budgets]
        for name in names:
            a = plen
            while a <= last:
                i = a - plen
                truth = x[a + 1 : a + bs]
                if name == "dflash":
                    acc = chain_accept(argmax[i], truth)
                    depth_hits[:acc] += 1
                else:
                    b_str, _, sc = name[len("ddtree"):].partition("_")
                    b = int(b_str)
                    depth, k = min(bs - 1, b), min(b, kmax)
                    vals, ids = tops[sc or "raw"]
                    nodes = build_tree(vals[i, :depth, :k].tolist(), b)
                    acc = tree_accept(nodes, ids[i, :depth, :k].tolist(), truth[:depth])
                steps.setdefault(name, []).append(acc + 1)
                a += acc + 1
    out = {name: float(np.mean(v)) for name, v in steps.items()}
    chain_steps = max(1, len(steps.get("dflash", [])))
    out["dflash_depth_hit_rate"] = [round(float(h / chain_steps), 4) for h in depth_hits]
    out.update(prompts=len(prompts), new_tokens=new_tokens, sampling=sampling.__dict__)
    return out


def offline_accept(drafter: Drafter, target: Target, prompts: list[list[int]], new_tokens: int,
                   budgets: Sequence[int], mask_token_id: int, seed: int) -> dict:
    """Mean accept length (tokens per verify step, as the server reports it) at T=0 of the
    DFLASH chain and of DDTREE trees per budget, replayed on the target's greedy continuations."""
    out = offline_accept_sampled(drafter, target, prompts, new_tokens, budgets, mask_token_id, seed, Sampling(),
                                 scorings=("raw",))  # fmt: skip
    out.pop("sampling")
    return out


@torch.no_grad()
def sampling_prompts(target: Target, prompts: list[dict], n: int, positions: int) -> list[dict]:
    """The ``n`` prompts whose greedy continuation has the highest mean next-token entropy over
    its first ``positions`` tokens (a two-sample test needs spread-out distributions)."""
    scored = []
    for pr, seq in zip(prompts, _greedy(target, [p["prompt_ids"] for p in prompts], positions, 0)):
        logits, _ = target(seq[None, :-1])
        logp = torch.log_softmax(logits[0, -positions:].float(), dim=-1)
        ent = (-(logp.exp() * logp).sum(-1)).tolist()
        scored.append((float(np.mean(ent)), ent, pr))
    scored.sort(key=lambda t: -t[0])
    return [{**pr, "greedy_entropy": [round(e, 3) for e in ent]} for _, ent, pr in scored[:n]]
