# SPDX-License-Identifier: Apache-2.0
"""The soak piece's own traffic passes upstream's request validation and patch 0082's checks:
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
