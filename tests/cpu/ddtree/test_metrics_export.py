# SPDX-License-Identifier: Apache-2.0
"""DDTree tree statistics in /metrics, through upstream's real export path.

SGLang exports Prometheus metrics in multiprocess mode: the scheduler process
writes values to files under PROMETHEUS_MULTIPROC_DIR and the HTTP process
serves ``MultiProcessCollector`` over that directory. prometheus_client picks
the multiprocess value class when it is first imported, so each case runs the
real ``DDTreeStepStats`` in a fresh interpreter (the "scheduler") beside the
real upstream ``SchedulerMetricsCollector``, built from a real ``ServerArgs``;
this process reads the directory as the HTTP server would.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from prometheus_client.parser import text_string_to_metric_families

from sglang.srt.speculative.ddtree import metrics

BUDGET = 8
INTERVAL = 3
NUM_STEPS = 10

_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}

# The scheduler side: upstream's collector and the DDTree stats, as the
# scheduler and the worker build them, fed with CPU tensors step by step.
_SCHEDULER = textwrap.dedent(
    """
    import json, sys
    import torch
    from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, multiprocess
    from sglang.srt.distributed.parallel_state_wrapper import ParallelState
    from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.ddtree import metrics

    cfg = json.load(open(sys.argv[1]))
    sa = ServerArgs(
        model_path=cfg["model"], device="cuda", skip_tokenizer_init=True,
        enable_metrics=cfg["enable_metrics"], served_model_name="ddtree-metrics-test",
        enable_priority_scheduling=True, extra_metric_labels={"cluster": "ci"},
    )
    ps = ParallelState.trivial()
    ctx = SchedulerMetricsCollector.init_new(
        server_args=sa, ps=ps, tp_rank=ps.tp_rank, pp_rank=ps.pp_rank, dp_rank=ps.dp_rank,
        enable_priority_scheduling=sa.enable_priority_scheduling,
        enable_lora=False, enable_hierarchical_cache=False,
    )
    if ctx.collector is not None:
        ctx.collector.spec_accept_length.labels(**ctx.collector.labels).set(2.5)

    stats = metrics.DDTreeStepStats.for_worker(sa, ps, cfg["budget"])
    # A second worker in the same process must not register the names again.
    metrics.DDTreeStepStats.for_worker(sa, ps, cfg["budget"])
    class Other:  # the same args with another label set (ServerArgs is read-only)
        extra_metric_labels = {"region": "x"}
        def __getattr__(self, name):
            return getattr(sa, name)
    try:
        other = Other()
        metrics.DDTreeStepStats.for_worker(other, ps, cfg["budget"])
        label_clash = None
    except ValueError as e:
        label_clash = str(e)

    def scrape():
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry).decode()

    scrapes = [scrape()]
    for accepted, depth, path in cfg["steps"]:
        stats.record(torch.tensor(accepted, dtype=torch.int32), torch.tensor(depth, dtype=torch.int32),
                     torch.tensor(path, dtype=torch.int32))
        scrapes.append(scrape())
    json.dump({
        "upstream_labels": ctx.collector.labels if ctx.collector else None,
        "our_labels": metrics.scheduler_metric_labels(sa, ps),
        "exports": stats.exports_metrics,
        "interval": stats.interval,
        "registered": sorted(n for n in REGISTRY._names_to_collectors if "ddtree" in n),
        "label_clash": label_clash,
        "scrapes": scrapes,
    }, open(cfg["out"], "w"))
    """
)


PATH_WIDTH = 7  # D + 1: the root and up to 6 accepted nodes


def _steps(seed=0):
    """Verify steps with different batch sizes: accepted draft nodes per
    request, a ``[bs, N]`` node-depth matrix (root first, depth 0) and the
    accepted path's nodes ``[bs, D + 1]`` (root first, -1 after the path)."""
    rng = random.Random(seed)
    steps = []
    for _ in range(NUM_STEPS):
        bs = rng.randint(1, 4)
        accepted, depth, paths = [], [], []
        for _ in range(bs):
            d = rng.randint(1, min(BUDGET, PATH_WIDTH - 1))
            row = [0] + sorted(rng.randint(1, d) for _ in range(BUDGET - 1)) + [d]
            depth.append(row)
            a = rng.randint(0, d)
            accepted.append(a)
            nodes = sorted(rng.sample(range(1, BUDGET + 1), a))  # a parent's index is below its child's
            paths.append([0] + nodes + [-1] * (PATH_WIDTH - 1 - a))
        steps.append((accepted, depth, paths))
    return steps


def _accepted_at_budget(done, budget):
    """Drafts accepted had the budget been ``budget``: a depth counts while every
    node down to it is among the first ``budget``."""
    return sum(
        sum(max(path[1 : j + 1]) <= budget for j in range(1, a + 1))
        for accepted, _, paths in done
        for a, path in zip(accepted, paths)
    )


def _commit_at_budget(done, budget):
    """Mean commit (accepted + 1) per request step had the budget been ``budget``."""
    return 1 + _accepted_at_budget(done, budget) / sum(len(acc) for acc, _, _ in done)


def _run_scheduler(tmp_path, enable_metrics):
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(_LLAMA))
    prom_dir = tmp_path / "prom"
    prom_dir.mkdir()
    cfg = {
        "model": str(model),
        "enable_metrics": enable_metrics,
        "budget": BUDGET,
        "steps": _steps(),
        "out": str(tmp_path / "out.json"),
    }
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(prom_dir),
        "SGLANG_DDTREE_STATS_INTERVAL": str(INTERVAL),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _SCHEDULER, str(tmp_path / "cfg.json")],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return cfg["steps"], json.loads((tmp_path / "out.json").read_text()), prom_dir


def _samples(text):
    """{(sample name, le or budget label): value} of the DDTree series, and their label sets."""
    values, label_sets = {}, set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "ddtree" not in s.name:
                continue
            labels = dict(s.labels)
            key = labels.pop("le", None) or labels.pop("budget", None)
            values[(s.name, key)] = s.value
            label_sets.add(tuple(sorted(labels.items())))
    return values, label_sets


def _expected_histogram(name, observations):
    out = {(f"{name}_count", None): float(len(observations)), (f"{name}_sum", None): float(sum(observations))}
    for b in metrics.DEPTH_BUCKETS:
        out[(f"{name}_bucket", f"{float(b)}")] = float(sum(v <= b for v in observations))
    out[(f"{name}_bucket", "+Inf")] = float(len(observations))
    return out


def _expected(steps, upto):
    """What /metrics shows after ``upto`` steps: everything up to the last
    snapshot (on CPU a snapshot lands at once and is published the same step)."""
    published = (upto // INTERVAL) * INTERVAL
    done = steps[:published]
    accepted = [a for acc, _, _ in done for a in acc]
    tree = [max(row) for _, depth, _ in done for row in depth]
    at_budget = {}
    for b in metrics.budget_tiers(BUDGET):
        at_budget[(f"{metrics.ACCEPTED_AT_BUDGET}_total", str(b))] = float(_accepted_at_budget(done, b))
        at_budget[(f"{metrics.REQUEST_STEPS_AT_BUDGET}_total", str(b))] = float(len(accepted))
    return {
        **_expected_histogram(metrics.ACCEPTED_DEPTH, accepted),
        **_expected_histogram(metrics.TREE_DEPTH, tree),
        (metrics.BUDGET, None): float(BUDGET),
        **at_budget,
    }


def test_tree_stats_exported_with_scheduler_labels(tmp_path):
    steps, out, prom_dir = _run_scheduler(tmp_path, enable_metrics=True)
    assert out["exports"] and out["interval"] == INTERVAL

    # Same label set as the scheduler's collector, so the series join upstream's.
    assert out["our_labels"] == out["upstream_labels"]
    assert out["upstream_labels"]["cluster"] == "ci" and "priority" in out["upstream_labels"]
    assert out["registered"] == sorted(
        [f"{metrics.ACCEPTED_DEPTH}{s}" for s in ("", "_bucket", "_count", "_sum", "_created")]
        + [f"{metrics.TREE_DEPTH}{s}" for s in ("", "_bucket", "_count", "_sum", "_created")]
        + [f"{name}{s}" for name in (metrics.ACCEPTED_AT_BUDGET, metrics.REQUEST_STEPS_AT_BUDGET)
           for s in ("", "_total", "_created")]
        + [metrics.BUDGET]
    )
    assert out["label_clash"] and "already registered" in out["label_clash"]

    # Every scrape, from startup on, shows exactly the published snapshots.
    for upto, text in enumerate(out["scrapes"]):
        values, label_sets = _samples(text)
        want = _expected(steps, upto)
        assert values == want, f"after {upto} steps"
        upstream = {k: str(v) for k, v in out["upstream_labels"].items()}
        assert label_sets == {tuple(sorted(upstream.items()))}
    assert _expected(steps, NUM_STEPS)[(f"{metrics.ACCEPTED_DEPTH}_count", None)] > 0

    # The HTTP server's view: another process reading the same directory.
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(prom_dir))
    text = generate_latest(registry).decode()
    assert _samples(text)[0] == _expected(steps, NUM_STEPS)
    assert "sglang:spec_accept_length{" in text


def test_metrics_off_exports_nothing(tmp_path):
    _, out, prom_dir = _run_scheduler(tmp_path, enable_metrics=False)
    assert out["upstream_labels"] is None and not out["exports"]
    assert out["registered"] == []
    assert out["label_clash"] is None
    for text in out["scrapes"]:
        assert "ddtree" not in text
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(prom_dir))
    assert "ddtree" not in generate_latest(registry).decode()


def test_log_line_keeps_cumulative_summary(caplog):
    steps = _steps(seed=1)
    stats = metrics.DDTreeStepStats(BUDGET, metric_labels=None, interval=INTERVAL)
    assert not stats.exports_metrics
    with caplog.at_level(logging.INFO, logger=metrics.__name__):
        for accepted, depth, path in steps:
            stats.record(torch.tensor(accepted), torch.tensor(depth), torch.tensor(path))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("DDTREE stats:")]
    assert len(lines) == NUM_STEPS // INTERVAL
    done = steps[: (NUM_STEPS // INTERVAL) * INTERVAL]
    accepted = [a for acc, _, _ in done for a in acc]
    hist = [accepted.count(v) for v in range(max(accepted) + 1)]
    mean_depth = sum(max(r) for _, d, _ in done for r in d) / len(accepted)
    assert f"accepted-depth histogram={hist}," in lines[-1]
    at_budget = ", ".join(f"{b}: {_commit_at_budget(done, b):.2f}" for b in metrics.budget_tiers(BUDGET))
    assert lines[-1].endswith(f"mean commit at budget {at_budget}")
    assert f"{BUDGET}: {1 + sum(accepted) / len(accepted):.2f}" in lines[-1]
    assert f"steps(req)={len(accepted)}," in lines[-1]
    assert f"mean tree depth={mean_depth:.2f}," in lines[-1]


def test_other_ranks_and_interval_zero_record_nothing():
    for stats in (
        metrics.DDTreeStepStats(BUDGET, stats_rank=False, metric_labels=None, interval=1),
        metrics.DDTreeStepStats(BUDGET, metric_labels=None, interval=0),
    ):
        stats.record(torch.tensor([1, 2]), torch.tensor([[0, 1, 2], [0, 1, 2]]), torch.tensor([[0, 1, -1], [0, 1, 2]]))
        assert stats.steps == 0 and stats._counts is None


def test_for_worker_on_a_non_stats_rank_registers_nothing():
    class Args:
        enable_metrics = True

    class PS:
        attn_tp_rank = 1

    stats = metrics.DDTreeStepStats.for_worker(Args(), PS(), BUDGET)
    assert not stats.enabled and not stats.exports_metrics
    assert metrics._prometheus is None
