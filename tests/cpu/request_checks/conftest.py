# SPDX-License-Identifier: Apache-2.0
"""Upstream's real HTTP app in front of a real TokenizerManager, on the CPU.

The tokenizer manager is built by upstream's own ``__init__`` from a model directory
shaped like the GPU tier's tiny test models (their tokenizer: 512 ids, context 4096),
and ``sglang.srt.entrypoints.http_server.app`` serves ``/generate``,
``/v1/completions`` and ``/v1/chat/completions`` through it, with the OpenAI handlers
the server's lifespan would create. Only the scheduler is replaced: a request that
passes every check is recorded (``served.sent``) and answered with ``max_new_tokens``
tokens, so a test sees exactly what would have reached the scheduler.

``scripted``: a server whose answers the request bodies script (slow, wrong, fatal), for
what upstream's app cannot be made to do: the malformed-request loop's handling of a wrong
answer, a failed normal request and a server that dies.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, List

import numpy as np
import pytest

from tests.cpu.soak._json_reply import JSONReplyHandler

REPO = Path(__file__).resolve().parents[3]
VOCAB = 512
CONTEXT = 4096


def _test_models_module():
    spec = importlib.util.spec_from_file_location("make_test_models", REPO / "scripts" / "make_test_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_model_dir(out: Path) -> Path:
    """A config (Llama, 512 ids, 4,096 positions) and the test models' own tokenizer."""
    gen = _test_models_module()
    assert gen.VOCAB == VOCAB and gen.MAX_POS == CONTEXT
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 256,
           "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
           "max_position_embeddings": CONTEXT, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg))
    gen.save_tokenizer(out, gen.words(np.random.default_rng(0)))
    return out


@dataclass
class Served:
    client: Any
    tokenizer_manager: Any
    sent: List[Any] = field(default_factory=list)

    def post(self, path: str, payload: bytes):
        r = self.client.post(path, content=payload, headers={"Content-Type": "application/json"})
        return r.status_code, r.content


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    from starlette.testclient import TestClient

    from sglang.srt.entrypoints import http_server
    from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.parser.template_manager import TemplateManager
    from sglang.srt.server_args import PortArgs, ServerArgs

    model = write_model_dir(tmp_path_factory.mktemp("model"))
    server_args = ServerArgs(model_path=str(model), device="cpu")
    tm = TokenizerManager(server_args, PortArgs.init_new(server_args))
    templates = TemplateManager()
    http_server.set_global_state(http_server._GlobalState(tokenizer_manager=tm, template_manager=templates,
                                                          scheduler_info={}))  # fmt: skip
    http_server.app.state.openai_serving_completion = OpenAIServingCompletion(tm, templates)
    http_server.app.state.openai_serving_chat = tm.serving_chat_class(tm, templates)
    served = Served(client=TestClient(http_server.app, raise_server_exceptions=False), tokenizer_manager=tm)

    def to_scheduler(tokenized):
        served.sent.append(tokenized)

    async def scheduler_answer(obj, request=None):
        """``max_new_tokens`` tokens; a stream gets them 4 at a time, 20 ms apart."""
        tokenized = next(t for t in reversed(served.sent) if t.rid == obj.rid)  # they may overlap
        n = tokenized.sampling_params.max_new_tokens or 1
        meta = {"id": obj.rid, "finish_reason": None, "prompt_tokens": len(tokenized.input_ids),
                "completion_tokens": n, "cached_tokens": 0, "weight_version": "default", "e2e_latency": 0.01}  # fmt: skip
        for k in range(4, n, 4) if obj.stream else ():
            await asyncio.sleep(0.02)
            yield {"text": " ".join(["bako"] * k), "output_ids": [17] * k, "meta_info": {**meta, "completion_tokens": k}}
        tm.rid_to_state.pop(obj.rid, None)  # what the scheduler's answer path does
        meta["finish_reason"] = {"type": "length", "length": n}
        yield {"text": " ".join(["bako"] * n), "output_ids": [17] * n, "meta_info": meta}

    tm._send_one_request = to_scheduler
    tm._wait_one_response = scheduler_answer
    yield served


class _Served:
    """The handle ``malformed_problems`` reads: name, base_url, alive()."""

    def __init__(self, name, base_url, thread):
        self.name, self.base_url, self._thread = name, base_url, thread

    def alive(self):
        return self._thread.is_alive()


@pytest.fixture(scope="session")
def over_http(served):
    import uvicorn

    from sglang.srt.entrypoints import http_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(http_server.app, host="127.0.0.1", port=port, log_level="warning",
                                           loop="asyncio", lifespan="off", log_config=None))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield _Served("cpu-upstream-app", f"http://127.0.0.1:{port}", thread)
    server.should_exit = True
    thread.join(10)


class _ScriptedHandler(JSONReplyHandler):

    def do_POST(self):
        s: Scripted = self.server.scripted
        data = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        normal = "input_ids" in data
        with s.lock:
            if s.dead:
                return  # a dead server's connection drops
            if not normal:
                s.cases_seen.append(data.get("case"))
                s.cases_now += 1
                s.most_cases_at_once = max(s.most_cases_at_once, s.cases_now)
        try:
            if normal:
                return self._normal(s, data)
            time.sleep(data.get("sleep", 0.0))
            if data.get("kill") or s.dead:
                return s.die()
            with s.lock:
                s.break_next |= bool(data.get("break_next"))
            self.reply_json(data.get("status", 400), {"error": {"message": data.get("refuse", "refused")}})
        finally:
            if not normal:
                with s.lock:
                    s.cases_now -= 1

    def _normal(self, s: "Scripted", data: dict) -> None:
        with s.lock:
            broken, s.break_next = s.break_next, False
        if broken:
            return self.reply_json(500, {"error": {"message": "Internal server error: scripted"}})
        n = data["sampling_params"]["max_new_tokens"]
        with s.lock:
            s.normal_served += 1
        meta = {"id": "r", "finish_reason": {"type": "length", "length": n}, "completion_tokens": n}
        self.reply_json(200, {"text": "bako " * n, "output_ids": [17] * n, "meta_info": meta})


class Scripted:
    """A body with ``input_ids`` is a normal request: served with ``max_new_tokens`` ids.
    Any other is a case: after ``sleep`` seconds answered ``status`` (400) with the message
    ``refuse``; ``kill`` makes the server die (its connection and every later one drop);
    ``break_next`` makes the next normal request get a 500. ``case`` names it in
    ``cases_seen``, the order the cases arrived in."""

    def __init__(self):
        self.lock = threading.Lock()
        self.dead = self.break_next = False
        self.cases_seen: list = []
        self.cases_now = self.most_cases_at_once = self.normal_served = 0
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _ScriptedHandler)
        self._http.daemon_threads = True
        self._http.scripted = self
        self.name = "scripted"
        self.base_url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return not self.dead

    def die(self) -> None:
        with self.lock:
            if self.dead:
                return
            self.dead = True
        threading.Thread(target=self.stop, daemon=True).start()

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()


@pytest.fixture
def scripted():
    server = Scripted()
    yield server
    if not server.dead:
        server.stop()
