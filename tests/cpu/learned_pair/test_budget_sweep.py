# SPDX-License-Identifier: Apache-2.0
"""benchmarks/budget_sweep.py's client against local fake OpenAI servers: the dflash client's
metric definitions, meta_info at either place, ratios, the lossless check with its margin
diagnosis, the deadline, the JSON and PNG, and bad input."""

from __future__ import annotations

import argparse

import json
import math
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from benchmarks import budget_sweep as bs

STEP_S = 0.005  # per verify step: large against a loaded machine's HTTP overhead, so the ratios hold


def _tokens(prompt: str, n: int) -> list[int]:
    seed = sum(map(ord, prompt))
    return [(seed * 31 + 7 * i) % 500 + 3 for i in range(n)]


class FakeOpenAI(BaseHTTPRequestHandler):
    """One server: ``cfg`` says its algorithm, accept length, where meta_info goes, and whether
    its output differs from the target's somewhere."""

    cfg: dict = {}

    def log_message(self, *a):
        pass

    def _send(self, obj, code=200):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        c = self.cfg
        if self.path == "/metrics" and c.get("registry") is not None:
            data = generate_latest(c["registry"])
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/v1/models":
            self._send({"data": [{"id": "learned-target"}]})
        elif self.path == "/server_info":
            self._send({"speculative_algorithm": c["algo"], "speculative_ddtree_budget": c.get("budget"),
                        "speculative_ddtree_tree": c.get("tree", "marginals")})
        else:
            self._send({"error": "no"}, 404)

    def do_POST(self):
        c = self.cfg
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        c.setdefault("requests", []).append(body)
        if c.get("log") is not None:  # shared by the servers of a test: the order they were asked in
            c["log"].append((c["who"], body.get("max_tokens")))
        if self.path == "/generate":  # the margin question of the lossless check
            self._send({"meta_info": {"output_top_logprobs": [[[-0.60, 111, None], [-0.62, 222, None]]]}})
            return
        assert self.path == "/v1/chat/completions"
        assert body["return_meta_info"] is True and body["model"] == "learned-target"
        n = body["max_tokens"]
        prompt = body["messages"][0]["content"]
        toks = _tokens(prompt, n)
        if c.get("diverge") and prompt == "p0" and body["temperature"] == 0 and n > 10:
            toks[5] = 222
        tau = c.get("tau", 1.0)
        steps = math.ceil(n / tau)
        time.sleep(steps * STEP_S)
        choice = {"index": 0, "message": {"role": "assistant", "content": " ".join(map(str, toks))},
                  "finish_reason": "length"}
        if body.get("return_token_ids"):
            choice["token_ids"], choice["prompt_token_ids"] = toks, [1, 2, 3]
        resp = {"choices": [choice], "usage": {"completion_tokens": n, "prompt_tokens": 3}}
        if c.get("registry") is not None:  # DDTREE's counters for these steps
            for _ in range(steps):
                c["steps_counter"].labels(model_name="m").observe(1)
            for b, tau_b in c["at_budget"].items():
                share = 1.0  # of the request steps that ran at budget b or above
                if c.get("steps_at_counter") is not None:  # an adaptive server: fewer steps at large budgets
                    share = 1.0 if b <= 8 else 0.5
                    c["steps_at_counter"].labels(model_name="m", budget=str(b)).inc(steps * share)
                c["at_counter"].labels(model_name="m", budget=str(b)).inc(steps * share * (tau_b - 1))
        if c["algo"] != "NONE":
            meta = {"spec_verify_ct": steps, "spec_accept_length": n / steps, "completion_tokens": n}
            if c.get("meta_in_choice"):
                choice["meta_info"] = meta
            else:
                resp["meta_info"] = meta
        self._send(resp)


@pytest.fixture
def fakes():
    servers, threads = {}, []

    def start(name, **cfg):
        handler = type(f"Fake_{name}", (FakeOpenAI,), {"cfg": cfg})
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        t = threading.Thread(target=httpd.serve_forever, daemon=True)
        t.start()
        servers[name] = (httpd, handler)
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    yield start, servers
    for httpd, _ in servers.values():
        httpd.shutdown()


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": f"p{i}"}) for i in range(6)) + "\n")
    return p


def test_load_prompts_formats_and_errors(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"prompt": "x", "prompt_ids": [1, 2]}\n\n{"messages": [{"role": "user", "content": "y"}]}\n'
                 '{"turns": ["z", "second turn ignored"]}\n')
    got = bs.load_prompts(p)
    assert [g["messages"][0]["content"] for g in got] == ["x", "y", "z"]
    assert got[0]["prompt_ids"] == [1, 2] and got[1]["prompt_ids"] is None
    for bad, msg in [('{"prompt": 3}', "expected 'prompt'"), ("not json", "not JSON"), ("[1]", "expected an object"),
                     ('{"prompt": "x", "prompt_ids": ["a"]}', "prompt_ids")]:
        p.write_text(bad + "\n")
        with pytest.raises(SystemExit, match=msg):
            bs.load_prompts(p)
    p.write_text("\n")
    with pytest.raises(SystemExit, match="no prompts"):
        bs.load_prompts(p)


def test_sweep_metrics_are_the_dflash_clients(fakes, prompts, tmp_path):
    start, servers = fakes
    urls = {
        "nospec": start("nospec", algo="NONE"),
        "dflash": start("dflash", algo="DFLASH", tau=4.0),
        "ddtree16": start("ddtree16", algo="DDTREE", budget=16, tau=6.0, meta_in_choice=True),  # upstream's place
        "ddtree64": start("ddtree64", algo="DDTREE", budget=64, tau=8.0, diverge=True),
    }
    argv = ["--prompts", str(prompts), "--server", f"nospec={urls['nospec']}", "--server", f"dflash={urls['dflash']}",
            "--server", urls["ddtree16"], "--server", urls["ddtree64"],  # labels from /server_info
            "--batch", "1,2", "--temperature", "0,1", "--num-prompts", "4", "--max-new-tokens", "48",
            "--tag", "t", "--out-dir", str(tmp_path)]
    assert bs.main(argv) == 0
    r = json.loads((tmp_path / "budget_sweep_t.json").read_text())
    assert (tmp_path / "budget_sweep_t.png").stat().st_size > 1000
    assert [s["config"] for s in r["servers"]] == ["nospec", "dflash", "ddtree16", "ddtree64"]
    rows = {(x["config"], x["batch"], x["temperature"]): x for x in r["rows"]}
    assert len(rows) == 16 and not r["skipped"]
    for (config, batch, t), row in rows.items():
        recs = row["records"]
        assert len(recs) == 4 and row["output_tokens"] == 4 * 48
        # dflash benchmark openai: throughput = completion tokens / wall; accept length = mean of
        # the per-request spec_accept_length; spec_verify_ct summed
        assert row["throughput_tok_s"] == pytest.approx(row["output_tokens"] / row["wall_s"])
        if config == "nospec":
            assert row["accept_length"] is None and row["spec_verify_ct"] == 0
        else:
            assert row["accept_length"] == pytest.approx(statistics.mean(x["spec_accept_length"] for x in recs))
            tau = {"dflash": 4.0, "ddtree16": 6.0, "ddtree64": 8.0}[config]
            assert row["accept_length"] == pytest.approx(48 / math.ceil(48 / tau))
            assert row["spec_verify_ct"] == 4 * math.ceil(48 / tau)
    # warm-up: `batch` requests of at most 64 tokens before each run, as dflash
    sent = servers["dflash"][1].cfg["requests"]
    # 4 points x 4 prompts, and the warm-ups (1 per bs-1 point, 2 per bs-2 point) capped at 48
    assert sum(1 for b in sent if b["max_tokens"] == 48) == 4 * 4 + 2 * (1 + 2)
    # token ids only asked at T=0, for the lossless check
    assert all(bool(b.get("return_token_ids")) == (b["temperature"] == 0) for b in sent)
    # ratios against no speculation and DFLASH of the same point
    point = next(p for p in r["ratios"] if p["batch"] == 1 and p["temperature"] == 0)
    e = point["configs"]["ddtree64"]
    assert e["speedup_vs_nospec"] == pytest.approx(rows[("ddtree64", 1, 0)]["throughput_tok_s"]
                                                   / rows[("nospec", 1, 0)]["throughput_tok_s"])
    assert e["accept_vs_dflash"] == pytest.approx(rows[("ddtree64", 1, 0)]["accept_length"]
                                                  / rows[("dflash", 1, 0)]["accept_length"])
    assert e["speedup_vs_dflash"] > 1.2 and point["best_ddtree"] == "ddtree64"
    # the budget choice: tokens/s over DFLASH, geometric mean over the four points
    choice = r["budget_choice"]
    assert choice["points"] == 4 and choice["best"] == "ddtree64"
    ratios64 = [rows[("ddtree64", b, t)]["throughput_tok_s"] / rows[("dflash", b, t)]["throughput_tok_s"]
                for b in (1, 2) for t in (0.0, 1.0)]
    assert choice["by_budget"]["ddtree64"]["geomean_vs_dflash"] == pytest.approx(math.prod(ratios64) ** 0.25)
    # lossless: ddtree64 differs on prompt 0 at token 5, a near tie of the target (margin 0.02)
    loss = {(x["batch"], x["config"]): x for x in r["lossless"]}
    assert loss[(1, "dflash")]["identical"] == 4 and not loss[(1, "dflash")]["differ"]
    d = loss[(1, "ddtree64")]["differ"]
    assert len(d) == 1 and d[0]["prompt"] == 0 and d[0]["first_difference"] == 5 and d[0]["spec_token"] == 222
    assert d[0]["margin_nats"] == pytest.approx(0.02) and d[0]["near_tie"] is True
    gen = [b for b in servers["nospec"][1].cfg["requests"] if "input_ids" in b]
    assert gen and gen[0]["input_ids"][:3] == [1, 2, 3] and len(gen[0]["input_ids"]) == 3 + 5
    # the texts and ids stay out of the JSON
    assert all("text" not in x and "token_ids" not in x for row in r["rows"] for x in row["records"])


def test_more_waves_at_larger_batches(fakes, prompts, tmp_path):
    """--num-prompts 2 --min-waves 3: each run sends 3 prompts per client (3 at batch 1, 6 at
    batch 2, 12 at batch 4, the file's six again in order), never fewer than --num-prompts."""
    assert [x["prompt"] for x in bs.point_prompts([{"prompt": i} for i in range(3)], 2, 2, 3)] == [0, 1, 2, 0, 1, 2]
    start, servers = fakes
    url = start("nospec", algo="NONE")
    argv = ["--prompts", str(prompts), "--server", f"nospec={url}", "--batch", "1,2,4", "--temperature", "0",
            "--num-prompts", "2", "--min-waves", "3", "--max-new-tokens", "8", "--tag", "w",
            "--out-dir", str(tmp_path)]
    assert bs.main(argv) == 0
    r = json.loads((tmp_path / "budget_sweep_w.json").read_text())
    assert {x["batch"]: x["num_prompts"] for x in r["rows"]} == {1: 3, 2: 6, 4: 12}
    for row in r["rows"]:  # each repeat's closed-loop rate beside a kept-full batch's (Little's law)
        (rep,) = row["repeat_stats"]
        assert rep["throughput_tok_s"] == pytest.approx(row["throughput_tok_s"])
        assert rep["latency_sum_s"] == pytest.approx(sum(x["latency_s"] for x in row["records"]))
        assert rep["full_batch_tok_s"] == pytest.approx(row["batch"] * row["output_tokens"] / rep["latency_sum_s"])
    sent = [b for b in servers["nospec"][1].cfg["requests"] if b["max_tokens"] == 8]
    assert len(sent) == 3 + 6 + 12 + (1 + 2 + 4)  # the runs, and each run's warm-up
    with pytest.raises(SystemExit):
        bs.main(argv[:-4] + ["--min-waves", "0"] + argv[-4:])


def test_accept_length_at_smaller_budgets_from_the_servers_counters(fakes, prompts, tmp_path):
    """A DDTREE server's /metrics (prometheus_client's exposition of the counters
    speculative/ddtree/metrics.py exports) gives each run the accept length of every smaller
    budget on the same requests: warm-ups before the first snapshot do not count."""
    start, servers = fakes
    registry = CollectorRegistry()
    at_budget = {1: 1.6, 2: 2.1, 4: 2.9, 8: 3.7, 16: 4.4, 32: 5.2}
    cfg = dict(registry=registry, at_budget=at_budget,
               steps_counter=Histogram("sglang:ddtree_accepted_depth", "d", ["model_name"], registry=registry,
                                       buckets=(1, 2)),
               at_counter=Counter("sglang:ddtree_accepted_drafts_at_budget", "d", ["model_name", "budget"],
                                  registry=registry))  # fmt: skip
    url = start("ddtree32", algo="DDTREE", budget=32, tau=5.2, **cfg)
    plain = start("ddtree16", algo="DDTREE", budget=16, tau=4.4)  # no metrics: no curve, no error
    registry2 = CollectorRegistry()
    adaptive = start("ddtree32-adaptive", algo="DDTREE", budget=32, tau=5.2, registry=registry2, at_budget=at_budget,
                     steps_counter=Histogram("sglang:ddtree_accepted_depth", "d", ["model_name"], registry=registry2,
                                             buckets=(1, 2)),
                     at_counter=Counter("sglang:ddtree_accepted_drafts_at_budget", "d", ["model_name", "budget"],
                                        registry=registry2),
                     steps_at_counter=Counter("sglang:ddtree_request_steps_at_budget", "d", ["model_name", "budget"],
                                              registry=registry2))  # fmt: skip
    argv = ["--prompts", str(prompts), "--server", url, "--server", plain, "--server", f"ddtree32-adaptive={adaptive}",
            "--batch", "1,2", "--temperature", "0", "--num-prompts", "4", "--max-new-tokens", "40", "--tag", "ab",
            "--out-dir", str(tmp_path)]  # fmt: skip
    assert bs.main(argv) == 0
    r = json.loads((tmp_path / "budget_sweep_ab.json").read_text())
    assert not r["skipped"], [x.get("reason") for x in r["skipped"]]
    rows = {(x["config"], x["batch"]): x for x in r["rows"]}
    for batch in (1, 2):
        got = rows[("ddtree32", batch)]["accept_length_at_budget"]
        assert got == pytest.approx({str(b): t for b, t in at_budget.items()})
        assert "accept_length_at_budget" not in rows[("ddtree16", batch)]
        # per budget over the steps run at it or above (half the steps above budget 8)
        got = rows[("ddtree32-adaptive", batch)]["accept_length_at_budget"]
        assert got == pytest.approx({str(b): t for b, t in at_budget.items()})
    point = next(p for p in r["ratios"] if p["batch"] == 1)
    assert point["configs"]["ddtree32"]["accept_length_at_budget"]["8"] == pytest.approx(3.7)
    assert bs.budget_counters("no counters here\n") is None
    assert bs.accept_at_budget(None, {"steps": 1, "at_budget": {1: 1.0}}) is None


def test_repeats_keep_the_median_and_deadline_skips(fakes, prompts, tmp_path, capsys):
    start, _ = fakes
    u = start("a", algo="NONE")
    argv = ["--prompts", str(prompts), "--server", f"nospec={u}", "--batch", "1", "--temperature", "0",
            "--num-prompts", "2", "--max-new-tokens", "20", "--repeats", "3", "--tag", "r", "--out-dir", str(tmp_path)]
    assert bs.main(argv) == 0
    row = json.loads((tmp_path / "budget_sweep_r.json").read_text())["rows"][0]
    assert len(row["throughput_runs"]) == 3 and row["throughput_tok_s"] == statistics.median(row["throughput_runs"])
    # every point skipped: written, but a failed run (on the GPU host: servers that never came up)
    assert bs.main(argv[:-4] + ["--deadline-s", "1", "--tag", "d", "--out-dir", str(tmp_path)]) == 1
    assert "no point was measured" in capsys.readouterr().err
    d = json.loads((tmp_path / "budget_sweep_d.json").read_text())
    assert not d["rows"] and d["skipped"] and "estimated" in d["skipped"][0]["reason"]


@pytest.mark.parametrize("order", ["interleaved", "grouped"])
def test_repeats_take_turns_across_the_servers(order, fakes, prompts, tmp_path):
    """Interleaved (the default), a point's repeats go one run per server per round, so drift on
    the host during a point weighs on every server alike; grouped, one server's runs go back to
    back. Each run is the batch's warm-up (at most 64 tokens) and then the measured prompts."""
    start, _ = fakes
    log = []
    a = start("a", algo="NONE", who="a", log=log)
    b = start("b", algo="DFLASH", tau=2.0, who="b", log=log)
    argv = ["--prompts", str(prompts), "--server", f"nospec={a}", "--server", f"dflash={b}", "--batch", "1",
            "--temperature", "0", "--num-prompts", "2", "--max-new-tokens", "80", "--repeats", "3",
            "--tag", order, "--out-dir", str(tmp_path)] + (["--order", order] if order == "grouped" else [])
    assert bs.main(argv) == 0
    measured = [name for name, tokens in log if tokens == 80]
    runs = ["a", "b"] * 3 if order == "interleaved" else ["a"] * 3 + ["b"] * 3
    assert measured == [name for name in runs for _ in range(2)]
    assert [tokens for _, tokens in log].count(64) == 6  # one warm-up request per run
    rows = json.loads((tmp_path / f"budget_sweep_{order}.json").read_text())["rows"]
    assert [(x["config"], x["repeats"], len(x["throughput_runs"]), x["order"]) for x in rows] == [
        ("nospec", 3, 3, order), ("dflash", 3, 3, order)]
    # interleaved, each round's ratio is kept beside the ratio of the medians
    point = json.loads((tmp_path / f"budget_sweep_{order}.json").read_text())["ratios"][0]["configs"]["dflash"]
    runs = {x["config"]: x["throughput_runs"] for x in rows}
    if order == "interleaved":
        assert point["speedup_vs_nospec_rounds"] == pytest.approx([x / y for x, y in zip(runs["dflash"], runs["nospec"])])
    else:
        assert "speedup_vs_nospec_rounds" not in point
    assert bs.point_rounds(["a", "b"], 2, "interleaved") == ["a", "b", "a", "b"]
    assert bs.point_rounds(["a", "b"], 2, "grouped") == ["a", "a", "b", "b"]


def test_report_merges_runs(fakes, prompts, tmp_path):
    start, _ = fakes
    a = start("a", algo="NONE")
    b = start("b", algo="DDTREE", budget=8, tau=3.0)
    common = ["--prompts", str(prompts), "--batch", "1", "--temperature", "0", "--num-prompts", "2",
              "--max-new-tokens", "12", "--out-dir", str(tmp_path)]
    bs.main(common + ["--server", f"nospec={a}", "--tag", "x"])
    bs.main(common + ["--server", f"ddtree8={b}", "--tag", "y"])
    assert bs.main(["--report", str(tmp_path / "budget_sweep_x.json"), str(tmp_path / "budget_sweep_y.json"),
                    "--tag", "xy", "--out-dir", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "budget_sweep_xy.json").read_text())
    assert [x["config"] for x in r["rows"]] == ["nospec", "ddtree8"]
    assert r["ratios"][0]["configs"]["ddtree8"]["speedup_vs_nospec"] > 1.5



def test_report_merges_steps_lossless_and_sampling_of_two_calls(tmp_path):
    """Batch 1 and batch 8 measured in two calls: the merged report keeps both calls' rows, step
    times, lossless entries and the one sampling check."""
    def row(config, batch, tps):
        kind, budget = bs.parse_config(config)
        return {"config": config, "kind": kind, "budget": budget, "batch": batch, "temperature": 0.0,
                "top_p": 1.0, "top_k": 0, "throughput_tok_s": tps, "accept_length": None if kind == "nospec" else 3.0,
                "records": []}

    def step(config, batch, ms, **sampling):
        return {"config": config, "ctx": 512, "batch": batch, "ms_per_step": ms, **sampling}

    a = {"what": "sweep", "date": "2026-12-02", "device": "GPU", "servers": [{"config": "nospec"}], "skipped": [],
         "rows": [row("nospec", 1, 100.0), row("ddtree16", 1, 150.0)],
         "steps": [step("nospec", 1, 1.0), step("ddtree16", 1, 3.0)],
         "lossless": [{"batch": 1, "config": "ddtree16", "prompts": 4, "identical": 4, "differ": []}]}
    b = {"what": "sweep", "date": "2026-12-02", "device": "GPU", "servers": [{"config": "nospec"}],
         "skipped": [{"what": "step time", "reason": "off"}],
         "rows": [row("nospec", 8, 400.0), row("ddtree16", 8, 500.0)],
         # a sampled step beside the greedy one of a (its own row), a greedy one replacing a's
         "steps": [step("ddtree16", 1, 4.0, temperature=1.0, top_p=1.0, top_k=0), step("nospec", 1, 1.1)],
         "lossless": [{"batch": 8, "config": "ddtree16", "prompts": 4, "identical": 3, "differ": [{"prompt": 2}]}],
         "sampling_check": {"verdict": {"reject": False}}}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert bs.main(["--report", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--tag", "ab",
                    "--out-dir", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "budget_sweep_ab.json").read_text())
    assert [(x["config"], x["batch"]) for x in r["rows"]] == [("nospec", 1), ("ddtree16", 1), ("nospec", 8),
                                                              ("ddtree16", 8)]
    assert [(s["config"], s["batch"], s.get("temperature", 0.0), s["ms_per_step"]) for s in r["steps"]] == [
        ("nospec", 1, 0.0, 1.1), ("ddtree16", 1, 0.0, 3.0), ("ddtree16", 1, 1.0, 4.0)]
    assert [(e["batch"], e["identical"]) for e in r["lossless"]] == [(1, 4), (8, 3)]
    assert r["sampling_check"]["verdict"] == {"reject": False} and len(r["skipped"]) == 1
    assert r["merged_from"] == ["a.json", "b.json"] and len(r["servers"]) == 2
    assert [p["batch"] for p in r["ratios"]] == [1, 8]

def test_bad_servers_and_flags(fakes, prompts, tmp_path):
    start, _ = fakes
    u = start("a", algo="EAGLE")
    base = ["--prompts", str(prompts), "--out-dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="EAGLE"):
        bs.main(base + ["--server", u])
    with pytest.raises(SystemExit, match="server label"):
        bs.main(base + ["--server", f"tree={u}"])
    with pytest.raises(SystemExit, match="two servers with one label"):
        bs.main(base + ["--server", f"nospec={u}", "--server", f"nospec={u}"])
    with pytest.raises(SystemExit, match="no label given"):
        bs.main(base + ["--server", "http://127.0.0.1:9"])
    with pytest.raises(SystemExit):
        bs.main(base + ["--server", f"nospec={u}", "--batch", "0"])
    with pytest.raises(SystemExit, match="has only"):
        bs.main(base + ["--server", f"nospec={u}", "--num-prompts", "99"])


def test_launch_args():
    a = bs.launch_args("ddtree32", "/d", [1, 8], ["--foo"])
    assert a[a.index("--speculative-algorithm") + 1] == "DDTREE" and a[a.index("--speculative-ddtree-budget") + 1] == "32"
    assert a[a.index("--cuda-graph-bs-decode") + 1: a.index("--cuda-graph-bs-decode") + 3] == ["1", "8"]
    assert "--disable-overlap-schedule" not in a and "--disable-cuda-graph" not in a and "--foo" in a
    assert "--speculative-algorithm" not in bs.launch_args("nospec", None, [1], [])
    assert bs.launch_args("dflash", "/d", [1], [])[-3:] == ["DFLASH", "--speculative-draft-model-path", "/d"]
    with pytest.raises(SystemExit, match="draft-model-path"):
        bs.launch_args("dflash", None, [1], [])
    t = bs.launch_args("ddtree16-transitions", "/d2", [1], [])
    assert t[-5:] == ["--speculative-ddtree-budget", "16", "--enable-metrics", "--speculative-ddtree-tree",
                      "transitions"]
    assert "--enable-metrics" in a and "--enable-metrics" not in bs.launch_args("dflash", "/d", [1], [])
    assert "--speculative-ddtree-tree" not in a
    assert bs.parse_config("ddtree16-transitions") == ("ddtree", 16)
    ad = bs.launch_args("ddtree64-adaptive", "/d", [1, 8], [])
    assert ad[-5:] == ["--speculative-ddtree-budget", "64", "--enable-metrics", "--speculative-ddtree-budget-policy",
                       "adaptive"]  # fmt: skip
    assert bs.parse_config("ddtree16-transitions-adaptive") == ("ddtree", 16)
    assert bs.label_from_server_info({"speculative_algorithm": "DDTREE", "speculative_ddtree_budget": 64,
                                      "speculative_ddtree_budget_policy": "adaptive"}) == "ddtree64-adaptive"
    gr = bs.launch_args("ddtree64-adaptive-graphs4.16", "/d", [1, 8], [])
    assert gr[-4:] == ["--speculative-ddtree-budget-policy", "adaptive", "--speculative-ddtree-graph-budgets", "4,16"]
    assert bs.parse_config("ddtree64-adaptive-graphs16") == ("ddtree", 64)
    assert bs.label_from_server_info({"speculative_algorithm": "DDTREE", "speculative_ddtree_budget": 64,
                                      "speculative_ddtree_budget_policy": "adaptive",
                                      "speculative_ddtree_graph_budgets": "4,16"}) == "ddtree64-adaptive-graphs4.16"
    assert sorted(["ddtree64-adaptive", "ddtree64", "ddtree16", "dflash"], key=bs.config_order) == [
        "dflash", "ddtree16", "ddtree64", "ddtree64-adaptive"]
    for bad in ("dflash-transitions", "nospec-transitions", "ddtree16-marginals", "dflash-adaptive",
                "ddtree16-adaptive-transitions", "ddtree64-graphs16", "ddtree64-adaptive-graphs", "ddtree64-adaptive-graphs0"):
        with pytest.raises(SystemExit, match="expected nospec, dflash or ddtree<budget>"):
            bs.parse_config(bad)


def test_a_second_drafter_by_label():
    """``-with-NAME`` servers load ``--extra-drafter NAME=PATH``: a DFlash and a DFlash 2
    drafter of one target measured in one sweep."""
    drafters = {"dflash1": "/d1"}
    assert bs.launch_args("dflash", "/d2", [1], [], drafters)[-2:] == ["--speculative-draft-model-path", "/d2"]
    assert bs.launch_args("dflash-with-dflash1", "/d2", [1], [], drafters)[-2:] == [
        "--speculative-draft-model-path", "/d1"]
    t = bs.launch_args("ddtree16-transitions-with-dflash1", "/d2", [1], [], drafters)
    assert t[t.index("--speculative-draft-model-path") + 1] == "/d1" and t[-1] == "transitions"
    assert bs.parse_config("ddtree64-adaptive-graphs16-with-d_1") == ("ddtree", 64)
    assert bs.drafter_name("ddtree16") is None and bs.drafter_name("dflash-with-dflash1") == "dflash1"
    assert sorted(["dflash-with-dflash1", "ddtree16", "dflash"], key=bs.config_order) == [
        "dflash", "dflash-with-dflash1", "ddtree16"]
    with pytest.raises(SystemExit, match="--extra-drafter other=PATH"):
        bs.launch_args("dflash-with-other", "/d2", [1], [], drafters)
    for bad in ("nospec-with-dflash1", "dflash-with-", "dflash-with-D1", "ddtree16-with-d1-transitions"):
        with pytest.raises(SystemExit, match="expected nospec, dflash or ddtree<budget>"):
            bs.parse_config(bad)


@pytest.mark.parametrize("item", ["dflash1", "=/d", "D1=/d", "d1="])
def test_extra_drafter_refuses_what_is_not_name_equals_path(item, prompts, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bs.main(["--prompts", str(prompts), "--launch", "--model-path", "/t", "--extra-drafter", item,
                 "--out-dir", str(tmp_path)])
    assert "expected NAME=PATH" in capsys.readouterr().err


def test_sampling_check_refuses_a_ddtree_server_it_would_not_start(prompts, tmp_path, capsys):
    """A sampling check whose --sampling-ddtree is not launched would compare no DDTREE server."""
    with pytest.raises(SystemExit):
        bs.main(["--prompts", str(prompts), "--launch", "--model-path", "/t", "--draft-model-path", "/d",
                 "--configs", "nospec,dflash,ddtree16-transitions", "--sampling-check", "--out-dir", str(tmp_path)])
    assert "--sampling-ddtree ddtree16 is not among --configs" in capsys.readouterr().err


@pytest.mark.parametrize("given, named", [("dflash,ddtree64", "ddtree64"), ("nospec,dflash", "nospec"),
                                          (",", "(none)")])
def test_sampling_configs_must_be_launched_speculative_servers(given, named, prompts, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bs.main(["--prompts", str(prompts), "--launch", "--model-path", "/t", "--draft-model-path", "/d",
                 "--configs", "nospec,dflash,ddtree16", "--sampling-check", "--sampling-configs", given,
                 "--out-dir", str(tmp_path)])
    assert f"--sampling-configs {named}: the sampling check compares launched" in capsys.readouterr().err


def test_trees_from_transitions_sweep_beside_marginal_trees(fakes, prompts, tmp_path):
    """A DDTREE server growing its tree from a DFlash 2 selector's transitions is labelled
    ddtree<B>-transitions from /server_info, compared with the marginal tree of its budget,
    and drawn as its own line."""
    start, _ = fakes
    argv = ["--prompts", str(prompts), "--server", start("n", algo="NONE"), "--server", start("d", algo="DFLASH", tau=3.0),
            "--server", start("m", algo="DDTREE", budget=16, tau=4.0),
            "--server", start("t", algo="DDTREE", budget=16, tau=5.0, tree="transitions"),
            "--batch", "1", "--temperature", "0", "--num-prompts", "2", "--max-new-tokens", "24",
            "--tag", "tr", "--out-dir", str(tmp_path)]  # fmt: skip
    assert bs.main(argv) == 0
    r = json.loads((tmp_path / "budget_sweep_tr.json").read_text())
    assert [x["config"] for x in r["rows"]] == ["nospec", "dflash", "ddtree16", "ddtree16-transitions"]
    configs = r["ratios"][0]["configs"]
    assert configs["ddtree16-transitions"]["accept_length"] > configs["ddtree16"]["accept_length"]
    assert (tmp_path / "budget_sweep_tr.png").stat().st_size > 1000


# ---------------------------------------------------------------------------------------------
# Launch mode: the real harness (tests/gpu/conftest.py ServerProcess) with a stand-in server
# program in place of sglang.launch_server, so the whole --launch run (starts, sweep, step times
# through benchmarks/e2e_step.py, sampling check, lossless check) runs here.

STAND_IN = '''
import argparse, json, math, random, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int)
ap.add_argument("--model-path")
ap.add_argument("--speculative-algorithm", default="NONE")
ap.add_argument("--speculative-ddtree-budget", type=int, default=16)
ap.add_argument("--enable-metrics", action="store_true")
args, _ = ap.parse_known_args()
TAU = {"NONE": 1.0, "DFLASH": 3.0, "DDTREE": 3.0 + math.log2(args.speculative_ddtree_budget) / 2}[args.speculative_algorithm]
B = args.speculative_ddtree_budget
TIERS = [2 ** i for i in range(B.bit_length()) if 2 ** i < B] + [B]
# DDTREE's counters, as its stats publish them: request steps, and drafts accepted under each
# budget (commit 1 + (TAU - 1) * log2(b + 1) / log2(B + 1) per step at budget b)
counted = {"steps": 0, "at": {b: 0.0 for b in TIERS}}
SERVE_METRICS = (args.enable_metrics and args.speculative_algorithm == "DDTREE"
                 and __import__("os").environ.get("SGLANG_DDTREE_STATS_INTERVAL") == "32")
STEP = 0.001
lock = threading.Lock()
# Sampling requests draw from a generator of their own: the server, the request's size and
# how many of that size came before (the sampling check's threads reorder equal-sized
# requests, which leaves the counts it tests unchanged), so a run's p-values are reproducible.
sized = {}

def tokens(seed, n):
    return [(seed * 31 + 7 * i) % 500 + 3 for i in range(n)]

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def send(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path == "/health":
            self.send({})
        elif self.path == "/v1/models":
            self.send({"data": [{"id": args.model_path}]})
        elif self.path == "/metrics" and SERVE_METRICS:
            with lock:
                lines = ['sglang:ddtree_accepted_depth_count{model_name="m"} %d' % counted["steps"]]
                lines += ['sglang:ddtree_accepted_drafts_at_budget_total{budget="%d",model_name="m"} %r' % (b, x)
                          for b, x in counted["at"].items()]
            data = ("\\n".join(lines) + "\\n").encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self.send_response(404); self.send_header("Content-Length", "0"); self.end_headers()
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/chat/completions":
            n = body["max_tokens"]
            steps = math.ceil(n / TAU)
            time.sleep(steps * STEP)
            toks = tokens(len(body["messages"][0]["content"]), n)
            choice = {"message": {"content": str(toks)}, "finish_reason": "length"}
            if body.get("return_token_ids"):
                choice["token_ids"], choice["prompt_token_ids"] = toks, [1, 2]
            resp = {"choices": [choice], "usage": {"completion_tokens": n}}
            if args.speculative_algorithm != "NONE":
                resp["meta_info"] = {"spec_verify_ct": steps, "spec_accept_length": n / steps}
            with lock:
                counted["steps"] += steps
                for b in TIERS:
                    counted["at"][b] += steps * (TAU - 1) * math.log2(b + 1) / math.log2(B + 1)
            self.send(resp)
        elif body.get("stream"):  # e2e_step.measure: one chunk per step
            n = body["sampling_params"]["max_new_tokens"]
            # a sampled step costs twice a greedy one here, so the step rows show which they timed
            step_s = STEP * (3 if body["sampling_params"].get("temperature", 0) > 0 else 1)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            done = 0
            try:
                for step in range(1, n + 1):
                    time.sleep(step_s)
                    done = min(n, round(step * TAU))
                    meta = {"completion_tokens": done, "spec_verify_ct": step}
                    self.wfile.write(f"data: {json.dumps({'meta_info': meta})}\\n\\n".encode())
                    self.wfile.flush()
                    if done >= n:
                        break
                self.wfile.write(b"data: [DONE]\\n\\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            self.close_connection = True
        else:  # sampling: the same distribution on every server
            k = body["sampling_params"]["max_new_tokens"]
            n = len(body["input_ids"])
            with lock:
                nth = sized[n] = sized.get(n, -1) + 1
            rng = random.Random(f"{args.speculative_algorithm}-{B}-{n}-{nth}")
            out = [{"output_ids": [rng.choices(range(5), weights=[5, 3, 2, 1, 1])[0] for _ in range(k)]}
                   for _ in body["input_ids"]]
            self.send(out)

ThreadingHTTPServer(("127.0.0.1", args.port), H).serve_forever()
'''


def test_launch_mode_end_to_end_with_stand_in_servers(tmp_path, monkeypatch, prompts):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("ddtree_gpu_harness_l", bs.REPO / "tests" / "gpu" / "conftest.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    monkeypatch.setattr(harness.ServerProcess, "launcher", (sys.executable, str(script)))
    real = bs._sibling
    monkeypatch.setattr(bs, "_sibling", lambda name, path: harness if name == "ddtree_gpu_harness" else real(name, path))
    model = tmp_path / "target"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 512}))
    sp = tmp_path / "sampling.json"
    sp.write_text(json.dumps([{"prompt_ids": [1, 2, 3]}]))
    argv = ["--launch", "--model-path", str(model), "--draft-model-path", str(tmp_path / "drafter"),
            "--configs", "nospec,dflash,ddtree4,ddtree16", "--prompts", str(prompts), "--batch", "1,2",
            "--temperature", "0,1", "--num-prompts", "3", "--max-new-tokens", "24", "--step-ctx", "64",
            "--sampling-check", "--sampling-prompts", str(sp), "--sampling-samples", "300",
            "--sampling-configs", "dflash,ddtree4,ddtree16",
            "--sampling-boundary-delta", "0", "--deadline-s", "900", "--start-timeout-s", "240", "--log-dir", str(tmp_path / "logs"),
            "--tag", "launch", "--out-dir", str(tmp_path)]
    assert bs.main(argv) == 0
    r = json.loads((tmp_path / "budget_sweep_launch.json").read_text())
    assert [s["config"] for s in r["servers"]] == ["nospec", "dflash", "ddtree4", "ddtree16"]
    assert "--speculative-ddtree-budget" in r["servers"][3]["args"]
    assert len(r["rows"]) == 4 * 4 and not r["skipped"], r["skipped"]
    # the step times of every server at both batch sizes and both temperatures, as e2e_step
    # measures them, the sampled ones with sampled requests (the stand-in's sampled step is slower)
    steps = {(s["config"], s["batch"], s["temperature"]): s for s in r["steps"]}
    assert len(steps) == len(r["steps"]) == 4 * 2 * 2
    assert set(steps) == {(c, b, t) for c in ("nospec", "dflash", "ddtree4", "ddtree16") for b in (1, 2)
                          for t in (0.0, 1.0)}
    assert all(0.5 < s["ms_per_step"] < 50 for s in steps.values())
    assert all(steps[(c, b, 1.0)]["ms_per_step"] > 1.5 * steps[(c, b, 0.0)]["ms_per_step"] for c, b, _ in steps)
    assert steps[("ddtree16", 1, 0.0)]["accept_length"] == pytest.approx(5.0, rel=0.1)
    # DDTREE servers run with metrics and a stats interval of 32: each run also gives the accept
    # length of every smaller budget (what the stand-in's counters say for its own traffic)
    for x in r["rows"]:
        at = x.get("accept_length_at_budget")
        if x["kind"] != "ddtree":
            assert at is None
            continue
        tau, b_max = 3.0 + math.log2(x["budget"]) / 2, x["budget"]
        want = {str(b): 1 + (tau - 1) * math.log2(b + 1) / math.log2(b_max + 1)
                for b in [1, 2, 4, 8, 16] if b <= b_max}
        assert at == pytest.approx(want), x["config"]
    sc = r["sampling_check"]
    # every server --sampling-configs names, in one check
    assert not sc["verdict"]["reject"] and {c["server"] for c in sc["comparisons"]} == {
        "nospec (second sample)", "nospec at 1.1x temperature (must differ)", "dflash", "ddtree4", "ddtree16"}
    assert (tmp_path / "budget_sweep_launch_sampling_samples.npz").stat().st_size > 0  # kept for --replay
    assert all(e["identical"] == 3 for e in r["lossless"])
    # batch 1 came first (and its lossless check), then the step times, batch 2, the sampling check
    order = [(x["batch"], x["temperature"]) for x in r["rows"]]
    assert order == sorted(order, key=lambda p: (p[0] != 1, p != (1, 0.0)))
    # and the cost model reads this sweep, its own-shape check from these step times
    from benchmarks import cost_model as cm

    own = cm.own_shape(r)
    assert {(o["config"], o["batch"], o["temperature"]) for o in own} == {
        (c, b, t) for c in ("nospec", "dflash", "ddtree4", "ddtree16") for b in (1, 2) for t in (0.0, 1.0)}
    assert all(o["step_temperature"] == o["temperature"] for o in own)



def test_the_sampling_checks_boundary_test_reads_the_target(tmp_path, prompts, capsys):
    """--sampling-boundary-delta: the check's ``decided`` comes from the target as transformers
    loads it, the filters in the order of the servers' sampling backend; settings it cannot
    judge are refused before any server starts."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "target")
    args = argparse.Namespace(model_path=str(tmp_path / "target"), sampling_positions=3, server_args="",
                              sampling_boundary_delta=0.0625, sampling_boundary_mass=0.02)
    decided = bs.boundary_test(args, [[1, 2, 3]])
    assert decided.backend == "flashinfer" and decided.delta == 0.0625 and decided.mass == 0.02
    samples = [[[5, 6, 7], [5, 8, 9]], [[5, 6, 1]]]
    flags = decided(0, samples, {"name": "x", "temperature": 0.7, "top_k": 5, "min_p": 0.05})
    assert set(flags) == {(), (5,), (5, 6), (5, 8)} and all(isinstance(v, bool) for v in flags.values())
    assert all(decided(0, samples, {"name": "y", "temperature": 1.0, "repetition_penalty": 1.1}).values())
    args.server_args = "--sampling-backend pytorch --mem-fraction-static 0.2"
    assert bs.boundary_test(args, [[1, 2, 3]]).backend == "pytorch"
    args.sampling_boundary_delta = 0
    assert bs.boundary_test(args, [[1]]) is None
    with pytest.raises(SystemExit):
        bs.main(["--launch", "--model-path", str(tmp_path / "target"), "--draft-model-path", "/d", "--sampling-check",
                 "--prompts", str(prompts), "--sampling-settings", "temperature=1:top_p=0.9:frequency_penalty=0.5"])
    assert "penalised logits" in capsys.readouterr().err
