# SPDX-License-Identifier: Apache-2.0
"""A request's req_to_token row holds every slot its decode steps reserve (patch 0074).

Each speculative decode step reserves ``kv_committed_len + 2 x num_draft_tokens`` slots per
request (DFLASH's ``prepare_for_decode``; EAGLE's ``eagle_prepare_for_decode`` likewise) and
writes them into the request's row with ``assign_req_to_token_pool``, which has no row
bound. A running request holds at most ``context_len - 1`` tokens, so the row must reach
``context_len - 1 + reserve``. Run on the real ``ServerArgs`` of DFLASH and DDTREE servers
(the sizing functions upstream and the scheduler use) and on the real Triton row writer
(interpreted), with a neighbour row beside the request at the context limit.
"""

from __future__ import annotations

import pytest
import torch


def row_layout(server_args):
    """(context length, row width, slots reserved per decode step)."""
    from sglang.srt.mem_cache.allocation_sizing import (
        get_alloc_reserve_per_decode,
        get_req_to_token_extra_context_len,
    )

    context_len = server_args.get_model_config().context_len
    width = context_len + get_req_to_token_extra_context_len(server_args)
    return context_len, width, get_alloc_reserve_per_decode(server_args)


CASES = [
    ("qwen3-8b-shape", "DFLASH", {}),
    ("qwen3-8b-shape", "DDTREE", {"speculative_ddtree_budget": 16}),
    ("qwen3-8b-shape", "DDTREE", {"speculative_ddtree_budget": 64}),
    ("v2lite-shape", "DDTREE", {"speculative_ddtree_budget": 128}),
    ("qwen3-8b-shape", "DFLASH", {"page_size": 16}),
]


@pytest.mark.parametrize("pair,algorithm,extra", CASES, ids=lambda c: str(c))
def test_the_row_reaches_the_reserve_of_a_request_at_the_context_limit(configured, pair, algorithm, extra):
    sa = configured(pair, algorithm, **extra).server_args
    context_len, width, reserve = row_layout(sa)
    # what DFLASH's prepare_for_decode reserves (DDTREE decodes through it)
    assert reserve == 2 * sa.speculative_num_draft_tokens
    committed = context_len - 1
    assert width >= committed + reserve + sa.page_size - 1, (width, committed, reserve)


@pytest.mark.parametrize("pair,algorithm,extra", CASES[:3], ids=lambda c: str(c))
def test_the_row_writer_stays_in_the_requests_row(configured, pair, algorithm, extra):
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    sa = configured(pair, algorithm, **extra).server_args
    context_len, width, reserve = row_layout(sa)
    pool = ReqToTokenPool(size=2, max_context_len=width, device="cpu", enable_memory_saver=False)
    req_to_token = pool.req_to_token
    req_to_token.fill_(-1)
    # the request in row 0 at the context limit, its neighbour in row 1
    cur = torch.tensor([context_len - 1], dtype=torch.int32)
    nxt = cur + reserve
    slots = torch.arange(1000, 1000 + reserve, dtype=torch.int64)
    assign_req_to_token_pool[(1,)](
        torch.tensor([0], dtype=torch.int64), req_to_token, cur, nxt, slots, req_to_token.shape[1], 1
    )
    assert torch.equal(req_to_token[0, context_len - 1 : context_len - 1 + reserve].long(), slots)
    assert bool((req_to_token[1] == -1).all()), "the reserve spilled into the neighbour's row"
