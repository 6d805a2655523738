# SPDX-License-Identifier: Apache-2.0
"""The soak piece's traffic (tests/gpu/soak/_load_mix.py): deterministic per client, within the
model's context, the mix the piece promises, and a KV pool of a quarter of the offered load."""

from __future__ import annotations

import statistics

import pytest

from tests.gpu.soak._load_mix import ABORT_MIN_TOKENS, LoadMix, MixConfig, pool_tokens

TINY = MixConfig(context_len=4096, vocab_size=512)


@pytest.fixture(scope="module")
def sample():
    return LoadMix(TINY).sample(64, 64)


def test_each_client_replays_the_same_requests():
    a, b = LoadMix(TINY), LoadMix(TINY)
    first = [next(a.client_requests(3)) for _ in range(2)]
    assert first[0] == first[1]
    assert a.sample(4, 20) == b.sample(4, 20)
    assert a.sample(4, 20) != LoadMix(MixConfig(context_len=4096, vocab_size=512, seed=1)).sample(4, 20)
    assert [r.seq for r in a.sample(1, 5)] == list(range(5))


def test_requests_fit_the_context_and_the_vocabulary(sample):
    for r in sample:
        assert len(r.prompt) >= 1 and r.max_tokens >= 1
        assert len(r.prompt) + r.max_tokens <= TINY.context_len - TINY.margin
        assert r.prompt[0] == TINY.bos_id
        assert all(TINY.first_token_id <= t < TINY.vocab_size for t in r.prompt[1:])


def test_the_mix(sample):
    n = len(sample)
    lengths = [len(r.prompt) for r in sample]
    assert min(lengths) == 1 and max(lengths) > 3000  # 1 token up to most of the context
    assert statistics.median(lengths) < 200  # log-uniform: mostly short
    assert 0.45 < sum(r.greedy for r in sample) / n < 0.55
    assert 0.5 < sum(r.stream for r in sample) / n < 0.65  # half, plus the aborted streams
    assert 0.08 < sum(r.abort_after is not None for r in sample) / n < 0.12
    assert 0.2 < sum(r.api == "completions" for r in sample) / n < 0.3
    outputs = [r.max_tokens for r in sample]
    assert min(outputs) == 1 and max(outputs) > 900
    for r in sample:
        if r.abort_after is not None:
            assert r.stream and r.max_tokens >= ABORT_MIN_TOKENS and 0 <= r.abort_after <= 6
        if not r.greedy:
            params = dict(r.sampling)
            assert params["temperature"] > 0 and 0 < params["top_p"] <= 1


def test_shared_prefixes_repeat(sample):
    mix = LoadMix(TINY)
    with_prefix = [r for r in sample if r.prefix is not None]
    assert len(with_prefix) > len(sample) // 5
    for r in with_prefix:
        assert r.prompt[: len(mix.prefixes[r.prefix])] == mix.prefixes[r.prefix]
    assert len({r.prefix for r in with_prefix}) == len(mix.prefixes) == len(TINY.prefix_lens)


def test_prompts_reach_16k_where_the_context_allows():
    mix = LoadMix(MixConfig(context_len=32768, vocab_size=512))
    lengths = [len(r.prompt) for r in mix.sample(32, 64)]
    assert max(lengths) <= 16384 and max(lengths) > 8192


def test_request_bodies():
    mix = LoadMix(TINY)
    reqs = mix.sample(8, 32)
    gen = next(r for r in reqs if r.api == "generate" and r.greedy and r.stream)
    body = gen.body("tiny")
    assert body["input_ids"] == list(gen.prompt) and body["stream"] is True
    assert body["sampling_params"] == {"max_new_tokens": gen.max_tokens, "ignore_eos": True, "temperature": 0.0}
    ref = gen.reference_body("tiny")
    assert ref["stream"] is False and ref["sampling_params"] == body["sampling_params"]
    cmpl = next(r for r in reqs if r.api == "completions" and not r.greedy and r.stream)
    body = cmpl.body("tiny")
    assert body["model"] == "tiny" and body["prompt"] == list(cmpl.prompt) and body["max_tokens"] == cmpl.max_tokens
    assert body["stream_options"] == {"include_usage": True} and body["temperature"] > 0 and body["ignore_eos"]
    assert cmpl.path == "/v1/completions" and gen.path == "/generate"
    with pytest.raises(AssertionError):
        cmpl.reference_body("tiny")


def test_pool_is_a_quarter_of_the_offered_load():
    mix = LoadMix(TINY)
    offered = 64 * mix.mean_request_tokens()
    pool = pool_tokens(mix, 64)
    assert pool % 1024 == 0 and offered / 4 <= pool < offered / 4 + 1024
    assert pool_tokens(mix, 64, fraction=0.5) > pool
    # a few clients: never below one request at the whole context and some room
    assert pool_tokens(mix, 2) == TINY.context_len + 1024


def test_a_context_too_short_is_refused():
    with pytest.raises(ValueError, match="leaves no room"):
        LoadMix(MixConfig(context_len=64, vocab_size=512))
