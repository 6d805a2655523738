# SPDX-License-Identifier: Apache-2.0
"""The soak piece's clients: HTTP requests with what happened to each, and the load loop.

``send`` posts one ``SoakRequest`` on its own connection and returns an ``Outcome``: the
status, the tokens or text, the latency and time to the first event, the error (an HTTP
error, an error event inside a stream, a broken connection), and whether the client
disconnected on purpose (``aborted``). ``run_load`` runs ``clients`` such loops per server
until a deadline, then gives the requests in flight until the drain deadline and closes
the connections of any still open (``hung``). ``References`` asks a no-speculation server
for each distinct greedy request once, while the load runs.

Standard library only, so the CPU tier tests it against a stand-in server.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from tests.gpu.soak._load_mix import LoadMix, SoakRequest


@dataclass
class Outcome:
    server: str
    req: SoakRequest
    status: int = 0  # HTTP status; 0: no response
    error: Optional[str] = None
    started: float = 0.0
    latency_s: float = 0.0
    first_event_s: Optional[float] = None
    output_ids: Optional[list] = None
    text: Optional[str] = None
    completion_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None
    finish_reason: Optional[str] = None
    events: int = 0
    #: the client disconnected on purpose before the end (``req.abort_after``)
    aborted: bool = False
    #: still open at the drain deadline: the test closed it
    hung: bool = False

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.error is None and not self.aborted and not self.hung

    def problem(self) -> Optional[str]:
        """What is wrong with this request's answer, if anything."""
        r = self.req
        where = f"{self.server} {r.tag} ({r.api}, {'stream' if r.stream else 'plain'}, max_tokens {r.max_tokens})"
        if self.hung:
            return f"{where}: no answer by the drain deadline ({self.latency_s:.0f} s after it was sent)"
        if self.aborted:
            return f"{where}: error before the client disconnected: {self.error}" if self.error else None
        if self.status != 200 or self.error:
            return f"{where}: HTTP {self.status}: {self.error}"
        got = len(self.output_ids) if r.api == "generate" else self.completion_tokens
        if got != r.max_tokens:
            return f"{where}: {got} tokens, expected {r.max_tokens} (ignore_eos)"
        return None


class Connections:
    """The connections in flight, so that the drain deadline can close them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: Dict[int, http.client.HTTPConnection] = {}
        self._closed_by_test: set = set()

    def add(self, conn) -> None:
        with self._lock:
            self._open[id(conn)] = conn

    def remove(self, conn) -> bool:
        """True when the test closed this connection (the request hung)."""
        with self._lock:
            self._open.pop(id(conn), None)
            return id(conn) in self._closed_by_test

    def close_all(self) -> int:
        with self._lock:
            conns = list(self._open.values())
            self._closed_by_test |= {id(c) for c in conns}
        for conn in conns:
            try:
                if conn.sock is not None:
                    conn.sock.shutdown(2)
                conn.close()
            except OSError:
                pass
        return len(conns)

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)


def _error_of(data) -> Optional[str]:
    """The message of an error answer or error event, else None."""
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("error"), dict):
        return str(data["error"].get("message") or data["error"])
    if data.get("error"):
        return str(data["error"])
    if data.get("object") == "error":
        return str(data.get("message"))
    return None


def _read_generate(out: Outcome, data: dict) -> None:
    out.output_ids = list(data.get("output_ids") or [])
    meta = data.get("meta_info") or {}
    out.cached_tokens = meta.get("cached_tokens", out.cached_tokens)
    finish = meta.get("finish_reason")
    if finish:
        out.finish_reason = finish.get("type") if isinstance(finish, dict) else str(finish)
        out.completion_tokens = meta.get("completion_tokens", len(out.output_ids))


def _read_completion(out: Outcome, data: dict, stream: bool) -> None:
    for choice in data.get("choices") or []:
        piece = choice.get("text") or ""
        out.text = (out.text or "") + piece if stream else piece
        if choice.get("finish_reason"):
            out.finish_reason = choice["finish_reason"]
    usage = data.get("usage")
    if usage:
        out.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        out.cached_tokens = details.get("cached_tokens", out.cached_tokens)


def send(server: str, base_url: str, model: str, req: SoakRequest, timeout: float,
         connections: Optional[Connections] = None, body: Optional[dict] = None) -> Outcome:  # fmt: skip
    """Post ``req`` (or ``body`` in its place) and read the answer as the request asks."""
    url = urllib.parse.urlsplit(base_url)
    payload = body if body is not None else req.body(model)
    stream = bool(payload.get("stream"))
    out = Outcome(server=server, req=req, started=time.monotonic())
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    if connections is not None:
        connections.add(conn)
    try:
        conn.request("POST", req.path, body=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        out.status = resp.status
        if resp.status != 200:
            raw = resp.read()
            try:
                out.error = _error_of(json.loads(raw)) or raw[:300].decode(errors="replace")
            except ValueError:
                out.error = raw[:300].decode(errors="replace") or resp.reason
            return out
        if not stream:
            data = json.loads(resp.read())
            out.error = _error_of(data)
            _read_generate(out, data) if req.api == "generate" else _read_completion(out, data, False)
            return out
        if req.abort_after == 0:
            out.aborted = True  # disconnect before the first event: the request may still be queued
            return out
        done = False
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:"):].strip()
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            out.events += 1
            if out.first_event_s is None:
                out.first_event_s = time.monotonic() - out.started
            error = _error_of(chunk)
            if error:
                out.error = error
                break
            _read_generate(out, chunk) if req.api == "generate" else _read_completion(out, chunk, True)
            if req.abort_after is not None and out.events >= req.abort_after:
                out.aborted = True
                break
        if not done and not out.aborted and out.error is None:
            out.error = f"the stream ended after {out.events} events without [DONE]"
    except (OSError, http.client.HTTPException, ValueError) as e:
        out.error = out.error or f"{type(e).__name__}: {e}"
    finally:
        out.latency_s = time.monotonic() - out.started
        if connections is not None and connections.remove(conn):
            out.hung = True
        conn.close()
    return out


@dataclass
class LoadTarget:
    """One server under load: its name, URL, served model id and traffic."""

    name: str
    base_url: str
    model: str
    mix: LoadMix
    #: called with every finished Outcome (from the client threads)
    on_outcome: Optional[Callable[[Outcome], None]] = None


def run_load(targets: List[LoadTarget], clients: int, duration_s: float, request_timeout_s: float,
             drain_s: float) -> Dict[str, List[Outcome]]:  # fmt: skip
    """``clients`` concurrent clients per target, each sending its requests one after another
    until ``duration_s`` has passed; requests in flight then have ``drain_s`` to finish
    before the test closes their connections (those outcomes are ``hung``)."""
    start = time.monotonic()
    deadline = start + duration_s
    outcomes: Dict[str, List[Outcome]] = {t.name: [] for t in targets}
    lock = threading.Lock()
    connections = Connections()

    def client_loop(target: LoadTarget, client: int) -> None:
        for req in target.mix.client_requests(client):
            if time.monotonic() >= deadline:
                return
            out = send(target.name, target.base_url, target.model, req, request_timeout_s, connections)
            with lock:
                outcomes[target.name].append(out)
            if target.on_outcome is not None:
                target.on_outcome(out)
            if out.status == 0 and out.error and "Connection refused" in out.error:
                return  # the server is gone: the checks report it, no need to hammer a dead port

    threads = [threading.Thread(target=client_loop, args=(t, c), daemon=True, name=f"soak-{t.name}-{c}")
               for t in targets for c in range(clients)]  # fmt: skip
    for th in threads:
        th.start()
    drain_deadline = deadline + drain_s
    for th in threads:
        th.join(max(0.0, drain_deadline - time.monotonic()))
    if any(th.is_alive() for th in threads):
        connections.close_all()
        for th in threads:
            th.join(30.0)
    return outcomes


class References:
    """Greedy references from a no-speculation server, each distinct request asked once."""

    def __init__(self, name: str, base_url: str, model: str, workers: int, timeout_s: float):
        self.name, self.base_url, self.model, self.timeout_s = name, base_url, model, timeout_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"ref-{name}")
        self._lock = threading.Lock()
        self._futures: Dict[tuple, Future] = {}

    def submit(self, req: SoakRequest) -> None:
        if not req.greedy:
            return
        with self._lock:
            if req.reference_key in self._futures:
                return
            self._futures[req.reference_key] = self._pool.submit(
                send, self.name, self.base_url, self.model, req, self.timeout_s, None, req.reference_body(self.model)
            )

    def __len__(self) -> int:
        with self._lock:
            return len(self._futures)

    def results(self, timeout_s: float) -> Dict[tuple, Optional[Outcome]]:
        """Every reference asked for; None for one not answered within ``timeout_s``."""
        end = time.monotonic() + timeout_s
        with self._lock:
            futures = dict(self._futures)
        out = {}
        for key, fut in futures.items():
            try:
                out[key] = fut.result(timeout=max(0.0, end - time.monotonic()))
            except Exception:  # noqa: BLE001 - a timeout or a failed request: reported as missing
                out[key] = None
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
