# SPDX-License-Identifier: Apache-2.0
"""The soak piece's traffic: a deterministic, endless stream of requests per client.

Every request is drawn from one seeded generator per (seed, client), so two servers of the
same target given the same seed see the same requests in the same order per client (the
greedy references are then shared), and a failure can be replayed from its (client, seq).

The mix (``MixConfig``): prompts of 1 token up to the context (log-uniform, so most are
short and some fill most of the context; the brief's 16K where the model allows it), half
of them opening with one of a few shared prefixes (radix-cache hits); ``max_tokens`` short,
medium and long; greedy and sampled (temperature, top-p, top-k); streaming and not; the
native ``/generate`` with token ids and ``/v1/completions`` with a token-id prompt; and a
share of long streaming requests whose client disconnects after a few events (or before the
first). Every request sets ``ignore_eos``, so a completed request has exactly
``max_tokens`` tokens, and ``prompt + max_tokens`` stays ``margin`` below the context.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Iterator, Optional

#: (weight, lo, hi) of max_tokens: short, medium and long outputs.
MAX_TOKENS_MIX = ((0.15, 1, 16), (0.45, 17, 256), (0.40, 257, 1024))
#: Sampled requests draw their parameters from these.
TEMPERATURES = (0.6, 1.0)
TOP_PS = (1.0, 0.95)
TOP_KS = (None, 20)
#: Aborted requests are long streams cut after this many events (0: before the first).
ABORT_AFTER_EVENTS = (0, 6)
ABORT_MIN_TOKENS = 256


@dataclass(frozen=True)
class MixConfig:
    context_len: int
    vocab_size: int
    seed: int = 0
    #: ids drawn for prompts: the test models' ordinary tokens (0..15 are special)
    first_token_id: int = 16
    #: the brief's longest prompt, cut to what the model's context allows
    max_prompt: int = 16384
    #: prompt + max_tokens stays this far below the context
    margin: int = 64
    greedy_share: float = 0.5
    stream_share: float = 0.5
    abort_share: float = 0.1
    openai_share: float = 0.25
    prefix_share: float = 0.5
    prefix_lens: tuple = (16, 64, 256, 1024, 2048)
    bos_id: int = 1


@dataclass(frozen=True)
class SoakRequest:
    client: int
    seq: int
    api: str  # "generate" (token ids in and out) or "completions" (OpenAI, text out)
    prompt: tuple
    max_tokens: int
    greedy: bool
    stream: bool
    #: events read before the client disconnects (streaming only); None: read to the end
    abort_after: Optional[int] = None
    #: the shared prefix the prompt opens with, if any
    prefix: Optional[int] = None
    sampling: tuple = field(default=())  # (name, value) pairs of a sampled request

    @property
    def path(self) -> str:
        return "/generate" if self.api == "generate" else "/v1/completions"

    def body(self, model: str, stream: Optional[bool] = None) -> dict:
        stream = self.stream if stream is None else stream
        params = dict(self.sampling) if not self.greedy else {"temperature": 0.0}
        if self.api == "generate":
            return {"input_ids": list(self.prompt), "stream": stream,
                    "sampling_params": {"max_new_tokens": self.max_tokens, "ignore_eos": True, **params}}  # fmt: skip
        body = {"model": model, "prompt": list(self.prompt), "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": stream, **params}  # fmt: skip
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def reference_body(self, model: str) -> dict:
        """The same greedy request, not streamed: what the no-speculation server answers."""
        assert self.greedy
        return self.body(model, stream=False)

    @property
    def reference_key(self) -> tuple:
        return (self.api, self.prompt, self.max_tokens)

    @property
    def tag(self) -> str:
        return f"client {self.client} request {self.seq}"


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    if hi <= lo:
        return lo
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


class LoadMix:
    def __init__(self, config: MixConfig):
        self.config = c = config
        if c.context_len - c.margin < 2:
            raise ValueError(f"context {c.context_len} leaves no room below the margin {c.margin}")
        rng = random.Random(f"prefixes-{c.seed}")
        self.longest = c.context_len - c.margin  # prompt + max_tokens <= this
        self.prefixes = [
            (c.bos_id,) + tuple(rng.randrange(c.first_token_id, c.vocab_size) for _ in range(n - 1))
            for n in c.prefix_lens
            if n < self.longest
        ]

    def _max_tokens(self, rng: random.Random) -> int:
        pick = rng.random()
        for weight, lo, hi in MAX_TOKENS_MIX:
            if pick < weight:
                break
            pick -= weight
        return min(rng.randint(lo, hi), self.longest - 1)

    def _prompt(self, rng: random.Random, length: int) -> tuple[tuple, Optional[int]]:
        c = self.config
        fits = [i for i, p in enumerate(self.prefixes) if len(p) <= length]
        if fits and rng.random() < c.prefix_share:
            i = rng.choice(fits)
            rest = length - len(self.prefixes[i])
            return self.prefixes[i] + tuple(rng.randrange(c.first_token_id, c.vocab_size) for _ in range(rest)), i
        return (c.bos_id,) + tuple(rng.randrange(c.first_token_id, c.vocab_size) for _ in range(length - 1)), None

    def client_requests(self, client: int) -> Iterator[SoakRequest]:
        c = self.config
        rng = random.Random(f"client-{c.seed}-{client}")
        seq = 0
        while True:
            abort = rng.random() < c.abort_share
            max_tokens = self._max_tokens(rng)
            if abort:
                max_tokens = max(max_tokens, min(ABORT_MIN_TOKENS, self.longest - 1))
            length = _log_uniform(rng, 1, min(c.max_prompt, self.longest - max_tokens))
            prompt, prefix = self._prompt(rng, length)
            greedy = rng.random() < c.greedy_share
            sampling = ()
            if not greedy:
                top_k = rng.choice(TOP_KS)
                sampling = (("temperature", rng.choice(TEMPERATURES)), ("top_p", rng.choice(TOP_PS)))
                sampling += (("top_k", top_k),) if top_k is not None else ()
            yield SoakRequest(
                client=client,
                seq=seq,
                api="completions" if rng.random() < c.openai_share else "generate",
                prompt=prompt,
                max_tokens=max_tokens,
                greedy=greedy,
                stream=abort or rng.random() < c.stream_share,
                abort_after=rng.randint(*ABORT_AFTER_EVENTS) if abort else None,
                prefix=prefix,
                sampling=sampling,
            )
            seq += 1

    def sample(self, clients: int, per_client: int) -> list:
        """The first ``per_client`` requests of each client."""
        out = []
        for client in range(clients):
            stream = self.client_requests(client)
            out += [next(stream) for _ in range(per_client)]
        return out

    def mean_request_tokens(self, clients: int = 64, per_client: int = 64) -> float:
        """Mean prompt + max_tokens over a sample of the mix: a request's KV footprint when it finishes."""
        reqs = self.sample(clients, per_client)
        return sum(len(r.prompt) + r.max_tokens for r in reqs) / len(reqs)


def pool_tokens(mix: LoadMix, clients: int, fraction: float = 0.25, round_to: int = 1024) -> int:
    """A KV pool of ``fraction`` of the offered load (``clients`` requests in flight at their
    full length), rounded up, and never below one request at the whole context plus room
    for the speculative step's reserve."""
    offered = clients * mix.mean_request_tokens()
    floor = mix.config.context_len + round_to
    tokens = max(offered * fraction, floor)
    return int(math.ceil(tokens / round_to) * round_to)
