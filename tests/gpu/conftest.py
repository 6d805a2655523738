# SPDX-License-Identifier: Apache-2.0
"""Shared GPU-tier fixtures: test models and a patched sglang server per configuration.

``launch_server(model, args)`` starts ``python -m sglang.launch_server`` on a free port in
its own process group, waits for ``/health`` (raising with the log tail if the process dies
or the deadline passes; relaunching on a new port if another server took that one first)
and always kills the whole group on exit. ``server_pool`` keeps one
server alive at a time across a session and restarts only when the configuration changes,
because a start costs 60-250 s (CUDA graphs, FlashInfer JIT); ``launch_servers_together``
starts a suite's servers at once so that their starts overlap. The suites' conftests reach
this module through ``tests.gpu.harness.harness(config)``.

On the GPU host (``DDTREE_GPU_HOST=1``, exported by ``scripts/gpu_host/env.sh``) a skip is a
failure: there it means a broken install (an import that fails, FlashInfer or FlashMLA
unavailable, no GPU visible), not a test that does not apply. A test that does not apply to
the host's hardware or to the caller's selection says so with a reason that starts with
``NOT_APPLICABLE`` ("not applicable: "), and stays a skip.

Environment:
  DDTREE_GPU_HOST      1 on the GPU host: skips fail, except "not applicable: ..." ones
  DDTREE_TEST_MODELS   an existing ``scripts/make_test_models.py`` output dir (else generated)
  DDTREE_GPU_LOG_DIR   where server logs go (default: a temp dir); the GPU tier runner packs it into its --out folder
  DDTREE_SERVER_TIMEOUT  seconds to wait for /health (default 420)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
LEAK_PATTERNS = ("memory leak detected", "Mem Leak Detected")

#: Set by scripts/gpu_host/env.sh on the GPU host, where the whole stack is expected to work.
GPU_HOST = os.environ.get("DDTREE_GPU_HOST") == "1"
#: The start of a skip reason for a test that does not apply to this host's hardware (too few
#: GPUs, another compute capability) or to the selection the caller made: a skip everywhere.
NOT_APPLICABLE = "not applicable: "


def _skip_reason(longrepr) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(getattr(longrepr, "reprcrash", None) and longrepr.reprcrash.message or longrepr)


def _fail_skip_on_gpu_host(report) -> None:
    if not (GPU_HOST and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report.longrepr)
    if reason.startswith(NOT_APPLICABLE):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped on the GPU host (DDTREE_GPU_HOST=1), where a skip means a broken install: "
                       f"{reason}\n(a test that does not apply here skips with a reason starting "
                       f"{NOT_APPLICABLE!r})")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_skip_on_gpu_host(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """Module-level skips (``importorskip``, "needs a CUDA device") happen while collecting."""
    outcome = yield
    _fail_skip_on_gpu_host(outcome.get_result())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What uvicorn logs when the HTTP port was taken; the server process lives on without it.
PORT_TAKEN = "address already in use"
LAUNCH_ATTEMPTS = 3


class ServerProcess:
    """A running server: URL helpers plus its log."""

    #: The command before ``--model-path``.
    launcher = (sys.executable, "-m", "sglang.launch_server")

    def __init__(self, name: str, model: str, args: list[str], log_dir: Path, env: Optional[dict] = None):
        self.name, self.model, self.args = name, model, list(args)
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_dir / f"server-{name}.log"
        self.log_path.write_text("")
        self._log = open(self.log_path, "a")  # append: this process and the server's share the file
        self.attempts = 0
        self.first_started = time.time()
        self.ready_s: Optional[float] = None
        self._spawn()

    def _spawn(self) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [*self.launcher, "--model-path", self.model, "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        self.attempts += 1
        if self.attempts > 1:
            self._log.write(f"\n--- {PORT_TAKEN!r}: relaunch {self.attempts} of {LAUNCH_ATTEMPTS} on a new port\n")
        self._log.write("$ " + " ".join(cmd) + "\n")
        self._log.flush()
        self._attempt_offset = self.log_path.stat().st_size
        self.started = time.time()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env,
        )

    def port_taken(self) -> bool:
        """The port was free when picked but something bound it first: a server starting
        beside this one takes ports near its own long before it listens on its HTTP port."""
        with open(self.log_path, errors="replace") as f:
            f.seek(self._attempt_offset)
            return PORT_TAKEN in f.read()

    # -- lifecycle -------------------------------------------------------------------------
    def wait_healthy(self, timeout: float) -> None:
        """Wait for /health, from the first launch; relaunch on a new port when the port was taken."""
        deadline = self.first_started + timeout
        while time.time() < deadline:
            if self.port_taken():
                if self.attempts >= LAUNCH_ATTEMPTS:
                    raise RuntimeError(f"server {self.name}: its port was taken {self.attempts} times:\n{self.log_tail()}")
                self._kill()
                self._spawn()
                continue
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self.get("/health", timeout=5).status == 200:
                    self.ready_s = time.time() - self.started
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server {self.name} not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def _kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):  # stray children of the group
            os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self) -> None:
        self._kill()
        self._log.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    # -- HTTP ------------------------------------------------------------------------------
    def get(self, path: str, timeout: float = 30.0):
        return urllib.request.urlopen(self.base_url + path, timeout=timeout)

    def post(self, path: str, payload: dict, timeout: float = 300.0) -> dict:
        req = urllib.request.Request(
            self.base_url + path, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def stream(self, path: str, payload: dict, timeout: float = 300.0) -> Iterator[dict]:
        """Server-sent events of a streaming request, parsed; closing the generator aborts."""
        req = urllib.request.Request(
            self.base_url + path,
            data=json.dumps({**payload, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                yield json.loads(data)

    def generate_ids(self, input_ids: list[int], max_new_tokens: int, **sampling) -> dict:
        """Native /generate with token ids in and out (greedy unless told otherwise)."""
        params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **sampling}
        return self.post("/generate", {"input_ids": input_ids, "sampling_params": params})

    def metrics(self) -> dict[str, float]:
        """Prometheus gauges/counters summed over label sets."""
        out: dict[str, float] = {}
        for line in self.get("/metrics").read().decode().splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
        return out

    # -- log -------------------------------------------------------------------------------
    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 80) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def leak_lines(self) -> list[str]:
        return [l for l in self.log_text().splitlines() if any(p in l for p in LEAK_PATTERNS)]


@contextlib.contextmanager
def launch_server(name: str, model: str, args: list[str], log_dir: Path, timeout: Optional[float] = None,
                  env: Optional[dict] = None):
    server = ServerProcess(name, model, args, log_dir, env=env)
    try:
        server.wait_healthy(timeout or float(os.environ.get("DDTREE_SERVER_TIMEOUT", "420")))
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def launch_servers_together(name_prefix: str, model: str, configs: dict[str, tuple[list[str], dict]],
                            log_dir: Path) -> Iterator[dict[str, ServerProcess]]:
    """One server of ``model`` per configuration (``name: (args, env)``), named
    ``name_prefix + name``: all are spawned before any is waited for, so their starts
    overlap; yields them by configuration name once each is healthy, and always stops them all."""
    started = []
    try:
        for name, (args, env) in configs.items():
            started.append(ServerProcess(f"{name_prefix}{name}", model, args, log_dir, env=env))
        timeout = float(os.environ.get("DDTREE_SERVER_TIMEOUT", "420"))
        for s in started:
            s.wait_healthy(timeout)
            print(f"\n[server {s.name} healthy after {s.ready_s:.0f} s]", flush=True)
        yield dict(zip(configs, started))
    finally:
        for s in started:
            s.stop()


class ServerPool:
    """One live server at a time, keyed by configuration name."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self._stack: Optional[contextlib.ExitStack] = None
        self.current: Optional[ServerProcess] = None
        self.failed: dict[str, str] = {}

    def get(self, name: str, model: str, args: list[str], env: Optional[dict] = None) -> ServerProcess:
        if self.current is not None and self.current.name == name and self.current.alive():
            return self.current
        self.close()
        if name in self.failed:  # do not pay a second start for a configuration that failed
            pytest.fail(f"server {name} failed to start earlier:\n{self.failed[name]}")
        self._stack = contextlib.ExitStack()
        try:
            self.current = self._stack.enter_context(launch_server(name, model, args, self.log_dir, env=env))
        except Exception as e:
            self.failed[name] = str(e)
            self.close()
            raise
        print(f"\n[server {name} healthy after {self.current.ready_s:.0f} s]", flush=True)
        return self.current

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
        self._stack, self.current = None, None


@pytest.fixture(scope="session")
def gpu_log_dir() -> Path:
    d = Path(os.environ.get("DDTREE_GPU_LOG_DIR") or tempfile.mkdtemp(prefix="ddtree_gpu_logs_"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="session")
def tiny_models() -> Path:
    """Output dir of scripts/make_test_models.py (generated once per session if not given)."""
    given = os.environ.get("DDTREE_TEST_MODELS")
    # Every tiny pair, not just a manifest: ``make_test_models.py --only shapes`` writes one too.
    need = ["manifest.json"] + [f"{m}/config.json" for m in ("tiny-mla", "tiny-mla-dflash", "tiny-qwen3",
                                                              "tiny-qwen3-dflash")]
    if given and all((Path(given) / n).exists() for n in need):
        return Path(given)
    out = Path(given) if given else Path(tempfile.mkdtemp(prefix="ddtree_models_"))
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_test_models.py"), str(out)], check=True)
    return out


def with_test_pair(models: Path, pair: str, only: str) -> Path:
    """``models`` (a ``tiny_models`` dir) with the test pair ``pair`` and its ``-dflash``
    drafter, generated into it (``make_test_models.py --only ONLY``) when an older dir lacks them."""
    if not (models / pair / "config.json").exists() or not (models / f"{pair}-dflash").exists():
        subprocess.run(
            [sys.executable, str(REPO / "scripts" / "make_test_models.py"), str(models), "--only", only],
            check=True,
        )
    return models


@pytest.fixture(scope="session")
def server_pool(gpu_log_dir):
    pool = ServerPool(gpu_log_dir)
    yield pool
    pool.close()
