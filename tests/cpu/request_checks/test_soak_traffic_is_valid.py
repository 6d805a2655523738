# SPDX-License-Identifier: Apache-2.0
"""The soak piece's own traffic passes upstream's request validation and patch 0084's checks:
a sample of its requests (and the greedy references asked of the no-speculation server) is
served by the real HTTP app and tokenizer manager, with the sampling parameters it asked for."""

from __future__ import annotations

import json

from tests.cpu.request_checks.conftest import CONTEXT, VOCAB
from tests.gpu.soak._load_mix import LoadMix, MixConfig


def test_soak_requests_are_served(served):
    mix = LoadMix(MixConfig(context_len=CONTEXT, vocab_size=VOCAB))
    for req in mix.sample(8, 6):
        body = req.body("tiny", stream=False)
        before = len(served.sent)
        status, answer = served.post(req.path, json.dumps(body).encode())
        assert status == 200, (req, answer[:300])
        (tokenized,) = served.sent[before:]
        assert list(tokenized.input_ids) == list(req.prompt)
        sp = tokenized.sampling_params
        assert sp.max_new_tokens == req.max_tokens and sp.ignore_eos
        assert sp.top_k == 1 if req.greedy else sp.temperature == dict(req.sampling)["temperature"]
        if req.greedy:
            status, _ = served.post(req.path, json.dumps(req.reference_body("tiny")).encode())
            assert status == 200


def test_the_soak_client_reads_upstreams_answers(over_http):
    """The soak's client (``_client.send``) over a real socket to upstream's app: it reads the
    native API's streamed chunks (cumulative ``output_ids``, ``meta_info``) and the OpenAI
    stream's text pieces and its closing usage chunk (``stream_options.include_usage``) as
    upstream writes them, and a client that leaves after a few events is counted as such."""
    from tests.gpu.soak._client import send
    from tests.gpu.soak._load_mix import SoakRequest

    prompt = (1, 17, 18, 300)
    for api in ("generate", "completions"):
        for stream in (False, True):
            req = SoakRequest(client=0, seq=0, api=api, prompt=prompt, max_tokens=10, greedy=True, stream=stream)
            out = send("cpu", over_http.base_url, "tiny", req, 60.0)
            assert out.problem() is None and out.completed, (api, stream, out)
            assert out.completion_tokens == 10 and out.cached_tokens == (0 if api == "generate" else None)
            if api == "generate":
                assert out.output_ids == [17] * 10
            else:
                assert out.text.split() == ["bako"] * 10
            assert (out.events > 1) == stream and (out.first_event_s is not None) == stream
        left = SoakRequest(client=0, seq=1, api=api, prompt=prompt, max_tokens=400, greedy=True, stream=True,
                           abort_after=2)  # fmt: skip
        out = send("cpu", over_http.base_url, "tiny", left, 60.0)
        assert out.aborted and out.events == 2 and out.problem() is None and not out.completed
