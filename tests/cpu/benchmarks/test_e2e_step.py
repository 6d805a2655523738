# SPDX-License-Identifier: Apache-2.0
"""The pure parts of benchmarks/e2e_step.py: configuration specs, server flags (parsed by the
real pinned upstream ServerArgs parser), step statistics, the wall-clock guard, ratios
against a reference run, the README table and merging split runs."""

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import e2e_step as es


@pytest.mark.parametrize("text,want", [
    ("ddtree64", ("ddtree64", "fused", "triton", "native")),
    ("ddtree64@upstream_extend", ("ddtree64", "upstream_extend", "triton", "native")),
    ("dflash@upstream_extend:flashinfer", ("dflash", "upstream_extend", "flashinfer", "native")),
    ("dflash:flashinfer", ("dflash", "fused", "flashinfer", "native")),
    ("nospec", ("nospec", "-", "triton", "native")),
    ("ddtree63@upstream_extend", ("ddtree63", "upstream_extend", "triton", "native")),
    ("ddtree256", ("ddtree256", "fused", "triton", "native")),
    ("ddtree16@auto+sm120", ("ddtree16", "auto", "triton", "sm120-proxy")),
    ("dflash:flashinfer+sm120", ("dflash", "fused", "flashinfer", "sm120-proxy")),
])
def test_parse_spec(text, want):
    spec = es.parse_spec(text)
    assert spec.key == want
    if spec.config != "nospec":
        assert es.parse_spec(spec.label) == spec  # the label reads back


def test_parse_spec_run_defaults_apply_only_without_suffix():
    assert es.parse_spec("ddtree16", verify="upstream_extend").verify == "upstream_extend"
    assert es.parse_spec("ddtree16@fused", verify="upstream_extend").verify == "fused"
    assert es.parse_spec("nospec", backend="flashinfer").backend == "flashinfer"


@pytest.mark.parametrize("text,msg", [
    ("ddtree0", "unknown configuration"),
    ("ddtree257", "unknown configuration"),
    ("ddtree016", "unknown configuration"),
    ("eagle", "unknown configuration"),
    ("ddtree64@dense", "unknown verify path"),
    ("dflash:fa3", "unknown backend"),
    ("nospec@upstream_extend", "no verify path"),
    ("ddtree64 @fused", "bad configuration"),
    ("ddtree16+sm90", "bad configuration"),
])
def test_parse_spec_errors_say_what_to_use(text, msg):
    with pytest.raises(ValueError, match=msg):
        es.parse_spec(text)


def test_ddtree_budgets_are_the_servers(upstream_parser):
    from sglang.srt.layers.attention.tree_verify import masks
    from sglang.srt.speculative.ddtree import budget

    assert (es.DDTREE_BUDGETS.start, es.DDTREE_BUDGETS.stop - 1) == (budget.MIN_BUDGET, masks.MAX_BUDGET)
    ns = upstream_parser.parse_args(["--model-path", "/m", *es.server_args(es.parse_spec("ddtree63"), "/d", 4096, [1])])
    assert (ns.speculative_algorithm, ns.speculative_ddtree_budget) == ("DDTREE", 63)


def test_table_orders_ddtree_by_budget():
    names = ["ddtree128", "dflash", "ddtree16-eager-segments", "ddtree16", "nospec", "ddtree63"]
    assert sorted(names, key=es.config_order) == [
        "nospec", "dflash", "ddtree16", "ddtree16-eager-segments", "ddtree63", "ddtree128"]  # fmt: skip


def test_eager_segments_is_the_same_server_without_step_graphs(upstream_parser):
    spec = es.parse_spec("ddtree16-eager-segments@auto")
    assert (spec.config, spec.verify, es.ddtree_budget(spec.config)) == ("ddtree16-eager-segments", "auto", 16)
    ns = upstream_parser.parse_args(["--model-path", "/m", *es.server_args(spec, "/d", 4096, [1])])
    assert (ns.speculative_algorithm, ns.speculative_ddtree_budget) == ("DDTREE", 16)
    env = es.server_env(spec, Path("/tmp/tc"))
    assert env["SGLANG_DDTREE_STEP_GRAPHS"] == "0"
    assert "SGLANG_DDTREE_STEP_GRAPHS" not in es.server_env(es.parse_spec("ddtree16@auto"), Path("/tmp/tc"))
    # The variable exists where the server reads it.
    from sglang.srt.ddtree_environ import ddtree_envs

    assert ddtree_envs.SGLANG_DDTREE_STEP_GRAPHS.get() is True
    for bad in ("ddtree16-eager", "dflash-eager-segments", "nospec-eager-segments"):
        with pytest.raises(ValueError):
            es.parse_spec(bad)
    rows = [{"config": c, "verify": "auto", "backend": "triton", "policy": "native", "ctx": 512, "batch": 1,
             "ms_per_step": ms} for c, ms in (("ddtree16", 2.0), ("ddtree16-eager-segments", 3.0))]  # fmt: skip
    (speedup,) = [r for r in es.ratios(rows, []) if "step graphs" in r["ratio"]]
    assert speedup["value"] == pytest.approx(1.5)


def test_refill_variant_sets_the_servers_variable(upstream_parser):
    for config, flags in (("dflash-refill-verify-buffers", ("DFLASH", None)),
                          ("ddtree16-refill-verify-buffers", ("DDTREE", 16))):  # fmt: skip
        spec = es.parse_spec(config)
        assert es.server_env(spec, Path("/tmp/tc"))["SGLANG_DDTREE_VERIFY_REFILL_UPSTREAM"] == "1"
        ns = upstream_parser.parse_args(["--model-path", "/m", *es.server_args(spec, "/d", 4096, [1])])
        assert (ns.speculative_algorithm, ns.speculative_ddtree_budget) == flags
    assert "SGLANG_DDTREE_VERIFY_REFILL_UPSTREAM" not in es.server_env(es.parse_spec("dflash"), Path("/tmp/tc"))
    from sglang.srt.ddtree_environ import ddtree_envs

    assert ddtree_envs.SGLANG_DDTREE_VERIFY_REFILL_UPSTREAM.get() is False
    for bad in ("nospec-refill-verify-buffers", "dflash-eager-segments-refill-verify-buffers"):
        with pytest.raises(ValueError):
            es.parse_spec(bad)
    names = ["ddtree16-refill-verify-buffers", "dflash-refill-verify-buffers", "ddtree16", "dflash",
             "ddtree16-eager-segments", "nospec"]  # fmt: skip
    assert sorted(names, key=es.config_order) == [
        "nospec", "dflash", "dflash-refill-verify-buffers", "ddtree16", "ddtree16-eager-segments",
        "ddtree16-refill-verify-buffers"]  # fmt: skip
    rows = [{"config": c, "verify": "fused", "backend": "triton", "policy": "native", "ctx": 512, "batch": 1,
             "ms_per_step": ms}
            for c, ms in (("dflash", 2.0), ("dflash-refill-verify-buffers", 2.2), ("ddtree16", 2.5),
                          ("ddtree16-refill-verify-buffers", 3.0))]  # fmt: skip
    got = {r["ratio"]: r["value"] for r in es.ratios(rows, []) if "refill" in r["ratio"]}
    assert sorted(got.values()) == [pytest.approx(1.1), pytest.approx(1.2)]


def test_torch_verify_indices_variant(upstream_parser):
    """``-torch-verify-indices``: the same server with a verify's KV indices built by torch ops,
    for the A/B of the one-launch kernel; the server reads the variable, and the ratio is reported."""
    for config in ("dflash-torch-verify-indices", "ddtree16-torch-verify-indices"):
        env = es.server_env(es.parse_spec(config), Path("/tmp/tc"))
        assert env["SGLANG_DDTREE_VERIFY_INDICES_TORCH"] == "1"
    assert "SGLANG_DDTREE_VERIFY_INDICES_TORCH" not in es.server_env(es.parse_spec("ddtree16"), Path("/tmp/tc"))
    with pytest.raises(ValueError):
        es.parse_spec("nospec-torch-verify-indices")
    rows = [{"config": c, "verify": "fused", "backend": "triton", "policy": "native", "ctx": 512, "batch": 1,
             "ms_per_step": ms}
            for c, ms in (("dflash", 2.0), ("dflash-torch-verify-indices", 2.1), ("ddtree16", 2.0),
                          ("ddtree16-torch-verify-indices", 2.3))]  # fmt: skip
    got = {r["ratio"]: r["value"] for r in es.ratios(rows, []) if "torch verify indices" in r["ratio"]}
    assert sorted(got.values()) == [pytest.approx(1.05), pytest.approx(1.15)]


def test_verify_paths_are_the_dispatchers_strategies():
    from sglang.srt.layers.attention.tree_verify.dispatch import STRATEGIES

    assert set(es.VERIFY_PATHS) == set(STRATEGIES) | {"auto"}


@pytest.fixture(scope="module")
def upstream_parser():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


@pytest.mark.parametrize("text", ["nospec", "dflash@upstream_extend:flashinfer", "ddtree128"])
def test_server_args_parse_with_the_pinned_server(upstream_parser, text):
    spec = es.parse_spec(text)
    args = es.server_args(spec, "/d", 32768, [8, 1])
    ns = upstream_parser.parse_args(["--model-path", "/m", *args])
    assert ns.cuda_graph_bs_decode == [1, 8]  # exactly the measured batch sizes
    assert ns.attention_backend == spec.backend
    assert ns.context_length == 32768 + es.CONTEXT_MARGIN >= 32768 + es.BATCH_TOKEN_CAP
    assert ns.load_format == "dummy"
    if spec.config == "nospec":
        assert ns.speculative_algorithm is None and ns.speculative_draft_model_path is None
    else:
        assert ns.speculative_draft_model_path == "/d"
    if spec.config.startswith("ddtree"):
        assert ns.speculative_algorithm == "DDTREE" and ns.speculative_ddtree_budget == 128


def test_every_request_of_a_batch_is_admitted_at_once(upstream_parser):
    """With the pinned scheduler's DFlash-family default, 7 of 8 requests ran and the
    8th waited for two free slots; the benchmark turns that batching off."""
    from sglang.srt.managers.min_free_slots_delayer import resolve_min_free_slots
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    for text, algo in (("dflash", "DFLASH"), ("ddtree64", "DDTREE")):
        family = SpeculativeAlgorithm.from_string(algo).is_dflash_family()
        assert resolve_min_free_slots(None, 8, is_dflash_family=family) == 2  # what bit us
        ns = upstream_parser.parse_args(["--model-path", "/m", *es.server_args(es.parse_spec(text), "/d", 16384, [8])])
        assert ns.max_running_requests == 8
        assert resolve_min_free_slots(ns.min_free_slots_delay, ns.max_running_requests,
                                      is_dflash_family=family) is None


@pytest.mark.parametrize("max_ctx", [1024, 16384, 32768])
def test_every_prompt_prefills_in_one_chunk(upstream_parser, max_ctx):
    """A chunked prompt holds a request slot; the pinned scheduler then marked the batch full
    and kept the 8th request of a 32K batch queued until the others finished."""
    ns = upstream_parser.parse_args(["--model-path", "/m", *es.server_args(es.parse_spec("dflash"), "/d", max_ctx, [8])])
    assert ns.chunked_prefill_size >= ns.context_length >= max_ctx
    assert ns.max_prefill_tokens >= ns.context_length
    assert ns.chunked_prefill_size >= 16384  # never below upstream's own chunk
    assert ns.prefill_max_requests == 1  # no prompt shares a prefill batch, so none is cut


def test_server_env_names_the_verify_path_unless_auto(tmp_path):
    """A row labelled fused ran the fused kernel, not whatever the server picks by default."""
    assert es.server_env(es.parse_spec("ddtree64"), tmp_path) == {
        "TRITON_CACHE_DIR": str(tmp_path), "SGLANG_DDTREE_VERIFY_STRATEGY": "fused"}
    env = es.server_env(es.parse_spec("ddtree64@upstream_extend"), tmp_path)
    assert env["SGLANG_DDTREE_VERIFY_STRATEGY"] == "upstream_extend"
    assert es.server_env(es.parse_spec("ddtree64@auto"), tmp_path) == {"TRITON_CACHE_DIR": str(tmp_path)}
    assert "SGLANG_DDTREE_VERIFY_STRATEGY" not in es.server_env(es.parse_spec("nospec"), tmp_path)


def test_the_sm120_proxy_is_the_overlays_switch(tmp_path, monkeypatch):
    """A +sm120 configuration's server follows the sm_12x policy: the variable is the one
    gpu_arch reads."""
    from sglang.srt.utils import gpu_arch

    env = es.server_env(es.parse_spec("ddtree16@auto+sm120"), tmp_path)
    assert env == {"TRITON_CACHE_DIR": str(tmp_path), gpu_arch.SM120_PROXY_ENV: "1"}
    monkeypatch.setenv(gpu_arch.SM120_PROXY_ENV, env[gpu_arch.SM120_PROXY_ENV])
    assert gpu_arch.sm120_proxy()
    assert gpu_arch.SM120_PROXY_ENV not in es.server_env(es.parse_spec("ddtree16@auto"), tmp_path)


def test_a_measured_strategy_table_reaches_every_server(tmp_path, monkeypatch):
    """--strategy-table: the variable the policy reads, checked before any server starts,
    and summarised in the result."""
    from sglang.srt.layers.attention.tree_verify import policy

    table = tmp_path / "t.json"
    table.write_text(json.dumps({"sections": [{"arch": "sm12x", "date": "2026-12-02", "hardware": "H200",
                                               "command": "c", "proxy": True, "rows": []}]}))  # fmt: skip
    env = es.server_env(es.parse_spec("ddtree16@auto+sm120"), tmp_path, strategy_table=table)
    monkeypatch.setenv(policy.TABLE_ENV, env[policy.TABLE_ENV])
    assert policy.load_table().sections[0].hardware == "H200"
    assert es.table_summary(table)["sections"] == [{"arch": "sm12x", "date": "2026-12-02", "hardware": "H200",
                                                    "proxy": True}]  # fmt: skip
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"sections": [{"arch": "sm75"}]}))
    with pytest.raises(SystemExit):
        es.main(["--configs", "dflash", "--strategy-table", str(bad), "--out-dir", str(tmp_path)])


def test_uniform_expert_routing_is_upstreams_switch(tmp_path, monkeypatch):
    """The variable must be the one the pinned upstream's MoE top-k reads."""
    from sglang.srt.environ import envs

    env = es.server_env(es.parse_spec("dflash@auto"), tmp_path, "uniform")
    assert set(env) == {"TRITON_CACHE_DIR", "SGLANG_SIMULATE_UNIFORM_EXPERTS"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert envs.SGLANG_SIMULATE_UNIFORM_EXPERTS.get() is True
    assert "SGLANG_SIMULATE_UNIFORM_EXPERTS" not in es.server_env(es.parse_spec("dflash"), tmp_path)


def test_tree_expert_routing_is_the_overlays_switch(tmp_path, monkeypatch):
    """The variable must be the one the patched MoE top-k reads (patch 0061, tree_routing.py)."""
    from sglang.srt.layers.moe import tree_routing

    env = es.server_env(es.parse_spec("ddtree16@auto"), tmp_path, "tree")
    assert set(env) == {"TRITON_CACHE_DIR", "SGLANG_DDTREE_SIMULATE_TREE_ROUTING"}
    assert not tree_routing.enabled()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert tree_routing.enabled()


def test_upstreams_moe_tile_rule_is_the_overlays_switch(tmp_path, monkeypatch):
    """The variable and value must be what default_row_tile.py reads."""
    from sglang.srt.layers.moe.moe_runner.triton_utils import default_row_tile

    env = es.server_env(es.parse_spec("ddtree64@auto"), tmp_path, moe_tile_rule="upstream")
    assert set(env) == {"TRITON_CACHE_DIR", default_row_tile.TILE_RULE_ENV}
    monkeypatch.setenv(default_row_tile.TILE_RULE_ENV, env[default_row_tile.TILE_RULE_ENV])
    assert default_row_tile.tile_rule_from_env() == "upstream"
    assert set(es.MOE_TILE_RULES) == set(default_row_tile.TILE_RULES)


def test_request_timelines_say_which_request_left_the_window():
    results = [{"stamps": [10.0, 10.5, 11.0], "meta": {"finish_reason": {"type": "length"}, "completion_tokens": 3}},
               {"stamps": [12.0], "meta": {}, "error_event": {"message": "KV cache full"}}]
    t = es.request_timelines(results, t0=9.0)
    assert t[0] == {"chunks": 3, "first_s": 1.0, "last_s": 2.0, "finish_reason": {"type": "length"},
                    "completion_tokens": 3, "error": None}
    assert t[1]["chunks"] == 1 and t[1]["error"] == {"message": "KV cache full"}


def test_step_stats_uses_only_the_common_window():
    # request A starts first (its early gaps are 1 s), B joins at t=10; A ends at t=20.
    a = [0, 1, 2, 10, 10.01, 10.02, 10.03, 10.04, 10.05, 20.0]
    b = [10.0, 10.02, 10.04, 10.06, 10.08, 10.10, 10.12, 30.0]
    s = es.step_stats([a, b])
    # window [10, 20]: A's gaps 0.01 x5 and 9.95, B's 0.02 x6
    assert s["steps_measured"] == 12
    assert s["ms_per_step"] == pytest.approx(20.0)
    assert s["ms_per_step_p90"] == pytest.approx(20.0)


def test_step_stats_refuses_too_few_steps_and_silent_requests():
    with pytest.raises(ValueError, match="too few decode steps"):
        es.step_stats([[0.0, 0.1, 0.2]])
    with pytest.raises(ValueError, match="no tokens"):
        es.step_stats([[0.0, 0.1], []])


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_budget_guards_starts_and_points():
    clock = FakeClock()
    b = es.Budget(deadline_s=500, start_estimate_s=200, margin_s=20, clock=clock)
    assert b.left() == 480 and b.fits(480) and not b.fits(481)
    assert b.start_estimate() == 200
    b.starts += [150.0, 80.0]
    assert b.start_estimate() == pytest.approx(172.5)  # worst start seen + 15 %
    clock.t += 400
    assert b.left() == 80 and not b.fits(b.start_estimate())
    assert b.point_estimate(32768, 8, 12.0) > b.point_estimate(1024, 1, 12.0) >= 12.0
    assert es.Budget(None, 200).fits(1e9)


def row(config, verify, ms, ctx=16384, batch=1, backend="triton", accept=1.0):
    return {"config": config, "verify": verify, "backend": backend, "ctx": ctx, "batch": batch,
            "ms_per_step": ms, "accept_length": accept}


REFERENCE_LINES = [
    {"what": "upstream reference, batch 1", "date": "2026-11-29"},
    {"config": "no speculation, --attention-backend triton", "ctx1024_ms_per_step": 4.0, "ctx16384_ms_per_step": 5.0},
    {"config": "DFLASH chain (16 tokens verified), --attention-backend triton", "ctx16384_ms_per_step": 80.0},
    {"config": "DFLASH chain (16 tokens verified), --attention-backend flashinfer (MLA; causal)",
     "ctx16384_ms_per_step": 8.0},
]


@pytest.fixture
def reference(tmp_path):
    p = tmp_path / "ref.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in REFERENCE_LINES) + "\n")
    return es.load_reference(p)


def test_load_reference_reads_every_ctx_field(reference):
    assert {(r["ctx"], r["ms_per_step"]) for r in reference} == {(1024, 4.0), (16384, 5.0), (16384, 80.0),
                                                                 (16384, 8.0)}
    assert all(r["batch"] == 1 for r in reference)
    assert es.load_reference(Path("/nonexistent/ref.jsonl")) == []


def test_ratios_this_run_and_reference(reference):
    rows = [row("dflash", "fused", 10.0), row("dflash", "upstream_extend", 70.0),
            row("ddtree64", "fused", 12.0), row("ddtree64", "upstream_extend", 120.0), row("nospec", "-", 5.5),
            row("dflash", "fused", 20.0, batch=8), row("ddtree64", "fused", 30.0, batch=8)]
    got = {(q["ctx"], q["batch"], q["ratio"]): q for q in es.ratios(rows, reference)}
    assert got[(16384, 1, "DFLASH upstream-triton / DFLASH fused (speedup)")]["value"] == pytest.approx(7.0)
    dd = got[(16384, 1, "DDTREE B=64 fused / DFLASH fused")]
    assert dd["value"] == pytest.approx(1.2) and dd["target"] == 1.25 and dd["source"] == "this run"
    assert got[(16384, 1, "DDTREE B=64 upstream / DDTREE B=64 fused (speedup)")]["value"] == pytest.approx(10.0)
    fi = got[(16384, 1, "DFLASH fused / reference DFLASH flashinfer (causal, sm_90)")]
    assert fi["value"] == pytest.approx(1.25) and fi["target"] == 1.3
    assert fi["source"].startswith("reference run, not this run")
    assert got[(16384, 1, "reference DFLASH upstream triton / DFLASH fused (speedup)")]["value"] == pytest.approx(8.0)
    assert got[(16384, 1, "no speculation / reference no speculation (host check)")]["value"] == pytest.approx(1.1)
    # batch 8: this run's ratio only; the reference run has batch 1 only
    assert got[(16384, 8, "DDTREE B=64 fused / DFLASH fused")]["value"] == pytest.approx(1.5)
    assert not [k for k in got if k[1] == 8 and "reference" in k[2]]
    assert (16384, 1, "DDTREE B=16 fused / DFLASH fused") not in got  # not measured: no ratio
    other = {(q["ctx"], q["batch"], q["ratio"]): q for q in es.ratios([row("dflash", "fused", 10.0), row("ddtree63", "fused", 13.0)], reference)}
    assert other[(16384, 1, "DDTREE B=63 fused / DFLASH fused")]["value"] == pytest.approx(1.3)
    assert "target" not in other[(16384, 1, "DDTREE B=63 fused / DFLASH fused")]  # the target is B=64's
    routes = [row("dflash", "fused", 10.0), row("ddtree64", "auto", 12.3), row("ddtree64", "flashmla_split", 12.5)]
    got = {q["ratio"]: q for q in es.ratios(routes, reference) if q["ctx"] == 16384 and q["batch"] == 1}
    assert got["DDTREE B=64 default / DFLASH fused"]["value"] == pytest.approx(1.23)
    assert got["DDTREE B=64 default / DFLASH fused"]["target"] == 1.25
    assert got["DDTREE B=64 flashmla_split / DFLASH fused"]["value"] == pytest.approx(1.25)


def test_ratios_of_the_flashinfer_chain_and_the_sm120_proxy(reference):
    proxy = dict(policy="sm120-proxy")
    rows = [row("dflash", "upstream_extend", 9.57, backend="flashinfer"), row("dflash", "auto", 8.5, backend="flashinfer"),
            {**row("dflash", "auto", 10.0), **proxy}, {**row("ddtree16", "auto", 12.0), **proxy},
            row("dflash", "auto", 7.0), row("ddtree16", "auto", 70.0)]  # native rows stay out of the proxy's ratio
    got = {q["ratio"]: q for q in es.ratios(rows, reference) if q["ctx"] == 16384}
    chain = got["DFLASH flashinfer hook / DFLASH flashinfer upstream"]
    assert chain["value"] == pytest.approx(8.5 / 9.57) and chain["target"] == 0.9
    tree = got["DDTREE B=16 default / DFLASH default, triton, sm120 proxy"]
    assert tree["value"] == pytest.approx(1.2) and tree["target"] == 1.3


def test_verify_shares_pair_upstream_with_its_fused_twin():
    def prof(config, verify, tv, ext, total):
        cats = {"tree_verify": {"ms_per_step": tv}, "extend_attention": {"ms_per_step": ext}}
        return {"config": config, "verify": verify, "backend": "triton", "ctx": 16384, "batch": 1,
                "categories": {k: v for k, v in cats.items() if v["ms_per_step"]}, "gpu_ms_per_step": total}

    shares = es.verify_shares([prof("ddtree64", "fused", 3.0, 1.0, 20.0), prof("ddtree64", "upstream_extend", 0, 61.0, 80.0)])
    by = {s["verify"]: s for s in shares}
    assert by["fused"]["share"] == pytest.approx(0.15)
    assert by["upstream_extend"]["verify_attention_ms"] == pytest.approx(60.0)
    assert by["upstream_extend"]["share"] == pytest.approx(0.75)


def test_markdown_table_relative_to_dflash_fused():
    rows = [row("ddtree64", "fused", 12.0), row("dflash", "fused", 10.0, accept=1.02), row("nospec", "-", 5.0),
            row("ddtree64", "fused", 40.0, ctx=32768)]
    md = es.markdown(rows, [{"config": "ddtree64", "verify": "fused", "backend": "triton", "ctx": 16384,
                             "batch": 1, "share": 0.2}]).splitlines()
    assert md[0].startswith("| config | verify path |") and len(md) == 2 + 4
    assert md[2] == "| nospec | - | triton | 16384 | 1 | 5.00 | 0.50 | 1.00 | - |"
    assert md[3] == "| dflash | fused | triton | 16384 | 1 | 10.00 | 1.00 | 1.02 | - |"
    assert md[4] == "| ddtree64 | fused | triton | 16384 | 1 | 12.00 | 1.20 | 1.00 | 20 % |"
    assert md[5].endswith("| 40.00 | - | 1.00 | - |")  # no DFLASH-fused row at 32K


def test_report_merges_split_runs_and_writes_a_plot(tmp_path, reference):
    a = {"what": "w", "date": "2026-11-29", "device": "NVIDIA H200", "argv": ["a"], "servers": [{"config": "x"}],
         "rows": [row("dflash", "fused", 11.0), row("ddtree64", "fused", 99.0)],
         "profiles": [], "skipped": [{"config": "ddtree128@fused:triton", "what": "server", "reason": "time"}]}
    old_style = {"config": "nospec", "verify": "default", "ctx": 16384, "batch": 1, "ms_per_step": 5.1,
                 "accept_length": 1.0}  # rows of runs before configuration specs
    b = {"argv": ["b"], "rows": [row("ddtree64", "fused", 13.0), row("dflash", "upstream_extend", 77.0), old_style],
         "profiles": [{"config": "ddtree64", "verify": "fused", "backend": "triton", "ctx": 16384, "batch": 1,
                       "gpu_ms_per_step": 12.0, "categories": {"tree_verify": {"ms_per_step": 3.0, "share": 0.25}}}],
         "skipped": []}
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    out = tmp_path / "merged.json"
    merged = es.report([pa, pb], out, reference)
    ms = {(r["config"], r["verify"]): r["ms_per_step"] for r in merged["rows"]}
    assert ms == {("dflash", "fused"): 11.0, ("ddtree64", "fused"): 13.0, ("dflash", "upstream_extend"): 77.0,
                  ("nospec", "-"): 5.1}
    assert merged["device"] == "NVIDIA H200" and merged["argv"] == [["a"], ["b"]] and len(merged["skipped"]) == 1
    assert merged["verify_attention"][0]["share"] == pytest.approx(0.25)
    r = {q["ratio"]: q["value"] for q in merged["ratios"]}
    assert r["DDTREE B=64 fused / DFLASH fused"] == pytest.approx(13 / 11)
    es.write(merged, out)
    assert json.loads(out.read_text())["rows"] == merged["rows"]
    es.plot(merged, out.with_suffix(".png"))
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_keeps_native_and_proxy_rows_apart(tmp_path, reference):
    native = row("ddtree16", "auto", 12.0)
    proxied = {**row("ddtree16", "auto", 15.0), "policy": "sm120-proxy"}
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    paths[0].write_text(json.dumps({"rows": [native], "skipped": []}))
    paths[1].write_text(json.dumps({"rows": [proxied], "skipped": []}))
    merged = es.report(paths, tmp_path / "m.json", reference)
    assert sorted(r["ms_per_step"] for r in merged["rows"]) == [12.0, 15.0]
    md = es.markdown(merged["rows"])
    assert "| ddtree16+sm120 | auto | triton | 16384 | 1 | 15.00 |" in md
    assert "| ddtree16 | auto | triton | 16384 | 1 | 12.00 |" in md


def test_report_refuses_to_mix_targets(tmp_path, reference):
    paths = _runs_with(tmp_path, "target", (None, "qwen3-8b"))
    assert es.report(paths[:1], tmp_path / "one.json", reference)["target"] == "v2lite"
    with pytest.raises(ValueError, match="target"):
        es.report(paths, tmp_path / "mixed.json", reference)


def test_report_refuses_to_mix_greedy_and_sampled_steps(tmp_path, reference):
    paths = _runs_with(tmp_path, "sampling", (None, "greedy", "T=1"))
    assert es.report(paths[:2], tmp_path / "one.json", reference)["sampling"] == "greedy"
    with pytest.raises(ValueError, match="sampling"):
        es.report(paths, tmp_path / "mixed.json", reference)


@pytest.mark.parametrize("text,params,label", [
    ("0", {"temperature": 0.0}, "greedy"),
    ("0/20/0.8", {"temperature": 0.0}, "greedy"),
    ("1", {"temperature": 1.0}, "T=1"),
    ("0.7/20/0.8", {"temperature": 0.7, "top_k": 20, "top_p": 0.8}, "T=0.7 top_k=20 top_p=0.8"),
    ("1/0/0.95", {"temperature": 1.0, "top_p": 0.95}, "T=1 top_p=0.95"),
])  # fmt: skip
def test_sampling_settings_and_their_labels(text, params, label):
    assert es.parse_sampling(text) == params
    assert es.sampling_label(params) == label


@pytest.mark.parametrize("text", ["", "x", "-1", "1/-2", "1/20/0", "1/20/1.5", "1/2/0.5/9"])
def test_bad_sampling_settings_say_what_to_write(text, capsys):
    with pytest.raises(ValueError, match="--sampling"):
        es.parse_sampling(text)
    with pytest.raises(SystemExit):
        es.main(["--sampling", text, "--configs", "nospec"])
    assert "--sampling" in capsys.readouterr().err


def test_report_drops_skips_a_later_run_measured(tmp_path, reference):
    fail = "failed: too few decode steps in the common window (0 < 5)"
    a = {"rows": [row("dflash", "fused", 11.0)],
         "skipped": [{"config": "dflash@fused:triton", "what": "ctx 16384 bs 8", "reason": fail},
                     {"config": "ddtree64@fused:triton", "what": "ctx 16384 bs 8", "reason": fail},
                     {"config": "ddtree16@fused:triton", "what": "server", "reason": "time"}]}
    b = {"rows": [row("dflash", "fused", 20.0, batch=8), row("ddtree16", "fused", 12.0)], "skipped": []}
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for p, d in zip(paths, (a, b)):
        p.write_text(json.dumps(d))
    merged = es.report(paths, tmp_path / "m.json", reference)
    assert merged["skipped"] == [a["skipped"][1]]  # ddtree64 at batch 8 is still owed


def test_uniform_routing_runs_are_not_compared_with_the_reference_run(tmp_path, reference):
    p = tmp_path / "u.json"
    p.write_text(json.dumps({"rows": [row("dflash", "fused", 11.0), row("ddtree64", "fused", 20.0)],
                             "skipped": [], "expert_routing": "uniform"}))
    merged = es.report([p], tmp_path / "m.json", reference)
    assert [q["ratio"] for q in merged["ratios"]] == ["DDTREE B=64 fused / DFLASH fused"]


def _runs_with(tmp_path, key, values):
    """One-row result files, each with ``key`` set to a value (None: a run before the option)."""
    paths = []
    for i, value in enumerate(values):
        data = {"rows": [row("dflash", "fused", 10.0)], "skipped": []}
        if value:
            data[key] = value
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(data))
    return paths


def test_report_refuses_to_mix_expert_routings(tmp_path, reference):
    paths = _runs_with(tmp_path, "expert_routing", (None, "uniform"))
    assert es.report(paths[:1], tmp_path / "one.json", reference)["expert_routing"] == "model"
    with pytest.raises(ValueError, match="expert-routing"):
        es.report(paths, tmp_path / "mixed.json", reference)
    with pytest.raises(SystemExit):
        es.main(["--report", *map(str, paths), "--out-dir", str(tmp_path)])


def test_report_refuses_to_mix_moe_tile_rules_and_old_runs_ran_upstreams(tmp_path, reference):
    paths = _runs_with(tmp_path, "moe_tile_rule", (None, "upstream", "rows_per_expert"))
    assert es.report(paths[:2], tmp_path / "one.json", reference)["moe_tile_rule"] == "upstream"
    with pytest.raises(ValueError, match="moe-tile-rule"):
        es.report(paths, tmp_path / "mixed.json", reference)


def test_cli_report_mode_end_to_end(tmp_path, capsys):
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"rows": [row("dflash", "fused", 10.0), row("ddtree64", "fused", 12.5)], "skipped": []}))
    assert es.main(["--report", str(p), "--tag", "t", "--out-dir", str(tmp_path), "--markdown",
                    "--reference", str(tmp_path / "none.jsonl")]) == 0
    text = capsys.readouterr().out
    assert "DDTREE B=64 fused / DFLASH fused = 1.25 (target <= 1.25)" in text
    assert "| ddtree64 | fused | triton | 16384 | 1 | 12.50 | 1.25 |" in text
    assert (tmp_path / "e2e_step_t.json").exists() and (tmp_path / "e2e_step_t.png").exists()


def test_cli_rejects_bad_configs_before_touching_the_gpu(tmp_path):
    with pytest.raises(SystemExit):
        es.main(["--configs", "dflash,ddtree999", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        es.main(["--configs", "dflash,dflash@fused", "--out-dir", str(tmp_path)])
