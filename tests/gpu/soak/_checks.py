# SPDX-License-Identifier: Apache-2.0
"""The soak piece's checks, each a list of problems (empty: passed), so that the GPU tests
assert them and the CPU tier runs them against stand-in servers and upstream's real HTTP app."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Tuple

from tests.gpu.soak import _verdict
from tests.gpu.soak._client import send
from tests.gpu.soak._load_mix import SoakRequest
from tests.gpu.soak._malformed import Ctx, Malformed, error_message, rejection_problem
from tests.gpu.soak._soak import ServerSoak, SoakSettings

LEAK_MARKS = ("memory leak", "Mem Leak", "double free", "use-after-free")


def listed(problems: List[str], n: int = 20) -> str:
    more = f"\n... and {len(problems) - n} more" if len(problems) > n else ""
    return "\n".join(problems[:n]) + more


def served_problems(r: ServerSoak) -> List[str]:
    """No server error: alive, every request answered in full, no 5xx, no error line."""
    if r.warmup_problems:
        return [f"{r.name} failed its first requests and was left out of the load:", *r.warmup_problems]
    if not r.alive:
        return [f"{r.name} died during the soak; its log ends:\n{r.log[-4000:]}"]
    problems = [p for o in r.outcomes if (p := o.problem())]
    if not any(o.completed for o in r.outcomes):
        problems.append(f"{r.name}: no request was served")
    problems += [f"{r.name} answered 5xx: {line}" for line in _verdict.server_error_answers(r.log)]
    problems += [f"{r.name} logged: {line}" for line in _verdict.error_lines(r.log, r.refused)]
    return problems


def greedy_problems(r: ServerSoak) -> List[str]:
    if not any(o.req.greedy and o.completed for o in r.outcomes):
        return [f"{r.name}: no greedy request completed"]
    return _verdict.greedy_mismatches(r.outcomes, r.references)


def pool_problems(r: ServerSoak) -> List[str]:
    """Once idle: alive (the strict idle check kills the server on a leak), no leak line,
    every KV slot free or in the radix cache."""
    if not r.alive:
        return [f"{r.name} died (the strict idle pool check kills the server on a leak):\n{r.log[-4000:]}"]
    problems = [f"{r.name} logged: {line}" for line in r.log.splitlines() if any(m in line for m in LEAK_MARKS)]
    if r.idle_problems:
        shown = {k: v for k, v in r.idle_metrics.items() if "token" in k or "reqs" in k}
        problems += [f"{r.name}: {p}" for p in r.idle_problems] + [f"{r.name} /metrics once idle: {json.dumps(shown)}"]
    return problems


def load_shape_problems(r: ServerSoak, settings: SoakSettings) -> List[str]:
    """The load did what it is for: the pool was small enough to retract, clients
    disconnected mid-stream, shared prefixes hit the radix cache."""
    fig = r.figures(settings.duration_s)
    problems = []
    if r.retracted() <= 0:
        problems.append(f"{r.name} never retracted a request: its KV pool ({r.max_total_tokens} tokens) was not small "
                        f"enough for the load (SOAK_POOL_FRACTION={settings.pool_fraction})")  # fmt: skip
    if fig["aborted_by_client"] <= 0:
        problems.append(f"{r.name}: no client disconnected mid-stream")
    if fig["requests_with_cached_prefix"] <= 0:
        problems.append(f"{r.name}: no request reported a cached prefix (radix cache)")
    return problems + ([f"{r.name} figures: {json.dumps(fig)}"] if problems else [])


def post(server, path: str, payload: bytes, timeout: float = 300.0) -> Tuple[int, bytes]:
    req = urllib.request.Request(server.base_url + path, data=payload, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def malformed_problems(server, ctx: Ctx, cases: List[Malformed], workers: int = 4,
                       messages: Optional[dict] = None) -> Tuple[List[str], dict]:  # fmt: skip
    """Every case on ``server``; after each, a normal request must be served. ``workers``
    cases at a time, so that the waits one after another would add up (round trips, each
    normal request's decode, the ~10 MB bodies' transfer and parsing) overlap; the ~10 MB
    ones first, so that none is left running alone at the end. Once the server is found
    dead nothing more is sent, and the cases then in flight are named: any of them may have
    killed it. Returns the problems and the status each case got, in the order of ``cases``;
    ``messages``, if given, receives each answer's error message by case name."""
    normal = SoakRequest(client=-2, seq=0, api="generate", prompt=tuple(ctx.prompt), max_tokens=8, greedy=True,
                         stream=False)  # fmt: skip
    rank = {case.name: i for i, case in enumerate(cases)}
    pending = iter(sorted(cases, key=lambda c: not c.heavy))
    lock = threading.Lock()
    in_flight: set = set()
    answers, found = {}, {}  # case name -> status; case name -> problems
    death: List[List[str]] = []  # the cases in flight when the server was first found dead

    def dead() -> bool:
        if server.alive():
            return False
        with lock:
            if not death:
                death.append(sorted(in_flight, key=rank.get))
        return True

    def one(case: Malformed) -> None:
        problems = found[case.name] = []
        try:
            status, body = post(server, case.path, case.payload(ctx))
        except OSError as e:
            status, body = 0, f"{type(e).__name__}: {e}".encode()
        answers[case.name] = status
        if messages is not None:
            messages[case.name] = error_message(body)
        if (p := rejection_problem(case, status, body)) is not None:
            problems.append(f"{server.name}: {p}")
        if dead():
            return
        if (p := send(server.name, server.base_url, ctx.model, normal, 120.0).problem()) is not None:
            problems.append(f"{server.name}: the normal request after {case.name}: {p}")
            dead()

    def worker() -> None:
        while True:
            with lock:
                case = None if death else next(pending, None)
                if case is None:
                    return
                in_flight.add(case.name)
            try:
                one(case)
            finally:
                with lock:
                    in_flight.discard(case.name)

    n = max(1, min(workers, len(cases)))
    with ThreadPoolExecutor(n, thread_name_prefix=f"malformed-{server.name}") as ex:
        for future in [ex.submit(worker) for _ in range(n)]:
            future.result()
    problems = [p for case in cases for p in found.get(case.name, [])]
    if death:
        names = death[0]
        after = names[0] if len(names) == 1 else f"one of {', '.join(names)} (in flight together)"
        unsent = len(cases) - len(answers)
        problems.append(f"{server.name}: died after {after}"
                        + (f"; {unsent} of {len(cases)} cases not sent" if unsent else ""))  # fmt: skip
    return problems, {case.name: answers[case.name] for case in cases if case.name in answers}


def after_problems(server, since: int) -> List[str]:
    """The server's log after byte ``since``: no crash, leak or 5xx answer."""
    from tests.gpu.soak._soak import log_bytes

    if not server.alive():
        return [f"{server.name} died:\n{server.log_tail(40)}"]
    later = log_bytes(server, since)
    marks = ("Scheduler hit an exception", "Traceback (most recent call last)", *LEAK_MARKS)
    problems = [f"{server.name} logged: {line}" for line in later.splitlines() if any(m in line for m in marks)]
    return problems + [f"{server.name} answered 5xx: {line}" for line in _verdict.server_error_answers(later)]
