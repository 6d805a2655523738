# SPDX-License-Identifier: Apache-2.0
"""What the penalties of a speculative step read: each request's output so far, on the GPU.

Upstream feeds its penalizers the last output token in ``prepare_for_decode``, a path
speculative decoding never takes, so under DFLASH the frequency, presence and
repetition penalties never saw an output token and ``min_new_tokens`` never counted
one. Under the overlap scheduler the host's view of a request's output also trails the
GPU by a step. So the table lives with the worker and is advanced on the GPU, in the
step's own stream, by the tokens the step commits; the host only assigns rows.

A row per penalised request (frequency, presence or repetition penalty, or
``min_new_tokens``): occurrence counts over the vocabulary of the output *before* the
current root (the last committed token, which the step's node paths include), the
number of those tokens, the request's penalty parameters and its stop tokens. A row is
filled when its request first decodes after a prefill (from the host's output ids, which
at that point are complete up to the root) and reclaimed once its request has finished
or been retracted (a retracted request prefills again and gets a fresh row). Requests
without penalties cost nothing.
"""

from __future__ import annotations

import weakref
from typing import Any, List, Optional, Sequence

import torch

from sglang.srt.speculative.verify_sampling.node_logits import PenaltyRows

#: Attribute on ``Req``: ``(table, (req_pool_idx, retraction_count), row)``.
_REQ_ATTR = "_verify_penalty_row"


def needs_penalty(sampling_params: Any) -> bool:
    return (
        sampling_params.frequency_penalty != 0.0
        or sampling_params.presence_penalty != 0.0
        or sampling_params.repetition_penalty != 1.0
        or sampling_params.min_new_tokens > 0
    )


def stop_token_ids(req: Any) -> List[int]:
    """The tokens ``min_new_tokens`` blocks: the request's stop ids, the tokenizer's
    additional stop ids and its EOS (upstream's ``BatchedMinNewTokensPenalizer``)."""
    tokenizer = getattr(req, "tokenizer", None)
    ids = set(req.sampling_params.stop_token_ids or ())
    if tokenizer is not None:
        ids |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is not None:
            ids.add(eos)
    return sorted(int(t) for t in ids)


def output_before_root(req: Any) -> Sequence[int]:
    """Output tokens committed before the root of the request's first decode step: those
    its last prefill covered (``origin_input_ids + output_ids`` at that time)."""
    n = len(req.full_untruncated_fill_ids) - len(req.origin_input_ids)
    return req.output_ids[: max(0, min(n, len(req.output_ids)))]


class PenaltyTable:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self.capacity = 0
        self.num_stop = 1
        self._owners: List[Optional[tuple]] = []  # per row: (weakref(req), key) or None
        self.counts = torch.zeros((0, self.vocab_size), dtype=torch.int32, device=self.device)
        self.out_len = torch.zeros((0,), dtype=torch.int32, device=self.device)
        self.frequency = torch.zeros((0,), dtype=torch.float32, device=self.device)
        self.presence = torch.zeros((0,), dtype=torch.float32, device=self.device)
        self.repetition = torch.ones((0,), dtype=torch.float32, device=self.device)
        self.min_new_tokens = torch.zeros((0,), dtype=torch.int32, device=self.device)
        self.stop_ids = torch.full((0, 1), -1, dtype=torch.int32, device=self.device)

    # ------------------------------------------------------------------ rows

    def rows_for(self, reqs: Sequence[Any]) -> Optional[PenaltyRows]:
        """This step's rows (``-1`` for requests without penalties), assigning and filling
        rows for requests that start decoding; ``None`` when no request is penalised."""
        rows: List[int] = []
        fresh = []
        for i, req in enumerate(reqs):
            if not needs_penalty(req.sampling_params):
                rows.append(-1)
                continue
            key = (req.req_pool_idx, req.retraction_count)
            held = getattr(req, _REQ_ATTR, None)
            if held is not None and held[0] is self and held[1] == key:
                rows.append(held[2])
            else:
                rows.append(-1)
                fresh.append((i, req, key))
        if fresh:
            live = {id(r) for r in reqs}
            for (i, req, key), row in zip(fresh, self._take_rows(len(fresh), live)):
                self._owners[row] = (weakref.ref(req), key)
                setattr(req, _REQ_ATTR, (self, key, row))
                rows[i] = row
            self._fill([req for _, req, _ in fresh], [rows[i] for i, _, _ in fresh])
        if all(r < 0 for r in rows):
            return None
        host = torch.tensor(rows, dtype=torch.int32, pin_memory=self._pin)
        return PenaltyRows(
            rows=host.to(self.device, non_blocking=True),
            counts=self.counts,
            out_len=self.out_len,
            frequency=self.frequency,
            presence=self.presence,
            repetition=self.repetition,
            min_new_tokens=self.min_new_tokens,
            stop_ids=self.stop_ids,
        )

    def _take_rows(self, n: int, live: set) -> List[int]:
        free = [r for r, o in enumerate(self._owners) if o is None]
        if len(free) < n:
            for r, owner in enumerate(self._owners):
                if owner is not None and self._reclaimable(owner, live):
                    self._owners[r] = None
                    free.append(r)
        if len(free) < n:
            old = self.capacity
            self._grow(max(2 * old, old + n - len(free), 8))
            free += list(range(old, self.capacity))
        return sorted(free)[:n]

    @staticmethod
    def _reclaimable(owner: tuple, live: set) -> bool:
        req = owner[0]()
        if req is None:
            return True
        if id(req) in live:
            return False
        return req.finished() or owner[1] != (req.req_pool_idx, req.retraction_count)

    def _grow(self, capacity: int) -> None:
        extra = capacity - self.capacity
        dev = self.device

        def more(t, fill):
            pad = torch.full((extra, *t.shape[1:]), fill, dtype=t.dtype, device=dev)
            return torch.cat([t, pad])

        self.counts = more(self.counts, 0)
        self.out_len = more(self.out_len, 0)
        self.frequency = more(self.frequency, 0.0)
        self.presence = more(self.presence, 0.0)
        self.repetition = more(self.repetition, 1.0)
        self.min_new_tokens = more(self.min_new_tokens, 0)
        self.stop_ids = more(self.stop_ids, -1)
        self._owners += [None] * extra
        self.capacity = capacity

    def _fill(self, reqs: Sequence[Any], rows: Sequence[int]) -> None:
        stops = [stop_token_ids(r) for r in reqs]
        width = max([len(s) for s in stops] + [1])
        if width > self.num_stop:
            pad = torch.full((self.capacity, width - self.num_stop), -1, dtype=torch.int32, device=self.device)
            self.stop_ids = torch.cat([self.stop_ids, pad], dim=1)
            self.num_stop = width
        history = [output_before_root(r) for r in reqs]
        pin = self._pin

        def h2d(values, dtype):
            return torch.tensor(values, dtype=dtype, pin_memory=pin).to(self.device, non_blocking=True)

        idx = h2d(list(rows), torch.int64)
        sp = [r.sampling_params for r in reqs]
        self.frequency[idx] = h2d([p.frequency_penalty for p in sp], torch.float32)
        self.presence[idx] = h2d([p.presence_penalty for p in sp], torch.float32)
        self.repetition[idx] = h2d([p.repetition_penalty for p in sp], torch.float32)
        self.min_new_tokens[idx] = h2d([p.min_new_tokens for p in sp], torch.int32)
        self.out_len[idx] = h2d([len(h) for h in history], torch.int32)
        self.stop_ids[idx] = h2d([s + [-1] * (self.num_stop - len(s)) for s in stops], torch.int32)
        self.counts[idx] = 0
        flat = [row * self.vocab_size + int(t) for row, h in zip(rows, history) for t in h]
        if flat:
            where = h2d(flat, torch.int64)
            self.counts.view(-1).index_add_(0, where, torch.ones_like(where, dtype=torch.int32))

    # ---------------------------------------------------------------- commit

    def commit(
        self,
        penalties: PenaltyRows,
        root: torch.Tensor,
        emitted: torch.Tensor,
        num_emitted: torch.Tensor,
    ) -> None:
        """Advance each penalised row by the step's root and the accepted drafts:
        ``emitted[b, :num_emitted[b] - 1]`` (the last emitted token is the next root)."""
        rows = penalties.rows.to(torch.int64)
        bs, width = emitted.shape
        has = rows >= 0
        n = num_emitted.to(torch.int64).view(bs, 1)
        col = torch.arange(width, device=emitted.device).view(1, width)
        tokens = torch.cat([root.view(bs, 1).to(torch.int64), emitted.to(torch.int64)], dim=1)
        take = torch.cat([has.view(bs, 1), (col < n - 1) & has.view(bs, 1)], dim=1)
        vocab = penalties.counts.shape[1]
        flat = torch.where(take, rows.view(bs, 1) * vocab + tokens.clamp(min=0), 0)
        penalties.counts.view(-1).index_add_(0, flat.view(-1), take.view(-1).to(torch.int32))
        penalties.out_len.index_add_(
            0, torch.where(has, rows, 0), torch.where(has, n.view(bs), 0).to(torch.int32)
        )
