# SPDX-License-Identifier: Apache-2.0
"""Soak: DDTREE and DFLASH on the tiny MLA and GQA pairs under 64 clients each for 5 minutes,
KV pools a quarter of the load, malformed requests among them (GPU host only).

The load (``_load_mix``): prompts of 1 token up to the context, shared prefixes, short to
long outputs, greedy and sampled, streamed and not, the native and the OpenAI API, and one
request in ten a stream the client drops. Afterwards, per speculative server:

* no server error: every request answered 200 with its ``max_tokens`` tokens (client side),
  no 5xx in the access log, no error line in the log, the process alive;
* every greedy answer equal to the no-speculation server's for the same request;
* once idle, the scheduler's strict pool check has not fired and /metrics shows every KV
  slot free or in the radix cache;
* the pool was small enough: the scheduler retracted requests; the clients' disconnects
  and the shared prefixes happened (aborts, radix hits).

From a third of the load on (``DURING_LOAD``), every malformed request of
``_malformed.CASES`` gets its 400 with a message naming the problem from every speculative
server, which serves a normal request right after, and a request that fills the context
exactly is served and equals no speculation; the HTTP layer's log line for each refusal is
not an error line. Both under load rather than after it: the piece stays within 8 minutes.

Figures (requests served, retractions, aborts, p50/p99 latency, ...) and the wall seconds
of each phase (``phases_s``: ``_soak.PHASES``; where each server's start went in
``server_start``; of the requests sent during the load in
``during_load_s``, the malformed requests' per server in ``malformed_wall_s``) go to
``DDTREE_SOAK_JSON`` (the tier runner: ``soak.json`` in its --out folder) and to ``soak.json`` in the
server-log dir.

On the GPU host after scripts/gpu_host/install.sh:
    bash scripts/gpu_host/run_gpu_tier.sh --only soak
    SOAK_DURATION_S=60 SOAK_CLIENTS=16 bash scripts/gpu_host/run_gpu_tier.sh --only soak   # a quick run
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("GPU tier: needs a CUDA device", allow_module_level=True)

from tests.gpu.harness import harness  # noqa: E402
from tests.gpu.soak import _checks  # noqa: E402
from tests.gpu.soak._client import send  # noqa: E402
from tests.gpu.soak._load_mix import SoakRequest  # noqa: E402
from tests.gpu.soak._malformed import CASES, Ctx  # noqa: E402
from tests.gpu.soak._soak import SPEC_SERVERS, log_bytes, results, run_soak, served_model  # noqa: E402
from tests.gpu.soak._verdict import start_timeline  # noqa: E402

SPEC = list(SPEC_SERVERS)
RESULTS: dict = {}
LOG_STARTS: dict = {}  # server name -> its log's size when the load started


def _write_results(gpu_log_dir: Path) -> None:
    text = json.dumps(RESULTS, indent=2, sort_keys=True) + "\n"
    (gpu_log_dir / "soak.json").write_text(text)
    path = os.environ.get("DDTREE_SOAK_JSON")
    if path:
        Path(path).write_text(text)


@pytest.fixture(scope="module")
def soak(request, soak_servers, soak_settings, soak_mixes, gpu_log_dir):
    spec = {n: soak_servers[n] for n in soak_settings.servers}
    refs = {t: soak_servers[f"{t}-reference"] for t in soak_settings.targets}
    phases = RESULTS.setdefault("phases_s", {})
    selected = {getattr(item, "originalname", item.name) for item in request.session.items}
    tasks = {name: task for name, (test, task) in DURING_LOAD.items() if test in selected}

    def during_load():
        with ThreadPoolExecutor(len(tasks) or 1) as ex:
            futures = {n: ex.submit(_timed, n, t, soak_servers, soak_mixes, soak_settings) for n, t in tasks.items()}
            for name, future in futures.items():
                DURING[name] = future.result()

    t0 = time.monotonic()
    try:
        report = run_soak(spec, refs, soak_mixes, soak_settings, log=lambda m: print(m, flush=True),
                          log_starts=LOG_STARTS, phases_s=phases,
                          during_load=during_load if tasks else None)  # fmt: skip
    except BaseException:
        _write_results(gpu_log_dir)  # the phases that ended: where a failed run's time went
        raise
    for name, r in report.items():
        r.refused = tuple(DURING.get("malformed", {}).get(name, {}).get("messages", {}).values())
    RESULTS.update(results(report, soak_settings, {
        "gpu": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d"),
        "soak_wall_s": round(time.monotonic() - t0, 1),
        "server_ready_s": {s.name: round(s.ready_s or 0, 1) for s in soak_servers.values()},
        "server_start": {s.name: start_timeline(log_bytes(s), s.started) for s in soak_servers.values()},
    }, phases_s=phases))  # fmt: skip
    _record_during_load()
    _write_results(gpu_log_dir)
    print(json.dumps(RESULTS["servers"], indent=1), flush=True)
    return report


@pytest.fixture(params=SPEC)
def name(request, soak_settings):
    if request.param not in soak_settings.servers:
        pytest.skip(f"{harness(request.config).NOT_APPLICABLE}SOAK_SERVERS leaves out {request.param}")
    return request.param


def test_soak_served_without_server_errors(soak, name):
    problems = _checks.served_problems(soak[name])
    assert not problems, f"{len(problems)} problems of {len(soak[name].outcomes)} requests:\n{_checks.listed(problems)}"


def test_soak_greedy_equals_no_speculation(soak, name):
    problems = _checks.greedy_problems(soak[name])
    assert not problems, f"{len(problems)} greedy answers differ:\n{_checks.listed(problems)}"


def test_soak_pools_clean_once_idle(soak, name):
    problems = _checks.pool_problems(soak[name])
    assert not problems, _checks.listed(problems)


def test_soak_retracted_aborted_and_hit_the_radix_cache(soak, name, soak_settings):
    problems = _checks.load_shape_problems(soak[name], soak_settings)
    assert not problems, _checks.listed(problems)


def test_reference_servers_stayed_clean(soak, soak_servers, soak_settings):
    refs = [soak_servers[f"{t}-reference"] for t in soak_settings.targets]
    problems = [p for ref in refs for p in _checks.after_problems(ref, LOG_STARTS.get(ref.name, 0))]
    assert not problems, _checks.listed(problems)


# ----------------------------------------------------------------- requests sent during the load


def _ctx(server, soak_mixes, name):
    mix = soak_mixes[SPEC_SERVERS[name][0]]
    return Ctx(model=served_model(server), context_len=mix.config.context_len, vocab_size=mix.config.vocab_size,
               prompt=mix.prefixes[0])  # fmt: skip


def _malformed(soak_servers, soak_mixes, soak_settings) -> dict:
    """Every case on every speculative server, the servers in parallel and a few cases at a
    time on each (``_checks.malformed_problems``); after each, a normal request must be served."""

    # The ~10 MB bodies cost seconds of tokenization each and test the HTTP layer, the same
    # on every server: one server per target gets them.
    heavy_on = {SPEC_SERVERS[n][0]: n for n in reversed(soak_settings.servers)}

    def one_server(name):
        server, t0, messages = soak_servers[name], time.monotonic(), {}
        if not server.alive():
            return {"problems": [f"{name} is not running"], "answers": {}, "messages": {}, "wall_s": 0.0}
        cases = [c for c in CASES if not c.heavy or heavy_on[SPEC_SERVERS[name][0]] == name]
        problems, answers = _checks.malformed_problems(server, _ctx(server, soak_mixes, name), cases,
                                                       messages=messages)  # fmt: skip
        return {"problems": problems, "answers": answers, "messages": messages,
                "wall_s": round(time.monotonic() - t0, 2)}  # fmt: skip

    with ThreadPoolExecutor(len(soak_settings.servers)) as ex:
        return dict(zip(soak_settings.servers, ex.map(one_server, soak_settings.servers)))


def _context_edge(soak_servers, soak_mixes, soak_settings) -> dict:
    """prompt + max_tokens == the context length, which upstream accepts (the scheduler
    then stops two tokens short of the context): the last steps draft and verify at the
    context's edge, here with the pool short and requests being retracted around it."""

    def one_server(name):
        server, target = soak_servers[name], SPEC_SERVERS[name][0]
        if not server.alive():
            return {"problems": [f"{name} is not running"], "output_tokens": (0, 0)}
        mix = soak_mixes[target]
        prompt = mix.prefixes[-1]
        req = SoakRequest(client=-3, seq=0, api="generate", prompt=prompt, greedy=True, stream=False,
                          max_tokens=mix.config.context_len - len(prompt))  # fmt: skip
        ref_server = soak_servers[f"{target}-reference"]
        with ThreadPoolExecutor(2) as ex:
            got, want = ex.map(lambda s: send(s.name, s.base_url, served_model(s), req, 300.0), (server, ref_server))
        problems = [f"{out.server}: HTTP {out.status}, {len(out.output_ids or [])} tokens: {out.error}"
                    for out in (got, want) if out.status != 200 or out.error or not out.output_ids]  # fmt: skip
        if got.output_ids and want.output_ids and got.output_ids != want.output_ids:
            first = next((i for i, (a, b) in enumerate(zip(got.output_ids, want.output_ids)) if a != b),
                         min(len(got.output_ids), len(want.output_ids)))  # fmt: skip
            problems.append(f"{name}: differs from no speculation at output position {first} of "
                            f"{len(want.output_ids)}")  # fmt: skip
        return {"problems": problems, "output_tokens": (len(got.output_ids or []), len(want.output_ids or []))}

    with ThreadPoolExecutor(len(soak_settings.servers)) as ex:
        return dict(zip(soak_settings.servers, ex.map(one_server, soak_settings.servers)))


#: What runs during the load: name -> (the test that reports it, run only when it is selected; the task).
DURING_LOAD = {
    "malformed": ("test_malformed_requests_get_a_400", _malformed),
    "context_edge": ("test_a_request_filling_the_context_is_served", _context_edge),
}
DURING: dict = {}  # name -> (server name -> what it found)
DURING_WALL: dict = {}  # name -> its wall seconds


def _timed(name: str, task, *args) -> dict:
    """``task``'s result (its wall seconds go to ``DURING_WALL``), or its own failure as a
    problem its test reports: ``run_soak`` runs it in a thread, whose exceptions nobody would see."""
    t0 = time.monotonic()
    try:
        found = task(*args)
    except Exception as e:  # noqa: BLE001 - reported by the task's test
        found = {"error": {"problems": [f"{type(e).__name__}: {e}"]}}
    DURING_WALL[name] = round(time.monotonic() - t0, 2)
    return found


def _record_during_load() -> None:
    malformed, edge = DURING.get("malformed", {}), DURING.get("context_edge", {})
    RESULTS["during_load_s"] = dict(DURING_WALL)
    if malformed:
        RESULTS["malformed_wall_s"] = {n: r.get("wall_s") for n, r in malformed.items()}
        RESULTS["malformed"] = {n: r.get("answers", {}) for n, r in malformed.items()}
    if edge:
        RESULTS["context_edge"] = {"output_tokens": {n: r.get("output_tokens") for n, r in edge.items()},
                                   "problems": [p for r in edge.values() for p in r["problems"]]}  # fmt: skip


def _found(name: str) -> List[str]:
    if name not in DURING:
        return [f"{name} did not run during the load (the soak fixture failed first)"]
    return [p for r in DURING[name].values() for p in r["problems"]]


def test_malformed_requests_get_a_400(soak):
    """Sent during the load: each gets its 400 with a message naming the problem from every
    speculative server, which serves a normal request right after."""
    problems = _found("malformed")
    assert not problems, _checks.listed(problems, 40)


def test_a_request_filling_the_context_is_served(soak):
    """Sent during the load: the whole context is served, equal to no speculation."""
    problems = _found("context_edge")
    assert not problems, _checks.listed(problems)


def test_servers_clean_and_serving_at_the_end(soak, soak_servers, soak_settings):
    time.sleep(3.0)  # the strict idle check runs once the scheduler is idle
    problems = []
    for name in soak_settings.servers:
        server = soak_servers[name]
        problems += _checks.after_problems(server, soak[name].log_end)
        if server.alive():
            server.get("/health_generate", timeout=60)
    assert not problems, _checks.listed(problems)
