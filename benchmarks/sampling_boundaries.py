# SPDX-License-Identifier: Apache-2.0
"""Where a hard sampling filter is decided by the target and where by rounding.

top-k, top-p and min-p cut the target's distribution at a threshold. Two servers of one target
compute its logits with different kernels (a decode step against a tree verify of 17 rows, other
GEMM shapes), and in bf16 those logits differ by about a unit in the last place (0.03 at a logit
of 6, 0.06 at 12). A token that close to a cut is kept by one server and dropped by the other
at every visit of that context, and a two-sample test of thousands of continuations sees that as
a difference of distributions although neither sampler is wrong.

A context is *decided* at ``delta`` when no change of its logits by at most ``delta`` each
changes the set of tokens the request's filters keep, in the order the server's sampling backend
applies them (``backend_order``). Top-p's cumulative masses can be held to a tolerance of their
own (``mass``): a change of every logit at once by ``delta`` in the worst direction is far more
than rounding does to a sum. ``truncate_undecided`` ends every continuation at its first
undecided context, a function of the continuation's own prefix: if two servers sample alike
wherever the cut is decided, their truncated samples have one distribution, so the sampling
check can test exactness there and report how much of each sample it had to leave out.

``decided`` is the vectorised test; ``filtered_set`` the plain definition it is tested against.
"""

from __future__ import annotations

import copy
import math
import sys
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

#: What an undecided context and everything after it become in a truncated continuation.
UNDECIDED = -1
#: Penalties (and the value that leaves the logits alone) change the logits by the context; with a
#: filter beside them the cut would have to be found on the penalised logits, which ``decided``
#: does not compute.
PENALTIES = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
#: The orders SGLang's sampling backends apply the filters in: FlashInfer with a min-p applies top-k,
#: then top-p to the renormalised top-k, then min-p; FlashInfer without one and the torch backend
#: apply all of them to the original distribution.
ORDERS = ("sequential", "joint")


def backend_order(backend: str, setting: dict) -> str:
    """The order ``backend`` (SGLang's ``--sampling-backend``) applies ``setting``'s filters in,
    for a batch of requests that all use ``setting`` (as the sampling check sends them)."""
    if backend not in ("flashinfer", "pytorch"):
        raise ValueError(f"sampling backend must be flashinfer or pytorch, got {backend!r}")
    return "sequential" if backend == "flashinfer" and float(setting.get("min_p", 0.0) or 0.0) > 0 else "joint"


def _filters(setting: dict, vocab: int) -> Tuple[float, int, float, float]:
    t = float(setting["temperature"])
    if t <= 0:
        raise ValueError(f"a sampled setting needs a positive temperature, got {t}")
    k = int(setting.get("top_k", -1) or -1)
    k = k if 0 < k < vocab else vocab
    p = float(setting.get("top_p", 1.0))
    m = float(setting.get("min_p", 0.0) or 0.0)
    if not 0 < p <= 1 or not 0 <= m < 1:
        raise ValueError(f"top_p must be in (0, 1] and min_p in [0, 1): {setting}")
    penalised = [x for x, neutral in PENALTIES.items() if setting.get(x, neutral) not in (None, neutral)]
    if penalised and (k < vocab or p < 1 or m > 0):
        raise ValueError(f"{', '.join(penalised)} with a top-k, top-p or min-p filter: the cut would lie in the "
                         "penalised logits, which this test does not compute")
    return t, k, p, m


def has_cut(setting: dict, vocab: int) -> bool:
    """Whether the setting cuts the distribution anywhere (otherwise every context is decided)."""
    _, k, p, m = _filters(setting, vocab)
    return k < vocab or p < 1 or m > 0


# ---------------------------------------------------------------------------------------------
# The plain definition


def filtered_set(logits: np.ndarray, setting: dict, order: str) -> frozenset:
    """The tokens one request's filters keep, for one row of logits (float64, plainly): top-p
    keeps every token whose higher-ranked tokens hold less than ``top_p``."""
    t, k, p, m = _filters(setting, len(logits))
    z = np.asarray(logits, dtype=np.float64) / t
    prob = np.exp(z - z.max())
    prob /= prob.sum()
    ranked = sorted(range(len(z)), key=lambda i: (-z[i], i))

    def top_p(tokens: List[int], mass: np.ndarray) -> List[int]:
        if p >= 1:
            return tokens
        cum, kept = 0.0, []
        for tok in tokens:
            if cum < p:
                kept.append(tok)
            cum += mass[tok]
        return kept

    if order == "sequential":
        kept = ranked[:k]
        mass = np.zeros_like(prob)
        mass[kept] = prob[kept] / prob[kept].sum()
        kept = top_p(kept, mass)
    elif order == "joint":
        kept = [tok for tok in top_p(ranked, prob) if tok in set(ranked[:k])]
    else:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if m > 0:
        kept = [tok for tok in kept if prob[tok] >= m * prob.max()]
    return frozenset(kept)


def filtered_probs(logits: torch.Tensor, setting: dict, order: str) -> torch.Tensor:
    """``filtered_set``'s distribution for every row of ``logits [n, V]`` (float64): the kept
    tokens' probabilities at the setting's temperature, renormalised; what a server samples."""
    n, vocab = logits.shape
    t, k, p, m = _filters(setting, vocab)
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    z = logits.double() / t
    prob = torch.softmax(z, dim=-1)
    sorted_p, idx = torch.sort(prob, dim=-1, descending=True, stable=True)
    keep = (torch.arange(vocab, device=logits.device) < k).expand(n, vocab).clone()
    if p < 1:
        mass = torch.where(keep, sorted_p, 0.0) if order == "sequential" else sorted_p
        mass = mass / mass.sum(-1, keepdim=True)
        keep &= (torch.cumsum(mass, dim=-1) - mass) < p
    if m > 0:
        keep &= sorted_p >= m * sorted_p[:, :1]
    kept = torch.zeros_like(prob).scatter(1, idx, torch.where(keep, sorted_p, 0.0))
    return kept / kept.sum(-1, keepdim=True)


# ---------------------------------------------------------------------------------------------
# The vectorised test


def _cut_decided(zs: torch.Tensor, p: float, eps: float, mass: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rows of descending ``zs [n, w]`` whose top-p cut holds, and each row's kept count.

    The top ``c`` tokens hold less than ``p`` and the top ``c + 1`` at least ``p``: token ``c``
    (0-based) is the last one kept. The cut holds if the kept and the first dropped token are
    more than ``2 eps`` apart and both masses stay on their sides of ``p``: by more than ``mass``
    when given, else under the worst change of at most ``eps`` per entry (every term on one side
    moved one way, the rest the other)."""
    n, w = zs.shape
    e = torch.exp(zs - zs[:, :1]).double()
    cum = torch.cumsum(e, dim=-1)
    total = cum[:, -1:]
    c = ((cum / total) < p).sum(-1, keepdim=True).clamp(max=w - 1)
    upper = torch.gather(cum, 1, c) / total  # mass of the top c + 1
    lower = upper - torch.gather(e, 1, c) / total  # mass of the top c
    if mass is None:
        spread = math.exp(2 * eps)
        ok = (upper / (upper + (1 - upper) * spread) >= p) & (lower * spread / (lower * spread + 1 - lower) < p)
    else:
        ok = (upper >= p + mass) & (lower < p - mass)
    nxt = torch.gather(zs, 1, (c + 1).clamp(max=w - 1))
    ok &= (c == w - 1) | (torch.gather(zs, 1, c) - nxt > 2 * eps)
    return ok.squeeze(1), (c + 1).squeeze(1)


def decided(logits: torch.Tensor, setting: dict, delta: float, mass: Optional[float] = None,
            orders: Sequence[str] = ORDERS) -> torch.Tensor:
    """``[n]`` bool: the rows of ``logits [n, V]`` whose filtered set, in each of ``orders``,
    holds under any change of at most ``delta`` per logit; with ``mass``, top-p's cumulative
    masses need only stay ``mass`` from ``p`` (rather than survive ``delta`` on every logit at once)."""
    n, vocab = logits.shape
    t, k, p, m = _filters(setting, vocab)
    if not set(orders) <= set(ORDERS) or not orders:
        raise ValueError(f"orders must be some of {ORDERS}, got {orders!r}")
    ok = torch.ones(n, dtype=torch.bool, device=logits.device)
    if not has_cut(setting, vocab):
        return ok
    eps = float(delta) / t
    zs = torch.sort(logits.float() / t, dim=-1, descending=True).values
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    for order in orders:
        kept = torch.full((n,), k, dtype=torch.long, device=logits.device)
        if p < 1:
            cut_ok, kept = _cut_decided(zs[:, : k if order == "sequential" else vocab], p, eps, mass)
            ok &= cut_ok
            kept = kept.clamp(max=k)
        survivors = kept
        if m > 0:
            near = ((zs - zs[:, :1] - math.log(m)).abs() <= 2 * eps) & (ranks < kept[:, None]) & (ranks > 0)
            ok &= ~near.any(-1)
            survivors = ((zs - zs[:, :1] >= math.log(m)) & (ranks < kept[:, None])).sum(-1)
        if k < vocab:  # the k-th and the next token must not swap where top-k is the cut that binds
            ok &= (survivors < k) | (zs[:, k - 1] - zs[:, k] > 2 * eps)
    return ok


# ---------------------------------------------------------------------------------------------
# Contexts of sampled continuations


def decided_contexts(contexts: Callable[[List[Tuple[int, ...]]], torch.Tensor], samples: Iterable[Sequence[int]],
                     positions: int, setting: dict, delta: float, mass: Optional[float] = None,
                     orders: Sequence[str] = ORDERS, batch: int = 256) -> Dict[Tuple[int, ...], bool]:
    """``prefix -> decided`` for every prefix (0 to ``positions - 1`` tokens) of the samples.

    ``contexts(seqs)`` takes equal-length token tuples (at most ``batch``) and returns the
    target's logits at each of their prefixes, ``[len(seqs), L + 1, V]`` (row j: after the
    prompt and the first j tokens)."""
    seqs = sorted({tuple(s[: positions - 1]) for s in samples if len(s) >= positions - 1})
    out: Dict[Tuple[int, ...], bool] = {}
    for i in range(0, len(seqs), batch):
        chunk = seqs[i : i + batch]
        logits = contexts(chunk)
        n, rows, vocab = logits.shape
        ok = decided(logits.reshape(n * rows, vocab), setting, delta, mass, orders).view(n, rows).cpu().tolist()
        for seq, flags in zip(chunk, ok):
            for j, flag in enumerate(flags):
                out[seq[:j]] = flag
    return out


def truncate_undecided(samples: Sequence[Sequence[int]], decided_at: Dict[Tuple[int, ...], bool],
                       positions: int) -> List[List[int]]:
    """Each continuation up to its first undecided context; that position and every later one
    become ``UNDECIDED``."""
    out = []
    for s in samples:
        s = list(s[:positions])
        for j in range(len(s)):
            if not decided_at.get(tuple(s[:j]), False):
                s[j:] = [UNDECIDED] * (len(s) - j)
                break
        out.append(s)
    return out


def decided_share(samples: Sequence[Sequence[int]], positions: int) -> List[float]:
    """Per position, the share of continuations still decided there."""
    n = max(1, len(samples))
    return [sum(1 for s in samples if len(s) > j and s[j] != UNDECIDED) / n for j in range(positions)]


class TargetContexts:
    """The target's logits after one prompt, by transformers (``decided_contexts``'s
    ``contexts``): the prompt runs once and its KV cache is repeated for each batch."""

    def __init__(self, model, prompt_ids: Sequence[int]):
        self.model, self.device = model, next(model.parameters()).device
        with torch.no_grad():
            out = model(torch.tensor([list(prompt_ids)], device=self.device), use_cache=True)
        self.cache, self.last = out.past_key_values, out.logits[:, -1:].float()

    @torch.no_grad()
    def __call__(self, seqs: List[Tuple[int, ...]]) -> torch.Tensor:
        first = self.last.expand(len(seqs), 1, -1)
        ids = torch.tensor(seqs, device=self.device).view(len(seqs), -1)
        if ids.shape[1] == 0:
            return first
        cache = copy.deepcopy(self.cache)
        cache.batch_repeat_interleave(len(seqs))
        return torch.cat([first, self.model(ids, past_key_values=cache, use_cache=True).logits.float()], dim=1)


def load_target(model_path: str, device: Optional[str] = None, dtype: torch.dtype = torch.bfloat16):
    """The target as transformers loads it, in the dtype the server runs it in."""
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()


class DecidedContexts:
    """``sampling_check.run_check``'s ``decided``: for a prompt's samples and a setting, which
    of their contexts the target's logits decide (in ``backend``'s order of the filters)."""

    def __init__(self, model, prompts: Sequence[Sequence[int]], positions: int, delta: float,
                 mass: Optional[float], backend: str = "flashinfer"):
        if delta <= 0 or mass is not None and mass < 0:
            raise ValueError(f"delta must be positive and mass non-negative, got {delta} and {mass}")
        backend_order(backend, {})  # a bad backend fails here, not after the servers have sampled
        self.model, self.prompts, self.positions = model, prompts, positions
        self.delta, self.mass, self.backend = delta, mass, backend
        self._contexts: Dict[int, TargetContexts] = {}

    def __call__(self, prompt_index: int, samples: Sequence[Sequence[Sequence[int]]], setting: dict):
        if not has_cut(setting, self.model.config.vocab_size):
            return {tuple(s[:j]): True for group in samples for s in group for j in range(self.positions)}
        if prompt_index not in self._contexts:
            self._contexts[prompt_index] = TargetContexts(self.model, self.prompts[prompt_index])
        return decided_contexts(self._contexts[prompt_index], (s for group in samples for s in group),
                                self.positions, setting, self.delta, self.mass,
                                orders=(backend_order(self.backend, setting),))


# ---------------------------------------------------------------------------------------------
# Which prompts a sampling check can judge


def sample_continuations(contexts: TargetContexts, setting: dict, order: str, samples: int, positions: int,
                         generator: torch.Generator) -> Tuple[List[Tuple[int, ...]], List[List[int]]]:
    """``samples`` continuations of ``positions`` tokens drawn from the target's filtered
    distribution (``filtered_probs``), and how many tokens each draw had to choose from."""
    seqs: List[Tuple[int, ...]] = [()] * samples
    choices: List[List[int]] = [[] for _ in range(samples)]
    for _ in range(positions):
        probs = filtered_probs(contexts(seqs)[:, -1], setting, order).float().cpu()
        nxt = torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()
        for c, n in zip(choices, (probs > 0).sum(-1).tolist()):
            c.append(n)
        seqs = [s + (t,) for s, t in zip(seqs, nxt)]
    return seqs, choices


def rank_prompts(model, prompts: List[dict], settings: List[dict], samples: int, positions: int, delta: float,
                 mass: Optional[float], backend: str, seed: int = 0) -> List[dict]:
    """Per prompt and setting, over the target's own continuations: the share still decided at
    each position (after ``truncate_undecided``, the first token decided as in the check) and the
    share decided there with a choice of two tokens or more (``informative_share``: a context
    with one token left tells no sampler from another). Prompts ordered by the mean informative
    share over the positions and the settings that cut."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for pr in prompts:
        contexts = TargetContexts(model, pr["prompt_ids"])
        decided_by, informative_by = {}, {}
        for setting in settings:
            if not has_cut(setting, model.config.vocab_size):
                continue
            order = backend_order(backend, setting)
            seqs, choices = sample_continuations(contexts, setting, order, samples, positions, gen)
            flags = {**decided_contexts(contexts, seqs, positions, setting, delta, mass, (order,)), (): True}
            cut = truncate_undecided(seqs, flags, positions)
            decided_by[setting["name"]] = [round(x, 4) for x in decided_share(cut, positions)]
            informative_by[setting["name"]] = [
                round(sum(1 for s, c in zip(cut, choices) if s[j] != UNDECIDED and c[j] > 1) / samples, 4)
                for j in range(positions)]
        score = float(np.mean([x for v in informative_by.values() for x in v] or [0.0]))
        out.append({**pr, "decided_share": decided_by, "informative_share": informative_by,
                    "score": round(score, 4)})
    out.sort(key=lambda r: -r["score"])
    return out


def main(argv=None) -> int:
    import argparse
    import json
    import platform
    import time
    from pathlib import Path

    from benchmarks import sampling_check as sc
    from benchmarks.plotting import pyplot

    ap = argparse.ArgumentParser(description="The prompts on which a sampling check can judge a setting: per position, "
                                 "the share of the target's own continuations whose contexts decide the filters' cut "
                                 "and leave a choice (benchmarks/sampling_boundaries.py rank_prompts).")
    ap.add_argument("target", help="the target's checkpoint (transformers)")
    ap.add_argument("--prompts", type=Path, required=True, help="JSON list or JSON lines of objects with prompt_ids")
    ap.add_argument("--settings", default="default", help="sampling_check.py --settings")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--positions", type=int, default=4)
    ap.add_argument("--delta", type=float, default=0.0625)
    ap.add_argument("--mass", type=float, default=0.02)
    ap.add_argument("--backend", default="flashinfer")
    ap.add_argument("--device", default=None)
    ap.add_argument("--best", type=int, default=2, help="how many prompts --write keeps")
    ap.add_argument("--write", type=Path, help="the best prompts as a sampling-prompts file")
    ap.add_argument("--tag", required=True)
    ap.add_argument("--out-dir", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        settings = sc.parse_settings(args.settings)
        for setting in settings:
            has_cut(setting, 1 << 30)
        backend_order(args.backend, {})
    except ValueError as e:
        ap.error(str(e))
    if min(args.samples, args.positions, args.best) < 1 or args.delta <= 0 or args.mass < 0:
        ap.error("--samples, --positions and --best take positive numbers, --delta a positive one, --mass >= 0")
    text = args.prompts.read_text()
    try:
        prompts = json.loads(text)
    except json.JSONDecodeError:
        prompts = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not prompts or not all(isinstance(p, dict) and p.get("prompt_ids") for p in prompts):
        ap.error(f"{args.prompts}: expected objects with prompt_ids")
    t0 = time.monotonic()
    ranked = rank_prompts(load_target(args.target, args.device), prompts, settings, args.samples, args.positions,
                          args.delta, args.mass, args.backend)
    result = {"what": "decided share of the target's continuations per prompt (benchmarks/sampling_boundaries.py)",
              "date": time.strftime("%Y-%m-%d"), "host": platform.node(), "argv": sys.argv[1:] if argv is None else argv,
              "delta": args.delta, "mass": args.mass, "backend": args.backend, "samples": args.samples,
              "settings": settings, "wall_s": round(time.monotonic() - t0, 1),
              "prompts": [{k: v for k, v in r.items() if k not in ("prompt_ids", "prompt")} for r in ranked]}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"sampling_boundaries_{args.tag}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    plt = pyplot()
    fig, axes = plt.subplots(1, len(settings), figsize=(5 * len(settings), 3.6), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        for i, r in enumerate(ranked):
            if setting["name"] in r["informative_share"]:
                ax.plot(range(1, args.positions + 1), r["informative_share"][setting["name"]],
                        color="C0" if i < args.best else "0.75", lw=1.5 if i < args.best else 0.8)
        ax.set(title=setting["name"], xlabel="position", ylabel="decided, 2+ tokens to choose from", ylim=(0, 1.02))
    fig.suptitle(f"delta {args.delta}, mass {args.mass}; best {args.best} of {len(ranked)} in colour", fontsize=9)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)
    print(f"wrote {path} and its plot")
    for r in ranked[: args.best]:
        print(f"  {r.get('source', '?')}: score {r['score']}, informative {r['informative_share']}, "
              f"decided {r['decided_share']}")
    if args.write:
        args.write.write_text(json.dumps(ranked[: args.best], indent=1) + "\n")
        print(f"wrote the best {args.best} prompts to {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
