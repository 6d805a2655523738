# SPDX-License-Identifier: Apache-2.0
"""What the soak piece reads from server logs and /metrics (tests/gpu/soak/_verdict.py), checked
against the pinned upstream: the access line as upstream configures uvicorn to write it, the
scheduler's retraction line as its source writes it, the metric names its collector exports."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from tests.gpu.soak import _verdict
from tests.gpu.soak._client import Outcome
from tests.gpu.soak._load_mix import SoakRequest


def _upstream_source(relative: str) -> str:
    import sglang

    return (Path(sglang.__file__).parent / relative).read_text()


def _access_line(path: str, status: int) -> str:
    """An access line formatted the way the server writes it: upstream's uvicorn formats
    (``set_uvicorn_logging_configs``) and uvicorn's own AccessFormatter and call."""
    from uvicorn.config import LOGGING_CONFIG
    from uvicorn.logging import AccessFormatter

    from sglang.srt.utils.common import set_uvicorn_logging_configs

    set_uvicorn_logging_configs()
    fmt = LOGGING_CONFIG["formatters"]["access"]
    formatter = AccessFormatter(fmt=fmt["fmt"], datefmt=fmt["datefmt"], use_colors=False)
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:40312", "POST", path, "1.1", status), None)  # fmt: skip
    return formatter.format(record)


def test_access_lines_as_the_server_writes_them():
    ok, bad = _access_line("/generate", 200), _access_line("/v1/completions", 500)
    assert '"POST /generate HTTP/1.1" 200' in ok and "INFO" in ok
    log = "\n".join([ok, ok, bad, "[2026-12-03 10:00:00] Prefill batch. #new-seq: 1"])
    assert _verdict.access_statuses(log) == {200: 2, 500: 1}
    assert _verdict.server_error_answers(log) == [bad]


def test_the_retraction_line_as_the_scheduler_writes_it():
    src = _upstream_source("srt/managers/scheduler.py")
    assert '"KV cache pool is full. Retract requests. "' in src
    assert 'msg_details = f"#retracted_reqs: {len(retracted_reqs)}, #new_tokens_gained: {new_token_gained}"' in src
    line = ("[2026-12-03 10:00:00] KV cache pool is full. Retract requests. #retracted_reqs: 3, "
            "#new_tokens_gained: 1210, #new_token_ratio: 0.4133 -> 0.5133")  # fmt: skip
    test_line = "[2026-12-03 10:00:01] Testing retraction. #retracted_reqs: 1, #new_tokens_gained: 12"
    assert _verdict.retractions("\n".join([line, test_line, line.replace("3,", "1,")])) == (2, 4)


def test_the_metrics_read_are_exported_by_upstream():
    src = _upstream_source("srt/observability/metrics_collector.py")
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_used_tokens",
                 "sglang:kv_available_tokens", "sglang:kv_evictable_tokens", "sglang:num_retracted_requests_total",
                 "sglang:num_aborted_requests_total", "sglang:spec_accept_length"):  # fmt: skip
        assert f'"{name}"' in src or f'"{name.removesuffix("_total")}"' in src, name


def test_the_leak_messages_are_upstreams():
    src = _upstream_source("srt/managers/scheduler_components/invariant_checker.py")
    assert "memory leak detected!" in src and "Mem Leak Detected!" in src
    assert any(p in "req_to_token_pool memory leak detected!" for p in _verdict.ERROR_PATTERNS)
    assert _upstream_source("srt/entrypoints/engine.py").count("Received sigquit from a child process") == 1


def test_error_lines():
    log = "\n".join([
        "[2026-12-03 10:00:00] Decode batch. #running-req: 8, #token: 900",
        "[2026-12-03 10:00:01] Scheduler hit an exception: Traceback (most recent call last):",
        "[2026-12-03 10:00:02] Request is disconnected from the client side (type 3). Abort request obj.rid='x'",
        "[2026-12-03 10:00:03] KV cache pool is full. Retract requests. #retracted_reqs: 1",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    ])  # fmt: skip
    assert _verdict.error_lines(log) == [log.splitlines()[1], log.splitlines()[4]]


def test_start_timeline_reads_upstreams_start_lines():
    """The marks are upstream's words; the timeline is seconds after the spawn, up to the
    server being fired up, in the log's own format (``utils/common.py``'s ``[%(asctime)s...]``)."""
    sources = "".join(_upstream_source(f) for f in (
        "srt/distributed/bootstrap.py", "srt/model_executor/model_runner.py",
        "srt/mem_cache/kv_cache_configurator.py", "srt/model_executor/model_runner_components/cuda_graph_setup.py",
        "srt/entrypoints/http_server.py"))  # fmt: skip
    for mark in _verdict.START_MARKS:
        if mark.startswith("CUDA graph"):
            assert f"{{capture_name}} {mark}" in sources, mark
        else:
            assert mark in sources, mark
    assert '[%(asctime)s{maybe_ms}{prefix}] %(message)s' in _upstream_source("srt/utils/common.py")
    t0 = time.mktime(time.strptime("2026-12-06 20:03:00", "%Y-%m-%d %H:%M:%S"))
    log = "\n".join([
        "some import warning",
        "[2026-12-06 20:03:14] server_args=ServerArgs(model_path='x')",
        "[2026-12-06 20:03:20 TP0] Init torch distributed begin.",
        "[2026-12-06 20:03:25 TP0] Load weight begin. avail mem=78.00 GB",
        "[2026-12-06 20:03:26 TP0] Load weight end. elapsed=0.52 s, type=Qwen3ForCausalLM",
        "[2026-12-06 20:03:27.123 TP0] Memory pool end. avail mem=60.00 GB",
        "[2026-12-06 20:03:27 TP0] Capture target decode CUDA graph begin. This can take up to several minutes.",
        "[2026-12-06 20:04:10 TP0] Capture target decode CUDA graph end. elapsed=43.00 s, mem usage=0.10 GB.",
        "[2026-12-06 20:04:30] The server is fired up and ready to roll!",
        "[2026-12-06 20:05:00 TP0] Capture target decode CUDA graph begin. (a later line)",
    ])  # fmt: skip
    assert _verdict.start_timeline(log, t0) == [
        [14.0, "first log line"], [20.0, "Init torch distributed begin."], [25.0, "Load weight begin"],
        [26.0, "Load weight end"], [27.0, "Memory pool end"], [27.0, "Capture target decode CUDA graph begin"],
        [70.0, "Capture target decode CUDA graph end"], [90.0, "The server is fired up and ready to roll!"]]  # fmt: skip
    assert _verdict.start_timeline("no timestamps here", t0) == []


def test_error_lines_excuse_only_the_refusals_provoked():
    log = "\n".join([
        "[2026-12-06 10:00:00] [http_server] Error: top_k must be -1 (disable) or a positive integer, got -5.",
        "[2026-12-06 10:00:01] [http_server] Error: top_k must be -1 (disable) or a positive integer, got -7.",
        "[2026-12-06 10:00:02] [http_server] Error: ",
        "[2026-12-06 10:00:03] Scheduler hit an exception: top_k must be -1 (disable) or a positive integer, got -5.",
    ])  # fmt: skip
    lines = log.splitlines()
    provoked = ["top_k must be -1 (disable) or a positive integer, got -5.\nmore detail", ""]
    assert _verdict.error_lines(log, provoked) == lines[1:]
    assert _verdict.error_lines(log) == lines


@pytest.mark.parametrize("values,q,want", [([], 50, None), ([3.0], 99, 3.0), ([1, 2, 3, 4], 50, 2.5),
                                           (list(range(101)), 99, 99.0), ([5, 1, 3], 0, 1)])  # fmt: skip
def test_percentile(values, q, want):
    assert _verdict.percentile(values, q) == want


def _metrics(**kw):
    base = {"sglang:num_running_reqs": 0.0, "sglang:num_queue_reqs": 0.0, "sglang:num_used_tokens": 0.0,
            "sglang:kv_available_tokens": 900.0, "sglang:kv_evictable_tokens": 124.0}  # fmt: skip
    return {**base, **kw}


def test_idle_pool():
    assert _verdict.idle_pool_problems(_metrics(), 1024) == []
    assert _verdict.idle_pool_problems(_metrics(**{"sglang:num_used_tokens": 16.0}), 1024) == [
        "sglang:num_used_tokens = 16 once idle, expected 0"]
    assert "8 held" in _verdict.idle_pool_problems(_metrics(**{"sglang:kv_available_tokens": 892.0}), 1024)[0]
    assert "is not on /metrics" in _verdict.idle_pool_problems({}, 1024)[0]


def _outcome(api, ids, greedy=True, **kw):
    req = SoakRequest(client=0, seq=0, api=api, prompt=(1, 20), max_tokens=len(ids), greedy=greedy, stream=False)
    out = Outcome(server="s", req=req, status=200, output_ids=ids if api == "generate" else None,
                  text=" ".join(f"w{t}" for t in ids) if api == "completions" else None,
                  completion_tokens=len(ids))  # fmt: skip
    for k, v in kw.items():
        setattr(out, k, v)
    return out


def test_greedy_mismatches():
    got, same, other = _outcome("generate", [5, 6, 7]), _outcome("generate", [5, 6, 7]), _outcome("generate", [5, 9, 7])
    key = got.req.reference_key
    assert _verdict.greedy_mismatches([got], {key: same}) == []
    assert "at output position 1 (got [6, 7], want [9, 7])" in _verdict.greedy_mismatches([got], {key: other})[0]
    assert "no reference answer" in _verdict.greedy_mismatches([got], {})[0]
    failed = _outcome("generate", [5, 6, 7], status=500, error="boom")
    assert "the reference request failed" in _verdict.greedy_mismatches([got], {key: failed})[0]
    # sampled, aborted or failed requests are not compared
    assert _verdict.greedy_mismatches([_outcome("generate", [1], greedy=False), _outcome("generate", [1], aborted=True),
                                       _outcome("generate", [1], status=500)], {}) == []  # fmt: skip
    # the OpenAI answers compare by words: streamed pieces join with their own spacing
    streamed = _outcome("completions", [5, 6, 7], text="w5 w6 w7 ")
    assert _verdict.greedy_mismatches([streamed], {streamed.req.reference_key: _outcome("completions", [5, 6, 7])}) == []


def test_figures():
    outs = [_outcome("generate", [1] * 4, latency_s=1.0), _outcome("generate", [1] * 4, latency_s=3.0, cached_tokens=16),
            _outcome("generate", [1] * 4, aborted=True, events=0), _outcome("generate", [1] * 4, hung=True)]  # fmt: skip
    fig = _verdict.figures(outs, duration_s=2.0)
    assert (fig["requests_sent"], fig["requests_served"], fig["aborted_by_client"], fig["hung"]) == (4, 2, 1, 1)
    assert (fig["failed"], fig["output_tokens"], fig["output_tokens_per_s"]) == (1, 8, 4.0)
    assert (fig["latency_ms_p50"], fig["requests_with_cached_prefix"], fig["cached_prompt_tokens"]) == (2000.0, 1, 16)
    assert fig["aborted_before_first_event"] == 1
