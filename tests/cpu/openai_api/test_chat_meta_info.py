# SPDX-License-Identifier: Apache-2.0
"""``return_meta_info`` puts the request's meta_info at the top level of a non-streaming
chat completion (patch 0081), where ``dflash benchmark openai`` (pip package ``dflash``
0.1.0, ``benchmark._run_openai``) reads ``meta_info.spec_accept_length`` and
``meta_info.spec_verify_ct`` beside ``usage.completion_tokens``; upstream's per-choice
``meta_info`` stays.

The responses are built by upstream's real (patched) ``OpenAIServingChat._build_chat_response``
from meta_info that upstream's ``TokenizerManager._calculate_spec_decoding_metrics``
computes, and read back from the JSON the HTTP layer sends.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.managers.tokenizer_manager import TokenizerManager

BUDGET = 16  # DDTREE's default: the verify width is 17 tokens


def meta_info(rid, completion_tokens, verify_ct, correct):
    """A finished request's meta_info with upstream's speculative metrics."""
    tm = object.__new__(TokenizerManager)
    tm.server_args = SimpleNamespace(speculative_num_draft_tokens=BUDGET + 1)
    meta = {"id": rid, "finish_reason": {"type": "length", "length": completion_tokens},
            "prompt_tokens": 11, "completion_tokens": completion_tokens, "cached_tokens": 0,
            "weight_version": "default", "e2e_latency": 0.5}  # fmt: skip
    recv = SimpleNamespace(
        spec_verify_ct=[verify_ct], spec_num_correct_drafts=[correct], completion_tokens=[completion_tokens],
        spec_correct_drafts_histogram=[], spec_num_cap_tokens=None, spec_cap_lens_histogram=None,
    )  # fmt: skip
    tm._calculate_spec_decoding_metrics(meta, recv, 0)
    return meta


def respond(metas, **request):
    chat = object.__new__(OpenAIServingChat)
    chat.chat_encoding_spec = None
    chat.reasoning_parser = None
    chat.tool_call_parser = None
    chat.tokenizer_manager = SimpleNamespace(server_args=SimpleNamespace(enable_cache_report=False))
    req = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "bako"}], max_tokens=64, n=len(metas), **request
    )
    ret = [{"text": "dake mori", "output_ids": [20, 21], "meta_info": m} for m in metas]
    response = chat._build_chat_response(req, ret, 1234)
    return json.loads(response.model_dump_json())


def client_reading(out):
    """What ``dflash benchmark openai`` takes from one response."""
    meta = out.get("meta_info", {}) or {}
    return (
        int((out.get("usage", {}) or {}).get("completion_tokens", 0)),
        int(meta.get("spec_verify_ct", 0)),
        float(meta["spec_accept_length"]) if "spec_accept_length" in meta else None,
    )


def test_one_choice_has_its_meta_info_on_top():
    m = meta_info("r1", completion_tokens=60, verify_ct=12, correct=48)
    out = respond([m], return_meta_info=True)
    assert out["meta_info"] == out["choices"][0]["meta_info"]
    assert out["meta_info"]["spec_accept_length"] == 60 / 12
    assert client_reading(out) == (60, 12, 5.0)


def test_several_choices_are_summed_as_one_request():
    ms = [meta_info("r1", 60, 12, 48), meta_info("r1", 40, 20, 20)]
    out = respond(ms, return_meta_info=True)
    top = out["meta_info"]
    assert [c["meta_info"]["spec_verify_ct"] for c in out["choices"]] == [12, 20]  # per choice, as upstream
    assert (top["n"], top["completion_tokens"], top["spec_verify_ct"]) == (2, 100, 32)
    assert top["spec_accept_length"] == 100 / 32
    assert top["spec_accept_rate"] == (48 + 20) / ((12 + 20) * BUDGET)
    assert (top["spec_num_correct_drafts"], top["spec_num_proposed_drafts"]) == (68, 32 * BUDGET)
    assert top["prompt_tokens"] == 11 and top["e2e_latency"] == 0.5
    assert client_reading(out) == (100, 32, 100 / 32)  # usage and meta_info count the same tokens


def test_without_return_meta_info_nothing_changes():
    out = respond([meta_info("r1", 60, 12, 48)])
    assert "meta_info" not in out and "meta_info" not in out["choices"][0]
    assert client_reading(out) == (60, 0, None)


def test_a_request_without_verify_steps_reports_no_acceptance():
    """A server without speculation (or a request done at prefill) has no spec fields:
    the client then prints no accept length rather than a wrong one."""
    m = {"id": "r1", "finish_reason": {"type": "stop"}, "prompt_tokens": 11, "completion_tokens": 1,
         "cached_tokens": 0, "weight_version": "default"}  # fmt: skip
    out = respond([m], return_meta_info=True)
    assert out["meta_info"]["completion_tokens"] == 1 and "spec_accept_length" not in out["meta_info"]
    assert client_reading(out) == (1, 0, None)
