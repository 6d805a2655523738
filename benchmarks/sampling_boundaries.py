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
than rounding does to a sum. ``truncate_undecided`` ends every continuation at its first undecided context, a
function of the continuation's own prefix: if two servers sample alike wherever the cut is
decided, their truncated samples have one distribution, so the sampling check can test
exactness there and report how much of each sample it had to leave out.

``decided`` is the vectorised test; ``filtered_set`` the plain definition it is tested against.
"""

from __future__ import annotations

import copy
import math
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
    """The order ``backend`` (SGLang's ``--sampling-backend``) applies ``setting``'s filters in."""
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
