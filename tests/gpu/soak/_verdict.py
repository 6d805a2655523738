# SPDX-License-Identifier: Apache-2.0
"""What the soak piece concludes from its outcomes, server logs and metrics.

Pure functions over text and numbers, tested on the CPU: error lines and 5xx answers in a
server log, the scheduler's retraction lines, the greedy comparison with the
no-speculation server, the idle pool numbers, and the figures the piece records
(requests served, retractions, aborts, p50/p99 latency).
"""

from __future__ import annotations

import math
import re
import time
from typing import Dict, Iterable, List, Optional

from tests.gpu.soak._client import Outcome

#: Lines of a server log that mean something went wrong while it served (matched
#: case-sensitively, as upstream writes them).
ERROR_PATTERNS = (
    "Traceback (most recent call last)",
    "Scheduler hit an exception",
    "TokenizerManager hit an exception",
    "DetokenizerManager hit an exception",
    "[http_server] Error",
    "Error in request",
    "Exception in ASGI application",
    "Internal server error",
    "CUDA error",
    "out of memory",
    "Out of memory",
    "memory leak detected",
    "Mem Leak Detected",
    "double free",
    "use-after-free",
    "Dumping requests before crash",
    "watchdog timeout",
    "Received sigquit",
    "Killed",
)
#: uvicorn's access log: ``INFO:     127.0.0.1:41234 - "POST /generate HTTP/1.1" 500 Internal Server Error``
ACCESS_LINE = re.compile(r'"(?:GET|POST|PUT|DELETE) (\S+) HTTP/[0-9.]+" (\d{3})')
#: The scheduler's line when decode runs out of KV: ``KV cache pool is full. Retract requests.
#: #retracted_reqs: 3, #new_tokens_gained: 1210, #new_token_ratio: 0.4133 -> 0.5133``
RETRACT_LINE = re.compile(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)")


#: The HTTP layer's line for a request it refuses with a 400: ``[http_server] Error: <message>``.
HTTP_REFUSAL = "[http_server] Error: "


def error_lines(log: str, refused: Iterable[str] = ()) -> List[str]:
    """The lines of ``log`` that say something went wrong. ``refused``: the messages of the
    400 answers the soak provoked on purpose (its malformed requests, sent during the load);
    the HTTP layer's line for each of those is the refusal working, not an error."""
    said = {first for m in refused if (first := m.strip().splitlines()[0].strip() if m.strip() else "")}
    return [line for line in log.splitlines()
            if any(p in line for p in ERROR_PATTERNS) and line.partition(HTTP_REFUSAL)[2].strip() not in said]  # fmt: skip


#: upstream's log line: ``[2026-12-06 20:03:01 TP0] message`` (milliseconds and a rank optional).
LOG_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:\.\d+)?(?: [^\]]*)?\] (.*)$")
#: The lines of a server's start that tell where its time goes, as upstream words them.
START_MARKS = (
    "Init torch distributed begin",
    "Load weight begin",
    "Load weight end",
    "Memory pool end",
    "CUDA graph begin",
    "CUDA graph end",
    "The server is fired up",
)


def start_timeline(log: str, spawned_at: float) -> List[list]:
    """``[seconds after the spawn, what]`` for the server log's first line and each line of
    ``START_MARKS`` up to the server being fired up, so that a slow start shows its slow part
    (imports before the first line, weights, graph captures, the warm-up after them)."""
    out: List[list] = []
    for line in log.splitlines():
        m = LOG_LINE.match(line)
        if not m:
            continue
        when = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) - spawned_at
        text = m.group(2)
        mark = next((k for k in START_MARKS if k in text), None)
        if not out or mark:
            what = text.split(". ")[0] if mark else "first log line"
            out.append([round(when, 1), what[:80]])
        if mark == "The server is fired up":
            break
    return out


def access_statuses(log: str) -> Dict[int, int]:
    """How many answers of each HTTP status the server's access log shows."""
    counts: Dict[int, int] = {}
    for m in ACCESS_LINE.finditer(log):
        status = int(m.group(2))
        counts[status] = counts.get(status, 0) + 1
    return counts


def server_error_answers(log: str) -> List[str]:
    return [line for line in log.splitlines() if (m := ACCESS_LINE.search(line)) and m.group(2).startswith("5")]


def retractions(log: str) -> tuple:
    """(times decode ran out of KV and retracted, requests retracted), from the scheduler's lines."""
    found = [int(n) for n in RETRACT_LINE.findall(log)]
    return len(found), sum(found)


def percentile(values: Iterable[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100) by linear interpolation between order statistics."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _answer(out: Outcome):
    """The part of an answer that must equal the reference's: token ids (native API) or the
    text's words (OpenAI API; streamed text is joined from its pieces)."""
    return list(out.output_ids or []) if out.req.api == "generate" else (out.text or "").split()


def greedy_mismatches(outcomes: Iterable[Outcome], references: Dict[tuple, Optional[Outcome]]) -> List[str]:
    """Every completed greedy request against the no-speculation server's answer to it."""
    problems = []
    for out in outcomes:
        if not (out.req.greedy and out.completed):
            continue
        ref = references.get(out.req.reference_key)
        where = f"{out.server} {out.req.tag} ({out.req.api}, prompt {len(out.req.prompt)} tokens, max_tokens " \
                f"{out.req.max_tokens})"  # fmt: skip
        if ref is None:
            problems.append(f"{where}: no reference answer from the no-speculation server")
        elif not ref.completed or ref.problem():
            problems.append(f"{where}: the reference request failed: {ref.problem() or ref.error}")
        elif _answer(out) != _answer(ref):
            got, want = _answer(out), _answer(ref)
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            problems.append(f"{where}: differs from no speculation at output position {first} "
                            f"(got {got[first:first + 4]}, want {want[first:first + 4]})")  # fmt: skip
    return problems


def idle_pool_problems(metrics: Dict[str, float], max_total_tokens: int) -> List[str]:
    """Once idle every KV slot is free or held by the radix cache (evictable)."""
    problems = []
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_used_tokens"):
        if name not in metrics:
            problems.append(f"{name} is not on /metrics")
        elif metrics[name] != 0:
            problems.append(f"{name} = {metrics[name]:g} once idle, expected 0")
    free = metrics.get("sglang:kv_available_tokens")
    evictable = metrics.get("sglang:kv_evictable_tokens")
    if free is None or evictable is None:
        problems.append("sglang:kv_available_tokens / sglang:kv_evictable_tokens are not on /metrics")
    elif free + evictable != max_total_tokens:
        problems.append(f"once idle {free:g} tokens free + {evictable:g} in the radix cache != the pool's "
                        f"{max_total_tokens} tokens: {max_total_tokens - free - evictable:g} held")  # fmt: skip
    return problems


def figures(outcomes: List[Outcome], duration_s: float) -> dict:
    """The numbers the piece records per server."""
    done = [o for o in outcomes if o.completed]
    lat = [o.latency_s for o in done]
    ttft = [o.first_event_s for o in done if o.first_event_s is not None]
    out_tokens = sum(o.req.max_tokens for o in done)

    def ms(x):
        return None if x is None else round(1000 * x, 1)

    return {
        "requests_sent": len(outcomes),
        "requests_served": len(done),
        "greedy_served": sum(o.req.greedy for o in done),
        "sampled_served": sum(not o.req.greedy for o in done),
        "streamed_served": sum(o.req.stream for o in done),
        "openai_served": sum(o.req.api == "completions" for o in done),
        "aborted_by_client": sum(o.aborted for o in outcomes),
        "aborted_before_first_event": sum(o.aborted and o.events == 0 for o in outcomes),
        "failed": sum(1 for o in outcomes if o.problem()),
        "hung": sum(o.hung for o in outcomes),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / duration_s, 1) if duration_s > 0 else None,
        "prompt_tokens_mean": round(sum(len(o.req.prompt) for o in done) / len(done), 1) if done else None,
        "requests_with_cached_prefix": sum(1 for o in done if (o.cached_tokens or 0) > 0),
        "cached_prompt_tokens": sum(o.cached_tokens or 0 for o in done),
        "latency_ms_p50": ms(percentile(lat, 50)),
        "latency_ms_p99": ms(percentile(lat, 99)),
        "latency_ms_max": ms(max(lat) if lat else None),
        "first_event_ms_p50": ms(percentile(ttft, 50)),
        "first_event_ms_p99": ms(percentile(ttft, 99)),
    }
