# SPDX-License-Identifier: Apache-2.0
"""benchmarks/cost_model.py: tokens/s = batch x tau / step time, the budget interpolation,
the own-shape check, and the real e2e_step result files it reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import cost_model as cm

REPO = Path(__file__).resolve().parents[3]


def _sweep(rows, steps=()):
    return {"date": "2026-12-02", "device": "NVIDIA H200", "rows": rows, "steps": list(steps)}


def _row(config, batch, t, tau, tps):
    return {"config": config, "batch": batch, "temperature": t, "top_p": 1.0, "top_k": 0,
            "accept_length": tau, "accept_length_pooled": tau, "throughput_tok_s": tps}


def _e2e(tmp_path, name, rows, **top):
    p = tmp_path / name
    p.write_text(json.dumps({"what": "decode step time, DeepSeek-V2-Lite-shaped target (dummy weights)",
                             "date": "2026-11-30", "device": "NVIDIA H200", "rows": rows, **top}))
    return p


def _step(config, ctx, batch, ms, verify="fused"):
    return {"config": config, "verify": "-" if config == "nospec" else verify, "backend": "triton", "ctx": ctx,
            "batch": batch, "ms_per_step": ms}


def test_prediction_is_batch_times_tau_over_step(tmp_path):
    sweep = _sweep([_row("nospec", 1, 0.0, None, 100.0), _row("dflash", 1, 0.0, 4.0, 300.0),
                    _row("ddtree16", 1, 0.0, 5.0, 350.0), _row("ddtree64", 1, 0.0, 6.0, 330.0),
                    _row("ddtree32", 1, 0.0, 5.6, 340.0), _row("dflash", 8, 0.0, 3.8, 2000.0)])
    e2e = _e2e(tmp_path, "a.json", [_step("nospec", 16384, 1, 5.0), _step("dflash", 16384, 1, 10.0),
                                    _step("ddtree16", 16384, 1, 11.0), _step("ddtree64", 16384, 1, 17.0),
                                    _step("dflash", 16384, 1, 99.0, verify="upstream_extend"),
                                    _step("dflash", 16384, 8, 20.0)])
    table = cm.load_step_rows([e2e])
    pred = {(p["ctx"], p["batch"], p["temperature"]): p for p in cm.predict(sweep, table)}
    p = pred[(16384, 1, 0.0)]
    c = p["configs"]
    assert c["nospec"]["tok_s"] == pytest.approx(1000 / 5.0)
    assert c["dflash"]["tok_s"] == pytest.approx(4.0 * 1000 / 10.0)  # the fused row, not upstream_extend's
    assert c["ddtree16"]["tok_s"] == pytest.approx(5.0 * 1000 / 11.0)
    assert c["ddtree16"]["speedup_vs_dflash"] == pytest.approx((5.0 / 11.0) / (4.0 / 10.0))
    assert c["dflash"]["speedup_vs_nospec"] == pytest.approx(400 / 200)
    # ddtree32 has no step row: interpolated in log2(B) between 16 and 64 (halfway)
    assert c["ddtree32"]["interpolated"] and c["ddtree32"]["ms_per_step"] == pytest.approx(14.0)
    assert not c["ddtree16"]["interpolated"]
    assert p["best_ddtree"] == "ddtree16"
    assert pred[(16384, 8, 0.0)]["configs"]["dflash"]["tok_s"] == pytest.approx(8 * 3.8 * 1000 / 20.0)
    md = cm.markdown(cm.predict(sweep, table))
    assert "| v2lite-shape | 16384 | 1 | 400 | ddtree16 |" in md and "32: " in md and "*" in md


def test_budgets_not_run_take_the_tau_their_larger_server_counted(tmp_path):
    """A DDTREE row's accept_length_at_budget (the server's exact counters) fills the budgets the
    sweep did not run; a budget the sweep ran keeps its own measurement."""
    big = _row("ddtree64", 1, 0.0, 6.0, 330.0)
    big["accept_length_at_budget"] = {"1": 1.7, "2": 2.2, "4": 3.0, "8": 3.9, "16": 4.8, "32": 5.5, "64": 6.0}
    mid = _row("ddtree32", 1, 0.0, 5.7, 340.0)
    mid["accept_length_at_budget"] = {"1": 1.6, "8": 3.8, "16": 4.7, "32": 5.7}
    sweep = _sweep([_row("nospec", 1, 0.0, None, 100.0), _row("dflash", 1, 0.0, 4.0, 300.0), mid, big])
    table = cm.tau_table(sweep)
    assert table[("ddtree32", 1, 0.0)] == {"tau": 5.7, "from": "ddtree32"}  # measured wins
    assert table[("ddtree16", 1, 0.0)] == {"tau": 4.8, "from": "ddtree64"}  # the largest budget's counters
    assert table[("ddtree1", 1, 0.0)] == {"tau": 1.7, "from": "ddtree64"}
    e2e = _e2e(tmp_path, "a.json", [_step("nospec", 1024, 1, 5.0), _step("dflash", 1024, 1, 10.0),
                                    _step("ddtree8", 1024, 1, 9.0), _step("ddtree16", 1024, 1, 10.0),
                                    _step("ddtree64", 1024, 1, 16.0)])
    c = cm.predict(sweep, cm.load_step_rows([e2e]))[0]["configs"]
    assert c["ddtree16"]["tok_s"] == pytest.approx(4.8 * 1000 / 10.0) and c["ddtree16"]["tau_from"] == "ddtree64"
    assert c["ddtree8"]["tau"] == pytest.approx(3.9) and "tau_from" not in c["ddtree64"]
    assert c["ddtree32"]["interpolated"] and "tau_from" not in c["ddtree32"]
    assert "ddtree4" not in c  # no step time at 4: never extrapolated


def test_no_extrapolation_and_later_files_win(tmp_path):
    a = _e2e(tmp_path, "a.json", [_step("ddtree16", 1024, 1, 9.0), _step("ddtree64", 1024, 1, 14.0)])
    b = _e2e(tmp_path, "b.json", [_step("ddtree64", 1024, 1, 15.0)], expert_routing="uniform")
    table = cm.load_step_rows([a, b])
    assert table[("v2lite-shape", 1024, 1, "ddtree64")]["ms_per_step"] == 15.0
    assert cm.step_ms(table, "v2lite-shape", 1024, 1, "ddtree128") is None  # beyond the measured budgets
    assert cm.step_ms(table, "v2lite-shape", 1024, 1, "ddtree8") is None
    assert cm.load_step_rows([a, b], routing="uniform").keys() == {("v2lite-shape", 1024, 1, "ddtree64")}
    # a file that names its shape keeps its rows apart
    c = _e2e(tmp_path, "c.json", [_step("ddtree16", 1024, 1, 3.0)], model="qwen3-8b-shape")
    assert ("qwen3-8b-shape", 1024, 1, "ddtree16") in cm.load_step_rows([a, c])
    # e2e_step records its --target
    d = _e2e(tmp_path, "d.json", [_step("ddtree16", 1024, 1, 4.0)], target="gptoss-20b")
    assert ("gptoss-20b-shape", 1024, 1, "ddtree16") in cm.load_step_rows([d])


def test_own_shape_check():
    sweep = _sweep([_row("dflash", 1, 0.0, 4.0, 380.0), _row("ddtree16", 1, 0.0, 5.0, 400.0),
                    _row("ddtree16", 1, 1.0, 3.0, 260.0)],
                   steps=[{"config": "dflash", "batch": 1, "ms_per_step": 10.0},
                          {"config": "ddtree16", "batch": 1, "ms_per_step": 11.0}])
    own = {(o["config"], o["temperature"]): o for o in cm.own_shape(sweep)}
    assert own[("dflash", 0.0)]["predicted_tok_s"] == pytest.approx(400.0)
    assert own[("dflash", 0.0)]["error"] == pytest.approx(400 / 380 - 1)
    assert own[("ddtree16", 1.0)]["predicted_tok_s"] == pytest.approx(3.0 * 1000 / 11.0)
    assert own[("ddtree16", 1.0)]["step_temperature"] == 0.0  # no sampled step measured: the greedy one


def test_own_shape_charges_each_temperature_its_own_step():
    """A sweep that measured a step at T=1 charges the T=1 point that step, not the greedy one;
    a step with top-k or top-p is not a plain T=1 step."""
    steps = [{"config": "ddtree16", "batch": 1, "ms_per_step": 11.0},
             {"config": "ddtree16", "batch": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "ms_per_step": 15.0},
             {"config": "ddtree16", "batch": 1, "temperature": 1.0, "top_p": 0.8, "top_k": 20, "ms_per_step": 99.0}]
    sweep = _sweep([_row("ddtree16", 1, 0.0, 5.0, 400.0), _row("ddtree16", 1, 1.0, 3.0, 260.0)], steps=steps)
    own = {o["temperature"]: o for o in cm.own_shape(sweep)}
    assert own[0.0]["ms_per_step"] == 11.0 and own[0.0]["step_temperature"] == 0.0
    assert own[1.0]["ms_per_step"] == 15.0 and own[1.0]["step_temperature"] == 1.0
    assert own[1.0]["predicted_tok_s"] == pytest.approx(3.0 * 1000 / 15.0)


def test_sampled_e2e_runs_are_not_the_models_step_times(tmp_path):
    greedy = _e2e(tmp_path, "g.json", [_step("dflash", 1024, 1, 5.0)])
    sampled = _e2e(tmp_path, "s.json", [_step("dflash", 1024, 1, 9.0)], sampling="T=1")
    table = cm.load_step_rows([greedy, sampled])
    assert table[("v2lite-shape", 1024, 1, "dflash")]["ms_per_step"] == 5.0


def test_reads_the_repository_e2e_step_results(tmp_path):
    files = sorted((REPO / "benchmarks" / "results").glob("e2e_step_*_h200_*.json"))
    assert files, "benchmarks/results/e2e_step_*_h200_*.json"
    table = cm.load_step_rows(files)
    assert ("v2lite-shape", 16384, 1, "dflash") in table and ("v2lite-shape", 16384, 1, "ddtree64") in table
    assert all(v["ms_per_step"] > 0 for v in table.values())
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps(_sweep([_row("nospec", 1, 0.0, None, 100.0), _row("dflash", 1, 0.0, 4.0, 300.0),
                                        _row("ddtree16", 1, 0.0, 5.0, 350.0), _row("ddtree64", 1, 0.0, 6.5, 360.0)])))
    assert cm.main(["--sweep", str(sweep), "--e2e", *map(str, files), "--tag", "t", "--out-dir", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "cost_model_t.json").read_text())
    assert r["predictions"] and (tmp_path / "cost_model_t.png").stat().st_size > 1000
    with pytest.raises(SystemExit, match="no such file"):
        cm.main(["--sweep", str(tmp_path / "missing.json"), "--e2e", str(files[0])])
    with pytest.raises(SystemExit, match="no usable"):
        cm.main(["--sweep", str(sweep), "--e2e", str(files[0]), "--verify", "nothing"])


def _step_row(config, batch, ms, accept, t=0.0):
    return {"config": config, "batch": batch, "temperature": t, "top_p": 1.0, "top_k": 0, "ms_per_step": ms,
            "accept_length": accept}


def test_token_costs_fit_the_host_work_per_committed_token():
    """At batch 8 a DDTREE server committing 4 tokens per request and step runs 8 x 4 / 8,000
    s = 4.0 ms a step, where the step measured on random prompts (1 token) took 2.5: 1.5 ms for
    8 x 3 more tokens, 0.0625 ms each. Batch-1 points and points that commit about what the
    measurement did are left out; each temperature gets its own fit."""
    sweep = _sweep([_row("ddtree16", 8, 0.0, 4.0, 8000.0), _row("dflash", 8, 0.0, 3.0, 8 * 3.0 * 1000 / 3.5),
                    _row("ddtree16", 8, 1.0, 2.0, 8 * 2.0 * 1000 / 4.0),
                    _row("ddtree16", 1, 0.0, 4.0, 100.0), _row("nospec", 8, 0.0, None, 5000.0)],
                   steps=[_step_row("ddtree16", 8, 2.5, 1.0), _step_row("dflash", 8, 2.5, 1.0),
                          _step_row("ddtree16", 8, 3.0, 1.0, t=1.0), _step_row("ddtree16", 1, 2.0, 1.0),
                          _step_row("nospec", 8, 1.5, 1.0)])
    costs = cm.token_costs([sweep])
    # T=0: DDTREE 0.0625 and DFLASH (3.5 - 2.5) / (8 x 2) = 0.0625; the batch-1 point (which
    # would give 20 ms a token) and no speculation (no extra token) are not fitted.
    assert costs[0.0] == pytest.approx(0.0625)
    assert costs[1.0] == pytest.approx((4.0 - 3.0) / 8)
    own = {(o["config"], o["batch"], o["temperature"]): o for o in cm.own_shape(sweep, costs)}
    assert own[("ddtree16", 8, 0.0)]["ms_per_step"] == pytest.approx(4.0)
    assert own[("ddtree16", 8, 0.0)]["measured_ms_per_step"] == 2.5
    assert own[("ddtree16", 8, 0.0)]["error"] == pytest.approx(0.0)
    assert own[("nospec", 8, 0.0)]["ms_per_step"] == 1.5  # commits what it was measured committing
    # Without the fit the same point is predicted from the random-prompt step alone.
    assert {(o["config"], o["batch"], o["temperature"]): o for o in cm.own_shape(sweep)}[
        ("ddtree16", 8, 0.0)]["error"] == pytest.approx(4.0 / 2.5 - 1)
    assert cm.token_cost(costs, 0.7) == costs[0.0]  # no fit at T=0.7: the greedy one
    assert cm.token_cost(None, 0.0) == 0.0


def test_predictions_charge_the_token_cost_beyond_each_step_rows_accept_length(tmp_path):
    sweep = _sweep([_row("nospec", 8, 0.0, None, 100.0), _row("ddtree16", 8, 0.0, 5.0, 300.0)])
    rows = [_step("nospec", 1024, 8, 5.0), {**_step("ddtree16", 1024, 8, 10.0), "accept_length": 1.5}]
    table = cm.load_step_rows([_e2e(tmp_path, "a.json", rows)])
    c = cm.predict(sweep, table, {0.0: 0.1})[0]["configs"]
    assert c["ddtree16"]["ms_per_step"] == pytest.approx(10.0 + 0.1 * 8 * (5.0 - 1.5))
    assert c["ddtree16"]["measured_ms_per_step"] == 10.0
    assert c["nospec"]["ms_per_step"] == 5.0
    assert c["ddtree16"]["tok_s"] == pytest.approx(8 * 5.0 * 1000 / 12.8)


def test_token_cost_from_on_the_command_line(tmp_path):
    """--token-cost-from fits the cost from other sweeps, records it and both own-shape errors;
    sweeps without a batch >= 2 point to fit from are refused."""
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps(_sweep([_row("ddtree16", 8, 0.0, 4.0, 8000.0)], steps=[_step_row("ddtree16", 8, 2.5, 1.0)])))
    checked = tmp_path / "checked.json"
    checked.write_text(json.dumps(_sweep([_row("nospec", 8, 0.0, None, 5000.0), _row("ddtree16", 8, 0.0, 3.0, 6000.0)],
                                         steps=[_step_row("nospec", 8, 1.6, 1.0), _step_row("ddtree16", 8, 2.8, 1.0)])))
    e2e = _e2e(tmp_path, "e.json", [_step("nospec", 1024, 8, 5.0), _step("ddtree16", 1024, 8, 10.0)])
    assert cm.main(["--sweep", str(checked), "--e2e", str(e2e), "--token-cost-from", str(fit), "--tag", "t",
                    "--out-dir", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "cost_model_t.json").read_text())
    assert out["token_cost_ms"] == {"0.0": pytest.approx(0.0625)}
    ddtree = [o for o in out["own_shape"] if o["config"] == "ddtree16"][0]
    assert ddtree["ms_per_step"] == pytest.approx(2.8 + 0.0625 * 8 * 2.0)
    assert out["own_shape_error"]["mean_abs"] < out["own_shape_error_without_token_cost"]["mean_abs"]
    batch1 = tmp_path / "batch1.json"
    batch1.write_text(json.dumps(_sweep([_row("ddtree16", 1, 0.0, 4.0, 800.0)], steps=[_step_row("ddtree16", 1, 2.5, 1.0)])))
    with pytest.raises(SystemExit, match="no batch >= 2 point"):
        cm.main(["--sweep", str(checked), "--e2e", str(e2e), "--token-cost-from", str(batch1), "--out-dir", str(tmp_path)])
