# SPDX-License-Identifier: Apache-2.0
"""Requests, batches and the per-node reference: upstream's own penalizers and sampler run on
one request whose output so far is the node's root path."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams

EOS = 1
VOCAB = 48


class Tokenizer:
    eos_token_id = EOS
    additional_stop_token_ids = {3}


class Req:
    """The fields of ``schedule_batch.Req`` the sampler and the verify read."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int], output: Sequence[int],
                 pool_idx: int = 0, prefilled_outputs: Optional[int] = None):
        self.sampling_params = params
        self.tokenizer = Tokenizer()
        self.origin_input_ids = list(prompt)
        self.output_ids = list(output)
        n = len(output) if prefilled_outputs is None else prefilled_outputs
        self.full_untruncated_fill_ids = self.origin_input_ids + self.output_ids[:n]
        self.req_pool_idx = pool_idx
        self.retraction_count = 0
        self.custom_logit_processor = None
        self.return_sampling_mask = False
        self.return_logprob = False
        self.return_hidden_states = False
        self.done = False

    def finished(self) -> bool:
        return self.done


class Batch:
    def __init__(self, reqs):
        self.reqs = list(reqs)
        self.device = "cpu"


def params(**kw) -> SamplingParams:
    kw.setdefault("max_new_tokens", 64)
    return SamplingParams(**kw)


def forward_info(reqs, vocab: int) -> SamplingBatchInfo:
    """The sampling info a forward gets (``copy_for_forward``), built by upstream."""
    return SamplingBatchInfo.from_schedule_batch(Batch(reqs), vocab).copy_for_forward()


BATCH_FLAGS = ("is_all_greedy", "need_top_k_sampling", "need_top_p_sampling", "need_min_p_sampling")


def _upstream_sample(sampler, p: SamplingParams, output: Sequence[int], logits: torch.Tensor, position: int,
                     vocab: int, batch_info=None):
    """Upstream's penalizers fed ``output`` token by token, its logit adjustments (overlap-mode
    order) and its sampler on ``logits``: (the token, the row the sampler was given)."""
    req = Req(p, [5, 6, 7], output)
    info = SamplingBatchInfo.from_schedule_batch(Batch([req]), vocab)
    for t in output:
        info.penalizer_orchestrator.cumulate_output_tokens(torch.tensor([t]))
    fwd = info.copy_for_forward()
    if batch_info is not None:
        for flag in BATCH_FLAGS:
            setattr(fwd, flag, getattr(batch_info, flag))
    row = logits.clone().view(1, -1)
    fwd.apply_logits_bias(row)
    ids = sampler.forward(LogitsProcessorOutput(next_token_logits=row), fwd, False, [], [], torch.tensor([position]))
    return int(ids.view(-1)[0]), row


def upstream_node_token(sampler, p: SamplingParams, output: Sequence[int], logits: torch.Tensor,
                        position: int, vocab: int, batch_info=None) -> int:
    """What the server without speculation samples after ``output``.

    Upstream picks the sampling path per batch (a request without top-k is still drawn by the
    top-k kernel when another request of its batch has one, which changes a seeded draw):
    ``batch_info``'s flags make the reference the request's draw inside that batch."""
    return _upstream_sample(sampler, p, output, logits, position, vocab, batch_info)[0]


def upstream_node_distribution(sampler, p: SamplingParams, output: Sequence[int], logits: torch.Tensor,
                               vocab: int, batch_info=None) -> torch.Tensor:
    """``[V]`` float64, vocabulary order: the distribution upstream's sampler (the pytorch
    backend, unseeded) draws the token after ``output`` from. Its torch.multinomial weights
    are over the probabilities sorted in descending order (distinct for random logits);
    the sampler leaves those probabilities in the row it was given."""
    weights = []
    real = torch.multinomial

    def record(w, num_samples, *args, **kwargs):
        weights.append(w.double().view(-1))
        return real(w, num_samples, *args, **kwargs)

    torch.multinomial = record
    try:
        _, row = _upstream_sample(sampler, p, output, logits, 0, vocab, batch_info)
    finally:
        torch.multinomial = real
    (w,) = weights
    out = torch.zeros(vocab, dtype=torch.float64)
    out[torch.argsort(row.view(-1), descending=True, stable=True)] = w
    return out / out.sum()


def random_tree(gen: torch.Generator, bs: int, n: int, vocab: int):
    """Parents drawn uniformly among earlier nodes (node 0 the root)."""
    parent = torch.full((bs, n), -1, dtype=torch.int64)
    depth = torch.zeros((bs, n), dtype=torch.int32)
    for b in range(bs):
        for i in range(1, n):
            p = int(torch.randint(0, i, (1,), generator=gen))
            parent[b, i] = p
            depth[b, i] = depth[b, p] + 1
    tokens = torch.randint(0, vocab, (bs, n), generator=gen)
    return tokens, parent, depth


def root_path(tokens, parent, b: int, i: int) -> list[int]:
    """Tokens from the root to node i (inclusive)."""
    out = []
    j = i
    while j >= 0:
        out.append(int(tokens[b, j]))
        j = int(parent[b, j])
    return out[::-1]
