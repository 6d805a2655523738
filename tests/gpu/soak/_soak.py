# SPDX-License-Identifier: Apache-2.0
"""The soak run: warm the servers up, load them, ask the references, wait for idle, collect;
each phase's wall seconds recorded (``PHASES``).

``run_soak`` works on server handles with the interface of the GPU harness's
``ServerProcess`` (``name``, ``base_url``, ``log_path``, ``alive()``, ``get()``,
``metrics()``, ``leak_lines()``), so the CPU tier runs it against stand-in servers.
Settings come from the environment (``SoakSettings.from_env``), defaults as in the piece's
brief: 64 clients per speculative server for 5 minutes.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from tests.gpu.soak import _verdict
from tests.gpu.soak._client import LoadTarget, Outcome, References, run_load, send
from tests.gpu.soak._load_mix import LoadMix, SoakRequest

#: Speculative servers the piece can run: name -> (target, algorithm).
SPEC_SERVERS = {
    "mla-ddtree": ("mla", "DDTREE"),
    "mla-dflash": ("mla", "DFLASH"),
    "gqa-ddtree": ("gqa", "DDTREE"),
    "gqa-dflash": ("gqa", "DFLASH"),
}
#: Target -> the tiny test pair of scripts/make_test_models.py.
PAIRS = {"mla": "tiny-mla", "gqa": "tiny-qwen3"}


def _env_number(name: str, default, cast=float):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return cast(raw)
    except ValueError as e:
        raise ValueError(f"{name}={raw!r} is not a number") from e


@dataclass(frozen=True)
class SoakSettings:
    duration_s: float = 300.0
    clients: int = 64
    servers: tuple = tuple(SPEC_SERVERS)
    pool_fraction: float = 0.25
    seed: int = 0
    request_timeout_s: float = 300.0
    drain_s: float = 150.0
    reference_workers: int = 64
    warmup_timeout_s: float = 400.0
    idle_timeout_s: float = 45.0

    @classmethod
    def from_env(cls) -> "SoakSettings":
        """SOAK_DURATION_S, SOAK_CLIENTS, SOAK_SERVERS (comma list of SPEC_SERVERS),
        SOAK_POOL_FRACTION, SOAK_SEED, SOAK_DRAIN_S, SOAK_REQUEST_TIMEOUT_S."""
        raw = os.environ.get("SOAK_SERVERS", "").strip()
        servers = tuple(s.strip() for s in raw.split(",") if s.strip()) if raw else tuple(SPEC_SERVERS)
        unknown = [s for s in servers if s not in SPEC_SERVERS]
        if unknown:
            raise ValueError(f"SOAK_SERVERS names unknown servers {unknown}; known: {', '.join(SPEC_SERVERS)}")
        s = cls(
            duration_s=_env_number("SOAK_DURATION_S", cls.duration_s),
            clients=_env_number("SOAK_CLIENTS", cls.clients, int),
            servers=servers,
            pool_fraction=_env_number("SOAK_POOL_FRACTION", cls.pool_fraction),
            seed=_env_number("SOAK_SEED", cls.seed, int),
            drain_s=_env_number("SOAK_DRAIN_S", cls.drain_s),
            request_timeout_s=_env_number("SOAK_REQUEST_TIMEOUT_S", cls.request_timeout_s),
        )
        if s.duration_s <= 0 or s.clients < 1 or not 0 < s.pool_fraction <= 1:
            raise ValueError(f"soak settings out of range: {s}")
        return s

    @property
    def targets(self) -> List[str]:
        return sorted({SPEC_SERVERS[s][0] for s in self.servers})


@dataclass
class ServerSoak:
    """What one speculative server did under the load, and how it was left."""

    name: str
    target: str
    outcomes: List[Outcome]
    references: Dict[tuple, Optional[Outcome]]
    max_total_tokens: int
    log: str  # the server's log from the start of the load to idle
    log_end: int  # byte offset of the log at idle: later lines belong to later tests
    alive: bool
    idle_metrics: Dict[str, float]
    idle_problems: List[str]
    metrics_before: Dict[str, float] = field(default_factory=dict)
    #: what went wrong with its first requests, before the load (it was then left out)
    warmup_problems: List[str] = field(default_factory=list)
    #: messages of the 400s it answered to requests malformed on purpose during the load
    refused: tuple = ()

    def figures(self, duration_s: float) -> dict:
        fig = _verdict.figures(self.outcomes, duration_s)
        events, retracted = _verdict.retractions(self.log)
        m, m0 = self.idle_metrics, self.metrics_before

        def delta(name):
            return m[name] - m0.get(name, 0.0) if name in m else None

        fig.update({
            "kv_pool_tokens": self.max_total_tokens,
            "retraction_events_in_log": events,
            "retracted_requests_in_log": retracted,
            "retracted_requests_metric": delta("sglang:num_retracted_requests_total"),
            "aborted_requests_metric": delta("sglang:num_aborted_requests_total"),
            "spec_accept_length": m.get("sglang:spec_accept_length"),
            "greedy_compared": sum(1 for o in self.outcomes if o.req.greedy and o.completed),
            "greedy_mismatches": len(_verdict.greedy_mismatches(self.outcomes, self.references)),
            "server_errors_in_access_log": len(_verdict.server_error_answers(self.log)),
            "access_log_statuses": _verdict.access_statuses(self.log),
            "error_lines_in_log": len(_verdict.error_lines(self.log, self.refused)),
        })  # fmt: skip
        return fig

    def retracted(self) -> float:
        """Requests retracted during the load: the scheduler's log lines, or /metrics."""
        _, in_log = _verdict.retractions(self.log)
        name = "sglang:num_retracted_requests_total"
        in_metrics = self.idle_metrics.get(name, 0.0) - self.metrics_before.get(name, 0.0)
        return max(in_log, in_metrics)


def log_bytes(server, start: int = 0, end: Optional[int] = None) -> str:
    with open(server.log_path, "rb") as f:
        f.seek(start)
        data = f.read() if end is None else f.read(max(0, end - start))
    return data.decode(errors="replace")


def log_size(server) -> int:
    return os.path.getsize(server.log_path)


def served_model(server) -> str:
    return json.loads(server.get("/v1/models").read())["data"][0]["id"]


def max_total_tokens(server) -> int:
    return int(json.loads(server.get("/server_info").read())["max_total_num_tokens"])


def warm_up(server, model: str, prompt: tuple, timeout_s: float, sampled: bool = True) -> List[str]:
    """One greedy, one streamed and (``sampled``) one sampled request: first-use compiles
    happen here, outside the measured window. The problems, if any."""
    reqs = [
        SoakRequest(client=-1, seq=0, api="generate", prompt=prompt, max_tokens=8, greedy=True, stream=False),
        SoakRequest(client=-1, seq=1, api="completions", prompt=prompt, max_tokens=8, greedy=True, stream=True),
    ]
    if sampled:
        reqs.append(SoakRequest(client=-1, seq=2, api="generate", prompt=prompt, max_tokens=8, greedy=False,
                                stream=False, sampling=(("temperature", 1.0), ("top_p", 0.95), ("top_k", 20))))
    return [p for r in reqs if (p := send(server.name, server.base_url, model, r, timeout_s).problem())]


def wait_idle(server, timeout_s: float) -> Dict[str, float]:
    """/metrics once nothing runs, nothing queues and no KV is held (idle gauges are
    published within 30 s of going idle); the last reading if that does not come."""
    end = time.monotonic() + timeout_s
    metrics: Dict[str, float] = {}
    while time.monotonic() < end and server.alive():
        try:
            metrics = server.metrics()
        except OSError:
            metrics = {}
        if all(metrics.get(k) == 0 for k in ("sglang:num_running_reqs", "sglang:num_queue_reqs",
                                             "sglang:num_used_tokens")):  # fmt: skip
            time.sleep(3.0)  # the scheduler's strict idle check runs once it is idle
            return server.metrics() if server.alive() else metrics
        time.sleep(1.0)
    return metrics


#: The phases of ``run_soak``, in order; their wall seconds add up to the run's.
PHASES = ("setup", "warmup", "load", "references", "idle")
#: When ``run_soak``'s ``during_load`` starts, as a fraction of the load's duration: early
#: enough that it ends before the load does, late enough that the pools are already full.
DURING_LOAD_AT = 1 / 3


def run_soak(spec: Dict[str, object], refs: Dict[str, object], mixes: Dict[str, LoadMix],
             settings: SoakSettings, log=print, log_starts: Optional[dict] = None,
             phases_s: Optional[dict] = None,
             during_load: Optional[Callable[[], None]] = None) -> Dict[str, ServerSoak]:  # fmt: skip
    """Load every server of ``spec`` (name -> handle; its target is ``SPEC_SERVERS[name][0]``)
    with ``settings.clients`` clients for ``settings.duration_s``, the greedy requests
    answered again by ``refs[target]``; then wait for idle and collect. ``log_starts``, if
    given, receives every server's log size (bytes) when the load starts, by handle name.
    ``phases_s``, if given, receives the wall seconds of each phase of ``PHASES`` as it ends
    (``load`` includes the drain), so that a run that fails midway still shows where its
    time went. ``during_load``, if given, runs in a thread from ``DURING_LOAD_AT`` of the
    load on (more requests, under the load rather than after it); the load phase ends when
    it has returned too. It must not raise: what it finds, it keeps."""
    phases = phases_s if phases_s is not None else {}
    lap = [time.monotonic()]

    def phase_done(phase: str) -> None:
        now = time.monotonic()
        phases[phase] = round(now - lap[0], 2)
        lap[0] = now

    everyone = {**spec, **{f"{t}-reference": h for t, h in refs.items()}}
    models = {name: served_model(h) for name, h in everyone.items()}
    pools = {name: max_total_tokens(h) for name, h in spec.items()}
    log(f"[soak] KV pools: {pools}")
    phase_done("setup")

    target_of = {**{n: SPEC_SERVERS[n][0] for n in spec}, **{f"{t}-reference": t for t in refs}}

    def warm_one(name):
        return warm_up(everyone[name], models[name], mixes[target_of[name]].prefixes[0], settings.warmup_timeout_s,
                       sampled=name in spec)  # fmt: skip

    with ThreadPoolExecutor(len(everyone)) as ex:
        warm = dict(zip(everyone, ex.map(warm_one, everyone)))
    phase_done("warmup")
    log(f"[soak] first requests answered after {phases['warmup']:.0f} s")
    failed_refs = {n: p for n, p in warm.items() if p and n not in spec}
    if failed_refs:
        raise AssertionError(f"reference servers failed their first requests: {failed_refs}")
    # A speculative server that fails its first requests stays out of the load (and fails
    # every check); the others are soaked all the same.
    loaded = {n: h for n, h in spec.items() if not warm[n]}
    if len(loaded) < len(spec):
        log(f"[soak] left out after failing their first requests: {sorted(set(spec) - set(loaded))}")

    starts = {name: log_size(h) for name, h in spec.items()}
    if log_starts is not None:
        log_starts.update({h.name: log_size(h) for h in everyone.values()})
    before = {name: (h.metrics() if name in loaded else {}) for name, h in spec.items()}
    books = {t: References(f"{t}-reference", h.base_url, models[f"{t}-reference"], settings.reference_workers,
                           settings.request_timeout_s) for t, h in refs.items()}  # fmt: skip

    def on_outcome(target):
        book = books[target]
        return lambda out: book.submit(out.req) if out.req.greedy and out.completed else None

    targets = [LoadTarget(name, h.base_url, models[name], mixes[SPEC_SERVERS[name][0]],
                          on_outcome(SPEC_SERVERS[name][0])) for name, h in loaded.items()]  # fmt: skip
    t0 = time.monotonic()
    log(f"[soak] {settings.clients} clients x {len(loaded)} servers for {settings.duration_s:.0f} s")
    side = None
    if during_load is not None:
        side = threading.Timer(settings.duration_s * DURING_LOAD_AT, during_load)
        side.daemon = True
        side.start()
    outcomes = run_load(targets, settings.clients, settings.duration_s, settings.request_timeout_s, settings.drain_s)
    if side is not None:
        side.join()
    phase_done("load")
    outcomes.update({n: [] for n in spec if n not in loaded})
    log(f"[soak] load done after {time.monotonic() - t0:.0f} s: "
        f"{ {n: len(o) for n, o in outcomes.items()} } requests; {sum(len(b) for b in books.values())} references")
    references = {t: b.results(settings.request_timeout_s) for t, b in books.items()}
    for b in books.values():
        b.close()
    phase_done("references")
    log(f"[soak] references done after {time.monotonic() - t0:.0f} s")

    with ThreadPoolExecutor(len(spec)) as ex:
        idle = dict(zip(spec, ex.map(lambda n: wait_idle(spec[n], settings.idle_timeout_s), spec)))
    out = {}
    for name, h in spec.items():
        end = log_size(h)
        target = SPEC_SERVERS[name][0]
        out[name] = ServerSoak(
            name=name, target=target, outcomes=outcomes[name], references=references[target],
            max_total_tokens=pools[name], log=log_bytes(h, starts[name], end), log_end=end, alive=h.alive(),
            idle_metrics=idle[name], idle_problems=_verdict.idle_pool_problems(idle[name], pools[name]),
            metrics_before=before[name], warmup_problems=warm[name],
        )  # fmt: skip
    phase_done("idle")
    log(f"[soak] idle after {time.monotonic() - t0:.0f} s; phases (s): {phases}")
    return out


def results(report: Dict[str, ServerSoak], settings: SoakSettings, extra: Optional[dict] = None,
            phases_s: Optional[dict] = None) -> dict:  # fmt: skip
    """The JSON the piece writes: settings, figures per server and, given ``phases_s``
    (``run_soak``'s, to which later phases may be added), the wall seconds per phase."""
    return {
        "settings": {"duration_s": settings.duration_s, "clients_per_server": settings.clients,
                     "pool_fraction": settings.pool_fraction, "seed": settings.seed},  # fmt: skip
        "servers": {name: {"target": r.target, **r.figures(settings.duration_s)} for name, r in report.items()},
        **({"phases_s": phases_s} if phases_s is not None else {}),
        **(extra or {}),
    }
