# SPDX-License-Identifier: Apache-2.0
"""The soak piece's malformed-request loop (``_checks.malformed_problems``, what the GPU test
runs on each server) over a real socket: upstream's HTTP app served by uvicorn, as the server
serves it, in front of the real tokenizer manager (``conftest.over_http``). Every case is refused
as the table says and the normal request after each is served."""

from __future__ import annotations

import logging
import time

import pytest

from tests.cpu.request_checks.conftest import CONTEXT, VOCAB
from tests.gpu.soak._checks import malformed_problems
from tests.gpu.soak._malformed import CASES, Ctx
from tests.gpu.soak._verdict import error_lines


def test_every_case_refused_and_the_next_request_served(over_http, served, caplog):
    """... and the server logs no traceback for any of them (the GPU test fails on one)."""
    cases = [c for c in CASES if not c.spec_only]
    ctx = Ctx(model="tiny", context_len=CONTEXT, vocab_size=VOCAB, prompt=(1, 17, 18, 300))
    before = len(served.sent)
    with caplog.at_level(logging.INFO):
        problems, answers = malformed_problems(over_http, ctx, cases)
    assert problems == []
    assert answers == {c.name: 400 for c in cases}
    assert len(served.sent) - before == len(cases)  # only the normal requests reached the scheduler
    assert any("[http_server] Error" in r.getMessage() for r in caplog.records)  # the log is seen
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert not [r for r in caplog.records if any(m in r.getMessage() for m in ("hit an exception", "Internal server"))]


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_a_client_leaving_mid_stream_logs_no_error(over_http, caplog, path):
    """The soak fails on an error line in a server log; a client that drops a stream (one
    request in ten of its load) must not cause one in the HTTP layer."""
    import http.client
    import json

    body = ({"input_ids": [1, 17, 18], "sampling_params": {"max_new_tokens": 400}, "stream": True}
            if path == "/generate" else
            {"model": "tiny", "prompt": [1, 17, 18], "max_tokens": 400, "stream": True})  # fmt: skip
    with caplog.at_level(logging.DEBUG):
        conn = http.client.HTTPConnection("127.0.0.1", int(over_http.base_url.rsplit(":", 1)[1]), timeout=30)
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        events = 0
        while events < 3:
            if resp.readline().startswith(b"data:"):
                events += 1
        conn.close()
        time.sleep(3.0)  # the stream notices, the abort task runs
    lines = [f"{r.name}: {r.getMessage()}" for r in caplog.records]
    assert not error_lines("\n".join(lines)), lines
    assert not [r for r in caplog.records if r.exc_info], lines
