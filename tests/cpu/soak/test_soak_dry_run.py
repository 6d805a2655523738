# SPDX-License-Identifier: Apache-2.0
"""The soak piece run end to end on the CPU against stand-in servers (``_standin.py``),
started by the GPU harness's own ``ServerProcess`` with the command lines the piece's
conftest builds: warm-up, 4 clients per server for a few seconds, references, idle, the
figures, the phases' wall seconds and the JSON. Healthy stand-ins pass every check; each
fault a stand-in can play is caught by the check meant for it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.gpu.conftest import ServerProcess
from tests.gpu.soak import _checks
from tests.gpu.soak._load_mix import LoadMix, MixConfig
from tests.gpu.soak._soak import PHASES, SPEC_SERVERS, SoakSettings, results, run_soak

STANDIN = Path(__file__).resolve().parent / "_standin.py"
SETTINGS = SoakSettings(duration_s=3.0, clients=4, drain_s=8.0, request_timeout_s=60.0, idle_timeout_s=6.0,
                        warmup_timeout_s=30.0, reference_workers=8)  # fmt: skip


class StandIn(ServerProcess):
    launcher = (sys.executable, str(STANDIN))


def _server_configs(models: Path, settings: SoakSettings, mixes: dict) -> dict:
    from tests.gpu.soak.conftest import server_configs

    return server_configs(models, settings, mixes)


def run(tmp_path, faults: dict, phases_s=None):
    """The soak with every speculative server; ``faults``: server name -> STANDIN_FAULT;
    ``phases_s`` receives ``run_soak``'s phases and, under ``"wall"``, its wall seconds."""
    mixes = {t: LoadMix(MixConfig(context_len=4096, vocab_size=512)) for t in SETTINGS.targets}
    configs = _server_configs(tmp_path / "models", SETTINGS, mixes)
    logs = tmp_path / "logs"
    logs.mkdir()
    servers = {}
    try:
        for name, (model, args, env) in configs.items():
            env = {**env, "STANDIN_FAULT": faults.get(name, "")}
            servers[name] = StandIn(f"soak-{name}", str(model), args, logs, env=env)
        for s in servers.values():
            s.wait_healthy(60)
        spec = {n: servers[n] for n in SETTINGS.servers}
        refs = {t: servers[f"{t}-reference"] for t in SETTINGS.targets}
        starts = {}
        t0 = time.monotonic()
        report = run_soak(spec, refs, mixes, SETTINGS, log=lambda m: None, log_starts=starts, phases_s=phases_s)
        if phases_s is not None:
            phases_s["wall"] = time.monotonic() - t0
        after = {n: _checks.after_problems(s, starts[s.name]) for n, s in servers.items()}
        return report, after, configs
    finally:
        for s in servers.values():
            s.stop()


def all_problems(report, name):
    r = report[name]
    return {
        "served": _checks.served_problems(r),
        "greedy": _checks.greedy_problems(r),
        "pools": _checks.pool_problems(r),
        "load": _checks.load_shape_problems(r, SETTINGS),
    }


def test_healthy_servers_pass_every_check(tmp_path):
    phases = {}
    report, after, configs = run(tmp_path, {}, phases)
    assert sorted(report) == sorted(SPEC_SERVERS)
    assert after == {n: [] for n in configs}  # references included
    for name in SPEC_SERVERS:
        assert all_problems(report, name) == {"served": [], "greedy": [], "pools": [], "load": []}, name
        fig = report[name].figures(SETTINGS.duration_s)
        assert fig["requests_served"] > 10 and fig["greedy_compared"] > 3 and fig["retracted_requests_in_log"] > 0
        assert fig["retracted_requests_metric"] == fig["retracted_requests_in_log"]
        assert fig["latency_ms_p50"] <= fig["latency_ms_p99"] and fig["aborted_by_client"] > 0
        assert fig["kv_pool_tokens"] == int(configs[name][1][configs[name][1].index("--max-total-tokens") + 1])
    wall = phases.pop("wall")
    data = json.loads(json.dumps(results(report, SETTINGS, {"gpu": "none"}, phases_s=phases)))
    assert data["settings"]["clients_per_server"] == 4 and set(data["servers"]) == set(SPEC_SERVERS)
    check_phases(data["phases_s"], wall)
    # no request hung: the drain ended with the last answer, well before its deadline
    assert SETTINGS.duration_s <= data["phases_s"]["load"] < SETTINGS.duration_s + SETTINGS.drain_s


def check_phases(phases: dict, wall: float) -> None:
    """Every phase, in order, its seconds sane: the load at least the configured duration,
    and all of them together the run's wall time."""
    assert list(phases) == list(PHASES), phases
    assert all(isinstance(v, float) and v >= 0 for v in phases.values()), phases
    assert phases["load"] >= SETTINGS.duration_s, phases
    assert abs(sum(phases.values()) - wall) < 0.05 * len(PHASES), (phases, wall)


def test_each_fault_is_caught_by_its_check(tmp_path):
    faults = {"mla-ddtree": "wrong_greedy", "mla-dflash": "http500", "gqa-ddtree": "leak", "gqa-dflash": "no_retract"}
    report, _, _ = run(tmp_path, faults)
    caught = {name: {k for k, v in all_problems(report, name).items() if v} for name in faults}
    assert caught == {"mla-ddtree": {"greedy"}, "mla-dflash": {"served"}, "gqa-ddtree": {"pools"},
                      "gqa-dflash": {"load"}}, caught  # fmt: skip
    assert "differs from no speculation at output position" in _checks.greedy_problems(report["mla-ddtree"])[0]
    assert any("HTTP 500" in p for p in _checks.served_problems(report["mla-dflash"]))
    assert any("sglang:num_used_tokens = 7" in p for p in _checks.pool_problems(report["gqa-ddtree"]))
    assert "never retracted" in _checks.load_shape_problems(report["gqa-dflash"], SETTINGS)[0]


def test_hangs_crashes_short_answers_and_error_lines_are_caught(tmp_path):
    faults = {"mla-ddtree": "hang", "mla-dflash": "crash", "gqa-ddtree": "error_line", "gqa-dflash": "short"}
    phases = {}
    report, after, _ = run(tmp_path, faults, phases)
    check_phases(phases, phases.pop("wall"))
    assert phases["load"] >= SETTINGS.duration_s + SETTINGS.drain_s  # the hung request held it to the drain's end
    served = {name: _checks.served_problems(report[name]) for name in faults}
    assert "died" in after["mla-dflash"][0] and "Scheduler hit an exception" in after["gqa-ddtree"][0]
    assert after["gqa-dflash"] == [] and after["mla-reference"] == []
    assert any("no answer by the drain deadline" in p for p in served["mla-ddtree"]), served["mla-ddtree"]
    assert report["mla-ddtree"].figures(SETTINGS.duration_s)["hung"] == 1
    assert _checks.pool_problems(report["mla-ddtree"])  # the hung request still holds its slot
    assert not report["mla-dflash"].alive and "died during the soak" in served["mla-dflash"][0]
    assert any("Scheduler hit an exception" in p for p in served["gqa-ddtree"]), served["gqa-ddtree"]
    assert any("expected" in p and "(ignore_eos)" in p for p in served["gqa-dflash"]), served["gqa-dflash"]


@pytest.mark.parametrize("name", sorted(SPEC_SERVERS))
def test_server_command_lines(tmp_path, name):
    """What the piece starts: triton attention, the algorithm and drafter, a KV pool of about
    a quarter of the offered load, metrics, the strict idle pool check."""
    mixes = {t: LoadMix(MixConfig(context_len=4096, vocab_size=512)) for t in ("mla", "gqa")}
    settings = SoakSettings()
    configs = _server_configs(tmp_path, settings, mixes)
    target, algorithm = SPEC_SERVERS[name]
    model, args, env = configs[name]
    flags = {a: (b if not b.startswith("--") else None) for a, b in zip(args, [*args[1:], "--"]) if a.startswith("--")}
    assert model.name == {"mla": "tiny-mla", "gqa": "tiny-qwen3"}[target]
    assert flags["--speculative-algorithm"] == algorithm and flags["--attention-backend"] == "triton"
    assert flags["--speculative-draft-model-path"].endswith(f"{model.name}-dflash")
    offered = settings.clients * mixes[target].mean_request_tokens()
    assert 0.2 * offered <= int(flags["--max-total-tokens"]) <= 0.3 * offered
    assert flags["--max-running-requests"] == "64" and "--enable-metrics" in args
    assert env["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] == "1"
    ref_model, ref_args, _ = configs[f"{target}-reference"]
    assert ref_model == model and "--speculative-algorithm" not in ref_args


def test_a_server_failing_its_first_requests_is_left_out(tmp_path):
    """The others are soaked and pass; it fails its checks with what went wrong."""
    report, _, _ = run(tmp_path, {"gqa-ddtree": "dead_on_arrival"})
    assert report["gqa-ddtree"].outcomes == [] and not report["gqa-ddtree"].alive
    assert "failed its first requests and was left out" in _checks.served_problems(report["gqa-ddtree"])[0]
    assert _checks.greedy_problems(report["gqa-ddtree"])
    for name in ("mla-ddtree", "mla-dflash", "gqa-dflash"):
        assert all_problems(report, name) == {"served": [], "greedy": [], "pools": [], "load": []}, name
