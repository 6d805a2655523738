# SPDX-License-Identifier: Apache-2.0
"""DDTree step statistics without host syncs in the decode loop.

Accepted length per step already reaches the logs and ``/metrics`` through the
scheduler's spec-v2 plumbing (``accept_lens`` -> ``spec_accept_length``,
``spec_accept_rate`` = accepted draft nodes / budget). This adds what is
specific to a tree: the histogram of accepted depths and of the depths of the
trees drafted, per request and verify step, and the accept length every smaller
budget would have had on the same steps.

That last one is exact, not a model: the tree builders number nodes in
best-first pop order, so the tree of budget b is nodes 1..b of the tree of
budget B >= b, and the walk over the same target tokens accepts, under b, the
path's depths whose nodes (and their ancestors') indices are all <= b. The
counters keep, per accepted depth, the largest node index on the path down to
it; their prefix sums give the accepted drafts at every b. Under the adaptive
budget policy steps run at several budgets; each budget keeps its own counters,
and budget b's accept length comes from the steps run at b or above only.

Counters live on the device; the step's commit kernel adds each step to them
(``step_io.commit_accepted``, reference ``add_step_counts``). Every ``interval`` steps a snapshot is copied to
pinned host memory asynchronously; once its copy has landed (an event query,
never a wait) it is logged and, with ``--enable-metrics``, the increments since
the previous snapshot go to Prometheus under the scheduler collector's labels.
Like the scheduler's own metrics, only the stats rank (attention-TP rank 0)
records anything.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.ddtree_environ import ddtree_envs

logger = logging.getLogger(__name__)

_DEFAULT_INTERVAL = ddtree_envs.SGLANG_DDTREE_STATS_INTERVAL.get()

# Depths are small integers (at most the draft block, at most the budget):
# one bucket per depth up to 16, coarser above, up to the largest budget.
DEPTH_BUCKETS = tuple(range(17)) + (20, 24, 32, 48, 64, 96, 128, 192, 256)

ACCEPTED_DEPTH = "sglang:ddtree_accepted_depth"
TREE_DEPTH = "sglang:ddtree_tree_depth"
BUDGET = "sglang:ddtree_budget"
ACCEPTED_AT_BUDGET = "sglang:ddtree_accepted_drafts_at_budget"
REQUEST_STEPS_AT_BUDGET = "sglang:ddtree_request_steps_at_budget"
#: Weight of the previous counts per published snapshot in ``accept_lengths``.
RECENT_DECAY = 0.7
#: Steps between snapshots when the adaptive budget policy reads them.
ADAPTIVE_INTERVAL = 32

# Rows of the device counters: accepted depth, tree depth, path maximum.
_ACCEPTED, _TREE, _PATH_MAX = 0, 1, 2
_ROWS = 3


def budget_tiers(budget: int) -> List[int]:
    """The budgets reported beside the configured one: powers of two below it."""
    tiers, b = [], 1
    while b < budget:
        tiers.append(b)
        b *= 2
    return tiers + [int(budget)]


def scheduler_metric_labels(server_args, ps) -> Dict[str, str]:
    """The label set of the scheduler's collector, so DDTree series join its
    series. Mirrors ``SchedulerMetricsCollector.init_new`` (0.5.17); a CPU test
    compares the two."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    labels = {
        "model_name": server_args.served_model_name,
        "engine_type": DisaggregationMode.to_engine_type(server_args.disaggregation_mode),
        "tp_rank": ps.tp_rank,
        "pp_rank": ps.pp_rank,
        "moe_ep_rank": ps.moe_ep_rank,
    }
    if server_args.enable_priority_scheduling:
        labels["priority"] = ""
    if ps.dp_rank is not None:
        labels["dp_rank"] = ps.dp_rank
    if server_args.extra_metric_labels:
        labels.update(server_args.extra_metric_labels)
    return labels


class _DDTreePrometheus:
    """The DDTree series. Registered once per process: the registry refuses a
    second registration of a name, and two workers may share a process (tests)."""

    def __init__(self, labelnames: List[str]):
        # Imported here, as upstream does, after PROMETHEUS_MULTIPROC_DIR is set.
        from prometheus_client import Counter, Gauge, Histogram

        self.labelnames = tuple(labelnames)
        self.accepted_depth = Histogram(
            name=ACCEPTED_DEPTH,
            documentation="Draft tokens accepted (depth of the accepted tree node) per request per verify step.",
            labelnames=labelnames,
            buckets=DEPTH_BUCKETS,
        )
        self.tree_depth = Histogram(
            name=TREE_DEPTH,
            documentation="Depth of the drafted tree per request per verify step.",
            labelnames=labelnames,
            buckets=DEPTH_BUCKETS,
        )
        self.budget = Gauge(
            name=BUDGET,
            documentation="Configured DDTree budget (draft nodes per tree).",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self.accepted_at_budget = Counter(
            name=ACCEPTED_AT_BUDGET,
            documentation=(
                "Draft tokens the verify steps run at `budget` or above would have accepted had "
                "the tree's budget been `budget` (exact: a smaller tree is the first nodes of the "
                "drafted one). Per request step: divide by ddtree_request_steps_at_budget."
            ),
            labelnames=list(labelnames) + ["budget"],
        )
        self.request_steps_at_budget = Counter(
            name=REQUEST_STEPS_AT_BUDGET,
            documentation="Request verify steps run at a tree budget of `budget` or above.",
            labelnames=list(labelnames) + ["budget"],
        )


_prometheus: Optional[_DDTreePrometheus] = None


def _get_prometheus(labels: Dict[str, str]) -> _DDTreePrometheus:
    global _prometheus
    if _prometheus is None:
        _prometheus = _DDTreePrometheus(list(labels))
    elif _prometheus.labelnames != tuple(labels):
        raise ValueError(
            f"DDTREE metrics are already registered in this process with labels "
            f"{list(_prometheus.labelnames)}; a second worker asked for {list(labels)}."
        )
    return _prometheus


def _observe_counts(histogram, counts: List[int]) -> None:
    """Observe value ``v`` ``counts[v]`` times, one bucket increment per value
    (what ``Histogram.observe`` does per sample; upstream's
    ``observe_inter_token_latency`` batches the same way)."""
    for value, n in enumerate(counts):
        if n <= 0:
            continue
        histogram._sum.inc(value * n)
        for i, bound in enumerate(histogram._upper_bounds):
            if value <= bound:
                histogram._buckets[i].inc(n)
                break


class DDTreeStepStats:
    def __init__(
        self,
        budget: int,
        stats_rank: bool = True,
        metric_labels: Optional[Dict[str, str]] = None,
        interval: int = _DEFAULT_INTERVAL,
        step_budgets: Optional[Sequence[int]] = None,
        log_every: int = 1,
    ):
        """``metric_labels`` None: no Prometheus export (``--enable-metrics`` off).
        ``step_budgets``: the budgets steps may run at (the adaptive policy's); each keeps
        its own counters, since a step at budget b says nothing about budgets above b.
        Default: the configured budget only. ``log_every``: snapshots per log line."""
        self.budget = int(budget)
        self.step_budgets = tuple(sorted({int(b) for b in (step_budgets or (self.budget,))}))
        if self.step_budgets[-1] != self.budget or self.step_budgets[0] < 1:
            raise ValueError(f"step budgets {self.step_budgets} must lie in [1, {self.budget}] and include it")
        self._block = {b: i for i, b in enumerate(self.step_budgets)}
        self.enabled = bool(stats_rank) and interval > 0
        self.interval = interval
        self.log_every = max(1, int(log_every))
        self.steps = 0
        self._publishes = 0
        self._counts: Optional[torch.Tensor] = None  # [step budgets, 3, budget + 1] int64
        self._host: Optional[torch.Tensor] = None
        self._event = None
        self._pending = False
        self._published = self._zeros()
        #: Exponentially decayed per-block counts since start, for ``accept_lengths``.
        self._recent = self._zeros()
        self._accept_lengths: Dict[Tuple[int, ...], Dict[int, Optional[float]]] = {}  # until the next snapshot
        self._series = None
        self._at_budget = None
        if self.enabled and metric_labels is not None:
            prom = _get_prometheus(metric_labels)
            # Create the children now so the series are in /metrics from startup.
            self._series = (
                prom.accepted_depth.labels(**metric_labels),
                prom.tree_depth.labels(**metric_labels),
            )
            prom.budget.labels(**metric_labels).set(self.budget)
            self._at_budget = {
                b: (prom.accepted_at_budget.labels(**metric_labels, budget=str(b)),
                    prom.request_steps_at_budget.labels(**metric_labels, budget=str(b)))
                for b in budget_tiers(self.budget)
            }  # fmt: skip

    def _zeros(self) -> List[List[List[float]]]:
        return [[[0] * (self.budget + 1) for _ in range(_ROWS)] for _ in self.step_budgets]

    @classmethod
    def for_worker(cls, server_args, ps, budget: int, step_budgets=None) -> "DDTreeStepStats":
        """Under the adaptive policy (several ``step_budgets``) snapshots come at least every
        ``ADAPTIVE_INTERVAL`` steps, the policy's view of the accept lengths, and the log
        keeps its cadence."""
        stats_rank = ps.attn_tp_rank == 0
        labels = None
        if server_args.enable_metrics and stats_rank:
            labels = scheduler_metric_labels(server_args, ps)
        interval, log_every = _DEFAULT_INTERVAL, 1
        if step_budgets is not None and len(set(step_budgets)) > 1 and interval > ADAPTIVE_INTERVAL:
            interval, log_every = ADAPTIVE_INTERVAL, -(-interval // ADAPTIVE_INTERVAL)
        return cls(budget, stats_rank=stats_rank, metric_labels=labels, interval=interval,
                   step_budgets=step_budgets, log_every=log_every)  # fmt: skip

    @property
    def exports_metrics(self) -> bool:
        return self._series is not None

    def counters(self, device, step_budget: Optional[int] = None) -> Optional[torch.Tensor]:
        """The device counters ``[3, budget + 1]`` int64 of steps run at ``step_budget``
        (default: the configured budget; row 0: accepted depth, row 1: tree depth, row 2:
        path maxima), for a kernel that adds a step's counts into them
        (``step_io.commit_accepted``); None when this rank records nothing."""
        if not self.enabled:
            return None
        if self._counts is None:
            shape = (len(self.step_budgets), _ROWS, self.budget + 1)
            self._counts = torch.zeros(shape, dtype=torch.int64, device=device)
        block = self._block.get(self.budget if step_budget is None else int(step_budget))
        if block is None:
            raise ValueError(f"step budget {step_budget} is not one of {self.step_budgets}")
        return self._counts[block]

    def record(
        self,
        num_accepted: torch.Tensor,
        depth: torch.Tensor,
        accept_index: torch.Tensor,
        step_budget: Optional[int] = None,
    ) -> None:
        """``num_accepted`` ``[bs]`` accepted draft nodes, ``depth`` ``[bs, N]``,
        ``accept_index`` ``[bs, D + 1]`` the path's nodes (-1 after it)."""
        if not self.enabled or num_accepted.numel() == 0:
            return
        add_step_counts(self.counters(num_accepted.device, step_budget), num_accepted, depth, accept_index)
        self.step_counted()

    def step_counted(self) -> None:
        """A step's counts are in ``counters()`` (queued on the stream): snapshot
        and publish on the interval. No host sync."""
        if not self.enabled:
            return
        self.steps += 1
        if not self._pending and self.steps % self.interval == 0:
            self._snapshot()
        if self._pending and (self._event is None or self._event.query()):
            self._pending = False
            self._publish(self._host.tolist())

    def _snapshot(self) -> None:
        if self._counts.is_cuda:
            if self._host is None:
                self._host = torch.empty(self._counts.shape, dtype=torch.int64, pin_memory=True)
            self._host.copy_(self._counts, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = self._counts.clone()
        self._pending = True

    def _publish(self, counts: List[List[List[int]]]) -> None:
        delta = [[[a - b for a, b in zip(n, o)] for n, o in zip(nb, ob)] for nb, ob in zip(counts, self._published)]
        if self._series is not None:
            for series, row in zip(self._series, (_ACCEPTED, _TREE)):
                _observe_counts(series, _row_total(delta, row))
        if self._at_budget is not None:
            for b, (drafts, steps) in self._at_budget.items():
                num, den = at_budget_sums(self.step_budgets, delta, b)
                drafts.inc(num)
                steps.inc(den)
        self._recent = [[[RECENT_DECAY * r + d for r, d in zip(rr, dr)] for rr, dr in zip(rb, db)]
                        for rb, db in zip(self._recent, delta)]  # fmt: skip
        self._accept_lengths.clear()
        self._published = counts
        self._publishes += 1
        if self._publishes % self.log_every == 0:
            self._log(counts)

    def accept_lengths(self, budgets: Sequence[int]) -> Dict[int, Optional[float]]:
        """Mean tokens committed per request step (accepted drafts + 1) each budget would
        have had over the recently published steps (exponentially decayed, factor
        ``RECENT_DECAY`` per snapshot), from the steps run at that budget or above; None
        for a budget with no such step yet. Asked every step, computed once per snapshot."""
        key = tuple(budgets)
        if key not in self._accept_lengths:
            self._accept_lengths[key] = {b: accept_length_at_budget(self.step_budgets, self._recent, b) for b in key}
        return self._accept_lengths[key]

    def _log(self, counts: List[List[List[int]]]) -> None:
        accepted, tree = _row_total(counts, _ACCEPTED), _row_total(counts, _TREE)
        depth_sum = torch.tensor([sum(d * c for d, c in enumerate(tree)), sum(tree)])
        summary = summarize(torch.tensor(accepted), depth_sum)
        if summary is None:
            return
        at_budget = {b: accept_length_at_budget(self.step_budgets, counts, b) for b in budget_tiers(self.budget)}
        by_step = ""
        if len(self.step_budgets) > 1:
            steps = {b: sum(block[_ACCEPTED]) for b, block in zip(self.step_budgets, counts)}
            by_step = ", request steps by step budget " + ", ".join(f"{b}: {n}" for b, n in steps.items() if n)
        logger.info(
            "DDTREE stats: steps(req)=%d, mean accepted drafts=%.2f, mean commit=%.2f, "
            "mean tree depth=%.2f, accepted-depth histogram=%s, mean commit at budget %s%s",
            summary["requests"],
            summary["mean_accepted"],
            summary["mean_accepted"] + 1,
            summary["mean_tree_depth"],
            summary["histogram"],
            ", ".join(f"{b}: {x:.2f}" for b, x in at_budget.items() if x is not None) or "-",
            by_step,
        )


_ONES: Dict[Tuple[int, str], torch.Tensor] = {}


def add_step_counts(
    counts: torch.Tensor, num_accepted: torch.Tensor, depth: torch.Tensor, accept_index: torch.Tensor
) -> None:
    """Add one step to ``counts`` ``[3, budget + 1]``: each request's accepted
    depth (``num_accepted`` ``[bs]``), tree depth (the max of ``depth``
    ``[bs, N]``) and, per accepted depth, the largest node index on the path
    down to it (``accept_index`` ``[bs, D + 1]``: the root, then the path's
    nodes, -1 after it). The reference of the commit kernel's counter update."""
    bs = num_accepted.shape[0]
    key = (bs, str(counts.device))
    ones = _ONES.get(key)
    if ones is None:
        ones = _ONES[key] = torch.ones((bs,), dtype=torch.int64, device=counts.device)
    # index_add_ takes int32 and int64 indices alike: no casts.
    counts[_ACCEPTED].index_add_(0, num_accepted, ones)
    counts[_TREE].index_add_(0, depth.max(dim=1).values, ones)
    path = accept_index[:, 1:].to(torch.int64)
    if path.shape[1] == 0:
        return
    on_path = torch.arange(path.shape[1], device=path.device) < num_accepted.to(torch.int64).unsqueeze(1)
    path_max = torch.cummax(path.clamp(0, counts.shape[1] - 1), dim=1).values
    # Entries past the path add 0: no boolean indexing, so no host sync.
    counts[_PATH_MAX].index_add_(0, path_max.reshape(-1), on_path.reshape(-1).to(torch.int64))


def _row_total(blocks, row: int) -> List[int]:
    """One counter row summed over the step budgets' blocks."""
    return [sum(col) for col in zip(*(block[row] for block in blocks))]


def at_budget_sums(step_budgets: Sequence[int], blocks, budget: int) -> Tuple[float, float]:
    """(accepted drafts had the tree's budget been ``budget``, request steps) over the
    steps run at ``budget`` or above; ``blocks`` holds each step budget's counter rows."""
    num = den = 0
    for b, block in zip(step_budgets, blocks):
        if b >= budget:
            num += sum(block[_PATH_MAX][: int(budget) + 1])
            den += sum(block[_ACCEPTED])
    return num, den


def accept_length_at_budget(step_budgets: Sequence[int], blocks, budget: int) -> Optional[float]:
    """Mean tokens committed per request step (accepted drafts + 1) under ``budget``;
    None without a step run at ``budget`` or above."""
    num, den = at_budget_sums(step_budgets, blocks, budget)
    return 1.0 + num / den if den > 0 else None


def summarize(hist: torch.Tensor, depth: torch.Tensor) -> Optional[dict]:
    """Host-side summary of a counters snapshot (cumulative since start):
    ``hist`` accepted-depth counts, ``depth`` = [sum of tree depths, requests]."""
    hist = hist.to(torch.int64).tolist()
    requests = int(sum(hist))
    if requests == 0:
        return None
    last = max(i for i, c in enumerate(hist) if c) if any(hist) else 0
    return {
        "requests": requests,
        "mean_accepted": sum(i * c for i, c in enumerate(hist)) / requests,
        "mean_tree_depth": int(depth[0]) / max(1, int(depth[1])),
        "histogram": hist[: last + 1],
    }
