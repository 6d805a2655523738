# SPDX-License-Identifier: Apache-2.0
"""Malformed requests and the answer each must get: a 400 whose message names what is wrong.

Used twice: by the soak piece against the live servers (tests/gpu/soak), and on the CPU
against upstream's real HTTP app and tokenizer manager (tests/cpu/request_checks), which
checks that every case here is answered as ``expect`` says before it ever reaches a GPU.

``fixed_here``: refused by this project's checks (``managers/request_checks.py``, patch
0084); upstream 0.5.17 answers it with a 500, passes it on to the scheduler (where top-k
beyond int32, a non-numeric logit bias, stop ids outside the vocabulary and token ids
outside it raise and kill the server), or refuses it with a message that does not name the
parameter. ``spec_only``: refused by the scheduler on a DFLASH
or DDTREE server (upstream's ``validate_dflash_request``) and served elsewhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

#: A body of about this many bytes for the "10 MB" cases.
BIG_BODY_BYTES = 10 * 1024 * 1024


@dataclass(frozen=True)
class Ctx:
    """What the bodies are built from: the served model's id, its context length and
    vocabulary, and a valid prompt (token ids)."""

    model: str
    context_len: int
    vocab_size: int
    prompt: tuple


@dataclass(frozen=True)
class Malformed:
    name: str
    path: str
    body: Callable[[Ctx], Union[dict, bytes]]
    #: a piece of the error message, compared case-insensitively
    expect: str
    fixed_here: bool = False
    spec_only: bool = False
    status: int = 400

    @property
    def heavy(self) -> bool:
        """A body of about 10 MB (seconds of tokenization)."""
        return self.name.startswith("body_10mb")

    def payload(self, ctx: Ctx) -> bytes:
        body = self.body(ctx)
        return body if isinstance(body, bytes) else json.dumps(body).encode()


def _gen(ctx: Ctx, prompt: Optional[list] = None, **sampling) -> dict:
    params = {"max_new_tokens": 8, "temperature": 0.0, **sampling}
    return {"input_ids": list(ctx.prompt if prompt is None else prompt), "sampling_params": params}


def _cmpl(ctx: Ctx, prompt: Any = None, **fields) -> dict:
    return {"model": ctx.model, "prompt": list(ctx.prompt) if prompt is None else prompt, "max_tokens": 8,
            "temperature": 0, **fields}  # fmt: skip


def _chat(ctx: Ctx, content: str = "bako dilu", **fields) -> dict:
    return {"model": ctx.model, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, **fields}  # fmt: skip


def _big_text(_: Ctx) -> dict:
    word = "bako "
    return {"text": word * (BIG_BODY_BYTES // len(word)), "sampling_params": {"max_new_tokens": 8}}


def _big_ids(ctx: Ctx) -> dict:
    token = ctx.prompt[-1]
    per = len(f"{token}, ")
    return {"input_ids": [token] * (BIG_BODY_BYTES // per), "sampling_params": {"max_new_tokens": 8}}


def _big_chat(ctx: Ctx) -> dict:
    return _chat(ctx, content="bako " * (BIG_BODY_BYTES // 5))


def _raw(text: str) -> Callable[[Ctx], bytes]:
    return lambda ctx: text.replace("PROMPT", json.dumps(list(ctx.prompt))).encode()


G, C, CH = "/generate", "/v1/completions", "/v1/chat/completions"
CASES = [
    # top_k: negative, zero, beyond what the sampler's int32 holds, not an integer
    Malformed("top_k_negative", G, lambda c: _gen(c, temperature=1.0, top_k=-5), "top_k"),
    Malformed("top_k_zero_openai", C, lambda c: _cmpl(c, temperature=1.0, top_k=0), "top_k"),
    Malformed("top_k_huge", G, lambda c: _gen(c, temperature=1.0, top_k=10**12), "top_k", fixed_here=True),
    Malformed("top_k_huge_openai", C, lambda c: _cmpl(c, temperature=1.0, top_k=2**40), "top_k", fixed_here=True),
    Malformed("top_k_fractional", G, lambda c: _gen(c, temperature=1.0, top_k=2.5), "top_k", fixed_here=True),
    # top_p outside (0, 1]
    Malformed("top_p_zero", G, lambda c: _gen(c, temperature=1.0, top_p=0.0), "top_p"),
    Malformed("top_p_above_one_openai", C, lambda c: _cmpl(c, temperature=1.0, top_p=1.5), "top_p"),
    Malformed("top_p_negative_chat", CH, lambda c: _chat(c, temperature=1.0, top_p=-0.1), "top_p"),
    # NaN is not JSON: the request parser refuses the body before any sampling check
    Malformed("top_p_nan", G, _raw('{"input_ids": PROMPT, "sampling_params": {"temperature": 1.0, "top_p": NaN}}'),
              "json"),  # fmt: skip
    # other sampling bounds
    Malformed("temperature_negative", G, lambda c: _gen(c, temperature=-1.0), "temperature"),
    Malformed("min_p_above_one", G, lambda c: _gen(c, temperature=1.0, min_p=1.5), "min_p"),
    Malformed("repetition_penalty_zero", G, lambda c: _gen(c, repetition_penalty=0.0), "repetition_penalty"),
    Malformed("sampling_seed_beyond_int64", G, lambda c: _gen(c, temperature=1.0, sampling_seed=2**70),
              "sampling_seed", fixed_here=True),  # fmt: skip
    # max_tokens beyond the context, negative, zero
    Malformed("max_tokens_beyond_context_openai", C, lambda c: _cmpl(c, max_tokens=c.context_len + 1),
              "context length"),  # fmt: skip
    Malformed("max_tokens_beyond_context_chat", CH, lambda c: _chat(c, max_tokens=4 * c.context_len),
              "context length"),  # fmt: skip
    Malformed("max_new_tokens_beyond_context", G, lambda c: _gen(c, max_new_tokens=10**9), "context length"),
    Malformed("max_new_tokens_negative", G, lambda c: _gen(c, max_new_tokens=-1), "max_new_tokens"),
    Malformed("max_tokens_zero_openai", C, lambda c: _cmpl(c, max_tokens=0), "max_tokens"),
    Malformed("min_new_tokens_above_max", G,
              lambda c: {"input_ids": list(c.prompt), "sampling_params": {"min_new_tokens": 2 * c.context_len}},
              "min_new_tokens"),  # fmt: skip
    # token ids outside the vocabulary
    Malformed("input_id_beyond_vocab", G, lambda c: _gen(c, [*c.prompt, c.vocab_size + 7]), "vocabulary",
              fixed_here=True),  # fmt: skip
    Malformed("input_id_negative", G, lambda c: _gen(c, [*c.prompt, -3]), "vocabulary", fixed_here=True),
    Malformed("prompt_id_beyond_vocab_openai", C, lambda c: _cmpl(c, [*c.prompt, 10**6]), "vocabulary",
              fixed_here=True),  # fmt: skip
    Malformed("input_id_beyond_int64", G, lambda c: _gen(c, [*c.prompt, 2**70]), "int64"),
    Malformed("stop_id_beyond_vocab", G,
              lambda c: _gen(c, temperature=1.0, min_new_tokens=2, stop_token_ids=[c.vocab_size + 100]),
              "stop_token_ids", fixed_here=True),  # fmt: skip
    Malformed("logit_bias_beyond_vocab", G, lambda c: _gen(c, logit_bias={str(c.vocab_size + 5): 1.0}), "logit_bias"),
    # empty input
    Malformed("empty_input_ids", G, lambda c: _gen(c, []), "empty"),
    Malformed("empty_text", G, lambda c: {"text": "", "sampling_params": {"max_new_tokens": 8}}, "empty"),
    Malformed("blank_text", G, lambda c: {"text": "   ", "sampling_params": {"max_new_tokens": 8}}, "empty",
              fixed_here=True),  # fmt: skip
    Malformed("empty_prompt_openai", C, lambda c: _cmpl(c, ""), "empty"),
    Malformed("blank_prompt_openai", C, lambda c: _cmpl(c, "  "), "empty", fixed_here=True),
    Malformed("empty_messages_chat", CH, lambda c: {**_chat(c), "messages": []}, "empty"),
    # wrong types
    Malformed("temperature_string", G, lambda c: _gen(c, temperature="hot"), "temperature", fixed_here=True),
    Malformed("max_new_tokens_string", G, lambda c: _gen(c, max_new_tokens="ten"), "max_new_tokens", fixed_here=True),
    Malformed("n_string", G, lambda c: _gen(c, n="2"), "integer", fixed_here=True),
    Malformed("unknown_sampling_param", G, lambda c: _gen(c, max_tokens=8), "max_new_tokens", fixed_here=True),
    Malformed("stop_not_strings", G, lambda c: _gen(c, stop=[5]), "stop", fixed_here=True),
    Malformed("logit_bias_value_string", G, lambda c: _gen(c, logit_bias={"17": "x"}), "logit_bias",
              fixed_here=True),  # fmt: skip
    Malformed("stream_interval_string", G, lambda c: _gen(c, stream_interval="x"), "stream_interval",
              fixed_here=True),  # fmt: skip
    Malformed("json_schema_object", G, lambda c: _gen(c, json_schema={"type": "object"}), "json_schema",
              fixed_here=True),  # fmt: skip
    Malformed("sampling_params_string", G, lambda c: {"input_ids": list(c.prompt), "sampling_params": "greedy"},
              "sampling_params"),  # fmt: skip
    Malformed("input_ids_string", G, lambda c: {"input_ids": "bako", "sampling_params": {"max_new_tokens": 8}},
              "input_ids"),  # fmt: skip
    Malformed("text_number", G, lambda c: {"text": 42, "sampling_params": {"max_new_tokens": 8}}, "text"),
    Malformed("max_tokens_string_openai", C, lambda c: _cmpl(c, max_tokens="many"), "max_tokens"),
    Malformed("temperature_string_chat", CH, lambda c: _chat(c, temperature="hot"), "temperature"),
    Malformed("messages_string_chat", CH, lambda c: {**_chat(c), "messages": "bako"}, "messages"),
    Malformed("invalid_json", G, _raw('{"input_ids": PROMPT, "sampling_params": {'), "json"),
    # about 10 MB
    Malformed("body_10mb_text", G, _big_text, "context length"),
    Malformed("body_10mb_input_ids", G, _big_ids, "context length"),
    Malformed("body_10mb_chat", CH, _big_chat, "context length"),
    Malformed("body_10mb_not_json", G, lambda c: b"{" + b"x" * BIG_BODY_BYTES, "json"),
    # what the speculative verify cannot give: refused by the scheduler on DFLASH and DDTREE
    Malformed("return_logprob_spec", G, lambda c: {**_gen(c), "return_logprob": True}, "return_logprob",
              spec_only=True),  # fmt: skip
    Malformed("logprobs_openai_spec", C, lambda c: _cmpl(c, logprobs=2), "return_logprob", spec_only=True),
]
BY_NAME = {case.name: case for case in CASES}


def error_message(body: bytes) -> str:
    """The message of an error response: upstream answers ``{"error": {"message": ...}}``
    on the native API and ``{"message": ..., "object": "error"}`` on the OpenAI one."""
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(data, dict):
        return ""
    err = data.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"]
    if isinstance(err, str):
        return err
    return data.get("message") if isinstance(data.get("message"), str) else ""


def rejection_problem(case: Malformed, status: int, body: bytes) -> Optional[str]:
    """None when the answer is the refusal the case expects, else what is wrong with it."""
    message = error_message(body)
    if status != case.status:
        return f"{case.name}: HTTP {status}, expected {case.status}: {body[:300]!r}"
    if not message:
        return f"{case.name}: HTTP {status} without an error message: {body[:300]!r}"
    if case.expect.lower() not in message.lower():
        return f"{case.name}: the message does not mention {case.expect!r}: {message[:300]!r}"
    return None
