# SPDX-License-Identifier: Apache-2.0
"""benchmarks/e2e_step.py's client side (concurrent streams, the bounded decode window, the
profiler handshake) against a local HTTP server that speaks SGLang's /generate stream and
/start_profile protocol, so the device run does not discover client bugs."""

import gzip
import importlib.util
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
from benchmarks import e2e_step as es

STEP_S = 0.01


def _harness():
    spec = importlib.util.spec_from_file_location("ddtree_gpu_harness_t", REPO / "tests" / "gpu" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Fake(BaseHTTPRequestHandler):
    """One SSE chunk per 'step'; /start_profile writes a trace after num_steps further steps."""

    state: dict = {}

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path == "/start_profile":
            self.state["profile"] = {"body": body, "left": body["num_steps"]}
            self._reply(b"Start profiling.\n")
        elif self.path == "/stop_profile":
            self.state["stopped_by_hand"] = True
            self._write_trace(self.state["profile"]["body"], steps=3)
            self._reply(b"Stop profiling.\n")
        elif self.path == "/generate":
            self.state.setdefault("prompts", []).append(len(body["input_ids"]))
            self.state.setdefault("sampling", []).append(body["sampling_params"])
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            n = body["sampling_params"]["max_new_tokens"]
            self.state.setdefault("max_new", []).append(n)
            if "serial_prefill_s" in self.state:  # one prefill at a time, as chunked prefill does
                with self.state["prefill_lock"]:
                    time.sleep(self.state["serial_prefill_s"])
            time.sleep(0.002 * len(body["input_ids"]) / 100)  # "prefill"
            try:
                for i in range(n):
                    time.sleep(STEP_S)
                    prof = self.state.get("profile")
                    if prof and prof["left"] is not None:
                        prof["left"] -= 1
                        if prof["left"] == 0:
                            self._write_trace(prof["body"], steps=prof["body"]["num_steps"])
                            prof["left"] = None
                    meta = {"completion_tokens": i + 1, "spec_verify_ct": i + 1}
                    self.wfile.write(f"data: {json.dumps({'meta_info': meta})}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
            except (BrokenPipeError, ConnectionResetError):
                self.state["aborted"] = self.state.get("aborted", 0) + 1

    def _write_trace(self, body, steps):
        ev = []
        for s in range(steps):
            ev.append({"ph": "X", "cat": "kernel", "name": "_tree_verify_split_kernel", "ts": 100.0 * s, "dur": 20})
            ev.append({"ph": "X", "cat": "kernel", "name": "fused_moe_kernel", "ts": 100.0 * s + 30, "dur": 60})
        path = Path(body["output_dir"]) / f"{body['profile_id']}-TP-0.trace.json.gz"
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": ev}, f)

    def _reply(self, data):
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server(tmp_path):
    Fake.state = {}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    proc = _harness().ServerProcess.__new__(_harness().ServerProcess)  # URL helpers only, no process
    proc.base_url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield proc
    httpd.shutdown()


def test_measure_concurrent_batch(server):
    r = es.measure(server, ctx=300, batch=4, new_tokens=30, vocab=512, seed=1, point_max_s=0)
    assert Fake.state["prompts"] == [300] * 4
    # every request streams past 30 chunks inside the common window, then all stop
    assert r["batch"] == 4 and r["completion_tokens"] > 120 and r["accept_length"] == 1.0
    assert STEP_S * 1000 * 0.8 < r["ms_per_step"] < STEP_S * 1000 * 3
    assert r["steps_measured"] >= 4 * 20


def test_measure_stops_at_the_time_bound_and_aborts(server):
    t0 = time.perf_counter()
    r = es.measure(server, ctx=100, batch=2, new_tokens=100000, vocab=512, seed=1, point_max_s=0.3)
    assert time.perf_counter() - t0 < 5  # 100000 steps would take 1000 s
    assert r["steps_measured"] >= 10
    time.sleep(STEP_S * 5)
    assert Fake.state.get("aborted") == 2  # both streams closed: the server aborts them


def test_batch_window_covers_requests_prefilled_one_after_another(server):
    """The last request starts decoding 0.6 s after the first; with a 20-token
    point the first ones keep decoding (cap BATCH_TOKEN_CAP) until every request
    has 20 steps inside the common window, then all are aborted."""
    Fake.state.update(serial_prefill_s=0.2, prefill_lock=threading.Lock())
    r = es.measure(server, ctx=100, batch=4, new_tokens=20, vocab=512, seed=1, point_max_s=10)
    assert Fake.state["max_new"] == [es.BATCH_TOKEN_CAP] * 4
    assert r["steps_measured"] >= 4 * 20
    assert STEP_S * 1000 * 0.8 < r["ms_per_step"] < STEP_S * 1000 * 3
    assert r["wall_s"] < 5  # ended on the window rule, not on the 10 s bound
    time.sleep(STEP_S * 5)
    assert Fake.state.get("aborted") == 4


def test_a_sampled_point_sends_its_sampling_to_every_request(server):
    sampling = es.parse_sampling("0.7/20/0.8")
    es.measure(server, ctx=100, batch=2, new_tokens=10, vocab=512, seed=1, point_max_s=0, sampling=sampling)
    sent = Fake.state["sampling"]
    assert len(sent) == 2 and all(p["temperature"] == 0.7 and p["top_k"] == 20 and p["top_p"] == 0.8
                                  and p["ignore_eos"] for p in sent)  # fmt: skip
    es.measure(server, ctx=100, batch=1, new_tokens=10, vocab=512, seed=1, point_max_s=0)
    assert Fake.state["sampling"][-1] == {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}


def test_single_request_keeps_its_token_count(server):
    r = es.measure(server, ctx=100, batch=1, new_tokens=25, vocab=512, seed=1, point_max_s=0)
    assert Fake.state["max_new"] == [25] and r["completion_tokens"] == 25


def test_profile_point_waits_for_the_servers_trace(server, tmp_path):
    out = es.profile_point(server, ctx=200, vocab=512, steps=8, trace_dir=tmp_path, profile_id="p1")
    body = Fake.state["profile"]["body"]
    assert body["num_steps"] == 8 and body["activities"] == ["GPU"] and body["with_stack"] is False
    assert out["steps"] == 8 and out["steps_from"] == "profiler num_steps"
    assert out["categories"]["tree_verify"]["ms_per_step"] == pytest.approx(0.020)
    assert out["categories"]["tree_verify"]["share"] == pytest.approx(0.25)
    assert out["trace"] == str(tmp_path / "p1-TP-0.trace.json.gz")
    assert "stopped_by_hand" not in Fake.state


def test_profile_point_stops_by_hand_when_the_request_ends_first(server, tmp_path):
    out = es.profile_point(server, ctx=200, vocab=512, steps=50, trace_dir=tmp_path, profile_id="p2", new_tokens=20)
    assert Fake.state.get("stopped_by_hand")
    assert out["steps_from"] == "stream" and out["steps"] == 20 - 4  # chunks after the profiler started
