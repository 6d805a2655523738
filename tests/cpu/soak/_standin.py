# SPDX-License-Identifier: Apache-2.0
"""A stand-in for ``python -m sglang.launch_server`` that speaks what the soak piece reads,
so the CPU tier can run the soak end to end: ``/generate`` and ``/v1/completions`` (plain and
streamed, in upstream's shapes), ``/v1/models``, ``/server_info``, ``/metrics``, ``/health``,
``/health_generate``; uvicorn-style access lines and the scheduler's retraction line on
stdout (the harness sends it to the server log).

Greedy output is a fixed function of the prompt, so two stand-ins agree as a speculative
server and its no-speculation reference must. ``STANDIN_FAULT`` makes one misbehave:
``wrong_greedy`` (some greedy answers differ), ``http500`` (some requests answered 500),
``hang`` (one request never answered), ``no_retract``, ``leak`` (KV held once idle),
``error_line`` (logs a scheduler exception), ``crash`` (exits after a few requests),
``short`` (some answers one token short), ``dead_on_arrival`` (exits at the first request).

    python _standin.py --model-path M --host H --port P [--max-total-tokens N] [other flags, ignored]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from http.server import ThreadingHTTPServer

from _json_reply import JSONReplyHandler  # this folder: the script runs from it

FAULT = os.environ.get("STANDIN_FAULT", "")
VOCAB = 512
LOCK = threading.Lock()
STATE = {"requests": 0, "inflight": 0, "retracted": 0, "aborted": 0, "prefixes": set(), "hung": False}


def log(line: str) -> None:
    print(line, flush=True)


def greedy_output(prompt, n):
    seed = prompt[-1] * 31 + prompt[0] * 7 + len(prompt)
    return [16 + (seed + 13 * i) % (VOCAB - 16) for i in range(n)]


def output_for(prompt, n, greedy):
    if greedy:
        out = greedy_output(prompt, n)
        if FAULT == "wrong_greedy" and len(prompt) % 3 == 0 and n > 2:
            out[n // 2] = 16 + (out[n // 2] + 1 - 16) % (VOCAB - 16)
        return out
    rng = random.Random()
    return [rng.randrange(16, VOCAB) for _ in range(n)]


class Handler(JSONReplyHandler):
    server_version = "standin"

    def log_request(self, code="-", size="-"):
        phrase = {200: "OK", 400: "Bad Request", 500: "Internal Server Error"}.get(int(code), "")
        log(f'INFO:     {self.client_address[0]}:{self.client_address[1]} - "{self.requestline}" {code} {phrase}')

    def do_GET(self):
        pool = self.server.pool
        if self.path in ("/health", "/health_generate"):
            return self.reply_json(200, {})
        if self.path == "/v1/models":
            return self.reply_json(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        if self.path == "/server_info":
            return self.reply_json(200, {"max_total_num_tokens": pool})
        if self.path == "/metrics":
            with LOCK:
                running, retracted, aborted = STATE["inflight"], STATE["retracted"], STATE["aborted"]
            used = running * 10 + (7 if FAULT == "leak" else 0)
            labels = '{model_name="tiny"}'
            lines = [f"sglang:num_running_reqs{labels} {running}.0", f"sglang:num_queue_reqs{labels} 0.0",
                     f"sglang:num_used_tokens{labels} {used}.0",
                     f"sglang:kv_available_tokens{labels} {pool - used - 100}.0",
                     f"sglang:kv_evictable_tokens{labels} 100.0",
                     "# TYPE sglang:num_retracted_requests_total counter",
                     f"sglang:num_retracted_requests_total{labels} {retracted}.0",
                     f"sglang:num_retracted_requests_created{labels} 1.7e9",
                     f"sglang:num_aborted_requests_total{labels} {aborted}.0",
                     f"sglang:spec_accept_length{labels} 4.5"]  # fmt: skip
            body = ("\n".join(lines) + "\n").encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.reply_json(404, {"error": {"message": "not found"}})

    def do_POST(self):
        data = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        with LOCK:
            STATE["requests"] += 1
            k = STATE["requests"]
            STATE["inflight"] += 1
            if k % 5 == 0 and FAULT != "no_retract":
                STATE["retracted"] += 2
                log("[2026-12-03 12:00:00] KV cache pool is full. Retract requests. #retracted_reqs: 2, "
                    "#new_tokens_gained: 300, #new_token_ratio: 0.3000 -> 0.4000")
            hang = FAULT == "hang" and k >= 10 and not STATE["hung"]
            STATE["hung"] |= hang
        try:
            if FAULT == "crash" and k > 20 or FAULT == "dead_on_arrival":
                os._exit(1)
            if FAULT == "error_line" and k == 12:
                log("[2026-12-03 12:00:01] Scheduler hit an exception: Traceback (most recent call last):")
            if hang:
                time.sleep(3600)
            if FAULT == "http500" and k % 7 == 0:
                return self.reply_json(500, {"object": "error", "message": "Internal server error: boom"})
            self._serve(data)
        except (BrokenPipeError, ConnectionResetError):
            with LOCK:
                STATE["aborted"] += 1
        finally:
            with LOCK:
                STATE["inflight"] -= 1

    def _serve(self, data):
        generate = self.path == "/generate"
        if generate:
            prompt, params = data["input_ids"], data.get("sampling_params") or {}
            n, temperature = params.get("max_new_tokens", 16), params.get("temperature", 1.0)
        else:
            prompt, n, temperature = data["prompt"], data.get("max_tokens", 16), data.get("temperature", 1.0)
        if FAULT == "short" and n > 3 and len(prompt) % 4 == 1:
            n -= 1
        out = output_for(prompt, n, temperature == 0)
        with LOCK:
            cached = 16 if len(prompt) > 16 and tuple(prompt[:16]) in STATE["prefixes"] else 0
            STATE["prefixes"].add(tuple(prompt[:16]))
        meta = {"id": "r", "finish_reason": {"type": "length", "length": n}, "prompt_tokens": len(prompt),
                "completion_tokens": n, "cached_tokens": cached}  # fmt: skip
        words = [f"w{t}" for t in out]
        if not data.get("stream"):
            if generate:
                return self.reply_json(200, {"text": " ".join(words), "output_ids": out, "meta_info": meta})
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
            return self.reply_json(200, {"object": "text_completion", "usage": usage,
                                    "choices": [{"index": 0, "text": " ".join(words), "finish_reason": "length"}]})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        step = 4
        for i in range(0, n, step):
            time.sleep(0.004)
            last = i + step >= n
            if generate:
                chunk = {"text": None, "output_ids": out[: i + step],
                         "meta_info": {**meta, "finish_reason": meta["finish_reason"] if last else None,
                                       "completion_tokens": min(n, i + step)}}  # fmt: skip
            else:
                chunk = {"object": "text_completion", "choices": [
                    {"index": 0, "text": "".join(w + " " for w in words[i:i + step]),
                     "finish_reason": "length" if last else None}]}  # fmt: skip
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
        if not generate and (data.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
            self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    args, rest = ap.parse_known_args(argv)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    server.pool = args.max_total_tokens
    log(f"[standin] {args.model_path} on {args.host}:{args.port} fault={FAULT or 'none'} flags={' '.join(rest)}")
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
