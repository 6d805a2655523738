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
from typing import Callable, Sequence

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
def draft_outputs(drafter: Drafter, target: Target, seq: torch.Tensor, anchors: torch.Tensor,
                  mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per anchor, the drafter's logits and hidden states at depths 1..L.
    seq [1, S], anchors [1, N] -> ([N, L, V] float32, [N, L, H])."""
    bs = drafter.shape.block_size
    s = seq.shape[1]
    _, captured = target(seq, capture=drafter.shape.target_layer_ids, logits=False)
    blocks = dflash_batch.make_blocks(seq, anchors, bs, mask_token_id, drafter.shape.loss_decay_gamma)
    embeds = target.model.embed_tokens(blocks.ids)
    ctx = drafter.context(captured)
    hidden = drafter(embeds.to(ctx.dtype), blocks.pos, ctx, torch.arange(s, device=seq.device), blocks.mask)
    logits = torch.nn.functional.linear(hidden, target.lm_head_weight.to(hidden.dtype)).float()
    n = anchors.shape[1]
    return logits.view(n, bs, -1)[:, 1:], hidden.view(n, bs, -1)[:, 1:]


def draft_logits(drafter: Drafter, target: Target, seq: torch.Tensor, anchors: torch.Tensor,
                 mask_token_id: int) -> torch.Tensor:
    """Per anchor, the drafter's logits at depths 1..L. seq [1, S], anchors [1, N] -> [N, L, V]."""
    return draft_outputs(drafter, target, seq, anchors, mask_token_id)[0]


@torch.no_grad()
def selector_lattice(drafter: Drafter, logits: torch.Tensor, hidden: torch.Tensor,
                     anchor_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A DFlash 2 drafter's lattice per anchor, as the server's ``selector_lattice`` builds it:
    each slot's top-K candidates by logit and ``scores[n, s, p, c]`` = candidate c's logit plus
    the selector's pair term after candidate p of slot s - 1 (the anchor for s = 0).
    logits [N, L, V], hidden [N, L, H], anchor_ids [N] -> ([N, L, K], [N, L, K, K] float32)."""
    k = drafter.shape.selector_top_k
    unary, ids = logits.float().topk(k, dim=-1)
    n, slots, _ = ids.shape
    previous = torch.cat([anchor_ids.view(n, 1, 1).expand(n, 1, k), ids[:, :-1]], dim=1)  # [N, L, K(p)]
    pair = drafter.candidate_selector.pair(
        previous, hidden.unsqueeze(2).expand(n, slots, k, hidden.shape[-1]), ids.unsqueeze(2).expand(n, slots, k, k)
    )
    return ids, unary.unsqueeze(2) + pair.float()


def transition_tree(logprobs: np.ndarray, budget: int) -> list[Node]:
    """The server's tree from a DFlash 2 lattice's transition log-probs ``[L, K, K]``
    (``speculative/ddtree/selector_tree.py``'s reference); a node's rank is its candidate
    index, so ``tree_accept`` reads its token from the lattice's candidate ids."""
    # The server's own builder, so the tree is the server's; imported here, as only a DFlash 2
    # replay needs the installed series.
    from sglang.srt.speculative.ddtree.selector_tree import build_selector_tree_ref

    ref = build_selector_tree_ref([[0] * logprobs.shape[1]] * logprobs.shape[0], logprobs, budget)
    return [Node(r.parent - 1, r.depth, r.rank, float(r.score)) for r in ref]


def selector_chain(logprobs: np.ndarray) -> list[int]:
    """The candidate indices of the selector's greedy walk through the lattice (DFLASH with a
    DFlash 2 drafter): the best first candidate, then the best transition from each."""
    walk, row = [], 0
    for slot in range(logprobs.shape[0]):
        row = int(np.argmax(logprobs[slot, row]))
        walk.append(row)
    return walk


@torch.no_grad()
def offline_accept_sampled(drafter: Drafter, target: Target, prompts: list[list[int]], new_tokens: int,
                           budgets: Sequence[int], mask_token_id: int, seed: int, sampling: Sampling,
                           scorings: Sequence[str] = SCORINGS) -> dict:
    """Mean accept length of the DFLASH chain (the drafter's argmax per depth; and how often it
    reaches each depth) and of DDTREE trees per budget and scoring, replayed on the target's
    continuations under ``sampling``. With a DFlash 2 drafter also the selector's chain
    (``dflash_transitions``) and the trees from its transitions (``ddtree<B>_transitions``)."""
    bs = drafter.shape.block_size
    kmax = max(budgets)
    steps: dict = {}
    depth_hits = np.zeros(bs - 1)
    for prompt, seq in zip(prompts, sampled_continuations(target, prompts, new_tokens, sampling, seed)):
        seq = seq.unsqueeze(0)
        plen, last = len(prompt), seq.shape[1] - bs
        anchors = torch.arange(plen, last + 1, device=seq.device).unsqueeze(0)
        logits, hidden = draft_outputs(drafter, target, seq, anchors, mask_token_id)
        x = seq[0].tolist()
        tops = {sc: tree_logprobs(logits, sc, sampling).topk(kmax, dim=-1) for sc in scorings}
        argmax = logits.argmax(-1).tolist()
        names = ["dflash"] + [f"ddtree{b}" + ("" if sc == "raw" else f"_{sc}") for sc in scorings for b in budgets]
        if drafter.shape.dflash2:
            cand, scores = selector_lattice(drafter, logits, hidden, seq[0, anchors[0]])
            transitions = torch.log_softmax(scores, dim=-1).cpu().numpy()
            cand = cand.tolist()
            names += ["dflash_transitions"] + [f"ddtree{b}_transitions" for b in budgets]
        for name in names:
            a = plen
            while a <= last:
                i = a - plen
                truth = x[a + 1 : a + bs]
                if name == "dflash":
                    acc = chain_accept(argmax[i], truth)
                    depth_hits[:acc] += 1
                elif name == "dflash_transitions":
                    acc = chain_accept([cand[i][s][c] for s, c in enumerate(selector_chain(transitions[i]))], truth)
                elif name.endswith("_transitions"):
                    nodes = transition_tree(transitions[i], int(name[len("ddtree"):-len("_transitions")]))
                    acc = tree_accept(nodes, cand[i], truth)
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


# ---------------------------------------------------------------------------------------------
# The oracle bound: the best tree a drafter that knew the target's conditionals could build,
# and the drafter's own tree and chain, each as an exact expectation under the target's
# sampling distribution (no sampling noise, so the three compare directly).

#: ``cond(paths) -> distributions``: the target's sampling distribution of the next token after
#: the context followed by each path (a tuple of token ids; ``()`` is the anchor itself).
Cond = Callable[[list[tuple]], list[np.ndarray]]


def best_first_tree(cond: Cond, budget: int, max_depth: int) -> list[tuple[tuple, float]]:
    """(path, probability) of each node, most probable first, of the best tree of at most ``budget`` nodes and depth at
    most ``max_depth``: the one maximising the expected accepted tokens, the sum over its nodes
    of P(path). A child's path probability is at most its parent's, so the ``budget`` most
    probable paths are prefix-closed (ties go to the shallower path) and taking them best-first
    is optimal for this additive objective; the best tree of any smaller budget b is the first
    b of them. Paths of probability 0 are never nodes (they add nothing).

    Expansions are batched in rounds: every not yet expanded path among the current top
    ``budget`` candidates is expanded at once (one ``cond`` call), until the top ``budget`` are
    all expanded (or at the depth cap); then no unexpanded descendant can outrank them."""
    cands: dict[tuple, float] = {}
    expanded: set = set()

    def push(path: tuple, prob: float, dist: np.ndarray) -> None:
        if len(path) >= max_depth:
            return
        k = min(budget, dist.size)
        idx = np.argpartition(-dist, k - 1)[:k] if k < dist.size else np.arange(dist.size)
        for t in idx:
            q = prob * float(dist[t])
            if q > 0:
                cands[path + (int(t),)] = q

    def top() -> list[tuple]:
        return sorted(cands, key=lambda p: (-cands[p], len(p), p))[:budget]

    push((), 1.0, np.asarray(cond([()])[0], dtype=np.float64))
    while True:
        best = top()
        for p in set(cands) - set(best):  # never again in the top: the top only improves
            del cands[p]
        # the last of a full top cannot have a child in it (a child sorts after its parent)
        todo = [p for p in best[: budget - 1 if len(best) == budget else budget]
                if p not in expanded and len(p) < max_depth]
        if not todo:
            return [(p, cands[p]) for p in best]
        for p, dist in zip(todo, cond(todo)):
            expanded.add(p)
            push(p, cands[p], np.asarray(dist, dtype=np.float64))


def path_probs(cond: Cond, paths: Sequence[tuple]) -> list[float]:
    """P(path) under the target's sampling for each path of a prefix-closed set: the product of
    the target's conditional probabilities along it. One ``cond`` call per depth."""
    probs: dict[tuple, float] = {(): 1.0}
    for d in range(1, max((len(p) for p in paths), default=0) + 1):
        level = sorted({p[:d] for p in paths if len(p) >= d})
        parents = sorted({p[:-1] for p in level})
        dists = dict(zip(parents, cond(parents)))
        for p in level:
            probs[p] = probs[p[:-1]] * float(dists[p[:-1]][p[-1]])
    return [probs[p] for p in paths]


def speculative_chain_accept(cond: Cond, draft: Sequence[int], proposal: Sequence[np.ndarray | None]) -> float:
    """Expected accepted tokens of one drawn chain under speculative sampling: depth ``d`` is kept
    with probability ``min(1, p_d(x_d) / q_d(x_d))`` once every shallower depth was, where ``p_d``
    is the target's sampling distribution after ``x_<d`` and ``q_d`` the distribution ``x_d`` was
    drawn from (``None``: a fixed token, kept with ``p_d(x_d)``). On a rejection the step draws
    its token from the residual ``max(p_d - q_d, 0)``, so the step is lossless whatever the
    ``q_d``; a block drafter's ``q_d`` depends on the context alone, not on ``x_<d``."""
    prefixes = [tuple(draft[:d]) for d in range(len(draft))]
    total, run = 0.0, 1.0
    for d, dist in enumerate(cond(prefixes)):
        x, q = int(draft[d]), proposal[d]
        p = float(dist[x])
        run *= p if q is None else min(1.0, p / max(float(q[x]), 1e-300))
        if run == 0.0:
            break
        total += run
    return total


def recursive_rejection_probs(p: np.ndarray, children: Sequence[int], proposal: np.ndarray | None = None,
                              drawn: Sequence[bool] | None = None) -> list[float]:
    """P(the verify keeps each child) at one node under recursive rejection sampling, ``p`` the
    target's distribution there. Child ``i`` is kept with ``min(1, p_i(c_i) / q_i(c_i))`` once the
    earlier ones were rejected, ``p_i`` the residual ``max(p_{i-1} - q_{i-1}, 0)`` renormalised.
    A drawn child (``drawn[i]``) was drawn from ``q_i`` = ``proposal`` without the earlier
    children, renormalised (draws without replacement); a fixed one is its own point mass, kept
    with ``p_i(c_i)``. After the last rejection the step draws from the residual, so the node's
    token follows ``p`` whatever the children. Every child fixed (the default) is the server's
    walk: child ``i`` kept with ``p(c_i)``."""
    p = np.asarray(p, dtype=np.float64).copy()
    q = None if proposal is None else np.asarray(proposal, dtype=np.float64).copy()
    drawn = [False] * len(children) if drawn is None else list(drawn)
    out, left = [], 1.0
    for i, c in enumerate(children):
        if drawn[i]:
            qi = q / max(q.sum(), 1e-300)
        else:
            qi = np.zeros_like(p)
            qi[c] = 1.0
        keep = min(1.0, p[c] / max(qi[c], 1e-300))
        out.append(left * keep)
        left *= 1.0 - keep
        residual = np.maximum(p - qi, 0.0)
        z = residual.sum()
        if left <= 0.0 or z <= 0.0:
            out.extend([0.0] * (len(children) - i - 1))
            break
        p = residual / z
        if q is not None:
            q[c] = 0.0
    return out


def drawn_tree_accept(cond: Cond, nodes: list[Node], tokens: Sequence[Sequence[int]],
                      proposal: Sequence[np.ndarray], drawn_depths: Sequence[int], rng: np.random.Generator,
                      fixed_first: int = 0) -> float:
    """Expected accepted tokens of one step over DDTree's tree shape ``nodes`` whose children at
    ``drawn_depths`` are drawn: each parent's, as many as the shape gives it, past its first
    ``fixed_first`` (which keep the shape's tokens), without replacement from ``proposal[d - 1]``
    less those (Gumbel top-k; the first draw takes the lowest free rank), verified by recursive
    rejection sampling (``recursive_rejection_probs``). Children at other depths, and any beyond
    the proposal's support, are the shape's own tokens (``tokens[d - 1][rank]``)."""
    children: dict[int, list[int]] = {}
    for i, n in enumerate(nodes):
        children.setdefault(n.parent, []).append(i)
    tok: list[int] = [0] * len(nodes)
    flags: dict[int, list[bool]] = {}
    for parent, kids in children.items():
        kids.sort(key=lambda i: nodes[i].rank)
        d = nodes[kids[0]].depth
        fixed = [int(t) for t in tokens[d - 1][: min(fixed_first, len(kids))]] if d in drawn_depths else []
        picked: list[int] = []
        if d in drawn_depths:
            q = np.asarray(proposal[d - 1], dtype=np.float64).copy()
            q[fixed] = 0.0
            keys = np.where(q > 0, np.log(np.maximum(q, 1e-300)) + rng.gumbel(size=q.size), -np.inf)
            picked = [int(t) for t in np.argsort(-keys, kind="stable")[: min(len(kids) - len(fixed), int((q > 0).sum()))]]
        rest = (int(t) for t in tokens[d - 1] if t not in fixed and t not in picked)
        order = fixed + picked
        flags[parent] = [False] * len(fixed) + [True] * len(picked) + [False] * (len(kids) - len(order))
        for j, i in enumerate(kids):
            tok[i] = order[j] if j < len(order) else next(rest)
    paths: list[tuple] = []
    for i, n in enumerate(nodes):  # pop order: a parent before its children
        paths.append((paths[n.parent] if n.parent >= 0 else ()) + (tok[i],))
    parents = sorted(children, reverse=True)  # children before their parents; the root (-1) last
    dists = dict(zip(parents, cond([paths[i] if i >= 0 else () for i in parents])))
    gain = [0.0] * len(nodes)
    for parent in parents:
        kids = children[parent]
        probs = recursive_rejection_probs(dists[parent], [tok[i] for i in kids],
                                          proposal[nodes[kids[0]].depth - 1], flags[parent])
        total = sum(pk * (1.0 + gain[i]) for pk, i in zip(probs, kids))
        if parent < 0:
            return total
        gain[parent] = total
    return 0.0


def tree_paths(nodes: list[Node], tokens: Sequence[Sequence[int]]) -> list[tuple]:
    """Each node's token path from the root (``tokens[d][r]`` as in ``tree_accept``)."""
    out: list[tuple] = []
    for n in nodes:
        out.append((out[n.parent] if n.parent >= 0 else ()) + (tokens[n.depth - 1][n.rank],))
    return out


def target_dist(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The target's sampling distribution; at temperature 0 one-hot at the argmax (greedy)."""
    if sampling.temperature <= 0:
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return sampling.probs(logits)


class TargetCond:
    """``Cond`` from the target at one anchor: the context's K/V once, then each path's last
    token run once on top of it with a tree mask (it sees the context, its ancestors and
    itself), its ancestors added to the same forward where they have not run yet. The
    distributions are kept, so the oracle and the drafter's tree share expansions."""

    def __init__(self, target: Target, k: list, v: list, ctx_len: int, root_logits: torch.Tensor,
                 sampling: Sampling):
        self.target, self.sampling, self.ctx_len = target, sampling, ctx_len
        self.cache = self._cache(ctx_len + 64)
        for i in range(len(k)):
            self.cache.k[i][:, :ctx_len] = k[i][:, :ctx_len]
            self.cache.v[i][:, :ctx_len] = v[i][:, :ctx_len]
        self.cache.length = ctx_len
        self.slot: dict[tuple, int] = {}  # path -> cache index of its last token
        self.dist: dict[tuple, np.ndarray] = {(): target_dist(root_logits, sampling).double().numpy()}
        self.forwards = 0

    def _cache(self, n: int) -> KVCache:
        p = next(self.target.parameters())
        return KVCache(self.target.shape, 1, n, p.device, p.dtype)

    def __call__(self, paths: list[tuple]) -> list[np.ndarray]:
        new = sorted({p[:d] for p in paths for d in range(1, len(p) + 1)} - set(self.dist), key=len)
        if new:
            self._run(new)
        return [self.dist[p] for p in paths]

    def _run(self, new: list[tuple]) -> None:
        start, m = self.cache.length, len(new)
        if start + m > self.cache.k[0].shape[1]:  # grow
            old, self.cache = self.cache, self._cache(2 * (start + m))
            for i in range(len(old.k)):
                self.cache.k[i][:, :start], self.cache.v[i][:, :start] = old.k[i][:, :start], old.v[i][:, :start]
            self.cache.length = start
        for j, p in enumerate(new):
            self.slot[p] = start + j
        mask = torch.zeros(m, start + m, dtype=torch.bool)
        mask[:, : self.ctx_len] = True
        for j, p in enumerate(new):
            mask[j, [self.slot[p[:d]] for d in range(1, len(p) + 1)]] = True
        dev = self.cache.k[0].device
        ids = torch.tensor([[p[-1] for p in new]], device=dev)
        pos = torch.tensor([self.ctx_len - 1 + len(p) for p in new], device=dev)
        logits, _ = self.target(ids, cache=self.cache, pos=pos, mask=mask.to(dev))
        self.forwards += 1
        dists = target_dist(logits[0].float(), self.sampling).double().cpu().numpy()
        for j, p in enumerate(new):
            self.dist[p] = dists[j]


#: Drawn-tree variants of ``oracle_accept``: (name, drawn depths (None: all), fixed first children).
DRAWN_TREES = (("drawn_tree", None, 0), ("root_drawn_tree", (1,), 0),
               ("top1_drawn_tree", None, 1), ("root_top1_drawn_tree", (1,), 1))


@torch.no_grad()
def oracle_accept(drafter: Drafter, target: Target, prompts: list[list[int]], new_tokens: int,
                  budgets: Sequence[int], mask_token_id: int, seed: int, sampling: Sampling,
                  stride: int = 8, tree_temperatures: Sequence[float] = (), draws: int = 0) -> dict:
    """Expected tokens per verify step (accepted + 1) under ``sampling`` at every ``stride``-th
    position of the target's own continuations (those of ``offline_accept_sampled``): of the
    best tree of B nodes built from the target's true conditionals (the bound no drafter can
    pass), of the drafter's DDTree tree of B nodes, and of its chain (argmax per depth).
    Depth is capped at ``block_size - 1`` as the server caps it. Also the target's mean
    next-token entropy (nats) and top-1 probability under ``sampling`` over the continuations.
    ``tree_temperatures``: also the drafter's tree built from its distribution at each of these
    temperatures (the server builds it at 1, whatever the request's).
    ``draws`` (at T > 0): also drafts *drawn* from the drafter's distribution put through the
    request's sampling, the mean over that many draws per anchor: chains verified by speculative
    sampling (``speculative_chain_accept``; every depth drawn, or depth 1 drawn and the deeper
    ones the argmax), and DDTree's tree shape with every depth's children drawn, or the root's
    children only, all of them or all but the most likely one (``DRAWN_TREES``), verified by
    recursive rejection sampling (``drawn_tree_accept``)."""
    bs = drafter.shape.block_size
    drawn = draws if sampling.temperature > 0 else 0
    chain_gen = torch.Generator().manual_seed(seed + 1)
    tree_rng = np.random.default_rng(seed + 1)
    cap, kmax = bs - 1, max(budgets)
    sums = {("chain", 0): 0.0, **{(w, b): 0.0 for w in ("oracle", "ddtree") for b in budgets},
            **{(t, b): 0.0 for t in tree_temperatures for b in budgets},
            ("drawn", 0): 0.0, ("drawn_first", 0): 0.0,
            **{(w, b): 0.0 for w, _, _ in DRAWN_TREES for b in budgets}}
    anchors_n, forwards, ent, top1 = 0, 0, [], []
    for prompt, seq in zip(prompts, sampled_continuations(target, prompts, new_tokens, sampling, seed)):
        plen, s = len(prompt), seq.numel()
        p = next(target.parameters())
        full = KVCache(target.shape, 1, s, p.device, p.dtype)
        logits, _ = target(seq.unsqueeze(0), cache=full)
        dist = target_dist(logits[0, plen - 1 : s - 1].float(), sampling)
        ent.append(-(dist * dist.clamp(min=1e-30).log()).sum(-1))
        top1.append(dist.max(-1).values)
        anchors = torch.arange(plen, s - bs + 1, stride, device=seq.device)
        d_logits = draft_logits(drafter, target, seq.unsqueeze(0), anchors.unsqueeze(0), mask_token_id)
        vals, ids = torch.log_softmax(d_logits.float(), dim=-1).topk(kmax, dim=-1)
        tempered = {t: torch.log_softmax(d_logits.float() / t, dim=-1).topk(kmax, dim=-1) for t in tree_temperatures}
        for i, a in enumerate(anchors.tolist()):
            cond = TargetCond(target, full.k, full.v, a + 1, logits[0, a].float(), sampling)
            chain = [tuple(d_logits[i, :d].argmax(-1).tolist()) for d in range(1, cap + 1)]
            sums[("chain", 0)] += 1 + sum(path_probs(cond, chain))
            if drawn:
                q = sampling.probs(d_logits[i, :cap]).double()
                xs = torch.multinomial(q, drawn, replacement=True, generator=chain_gen).T.tolist()  # [drawn, cap]
                qs = list(q.numpy())
                argmax = list(chain[-1])
                cond([tuple(x[:d]) for x in xs for d in range(cap)])  # every draw's contexts in one forward
                for x in xs:
                    sums[("drawn", 0)] += (1 + speculative_chain_accept(cond, x, qs)) / drawn
                    sums[("drawn_first", 0)] += (
                        1 + speculative_chain_accept(cond, x[:1] + argmax[1:], qs[:1] + [None] * (cap - 1))) / drawn
            best = best_first_tree(cond, kmax, cap)
            for b in budgets:
                sums[("oracle", b)] += 1 + sum(q for _, q in best[:b])
                depth, k = min(cap, b), min(b, kmax)
                nodes = build_tree(vals[i, :depth, :k].tolist(), b)
                top = ids[i, :depth, :k].tolist()
                sums[("ddtree", b)] += 1 + sum(path_probs(cond, tree_paths(nodes, top)))
                for _ in range(drawn):
                    for name, at, fixed in DRAWN_TREES:
                        at = range(1, depth + 1) if at is None else at
                        sums[(name, b)] += (1 + drawn_tree_accept(cond, nodes, top, qs, at, tree_rng, fixed)) / drawn
                for t, (t_vals, t_ids) in tempered.items():
                    nodes = build_tree(t_vals[i, :depth, :k].tolist(), b)
                    sums[(t, b)] += 1 + sum(path_probs(cond, tree_paths(nodes, t_ids[i, :depth, :k].tolist())))
            anchors_n += 1
            forwards += cond.forwards
    n = max(anchors_n, 1)
    chain = sums[("chain", 0)] / n
    rows = [{"budget": b, "oracle_expected_accept": round(sums[("oracle", b)] / n, 4),
             "drafter_tree_expected_accept": round(sums[("ddtree", b)] / n, 4),
             "drafter_chain_expected_accept": round(chain, 4), "anchors": anchors_n} for b in budgets]
    for row in rows:
        if drawn:
            row["drawn_chain_expected_accept"] = round(sums[("drawn", 0)] / n, 4)
            row["first_drawn_chain_expected_accept"] = round(sums[("drawn_first", 0)] / n, 4)
            for name, _, _ in DRAWN_TREES:
                row[f"{name}_expected_accept"] = round(sums[(name, row["budget"])] / n, 4)
            row["draws_per_anchor"] = drawn
        if tree_temperatures:
            row["drafter_tree_expected_accept_at_temperature"] = {
                str(t): round(sums[(t, row["budget"])] / n, 4) for t in tree_temperatures}
    return {"sampling": sampling.__dict__, "prompts": len(prompts), "new_tokens": new_tokens, "stride": stride,
            "anchors": anchors_n, "depth_cap": cap, "budgets": rows,
            "target_entropy_mean": round(float(torch.cat(ent).mean()), 4),
            "target_top1_mean": round(float(torch.cat(top1).mean()), 4),
            "target_forwards": forwards}
