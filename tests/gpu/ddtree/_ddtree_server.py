"""Tiny HTTP helpers and a server process wrapper for the DDTREE e2e tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, payload: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class Server:
    def __init__(self, name: str, args: list[str], log_dir: Path):
        self.name = name
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        cmd = [sys.executable, "-m", "sglang.launch_server", "--port", str(self.port), *args]
        self.cmd = cmd
        self._log = open(self.log_path, "w")
        # A KV leak, double free or use-after-free found by the scheduler's
        # idle self-check kills the server instead of logging a warning.
        env = dict(os.environ, SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE="1")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, deadline: float) -> None:
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited rc={self.proc.returncode}:\n{self.log_tail()}")
            try:
                get(self.url + "/health_generate", timeout=5)
                return
            except Exception:
                time.sleep(1)
        raise TimeoutError(f"{self.name} not healthy in time:\n{self.log_tail()}")

    def generate(self, input_ids, **sampling) -> dict:
        return post(self.url + "/generate", {"input_ids": input_ids, "sampling_params": sampling})

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 60) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()
