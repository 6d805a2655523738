# SPDX-License-Identifier: Apache-2.0
"""Soak: DDTREE and DFLASH on the tiny MLA and GQA pairs under 64 clients each for 5 minutes,
KV pools a quarter of the load, then malformed requests (GPU host only).

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

Then every malformed request of ``_malformed.CASES`` gets its 400 with a message naming
the problem from every speculative server, which serves a normal request right after, and
a request that fills the context exactly is served and equals no speculation.

Figures (requests served, retractions, aborts, p50/p99 latency, ...) go to
``DDTREE_SOAK_JSON`` (the tier runner: ``$OUT/soak.json``) and to ``soak.json`` in the
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

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("GPU tier: needs a CUDA device", allow_module_level=True)

from tests.gpu.soak import _verdict  # noqa: E402
from tests.gpu.soak._client import send  # noqa: E402
from tests.gpu.soak._load_mix import SoakRequest  # noqa: E402
from tests.gpu.soak._malformed import CASES, Ctx, rejection_problem  # noqa: E402
from tests.gpu.soak._soak import SPEC_SERVERS, log_bytes, results, run_soak, served_model  # noqa: E402

SPEC = list(SPEC_SERVERS)
RESULTS: dict = {}


def _write_results(gpu_log_dir: Path) -> None:
    text = json.dumps(RESULTS, indent=2, sort_keys=True) + "\n"
    (gpu_log_dir / "soak.json").write_text(text)
    path = os.environ.get("DDTREE_SOAK_JSON")
    if path:
        Path(path).write_text(text)


@pytest.fixture(scope="module")
def soak(soak_servers, soak_settings, soak_mixes, gpu_log_dir):
    spec = {n: soak_servers[n] for n in soak_settings.servers}
    refs = {t: soak_servers[f"{t}-reference"] for t in soak_settings.targets}
    t0 = time.monotonic()
    report = run_soak(spec, refs, soak_mixes, soak_settings, log=lambda m: print(m, flush=True))
    RESULTS.update(results(report, soak_settings, {
        "gpu": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d"),
        "soak_wall_s": round(time.monotonic() - t0, 1),
        "server_ready_s": {s.name: round(s.ready_s or 0, 1) for s in soak_servers.values()},
    }))  # fmt: skip
    _write_results(gpu_log_dir)
    print(json.dumps(RESULTS["servers"], indent=1), flush=True)
    return report


@pytest.fixture(params=SPEC)
def name(request, soak_settings):
    if request.param not in soak_settings.servers:
        from tests.gpu.conftest import NOT_APPLICABLE

        pytest.skip(f"{NOT_APPLICABLE}SOAK_SERVERS leaves out {request.param}")
    return request.param


def _listed(problems, n=20):
    more = f"\n... and {len(problems) - n} more" if len(problems) > n else ""
    return "\n".join(problems[:n]) + more


def test_soak_served_without_server_errors(soak, name):
    r = soak[name]
    assert r.alive, f"{name} died during the soak:\n{r.log[-4000:]}"
    problems = [p for o in r.outcomes if (p := o.problem())]
    assert not problems, f"{len(problems)} of {len(r.outcomes)} requests failed:\n{_listed(problems)}"
    assert r.outcomes and any(o.completed for o in r.outcomes), "no request was served"
    assert not _verdict.server_error_answers(r.log), _listed(_verdict.server_error_answers(r.log))
    assert not _verdict.error_lines(r.log), _listed(_verdict.error_lines(r.log))


def test_soak_greedy_equals_no_speculation(soak, name):
    r = soak[name]
    compared = [o for o in r.outcomes if o.req.greedy and o.completed]
    assert compared, "no greedy request completed"
    problems = _verdict.greedy_mismatches(r.outcomes, r.references)
    assert not problems, f"{len(problems)} of {len(compared)} greedy answers:\n{_listed(problems)}"


def test_soak_pools_clean_once_idle(soak, name):
    r = soak[name]
    assert r.alive, f"{name} died (the strict idle check kills the server on a leak):\n{r.log[-4000:]}"
    leaks = [line for line in r.log.splitlines() if any(p in line for p in ("memory leak", "Mem Leak"))]
    assert not leaks, _listed(leaks)
    assert not r.idle_problems, f"{name} once idle: {r.idle_problems}; /metrics: " + json.dumps(
        {k: v for k, v in r.idle_metrics.items() if "token" in k or "reqs" in k})


def test_soak_retracted_aborted_and_hit_the_radix_cache(soak, name, soak_settings):
    r = soak[name]
    fig = r.figures(soak_settings.duration_s)
    assert r.retracted() > 0, (
        f"{name} never retracted a request: its KV pool ({r.max_total_tokens} tokens) was not small enough "
        f"for the load (SOAK_POOL_FRACTION={soak_settings.pool_fraction}); figures: {fig}")
    assert fig["aborted_by_client"] > 0, fig
    assert fig["requests_with_cached_prefix"] > 0, fig


def test_reference_servers_stayed_clean(soak, soak_servers, soak_settings):
    for target in soak_settings.targets:
        ref = soak_servers[f"{target}-reference"]
        assert ref.alive(), ref.log_tail()
        assert not ref.leak_lines(), ref.leak_lines()
        log = ref.log_text()
        assert not _verdict.server_error_answers(log), _listed(_verdict.server_error_answers(log))


# ------------------------------------------------------------------------------ after the soak


def _ctx(server, soak_mixes, name):
    mix = soak_mixes[SPEC_SERVERS[name][0]]
    return Ctx(model=served_model(server), context_len=mix.config.context_len, vocab_size=mix.config.vocab_size,
               prompt=mix.prefixes[0])  # fmt: skip


def _post(server, path, payload: bytes, timeout=300.0):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server.base_url + path, data=payload, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _normal_request_problem(server, model, prompt) -> str:
    req = SoakRequest(client=-2, seq=0, api="generate", prompt=tuple(prompt), max_tokens=8, greedy=True, stream=False)
    return send(server.name, server.base_url, model, req, 120.0).problem()


def test_malformed_requests_get_a_400(soak, soak_servers, soak_mixes, soak_settings):
    """Every case on every speculative server, the servers in parallel; after each, a normal
    request must be served."""

    def one_server(name):
        server = soak_servers[name]
        ctx = _ctx(server, soak_mixes, name)
        problems, answers = [], {}
        for case in CASES:
            status, body = _post(server, case.path, case.payload(ctx))
            answers[case.name] = status
            if (p := rejection_problem(case, status, body)) is not None:
                problems.append(f"{name}: {p}")
            if not server.alive():
                problems.append(f"{name}: died after {case.name}")
                break
            if (p := _normal_request_problem(server, ctx.model, ctx.prompt)) is not None:
                problems.append(f"{name}: after {case.name}: {p}")
        return problems, answers

    with ThreadPoolExecutor(len(soak_settings.servers)) as ex:
        done = dict(zip(soak_settings.servers, ex.map(one_server, soak_settings.servers)))
    RESULTS["malformed"] = {name: answers for name, (_, answers) in done.items()}
    problems = [p for ps, _ in done.values() for p in ps]
    assert not problems, _listed(problems, 40)


def test_a_request_filling_the_context_is_served(soak, soak_servers, soak_mixes, soak_settings, gpu_log_dir):
    """prompt + max_tokens == the context length, which upstream accepts (the scheduler
    then stops two tokens short of the context): the last steps draft and verify at the
    context's edge; the answer equals no speculation's."""
    problems, lengths = [], {}
    for name in soak_settings.servers:
        server, target = soak_servers[name], SPEC_SERVERS[name][0]
        mix = soak_mixes[target]
        prompt = mix.prefixes[-1]
        req = SoakRequest(client=-3, seq=0, api="generate", prompt=prompt, greedy=True, stream=False,
                          max_tokens=mix.config.context_len - len(prompt))  # fmt: skip
        got = send(name, server.base_url, served_model(server), req, 300.0)
        ref_server = soak_servers[f"{target}-reference"]
        want = send(ref_server.name, ref_server.base_url, served_model(ref_server), req, 300.0)
        lengths[name] = (len(got.output_ids or []), len(want.output_ids or []))
        for out in (got, want):
            if out.status != 200 or out.error or not out.output_ids:
                problems.append(f"{out.server}: HTTP {out.status}, {len(out.output_ids or [])} tokens: {out.error}")
        if got.output_ids and want.output_ids and got.output_ids != want.output_ids:
            first = next((i for i, (a, b) in enumerate(zip(got.output_ids, want.output_ids)) if a != b),
                         min(len(got.output_ids), len(want.output_ids)))  # fmt: skip
            problems.append(f"{name}: differs from no speculation at output position {first} of "
                            f"{len(want.output_ids)}")  # fmt: skip
    RESULTS["context_edge"] = {"prompt_tokens": len(prompt), "output_tokens": lengths, "problems": problems}
    _write_results(gpu_log_dir)
    assert not problems, _listed(problems)


def test_servers_clean_after_the_malformed_requests(soak, soak_servers, soak_settings, gpu_log_dir):
    time.sleep(3.0)  # the strict idle check runs once the scheduler is idle
    problems = []
    for name in soak_settings.servers:
        server = soak_servers[name]
        if not server.alive():
            problems.append(f"{name} died:\n{server.log_tail(40)}")
            continue
        later = log_bytes(server, soak[name].log_end)
        bad = [line for line in later.splitlines() if any(p in line for p in (
            "Scheduler hit an exception", "Traceback (most recent call last)", "memory leak", "Mem Leak",
            "double free", "use-after-free"))]  # fmt: skip
        problems += [f"{name}: {line}" for line in bad]
        problems += [f"{name}: {line}" for line in _verdict.server_error_answers(later)]
        server.get("/health_generate", timeout=60)
    _write_results(gpu_log_dir)
    assert not problems, _listed(problems)
