# SPDX-License-Identifier: Apache-2.0
"""The GPU tier's server harness (tests/gpu/conftest.py ServerProcess) with a stand-in HTTP
server in place of sglang: a taken port gets a relaunch on a new one, a server that dies or
never answers raises with its log. The stand-in behaves like uvicorn does in sglang: when
the bind fails it logs the error and the process stays alive."""

import importlib.util
import socket
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

STAND_IN = textwrap.dedent('''
    import argparse, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int)
    ap.add_argument("--die", action="store_true")
    args, _ = ap.parse_known_args()
    if args.die:
        print("model load failed", flush=True)
        sys.exit(3)

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    try:
        httpd = HTTPServer(("127.0.0.1", args.port), Health)
    except OSError as e:
        print(f"ERROR:    [Errno {e.errno}] error while attempting to bind on address "
              f"('127.0.0.1', {args.port}): {e.strerror.lower()}", flush=True)
        time.sleep(600)
    print("startup complete", flush=True)
    httpd.serve_forever()
''')


@pytest.fixture
def harness(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("ddtree_gpu_harness_h", REPO / "tests" / "gpu" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    script = tmp_path / "stand_in_server.py"
    script.write_text(STAND_IN)
    monkeypatch.setattr(mod.ServerProcess, "launcher", (sys.executable, str(script)))
    return mod


def test_a_taken_port_is_relaunched_on_a_new_one(harness, tmp_path, monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    ports = iter([taken.getsockname()[1]])
    real_free_port = harness.free_port
    monkeypatch.setattr(harness, "free_port", lambda: next(ports, None) or real_free_port())
    server = harness.ServerProcess("s", "/m", [], tmp_path)
    try:
        first_port = server.port
        server.wait_healthy(60)
        assert server.attempts == 2 and server.port != first_port
        assert server.get("/health").status == 200
        log = server.log_text()
        assert "address already in use" in log and "relaunch 2 of 3" in log
        assert log.count("$ ") == 2 and log.count("startup complete") == 1
    finally:
        server.stop()
        taken.close()


def test_gives_up_after_the_last_attempt(harness, tmp_path, monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    monkeypatch.setattr(harness, "free_port", lambda: taken.getsockname()[1])
    server = harness.ServerProcess("s", "/m", [], tmp_path)
    try:
        with pytest.raises(RuntimeError, match="port was taken 3 times"):
            server.wait_healthy(60)
    finally:
        server.stop()
        taken.close()
    assert server.proc.poll() is not None  # the last attempt was stopped too


def test_a_server_that_exits_raises_with_its_log(harness, tmp_path):
    server = harness.ServerProcess("s", "/m", ["--die"], tmp_path)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)exited with 3.*model load failed"):
            server.wait_healthy(30)
    finally:
        server.stop()
