# SPDX-License-Identifier: Apache-2.0
"""The soak piece's malformed-request loop (``_checks.malformed_problems``, what the GPU test
runs on each server) over a real socket: upstream's HTTP app served by uvicorn, as the server
serves it, in front of the real tokenizer manager (``conftest.over_http``). Every case is refused
as the table says and the normal request after each is served.

The loop runs a few cases at a time; on a scripted server (``conftest.scripted``) it still
records every case's status in the table's order, flags a wrong answer and a normal request
not served, and stops at a server that dies, naming the cases in flight."""

from __future__ import annotations

import logging
import time

import pytest

from tests.cpu.request_checks.conftest import CONTEXT, VOCAB
from tests.gpu.soak._checks import malformed_problems
from tests.gpu.soak._malformed import CASES, Ctx, Malformed
from tests.gpu.soak._verdict import error_lines


def test_every_case_refused_and_the_next_request_served(over_http, served, caplog):
    """... and the server logs no traceback for any of them (the GPU test fails on one)."""
    cases = [c for c in CASES if not c.spec_only]
    ctx = Ctx(model="tiny", context_len=CONTEXT, vocab_size=VOCAB, prompt=(1, 17, 18, 300))
    before = len(served.sent)
    messages = {}
    with caplog.at_level(logging.INFO):
        problems, answers = malformed_problems(over_http, ctx, cases, messages=messages)
    assert problems == []
    assert answers == {c.name: 400 for c in cases} and list(answers) == [c.name for c in cases]
    assert len(served.sent) - before == len(cases)  # only the normal requests reached the scheduler
    assert any("[http_server] Error" in r.getMessage() for r in caplog.records)  # the log is seen
    # The soak sends these during its load and checks the load's log: each refusal's line is
    # excused by the message its 400 carried, and nothing else is.
    log = "\n".join(f"[2026-12-06 10:00:00] {r.getMessage()}" for r in caplog.records)
    assert set(messages) == {c.name for c in cases} and all(messages.values())
    assert error_lines(log) and error_lines(log, messages.values()) == []
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


def test_a_case_served_instead_is_flagged(over_http):
    """Without speculation the app serves the ``spec_only`` cases: each is flagged, with its
    status, among the others' 400s, in the table's order."""
    ctx = Ctx(model="tiny", context_len=CONTEXT, vocab_size=VOCAB, prompt=(1, 17, 18, 300))
    cases = [c for c in CASES if not c.heavy]
    spec_only = [c.name for c in cases if c.spec_only]
    problems, answers = malformed_problems(over_http, ctx, cases)
    assert list(answers) == [c.name for c in cases]
    assert answers == {c.name: 200 if c.spec_only else 400 for c in cases}
    assert spec_only and [p.split(", expected 400: ")[0] for p in problems] == [
        f"cpu-upstream-app: {name}: HTTP 200" for name in spec_only]  # fmt: skip


# ------------------------------------------------------------------ the loop on a scripted server

CTX = Ctx(model="tiny", context_len=CONTEXT, vocab_size=VOCAB, prompt=(1, 17, 18))


def case(name: str, **script) -> Malformed:
    """A case the scripted server answers as ``script`` says; refused as expected by default."""
    return Malformed(name, "/generate", lambda c: {"case": name, "refuse": f"{name} is wrong", **script}, name)


def test_cases_run_a_few_at_a_time_and_are_reported_in_order(scripted):
    cases = [case(f"slow_{i}", sleep=0.3) for i in range(12)]
    t0 = time.monotonic()
    problems, answers = malformed_problems(scripted, CTX, cases, workers=4)
    assert problems == [] and list(answers.items()) == [(c.name, 400) for c in cases]
    assert scripted.most_cases_at_once == 4 and scripted.normal_served == 12
    assert time.monotonic() - t0 < 12 * 0.3  # not one after another


def test_one_worker_is_one_after_another_the_10mb_cases_first(scripted):
    cases = [case("first"), case("body_10mb_a"), case("second"), case("body_10mb_b")]
    problems, answers = malformed_problems(scripted, CTX, cases, workers=1)
    assert problems == [] and list(answers) == ["first", "body_10mb_a", "second", "body_10mb_b"]
    assert scripted.cases_seen == ["body_10mb_a", "body_10mb_b", "first", "second"]
    assert scripted.most_cases_at_once == 1 and scripted.normal_served == 4


def test_a_wrong_answer_is_flagged_and_the_others_pass(scripted):
    cases = [case(f"ok_{i}", sleep=0.05) for i in range(6)]
    cases[1] = case("served", status=200, sleep=0.05)
    cases[4] = case("vague", refuse="no", sleep=0.05)
    problems, answers = malformed_problems(scripted, CTX, cases)
    assert answers == {c.name: 200 if c.name == "served" else 400 for c in cases}
    assert len(problems) == 2, problems
    assert problems[0].startswith("scripted: served: HTTP 200, expected 400")
    assert problems[1].startswith("scripted: vague: the message does not mention 'vague'")
    assert scripted.normal_served == 6


def test_a_normal_request_not_served_is_flagged(scripted):
    cases = [case("before"), case("breaks", break_next=True), case("after")]
    problems, answers = malformed_problems(scripted, CTX, cases, workers=1)
    assert answers == {"before": 400, "breaks": 400, "after": 400}
    assert len(problems) == 1 and problems[0].startswith("scripted: the normal request after breaks: ")
    assert "HTTP 500" in problems[0] and scripted.alive()


def test_a_server_that_dies_stops_the_loop_naming_the_cases_in_flight(scripted):
    """The two slow cases are still in flight when the third kills the server; none of the
    rest is sent, and every case sent has its status."""
    cases = [case("slow_a", sleep=1.0), case("slow_b", sleep=1.0), case("kill", kill=True),
             *[case(f"later_{i}") for i in range(6)]]  # fmt: skip
    problems, answers = malformed_problems(scripted, CTX, cases, workers=3)
    assert answers == {"slow_a": 0, "slow_b": 0, "kill": 0}
    assert problems[-1] == ("scripted: died after one of slow_a, slow_b, kill (in flight together); "
                            "6 of 9 cases not sent")  # fmt: skip
    assert [p.split(":")[1].strip() for p in problems[:-1]] == ["slow_a", "slow_b", "kill"]  # no answer: HTTP 0
    # (slow_b, taken before kill, may reach the server after it and find it dead)
    assert "kill" in scripted.cases_seen and set(scripted.cases_seen) <= {"slow_a", "slow_b", "kill"}
    assert scripted.normal_served == 0


def test_a_server_that_dies_alone_names_its_case(scripted):
    cases = [case("first"), case("kill", kill=True), case("never")]
    problems, answers = malformed_problems(scripted, CTX, cases, workers=1)
    assert answers == {"first": 400, "kill": 0}
    assert problems[-1] == "scripted: died after kill; 1 of 3 cases not sent" and len(problems) == 2
    assert scripted.normal_served == 1
