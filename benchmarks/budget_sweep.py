#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""DDTREE budget sweep through the OpenAI API, with the metrics of ``dflash benchmark openai``.

Point it at servers of one target + drafter pair (no speculation, DFLASH, DDTREE at several
budgets), each already running, and a local JSONL prompt file; for every (batch,
temperature) it sends the prompts ``batch`` at a time to ``/v1/chat/completions`` with
``return_meta_info`` and reports, per server, exactly what the dflash client prints:

- throughput = completion tokens of all requests / wall time of the run (tok/s);
- accept length = mean over requests of ``meta_info.spec_accept_length``
  (the server's completion_tokens / spec_verify_ct per request); ``spec_verify_ct`` summed;
- output tokens (``usage.completion_tokens``).

``meta_info`` is read at the top level of the response (where the dflash client reads it)
or, as upstream SGLang returns it, inside the choice. Before each run ``batch`` warm-up
requests of at most 64 tokens go out (as dflash does). With ``--repeats N`` each run is
repeated and the median throughput kept; the repeats take turns across the servers (one run
of each server, then the next round: ``--order interleaved``, the default), so a host that
slows down or speeds up during a point weighs on every server alike, where ``--order grouped``
runs one server's repeats back to back. Ratios per (batch, temperature): speed-up over no
speculation and over DFLASH, accept length over DFLASH, and the budget with the highest
throughput. At T=0 the outputs of every speculative server are compared with no
speculation's, prompt by prompt (``--token-ids`` asks SGLang for the token ids, so a
difference is located to the token; the no-speculation server then gives the logit margin
there, which tells a bf16 near-tie from a real divergence).

Prompt file, one JSON object per line: ``{"prompt": "..."}``, ``{"messages": [...]}`` or
``{"turns": ["..."]}`` (first turn); ``prompt_ids`` (token ids) is used by the step-time
and sampling checks when present.

  # servers you started (a label says what each is; without one /server_info is asked)
  python3 benchmarks/budget_sweep.py --prompts my_prompts.jsonl \\
      --server nospec=http://127.0.0.1:30000 --server dflash=http://127.0.0.1:30001 \\
      --server http://127.0.0.1:30002 --server http://127.0.0.1:30003 \\
      --batch 1,8 --temperature 0,1 --num-prompts 16 --max-new-tokens 256 --tag mine --out-dir results
  # or let it start them (needs this repository: tests/gpu/conftest.py's server harness)
  python3 benchmarks/budget_sweep.py --launch --model-path T --draft-model-path D \\
      --configs nospec,dflash,ddtree4,ddtree8,ddtree16,ddtree32,ddtree64,ddtree128 --prompts P.jsonl ...
  # merge runs:  python3 benchmarks/budget_sweep.py --report a.json b.json --tag all --out-dir results

In ``--launch`` mode, ``--step-ctx C`` also measures each server's decode step time the way
``benchmarks/e2e_step.py`` does (random prompts of C tokens, median gap between streamed
chunks), at each sampling setting of the sweep, the input of ``benchmarks/cost_model.py``; ``--sampling-check`` runs
``benchmarks/sampling_check.py`` on the same servers. Output: ``budget_sweep_<tag>.json``
and ``.png`` (accept length and tokens/s against the budget), and the sampling check's samples
(``budget_sweep_<tag>_sampling_samples.npz``, for ``sampling_check.py --replay``). The JSON is rewritten after
every point; ``--deadline-s`` skips what would not fit and lists it under ``skipped``. A run
that measures no point (every server down, or nothing fits the deadline) exits 1.

A DDTREE server with ``--enable-metrics`` (``--launch`` turns it on, with a stats interval of
32 steps) also gives, per run, the accept length every smaller budget would have had on the
same requests (``accept_length_at_budget``: budgets 1, 2, 4, ... and its own; exact per step,
docs/ddtree.md#metrics), from its ``/metrics`` counters before and after the run; the counters
trail the decode loop by at most one stats interval.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import re
import statistics
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
CONFIG = re.compile(r"^(nospec|dflash|ddtree([1-9][0-9]*))(-transitions)?(-adaptive(-graphs[1-9][0-9]*(?:\.[1-9][0-9]*)*)?)?"
                    r"(-with-([a-z0-9_]+))?$")
#: A DDTREE label's suffix for a tree grown from a DFlash 2 drafter's selector transitions
#: (``--speculative-ddtree-tree transitions``), e.g. ``ddtree16-transitions``.
TRANSITIONS = "-transitions"
#: A DDTREE label's suffix for a server choosing each step's budget up to the label's
#: (``--speculative-ddtree-budget-policy adaptive``), e.g. ``ddtree64-adaptive``.
ADAPTIVE = "-adaptive"
#: After ``-adaptive``: its graph budgets (``--speculative-ddtree-graph-budgets``, dots for
#: commas), e.g. ``ddtree64-adaptive-graphs16`` or ``ddtree64-adaptive-graphs4.16``.
GRAPHS = "-graphs"
#: Last: the drafter a speculative server loads when it is not ``--draft-model-path``, one
#: named by ``--extra-drafter NAME=PATH`` (``dflash-with-dflash1``: a second drafter of the
#: same target measured beside the first in one sweep).
WITH = "-with-"
WARMUP_TOKENS = 64  # dflash's warm-up length
#: DDTREE's Prometheus counters (``speculative/ddtree/metrics.py``): drafts accepted had the
#: budget been ``budget``, and the request steps they are counted over (per budget; a server
#: without that counter ran every step at its full budget: all its request steps).
AT_BUDGET_COUNTER = "sglang:ddtree_accepted_drafts_at_budget_total"
STEPS_AT_BUDGET_COUNTER = "sglang:ddtree_request_steps_at_budget_total"
STEPS_COUNTER = "sglang:ddtree_accepted_depth_count"
#: The stats interval of servers started here: the counters trail the run by at most this many steps.
LAUNCH_STATS_INTERVAL = 32
_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_BUDGET_LABEL = re.compile(r'(?:^|,)budget="([0-9]+)"')


def budget_counters(text: str) -> Optional[dict]:
    """``{"at_budget": {budget: accepted drafts}, "steps_at_budget": {budget: request steps}}``
    from a ``/metrics`` text (summed over the other labels), or None when the server exports no
    such counters."""
    steps, at, steps_at = None, {}, {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        if name == STEPS_COUNTER:
            steps = (steps or 0.0) + float(value)
        elif name in (AT_BUDGET_COUNTER, STEPS_AT_BUDGET_COUNTER):
            b = _BUDGET_LABEL.search(labels or "")
            into = at if name == AT_BUDGET_COUNTER else steps_at
            if b:
                into[int(b.group(1))] = into.get(int(b.group(1)), 0.0) + float(value)
    if steps is None or not at:
        return None
    return {"at_budget": at, "steps_at_budget": {b: steps_at.get(b, steps) for b in at}}


def accept_at_budget(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    """Mean tokens per request step (accepted + 1) under each budget, between two snapshots
    (over the steps run at that budget or above)."""
    if before is None or after is None:
        return None
    out = {}
    for b, n in sorted(after["at_budget"].items()):
        steps = after["steps_at_budget"][b] - before["steps_at_budget"].get(b, 0.0)
        if steps > 0:
            out[str(b)] = 1.0 + (n - before["at_budget"].get(b, 0.0)) / steps
    return out or None


def _sibling(name: str, path: Path):
    """A repository module by path: works however this file was started (script or -m)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------
# Input


def load_prompts(path: Path) -> list[dict]:
    """Each line's messages (and prompt_ids if given); a bad line is named, not skipped."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}:{n}: not JSON ({e.msg})")
        if not isinstance(item, dict):
            raise SystemExit(f"{path}:{n}: expected an object with 'prompt', 'messages' or 'turns'")
        if isinstance(item.get("messages"), list) and item["messages"]:
            messages = item["messages"]
        elif isinstance(item.get("turns"), list) and item["turns"] and isinstance(item["turns"][0], str):
            messages = [{"role": "user", "content": item["turns"][0]}]
        elif isinstance(item.get("prompt"), str):
            messages = [{"role": "user", "content": item["prompt"]}]
        else:
            raise SystemExit(f"{path}:{n}: expected 'prompt' (string), 'messages' (list) or 'turns' (list)")
        ids = item.get("prompt_ids")
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
            raise SystemExit(f"{path}:{n}: 'prompt_ids' must be a list of token ids")
        out.append({"messages": messages, "prompt_ids": ids})
    if not out:
        raise SystemExit(f"{path}: no prompts")
    return out


def parse_config(label: str) -> tuple[str, Optional[int]]:
    m = CONFIG.match(label)
    if not m or ((m.group(3) or m.group(4)) and not m.group(2)) or (m.group(6) and m.group(1) == "nospec"):
        raise SystemExit(f"server label {label!r}: expected nospec, dflash or ddtree<budget>[{TRANSITIONS}]"
                         f"[{ADAPTIVE}[{GRAPHS}<b>[.<b>...]]], a speculative one optionally ending in "
                         f"{WITH}<drafter> (e.g. ddtree32, ddtree16{TRANSITIONS}, ddtree64{ADAPTIVE}, "
                         f"ddtree64{ADAPTIVE}{GRAPHS}16, dflash{WITH}dflash1)")
    return ("ddtree", int(m.group(2))) if m.group(2) else (m.group(1), None)


def drafter_name(label: str) -> Optional[str]:
    """The ``--extra-drafter`` a label's server loads, or None for ``--draft-model-path``."""
    m = CONFIG.match(label)
    return m.group(7) if m else None


def config_order(label: str) -> tuple:
    kind, budget = parse_config(label)
    return ({"nospec": 0, "dflash": 1, "ddtree": 2}[kind], ADAPTIVE in label, budget or 0, TRANSITIONS in label,
            drafter_name(label) or "")


def label_from_server_info(info: dict) -> str:
    algo = str(info.get("speculative_algorithm") or "").upper()
    if algo in ("", "NONE"):
        return "nospec"
    if algo == "DFLASH":
        return "dflash"
    if algo == "DDTREE":
        suffix = TRANSITIONS if info.get("speculative_ddtree_tree") == "transitions" else ""
        suffix += ADAPTIVE if info.get("speculative_ddtree_budget_policy") == "adaptive" else ""
        if info.get("speculative_ddtree_graph_budgets"):
            suffix += GRAPHS + str(info["speculative_ddtree_graph_budgets"]).replace(",", ".")
        return f"ddtree{int(info['speculative_ddtree_budget'])}{suffix}"
    raise SystemExit(f"server runs speculative algorithm {algo}: not one this sweep compares")


# ---------------------------------------------------------------------------------------------
# HTTP


class Server:
    """One OpenAI-compatible endpoint (an already running server, or one this tool started)."""

    def __init__(self, label: str, base_url: str, model: Optional[str] = None, timeout_s: float = 600.0):
        self.label, self.base_url, self.timeout_s = label, base_url.rstrip("/"), timeout_s
        self.model = model

    def post(self, path: str, body: dict, timeout: Optional[float] = None) -> dict:
        req = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise RuntimeError(f"{self.label}: POST {path} -> HTTP {e.code}: {detail}") from None

    def get(self, path: str, timeout: float = 30.0) -> dict:
        with urllib.request.urlopen(self.base_url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def budget_counters(self) -> Optional[dict]:
        """DDTREE's per-budget counters from ``/metrics`` (None without them)."""
        try:
            with urllib.request.urlopen(self.base_url + "/metrics", timeout=30.0) as r:
                return budget_counters(r.read().decode(errors="replace"))
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def resolve_model(self) -> str:
        if self.model is None:
            try:
                data = self.get("/v1/models").get("data") or []
                self.model = data[0]["id"] if data else "default"
            except (urllib.error.URLError, OSError, KeyError, ValueError):
                self.model = "default"
        return self.model

    def chat(self, messages, max_tokens, temperature, top_p, top_k, token_ids=False) -> dict:
        body = {"model": self.resolve_model(), "messages": messages, "max_tokens": max_tokens,
                "temperature": temperature, "top_p": top_p, "chat_template_kwargs": {},
                "return_meta_info": True}
        if top_k > 0:
            body["top_k"] = top_k
        if token_ids:
            body["return_token_ids"] = True
        return self.post("/v1/chat/completions", body)


def meta_of(resp: dict) -> dict:
    """``meta_info`` at the top level (the dflash client's place), else the first choice's."""
    meta = resp.get("meta_info")
    if not meta and resp.get("choices"):
        meta = resp["choices"][0].get("meta_info")
    return meta or {}


def record_of(resp: dict, latency_s: float) -> dict:
    meta = meta_of(resp)
    usage = resp.get("usage") or {}
    choice = (resp.get("choices") or [{}])[0]
    rec = {
        "completion_tokens": int(usage.get("completion_tokens", 0) or 0),
        "spec_verify_ct": int(meta.get("spec_verify_ct", 0) or 0),
        "latency_s": latency_s,
        "finish_reason": choice.get("finish_reason"),
        "text": (choice.get("message") or {}).get("content"),
    }
    if "spec_accept_length" in meta:
        try:
            rec["spec_accept_length"] = float(meta["spec_accept_length"])
        except (TypeError, ValueError):
            pass
    if choice.get("token_ids") is not None:
        rec["token_ids"] = list(choice["token_ids"])
    if choice.get("prompt_token_ids") is not None:
        rec["prompt_token_ids"] = list(choice["prompt_token_ids"])
    return rec


# ---------------------------------------------------------------------------------------------
# One run, as dflash benchmark openai runs it


def run_once(server: Server, prompts: list[dict], warmup: list[dict], batch: int, max_new_tokens: int,
             temperature: float, top_p: float, top_k: int, token_ids: bool = False) -> dict:
    def one(item, n):
        t = time.perf_counter()
        resp = server.chat(item["messages"], n, temperature, top_p, top_k, token_ids)
        return record_of(resp, time.perf_counter() - t)

    with ThreadPoolExecutor(max_workers=batch) as pool:
        list(pool.map(lambda p: one(p, min(WARMUP_TOKENS, max_new_tokens)), warmup[:batch]))
        before = server.budget_counters()
        start = time.perf_counter()
        records = list(pool.map(lambda p: one(p, max_new_tokens), prompts))
    wall = time.perf_counter() - start
    at_budget = accept_at_budget(before, server.budget_counters() if before else None)
    tokens = sum(r["completion_tokens"] for r in records)
    accepts = [r["spec_accept_length"] for r in records if "spec_accept_length" in r]
    verify = sum(r["spec_verify_ct"] for r in records)
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "throughput_tok_s": tokens / max(wall, 1e-6),
        "accept_length": statistics.mean(accepts) if accepts else None,
        "accept_length_pooled": tokens / verify if verify else None,
        "spec_verify_ct": verify,
        "records": records,
        **({"accept_length_at_budget": at_budget} if at_budget else {}),
    }


def repeat_stats(run: dict, batch: int) -> dict:
    """One repeat's closed-loop tokens/s beside what a batch kept full would give (Little's
    law: batch x tokens over the summed request latencies). The closed loop ends in a tail
    with fewer than ``batch`` requests in flight, which drags the first and not the second."""
    latency = sum(x["latency_s"] for x in run["records"])
    return {
        "throughput_tok_s": run["throughput_tok_s"], "wall_s": run["wall_s"],
        "spec_verify_ct": run["spec_verify_ct"], "latency_sum_s": latency,
        "full_batch_tok_s": batch * run["output_tokens"] / max(latency, 1e-9),
    }  # fmt: skip


def point_row(server: Server, prompts, batch, max_new_tokens, temperature, top_p, top_k, runs: list[dict]) -> dict:
    """One (server, point) row from its runs (``run_once``): the median throughput and its spread."""
    tps = [r["throughput_tok_s"] for r in runs]
    first = runs[0]
    kind, budget = parse_config(server.label)
    return {
        "config": server.label, "kind": kind, "budget": budget,
        "batch": batch, "temperature": temperature, "top_p": top_p, "top_k": top_k,
        "num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "repeats": len(runs),
        "throughput_tok_s": statistics.median(tps),
        "throughput_runs": tps,
        # (max - min) / median of the runs: the spread a ratio between two configs must beat
        "throughput_spread": (max(tps) - min(tps)) / max(statistics.median(tps), 1e-9),
        "accept_length": first["accept_length"],
        "accept_length_pooled": first["accept_length_pooled"],
        "spec_verify_ct": first["spec_verify_ct"],
        "output_tokens": first["output_tokens"],
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "records": first["records"],
        "repeat_stats": [repeat_stats(r, batch) for r in runs],
        **({"accept_length_at_budget": first["accept_length_at_budget"]}
           if "accept_length_at_budget" in first else {}),
    }


def point_rounds(servers: list, repeats: int, order: str) -> list:
    """The order of a point's runs: ``interleaved`` takes one run of each server per round,
    ``grouped`` runs each server's repeats back to back."""
    if order == "grouped":
        return [s for s in servers for _ in range(repeats)]
    return [s for _ in range(repeats) for s in servers]


# ---------------------------------------------------------------------------------------------
# Analysis


def _key(row) -> tuple:
    return (row["batch"], row["temperature"], row.get("top_p", 1.0), row.get("top_k", 0))


def round_ratios(row: dict, other: dict) -> Optional[list]:
    """Per round, ``row``'s tokens/s over ``other``'s when both ran interleaved with as many
    runs (the runs of a round met the same host): the ratio's own spread, beside the ratio of
    the medians."""
    a, b = row.get("throughput_runs") or [], other.get("throughput_runs") or []
    if row.get("order") != "interleaved" or other.get("order") != "interleaved" or len(a) != len(b) or len(a) < 2:
        return None
    return [x / y for x, y in zip(a, b)]


def ratios(rows: list[dict]) -> list[dict]:
    """Per (batch, sampling) point: each config against no speculation and DFLASH of the same run."""
    out = []
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault(_key(r), {})[r["config"]] = r
    for key, by in sorted(groups.items()):
        base, chain = by.get("nospec"), by.get("dflash")
        trees = {c: r for c, r in by.items() if c.startswith("ddtree")}
        best = max(trees.values(), key=lambda r: r["throughput_tok_s"], default=None)
        point = {"batch": key[0], "temperature": key[1], "top_p": key[2], "top_k": key[3], "configs": {}}
        for c, r in sorted(by.items(), key=lambda kv: config_order(kv[0])):
            e = {"throughput_tok_s": r["throughput_tok_s"], "accept_length": r["accept_length"]}
            if r.get("accept_length_at_budget"):
                e["accept_length_at_budget"] = r["accept_length_at_budget"]
            if base:
                e["speedup_vs_nospec"] = r["throughput_tok_s"] / base["throughput_tok_s"]
                if c != "nospec" and (rounds := round_ratios(r, base)):
                    e["speedup_vs_nospec_rounds"] = rounds
            if chain and c != "dflash":
                e["speedup_vs_dflash"] = r["throughput_tok_s"] / chain["throughput_tok_s"]
                if rounds := round_ratios(r, chain):
                    e["speedup_vs_dflash_rounds"] = rounds
                if r["accept_length"] and chain["accept_length"]:
                    e["accept_vs_dflash"] = r["accept_length"] / chain["accept_length"]
            point["configs"][c] = e
        if best is not None:
            point["best_ddtree"] = best["config"]
        out.append(point)
    return out


def budget_choice(rows: list[dict]) -> dict:
    """Each DDTREE budget's tokens/s over DFLASH's, as a geometric mean over the measured
    (batch, sampling) points, and the budget that is best over the points it was measured at
    (only budgets measured at every point that has a DFLASH row compete)."""
    by_point: dict[tuple, dict[str, float]] = {}
    for r in rows:
        by_point.setdefault(_key(r), {})[r["config"]] = r["throughput_tok_s"]
    ratios_by_budget: dict[str, list[float]] = {}
    points = [p for p in by_point.values() if "dflash" in p]
    for p in points:
        for c, tps in p.items():
            if c.startswith("ddtree"):
                ratios_by_budget.setdefault(c, []).append(tps / p["dflash"])
    table = {c: {"geomean_vs_dflash": math.exp(sum(map(math.log, v)) / len(v)), "min": min(v), "max": max(v),
                 "points": len(v)} for c, v in ratios_by_budget.items()}
    full = {c: e for c, e in table.items() if e["points"] == len(points)}
    best = max(full, key=lambda c: full[c]["geomean_vs_dflash"], default=None)
    return {"by_budget": dict(sorted(table.items(), key=lambda kv: config_order(kv[0]))), "best": best,
            "points": len(points)}


def lossless(rows: list[dict]) -> list[dict]:
    """T=0: every speculative server's output against no speculation's, prompt by prompt."""
    out = []
    by = {(_key(r), r["config"]): r for r in rows}
    for (key, config), r in sorted(by.items(), key=lambda kv: (kv[0][0], config_order(kv[0][1]))):
        if key[1] != 0 or config == "nospec" or (key, "nospec") not in by:
            continue
        base = by[(key, "nospec")]["records"]
        same, diffs = 0, []
        for i, (a, b) in enumerate(zip(base, r["records"])):
            if "token_ids" in a and "token_ids" in b:
                x, y = a["token_ids"], b["token_ids"]
            else:
                x, y = a.get("text") or "", b.get("text") or ""
            if x == y:
                same += 1
                continue
            j = next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            d = {"prompt": i, "first_difference": j, "unit": "token" if isinstance(x, list) else "char"}
            if isinstance(x, list):
                d.update(nospec_token=x[j] if j < len(x) else None, spec_token=y[j] if j < len(y) else None)
                d["prompt_token_ids"] = a.get("prompt_token_ids")
                d["common_prefix"] = x[:j]
            diffs.append(d)
        out.append({"batch": key[0], "config": config, "prompts": len(base), "identical": same, "differ": diffs})
    return out


def explain_differences(nospec: Server, report: list[dict], near_tie_nats: float = 0.05) -> None:
    """Ask the no-speculation server for its top-2 log-probs where an output first differs."""
    for entry in report:
        for d in entry["differ"]:
            ids = d.pop("prompt_token_ids", None)
            prefix = d.pop("common_prefix", None)
            if ids is None or prefix is None:
                continue
            try:
                out = nospec.post("/generate", {
                    "input_ids": ids + prefix,
                    "sampling_params": {"temperature": 0.0, "max_new_tokens": 1},
                    "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": -1})
                top = (out.get("meta_info") or {}).get("output_top_logprobs") or []
                (lp1, t1, *_), (lp2, t2, *_) = top[0][0], top[0][1]
            except Exception as e:  # a diagnosis, not a measurement: say why it is missing
                d["margin_error"] = str(e)[:300]
                continue
            d["margin_nats"] = lp1 - lp2
            d["top2"] = [t1, t2]
            d["near_tie"] = bool(lp1 - lp2 < near_tie_nats and d.get("spec_token") in (t1, t2))


# ---------------------------------------------------------------------------------------------
# Output


def strip_records(rows: list[dict]) -> list[dict]:
    """Rows for the JSON: per-request numbers kept, texts and ids dropped."""
    keep = ("completion_tokens", "spec_verify_ct", "spec_accept_length", "latency_s", "finish_reason")
    return [{**r, "records": [{k: x[k] for k in keep if k in x} for x in r["records"]]} for r in rows]


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG", flush=True)
        return
    rows = result["rows"]
    keys = sorted({_key(r) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for key in keys:
        name = f"bs {key[0]}, T={key[1]:g}" + (f", top-p {key[2]:g}" if key[2] < 1 else "") + \
               (f", top-k {key[3]}" if key[3] > 0 else "")
        line = None
        for source, style in (("", "o-"), (TRANSITIONS, "s--")):
            pts = sorted(((r["budget"], r) for r in rows if _key(r) == key and r["kind"] == "ddtree"
                          and (TRANSITIONS in r["config"]) == bool(source) and ADAPTIVE not in r["config"]),
                         key=lambda br: br[0])  # fmt: skip
            if not pts:
                continue
            label = f"DDTREE{' from transitions' if source else ''} {name}"
            color = line.get_color() if line is not None else None
            drawn, = axes[0].plot([b for b, _ in pts], [r["accept_length"] or 1.0 for _, r in pts], style,
                                  color=color, label=label)
            axes[1].plot([b for b, _ in pts], [r["throughput_tok_s"] for _, r in pts], style,
                         color=drawn.get_color(), label=label)
            line = line or drawn
        color = line.get_color() if line is not None else None
        for r in rows:
            if _key(r) != key:
                continue
            if r["kind"] == "dflash":
                axes[0].axhline(r["accept_length"] or 1.0, ls="--", color=color, lw=1, label=f"DFLASH {name}")
                axes[1].axhline(r["throughput_tok_s"], ls="--", color=color, lw=1, label=f"DFLASH {name}")
            elif r["kind"] == "nospec":
                axes[1].axhline(r["throughput_tok_s"], ls=":", color=color, lw=1, label=f"no spec {name}")
            elif ADAPTIVE in r["config"]:  # the adaptive server at its largest budget
                axes[0].plot([r["budget"]], [r["accept_length"] or 1.0], "*", ms=12, color=color,
                             label=f"{r['config']} {name}")
                axes[1].plot([r["budget"]], [r["throughput_tok_s"]], "*", ms=12, color=color,
                             label=f"{r['config']} {name}")
    for ax, ylabel in zip(axes, ["accept length (tokens per verify step)", "tokens/s (all requests)"]):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("DDTREE budget B (draft nodes per tree)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    if axes[1].get_legend_handles_labels()[0]:
        axes[1].legend(fontsize=6, ncol=2)
    fig.suptitle(f"{result.get('what', 'budget sweep')} ({result.get('device', '?')}, {result.get('date', '')})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def finish(result: dict) -> dict:
    result["ratios"] = ratios(result["rows"])
    result["budget_choice"] = budget_choice(result["rows"])
    return result


def write(result: dict, out: Path) -> None:
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)


def summary_lines(result: dict) -> list[str]:
    lines = []
    choice = result.get("budget_choice") or {}
    if choice.get("by_budget"):
        lines.append("DDTREE tokens/s over DFLASH, geometric mean over the points: " + ", ".join(
            f"{c} {e['geomean_vs_dflash']:.2f} ({e['points']})" for c, e in choice["by_budget"].items())
            + f"; best at every point's mean: {choice['best']}")
    for p in result.get("ratios", []):
        lines.append(f"bs {p['batch']} T={p['temperature']:g} top_p={p['top_p']:g} top_k={p['top_k']}"
                     + (f"  best {p['best_ddtree']}" if "best_ddtree" in p else ""))
        for c, e in p["configs"].items():
            parts = [f"{e['throughput_tok_s']:8.1f} tok/s"]
            if e.get("accept_length"):
                parts.append(f"accept {e['accept_length']:5.2f}")
            if e.get("accept_length_at_budget"):
                parts.append("at smaller budgets " + " ".join(
                    f"{b}:{x:.2f}" for b, x in e["accept_length_at_budget"].items()))
            for k, name in (("speedup_vs_nospec", "x nospec"), ("speedup_vs_dflash", "x dflash"),
                            ("accept_vs_dflash", "x dflash accept")):
                if k in e:
                    parts.append(f"{e[k]:.2f} {name}")
            lines.append(f"  {c:10s} " + ", ".join(parts))
    return lines


# ---------------------------------------------------------------------------------------------
# Servers started here (launch mode)


def launch_args(label: str, drafter: Optional[str], batches: list[int], extra: list[str],
                drafters: Optional[dict] = None) -> list[str]:
    """The served configuration: triton attention, decode CUDA graphs for exactly the measured
    batch sizes and none for prefill (a speculative server captures 58 of them before it serves;
    a sweep measures decode),
    the overlap scheduler on (the default); KV pools capped so servers can share a GPU.
    ``drafters``: the ``--extra-drafter`` paths a ``-with-NAME`` label picks from."""
    kind, budget = parse_config(label)
    name = drafter_name(label)
    if name is not None:
        if name not in (drafters or {}):
            raise SystemExit(f"{label} loads the drafter {name!r}: give it as --extra-drafter {name}=PATH")
        drafter = drafters[name]
    args = ["--attention-backend", "triton", "--mem-fraction-static", "0.85", "--max-total-tokens", "65536",
            "--max-running-requests", "128", "--cuda-graph-bs-decode", *[str(b) for b in sorted(set(batches))],
            "--cuda-graph-backend-prefill", "disabled", *extra]
    if kind != "nospec":
        if not drafter:
            raise SystemExit(f"{label} needs --draft-model-path")
        args += ["--speculative-algorithm", "DFLASH" if kind == "dflash" else "DDTREE",
                 "--speculative-draft-model-path", drafter]
        if budget is not None:
            args += ["--speculative-ddtree-budget", str(budget), "--enable-metrics"]
        if TRANSITIONS in label:
            args += ["--speculative-ddtree-tree", "transitions"]
        if ADAPTIVE in label:
            args += ["--speculative-ddtree-budget-policy", "adaptive"]
        if GRAPHS in label:
            args += ["--speculative-ddtree-graph-budgets", label.split(GRAPHS, 1)[1].replace(".", ",")]
    return args


class Deadline:
    def __init__(self, seconds: Optional[float]):
        self.t0, self.seconds = time.monotonic(), seconds

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - (time.monotonic() - self.t0)


def measure_steps(e2e_step, server: Server, proc, ctx: int, batches: list[int], vocab: int,
                  samplings: Sequence[tuple] = ((0.0, 1.0, 0),)) -> list[dict]:
    """Decode step time as benchmarks/e2e_step.py measures it (its own measure()), at each
    (T, top_p, top_k) of ``samplings``: a sampled step draws per node, which a greedy one does
    not, so the cost model charges each point the step of its own sampling."""
    rows = []
    kind, budget = parse_config(server.label)
    for t, top_p, top_k in samplings:
        sampling = e2e_step.sampling_params(t, top_p, top_k)
        for b in batches:
            r = e2e_step.measure(proc, ctx, b, 64, vocab, seed=ctx + b, point_max_s=6.0, sampling=sampling)
            r.update(config=server.label, kind=kind, budget=budget, temperature=t, top_p=top_p, top_k=top_k)
            rows.append(r)
            print(json.dumps({"step": r}), flush=True)
    return rows


def step_key(step: dict) -> tuple:
    """A step-time row's (config, context, batch, T, top_p, top_k); rows before sampled steps
    were measured are greedy."""
    return (step["config"], step["ctx"], step["batch"], step.get("temperature", 0.0), step.get("top_p", 1.0),
            step.get("top_k", 0))


def sweep_points(args) -> list[tuple[int, tuple]]:
    """(batch, (temperature, top_p, top_k)) points, batch 1 at T=0 (the headline) first, then in
    the order given."""
    points = [(b, s) for b in args.batch for s in args.sampling]
    return sorted(points, key=lambda p: not (p[0] == 1 and p[1][0] == 0))


def parse_sampling(spec: str) -> list[tuple[float, float, int]]:
    """``T[/top_k[/top_p]]`` items, comma-separated (``0,0.7/20/0.8,1``) -> (T, top_p, top_k)."""
    out = []
    for item in (x for x in spec.split(",") if x):
        parts = item.split("/")
        if len(parts) > 3:
            raise ValueError(item)
        t = float(parts[0])
        top_k = int(parts[1]) if len(parts) > 1 else 0
        top_p = float(parts[2]) if len(parts) > 2 else 1.0
        if t < 0 or top_k < 0 or not 0 < top_p <= 1:
            raise ValueError(item)
        out.append((t, top_p, top_k))
    return out


def point_prompts(prompts: list[dict], n: int, batch: int, min_waves: int) -> list[dict]:
    """The prompts one run at ``batch`` sends: the first ``n``, or ``min_waves`` per
    concurrent request when that is more, the file's prompts taken again in order when it
    has fewer. A closed loop of ``batch`` clients ends with a tail in which fewer requests
    remain (speculative requests finish at different times); more waves make it a smaller
    share of the run. A prompt sent twice hits the radix cache, in every config alike."""
    k = max(n, min_waves * batch)
    return [prompts[i % len(prompts)] for i in range(k)]


def run_points(servers: list[Server], prompts: list[dict], args, result: dict, out: Path, deadline: Deadline,
               points: list[tuple[int, tuple]]) -> None:
    n = args.num_prompts
    if len(prompts) < n:
        raise SystemExit(f"--num-prompts {n}: the prompt file has only {len(prompts)}")
    warm = (prompts[n:] + prompts)[: max(args.batch)]
    seen = result.setdefault("_run_s", {})  # the longest run per point so far, its warm-up included
    for b, sampling in points:
        t, top_p, top_k = sampling
        measured = point_prompts(prompts, n, b, args.min_waves)
        runs: dict[str, list] = {s.label: [] for s in servers}
        why: dict[str, str] = {}
        for s in point_rounds(servers, args.repeats, args.order):
            if s.label in why:
                continue
            est = (seen.get((b, sampling)) or 10.0 / args.repeats) * 1.2
            if deadline.left() < est:
                why[s.label] = f"{deadline.left():.0f} s left < {est:.0f} s estimated"
                continue
            t0 = time.monotonic()
            try:
                runs[s.label].append(run_once(s, measured, warm, b, args.max_new_tokens, t, top_p, top_k,
                                              args.token_ids and t == 0))
            except Exception as e:
                why[s.label] = f"failed: {e}"[:2000]
                runs[s.label] = []
                print(f"[{s.label}] bs {b} T={t} top_p={top_p} top_k={top_k} failed: {e}", flush=True)
                continue
            seen[(b, sampling)] = max(seen.get((b, sampling), 0.0), time.monotonic() - t0)
        for s in servers:
            if not runs[s.label]:
                result["skipped"].append({"config": s.label, "batch": b, "temperature": t, "top_p": top_p,
                                          "top_k": top_k, "reason": why.get(s.label, "not run")})
                continue
            row = point_row(s, measured, b, args.max_new_tokens, t, top_p, top_k, runs[s.label])
            row["order"] = args.order
            result["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "records"}), flush=True)
        write(_public(finish(result)), out)


def check_lossless(servers: list[Server], result: dict, out: Path) -> None:
    """While the servers are up: T=0 outputs against no speculation's, and where one differs,
    the no-speculation server's margin there."""
    result["lossless"] = lossless(result["rows"])
    nospec = next((s for s in servers if s.label == "nospec"), None)
    if nospec is not None and any(e["differ"] for e in result["lossless"]):
        explain_differences(nospec, result["lossless"])
    for e in result["lossless"]:
        for d in e["differ"]:
            d.pop("prompt_token_ids", None), d.pop("common_prefix", None)
    write(_public(finish(result)), out)


def run_sweep(servers: list[Server], prompts: list[dict], args, result: dict, out: Path,
              deadline: Deadline) -> dict:
    run_points(servers, prompts, args, result, out, deadline, sweep_points(args))
    check_lossless(servers, result, out)
    return result


def _public(result: dict) -> dict:
    r = {k: v for k, v in result.items() if not k.startswith("_")}
    r["rows"] = strip_records(result["rows"])
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=Path, help="JSONL prompt file")
    ap.add_argument("--server", action="append", default=[], help="[LABEL=]URL of a running server; LABEL is "
                    "nospec, dflash, ddtree<B> or ddtree<B>-transitions (asked from /server_info when omitted)")
    ap.add_argument("--model", help="model name for the OpenAI requests (default: the server's first)")
    ap.add_argument("--batch", default="1,8", help="concurrencies, e.g. 1,8")
    ap.add_argument("--temperature", default="0,1", help="temperatures, e.g. 0,1")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="0 disables top-k (as dflash)")
    ap.add_argument("--sampling", help="sampling settings T[/top_k[/top_p]], comma-separated (e.g. "
                    "0,0.7/20/0.8,1); replaces --temperature/--top-p/--top-k")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--min-waves", type=int, default=1,
                    help="at batch b send at least this many prompts per client (b x waves), the file's "
                         "prompts again in order if it has fewer: a shorter closed-loop tail")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1, help="runs per point; the median throughput is kept")
    ap.add_argument("--order", choices=("interleaved", "grouped"), default="interleaved",
                    help="a point's runs: one of each server per round (interleaved), or each server's repeats "
                    "back to back (grouped)")
    ap.add_argument("--token-ids", action=argparse.BooleanOptionalAction, default=True,
                    help="ask for output token ids at T=0 (SGLang's return_token_ids) for the lossless check")
    ap.add_argument("--deadline-s", type=float)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    ap.add_argument("--tag", default="run")
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--device-name", help="recorded in the JSON (launch mode reads it from torch)")
    ap.add_argument("--report", type=Path, nargs="+", help="merge earlier JSON results instead of measuring")
    lg = ap.add_argument_group("launch mode (starts the servers through tests/gpu/conftest.py)")
    lg.add_argument("--launch", action="store_true")
    lg.add_argument("--model-path")
    lg.add_argument("--draft-model-path")
    lg.add_argument("--extra-drafter", action="append", default=[], metavar="NAME=PATH",
                    help="another drafter of the same target, loaded by the configs ending in -with-NAME "
                    "(e.g. --extra-drafter dflash1=/tmp/learned-pair/drafter --configs dflash,dflash-with-dflash1)")
    lg.add_argument("--configs", default="nospec,dflash,ddtree4,ddtree8,ddtree16,ddtree32,ddtree64,ddtree128")
    lg.add_argument("--server-args", default="", help="extra arguments for every server")
    lg.add_argument("--log-dir", type=Path, default=Path(os.environ.get("DDTREE_GPU_LOG_DIR", "/tmp/budget-sweep-logs")))
    lg.add_argument("--start-timeout-s", type=float, default=420.0)
    lg.add_argument("--step-ctx", type=int, default=0, help="also measure decode step time at this context")
    lg.add_argument("--sampling-check", action="store_true", help="run benchmarks/sampling_check.py too")
    lg.add_argument("--sampling-prompts", type=Path, help="JSON list of {prompt_ids} for the sampling check")
    lg.add_argument("--sampling-samples", type=int, default=3000)
    lg.add_argument("--sampling-settings", default="default",
                    help="the sampling check's settings (sampling_check.py --settings)")
    lg.add_argument("--sampling-positions", type=int, default=8, help="generated positions the sampling check compares")
    lg.add_argument("--sampling-concurrency", type=int, default=1000,
                    help="continuations in flight per server in the sampling check (the batch the servers decode)")
    lg.add_argument("--sampling-ddtree", default="ddtree16", help="the DDTREE server the sampling check uses")
    lg.add_argument("--sampling-configs", help="the speculative servers the sampling check compares with nospec, "
                    "comma-separated (default: dflash and --sampling-ddtree), e.g. "
                    "dflash,ddtree16,dflash-with-dflash2: one check, its controls drawn once")
    lg.add_argument("--sampling-max-s", type=float, default=120.0, help="time the sampling check may take (0 leaves it out)")
    lg.add_argument("--sampling-boundary-delta", type=float, default=0.0625,
                    help="the sampling check's verdict only where no change of the target's logits by this much moves "
                    "a filter's cut (benchmarks/sampling_boundaries.py); 0 compares every context")
    lg.add_argument("--sampling-boundary-mass", type=float, default=0.02,
                    help="top-p's cumulative masses must stay this far from top_p for its cut to count as decided")
    lg.add_argument("--py-spy", default="", help="configs whose scheduler py-spy samples during the first batch's "
                    "points (host time per step), e.g. dflash,ddtree16")
    args = ap.parse_args(argv)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"budget_sweep_{args.tag}.json"
    if args.report:
        return report(args.report, out)
    if not args.prompts:
        ap.error("--prompts is required")
    try:
        args.batch = [int(x) for x in args.batch.split(",") if x]
        args.temperature = [float(x) for x in args.temperature.split(",") if x]
    except ValueError:
        ap.error("--batch and --temperature take comma-separated numbers")
    if not args.batch or min(args.batch) < 1 or not args.temperature or min(args.temperature) < 0:
        ap.error("--batch needs positive integers, --temperature non-negative numbers")
    if not 0 < args.top_p <= 1 or args.top_k < 0 or args.repeats < 1 or args.num_prompts < 1 or args.min_waves < 1:
        ap.error("top-p in (0, 1], top-k >= 0, repeats >= 1, num-prompts >= 1, min-waves >= 1")
    try:
        args.py_spy = [c for c in args.py_spy.split(",") if c]
        args.sampling = (parse_sampling(args.sampling) if args.sampling
                         else [(t, args.top_p, args.top_k) for t in args.temperature])
    except ValueError as e:
        ap.error(f"--sampling: {e} is not T[/top_k[/top_p]] with T >= 0, top_k >= 0, top_p in (0, 1]")
    if not args.sampling:
        ap.error("--sampling: no setting given")
    drafters = {}
    for item in args.extra_drafter:
        name, sep, path = item.partition("=")
        if not sep or not path or not re.fullmatch(r"[a-z0-9_]+", name) or name in drafters:
            ap.error(f"--extra-drafter {item!r}: expected NAME=PATH, NAME of a-z, 0-9 and _, each NAME once")
        drafters[name] = path
    args.extra_drafter = drafters
    if args.sampling_check:
        try:
            sc_module = _sibling("sampling_check", REPO / "benchmarks" / "sampling_check.py")
            args.sampling_settings = sc_module.parse_settings(args.sampling_settings)
        except ValueError as e:
            ap.error(f"--sampling-settings: {e}")
        if args.sampling_positions < 1 or args.sampling_concurrency < 1:
            ap.error("--sampling-positions and --sampling-concurrency take positive numbers")
        if args.sampling_boundary_delta < 0 or args.sampling_boundary_mass < 0:
            ap.error("--sampling-boundary-delta and --sampling-boundary-mass take numbers >= 0")
        if args.sampling_boundary_delta > 0:
            sb = _sibling("sampling_boundaries", REPO / "benchmarks" / "sampling_boundaries.py")
            try:
                for setting in args.sampling_settings:
                    sb.has_cut(setting, 1 << 30)
            except ValueError as e:
                ap.error(f"--sampling-settings with --sampling-boundary-delta: {e} (--sampling-boundary-delta 0 "
                         "compares every context)")
    prompts = load_prompts(args.prompts)
    if args.launch == bool(args.server):
        ap.error("give running servers (--server) or --launch, not both or neither")
    configs = [c for c in args.configs.split(",") if c]
    checking = args.launch and args.sampling_check and args.sampling_max_s > 0
    if args.sampling_configs is not None:
        args.sampling_configs = [c for c in args.sampling_configs.split(",") if c]
        missing = [c for c in args.sampling_configs if c not in configs or c == "nospec"]
        if checking and (missing or not args.sampling_configs):
            ap.error(f"--sampling-configs {','.join(missing) or '(none)'}: the sampling check compares launched "
                     "speculative servers with nospec; name configs of --configs other than nospec")
    elif (checking and args.sampling_ddtree not in configs
            and any(parse_config(c)[0] == "ddtree" for c in configs)):
        ap.error(f"--sampling-ddtree {args.sampling_ddtree} is not among --configs, so the sampling check would "
                 "leave DDTREE out: name one of the DDTREE configs")
    result = {
        "what": "DDTREE budget sweep through the OpenAI API (benchmarks/budget_sweep.py)",
        "date": time.strftime("%Y-%m-%d"),
        "device": args.device_name or "unknown",
        "argv": sys.argv[1:] if argv is None else list(argv),
        "prompts_file": str(args.prompts),
        "metrics": "dflash benchmark openai: throughput = completion tokens / wall; accept length = mean of "
                   "per-request meta_info.spec_accept_length",
        "servers": [],
        "rows": [],
        "skipped": [],
    }
    deadline = Deadline(args.deadline_s)
    if args.server:
        servers = []
        for item in args.server:
            label, sep, url = item.partition("=")
            if not sep:
                url, label = item, None
            s = Server(label or "?", url, args.model, args.timeout_s)
            if label is None:
                try:
                    s.label = label_from_server_info(s.get("/server_info"))
                except (urllib.error.URLError, OSError, KeyError, ValueError) as e:
                    raise SystemExit(f"{url}: no label given and /server_info did not say ({e}); "
                                     "give LABEL=URL") from None
            parse_config(s.label)
            servers.append(s)
        if len({s.label for s in servers}) != len(servers):
            raise SystemExit(f"two servers with one label: {[s.label for s in servers]}")
        servers.sort(key=lambda s: config_order(s.label))
        result["servers"] = [{"config": s.label, "url": s.base_url} for s in servers]
        run_sweep(servers, prompts, args, result, out, deadline)
    else:
        run_launched(args, prompts, result, out, deadline)
    write(_public(finish(result)), out)
    plot(result, out.with_suffix(".png"))
    print("\n".join(summary_lines(result)))
    for e in result.get("lossless", []):
        print(f"lossless bs {e['batch']} {e['config']}: {e['identical']}/{e['prompts']} identical"
              + "".join(f"; prompt {d['prompt']} differs at {d['unit']} {d['first_difference']}"
                        + (f" (margin {d['margin_nats']:.3f} nats{', near tie' if d.get('near_tie') else ''})"
                           if "margin_nats" in d else "") for d in e["differ"]))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    if not result["rows"]:
        print("budget_sweep: no point was measured (see the servers' reasons under 'skipped' and "
              f"their logs in {args.log_dir if args.launch else 'the servers'})", file=sys.stderr)
        return 1
    return 0


@contextlib.contextmanager
def host_profiles(procs: dict, out_dir: Path, tag: str, result: dict):
    """While the block runs, py-spy samples each given server's scheduler process (where a
    decode step's host work runs) into ``hostprof_<tag>_<config>.json`` (speedscope format):
    where the host time of a step goes, on a target too small to hide it."""
    import shutil
    import signal
    import subprocess

    spy = shutil.which("py-spy")
    if procs and spy is None:
        result["skipped"].append({"what": "host profile", "reason": "py-spy is not installed"})
    running = []
    for label, proc in (procs.items() if spy else ()):
        pid = scheduler_pid(proc.proc.pid)
        if pid is None:
            result["skipped"].append({"what": "host profile", "config": label, "reason": "no scheduler process"})
            continue
        path = out_dir / f"hostprof_{tag}_{label}.json"
        running.append(subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", "200", "--format", "speedscope",
                                         "--nonblocking", "-o", str(path)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.STDOUT))  # fmt: skip
        result.setdefault("host_profiles", {})[label] = path.name
    try:
        yield
    finally:
        for p in running:
            p.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for p in running:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def scheduler_pid(launcher_pid: int):
    """The launcher's descendant that runs the scheduler (SGLang titles it ``sglang::scheduler``)."""
    import psutil

    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if "scheduler" in " ".join([child.name(), *child.cmdline()]):
                return child.pid
        except psutil.Error:
            continue
    return None


def run_launched(args, prompts: list[dict], result: dict, out: Path, deadline: Deadline) -> None:
    if not args.model_path:
        raise SystemExit("--launch needs --model-path (and --draft-model-path for speculative configs)")
    labels = sorted({c for c in args.configs.split(",") if c}, key=config_order)
    for c in labels:
        parse_config(c)
    harness = _sibling("ddtree_gpu_harness", REPO / "tests" / "gpu" / "conftest.py")
    import shlex

    import torch

    result["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else result["device"]
    result["model_path"], result["draft_model_path"] = args.model_path, args.draft_model_path
    if args.extra_drafter:
        result["extra_drafters"] = dict(args.extra_drafter)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(args.server_args)
    procs = {}
    try:
        for c in labels:  # all at once: starts overlap (the harness relaunches one whose port was taken)
            procs[c] = harness.ServerProcess(f"sweep-{c}", args.model_path,
                                             launch_args(c, args.draft_model_path, args.batch, extra,
                                                         args.extra_drafter), args.log_dir,
                                             env={"SGLANG_DDTREE_STATS_INTERVAL": str(LAUNCH_STATS_INTERVAL)})
        for c in list(labels):
            try:
                procs[c].wait_healthy(min(args.start_timeout_s, max(30.0, deadline.left() - 60)))
            except Exception as e:  # one server that does not start must not cost the others
                result["skipped"].append({"config": c, "what": "server", "reason": f"failed: {e}"[-3000:]})
                print(f"[{c}] did not start: {str(e)[-500:]}", flush=True)
                procs.pop(c).stop()
                labels.remove(c)
                continue
            result["servers"].append({"config": c, "url": procs[c].base_url, "ready_s": procs[c].ready_s,
                                      "args": procs[c].args, "log": str(procs[c].log_path)})
            print(f"[{c}] healthy after {procs[c].ready_s:.0f} s ({time.monotonic() - deadline.t0:.0f} s in)",
                  flush=True)
        servers = [Server(c, procs[c].base_url, None, args.timeout_s) for c in labels]
        # Order of importance, so a short deadline drops the tail: batch 1 (T=0, then the other
        # temperatures) and its lossless check, the step times, the larger batches, then the
        # sampling check (which fits itself into what is left).
        points = sweep_points(args)
        first = [p for p in points if p[0] == min(args.batch)]
        with host_profiles({c: procs[c] for c in args.py_spy if c in procs}, args.out_dir, args.tag, result):
            run_points(servers, prompts, args, result, out, deadline, first)
        check_lossless(servers, result, out)
        if args.step_ctx:
            e2e_step = _sibling("e2e_step", REPO / "benchmarks" / "e2e_step.py")
            vocab = json.loads((Path(args.model_path) / "config.json").read_text())["vocab_size"]
            result["steps"] = []
            for c in labels:
                if deadline.left() < 10 * len(args.batch) * len(args.sampling):
                    result["skipped"].append({"config": c, "what": "step time",
                                              "reason": f"{deadline.left():.0f} s left"})
                    continue
                try:
                    result["steps"] += measure_steps(e2e_step, Server(c, procs[c].base_url), procs[c],
                                                     args.step_ctx, args.batch, vocab, args.sampling)
                except Exception as e:
                    result["skipped"].append({"config": c, "what": "step time", "reason": f"failed: {e}"[:2000]})
                write(_public(finish(result)), out)
        run_points(servers, prompts, args, result, out, deadline, [p for p in points if p not in first])
        if args.sampling_check and args.sampling_max_s <= 0:
            result["skipped"].append({"what": "sampling check", "reason": "--sampling-max-s 0"})
        elif args.sampling_check:
            sc = _sibling("sampling_check", REPO / "benchmarks" / "sampling_check.py")
            compared = args.sampling_configs or ["dflash", args.sampling_ddtree]
            chosen = [c for c in ["nospec", *compared] if c in procs]
            src = args.sampling_prompts
            sprompts = json.loads(src.read_text()) if src else [p for p in prompts if p["prompt_ids"]][:2]
            budget = min(args.sampling_max_s, deadline.left() - 30)
            if "nospec" not in chosen or budget < 30:
                result["skipped"].append({"what": "sampling check",
                                          "reason": f"{deadline.left():.0f} s left" if budget < 30 else "no nospec"})
            else:
                sampling_ids = [p["prompt_ids"] for p in sprompts]
                result["sampling_check"] = sc.run_check(
                    {c: Server(c, procs[c].base_url, None, args.timeout_s) for c in chosen},
                    sampling_ids, samples=args.sampling_samples,
                    positions=args.sampling_positions, settings=args.sampling_settings,
                    deadline_s=budget, concurrency=args.sampling_concurrency,
                    decided=boundary_test(args, sampling_ids),
                    samples_out=out.with_name(out.stem + "_sampling_samples.npz"))
                write(_public(finish(result)), out)
        check_lossless(servers, result, out)
    finally:
        for p in procs.values():
            p.stop()


def boundary_test(args, prompts: list[list[int]]):
    """The sampling check's ``decided`` (sampling_boundaries.DecidedContexts) for the launched
    target, or None with --sampling-boundary-delta 0. The filters' order is the servers'
    sampling backend's (FlashInfer unless --server-args names another)."""
    if args.sampling_boundary_delta <= 0:
        return None
    sb = _sibling("sampling_boundaries", REPO / "benchmarks" / "sampling_boundaries.py")
    backend = "pytorch" if re.search(r"--sampling-backend[= ]pytorch\b", args.server_args) else "flashinfer"
    return sb.DecidedContexts(sb.load_target(args.model_path), prompts, args.sampling_positions,
                              args.sampling_boundary_delta, args.sampling_boundary_mass, backend)


def report(paths: list[Path], out: Path) -> int:
    """Merge runs (e.g. batch 1 and batch 8 measured in two calls on one machine): a later file's
    row for the same (config, batch, sampling), step time for the same (config, context, batch, sampling),
    lossless entry for the same (batch, config) and sampling check replace an earlier one's."""
    rows: dict = {}
    steps: dict = {}
    same: dict = {}
    base = None
    extra: dict = {"servers": [], "skipped": []}
    for p in paths:
        r = json.loads(Path(p).read_text())
        base = base or r
        for row in r["rows"]:
            rows[(row["config"],) + _key(row)] = row
        for s in r.get("steps") or []:
            steps[step_key(s)] = s
        for e in r.get("lossless") or []:
            same[(e["batch"], e["config"])] = e
        if r.get("sampling_check"):
            extra["sampling_check"] = r["sampling_check"]
        extra["servers"] += r.get("servers") or []
        extra["skipped"] += r.get("skipped") or []
    result = {**base, **extra,
              "rows": sorted(rows.values(), key=lambda r: (_key(r), config_order(r["config"]))),
              "merged_from": [Path(p).name for p in paths]}
    if steps:
        result["steps"] = [steps[k] for k in sorted(steps, key=lambda k: (k[1], k[2], k[3:], config_order(k[0])))]
    if same:
        result["lossless"] = [same[k] for k in sorted(same, key=lambda k: (k[0], config_order(k[1])))]
    write(finish(result), out)
    plot(result, out.with_suffix(".png"))
    print("\n".join(summary_lines(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
