# SPDX-License-Identifier: Apache-2.0
"""Every malformed request of the soak piece's table (tests/gpu/soak/_malformed.py) gets, from
upstream's real HTTP app and tokenizer manager (with patch 0084), the 400 and the message the
GPU test will expect, never reaches the scheduler, leaves no request state behind, and the
next valid request is served. Requests the scheduler refuses on a speculative server
(``spec_only``) are checked against upstream's own ``validate_dflash_request``.

What upstream does with the requests patch 0084 refuses, on its own code: a wrong type or an
unknown parameter raises ``TypeError`` in ``SamplingParams`` (a 500 on ``/generate``, which
turns only ``ValueError`` into a 400), and ``SamplingBatchInfo.from_schedule_batch``, which
the scheduler runs for every batch, raises on top-k beyond int32, a non-numeric logit bias and
stop ids outside the vocabulary (an exception there kills the server).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.cpu.request_checks.conftest import CONTEXT, VOCAB
from tests.gpu.soak._malformed import BY_NAME, CASES, Ctx, error_message, rejection_problem

CTX = Ctx(model="tiny", context_len=CONTEXT, vocab_size=VOCAB, prompt=(1, 17, 18, 300))
VALID = {
    "/generate": {"input_ids": list(CTX.prompt), "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
    "/v1/completions": {"model": "tiny", "prompt": list(CTX.prompt), "max_tokens": 8, "temperature": 0},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "bako dilu"}],
                             "max_tokens": 8, "temperature": 0},
}  # fmt: skip


def _post(served, path, payload: bytes):
    before = len(served.sent)
    status, body = served.post(path, payload)
    return status, body, served.sent[before:]


@pytest.mark.parametrize("name", [c.name for c in CASES if not c.spec_only])
def test_refused_before_the_scheduler(served, name):
    case = BY_NAME[name]
    status, body, reached = _post(served, case.path, case.payload(CTX))
    assert rejection_problem(case, status, body) is None, rejection_problem(case, status, body)
    assert not reached, f"{name} reached the scheduler"
    assert not served.tokenizer_manager.rid_to_state, "a refused request left its state behind"
    status, body, reached = _post(served, case.path, json.dumps(VALID[case.path]).encode())
    assert status == 200 and len(reached) == 1, body[:300]


@pytest.mark.parametrize("path", sorted(VALID))
def test_valid_requests_are_served(served, path):
    status, body, reached = _post(served, path, json.dumps(VALID[path]).encode())
    assert status == 200, body[:300]
    (tokenized,) = reached
    assert tokenized.sampling_params.max_new_tokens == 8 and tokenized.sampling_params.top_k == 1


def test_integral_floats_are_integers(served):
    payload = {"input_ids": list(CTX.prompt), "sampling_params": {"max_new_tokens": 8.0, "top_k": 20.0,
                                                                   "temperature": 1}}  # fmt: skip
    status, body, (tokenized,) = _post(served, "/generate", json.dumps(payload).encode())
    assert status == 200, body
    assert (tokenized.sampling_params.max_new_tokens, tokenized.sampling_params.top_k) == (8, 20)
    assert isinstance(tokenized.sampling_params.top_k, int)


def test_the_largest_top_k_and_the_whole_context_are_served(served):
    """The bounds are inclusive: top_k 2^30 (upstream's "whole vocabulary") and a request
    whose prompt and max_new_tokens fill the context exactly."""
    prompt = list(CTX.prompt)
    payload = {"input_ids": prompt, "sampling_params": {"max_new_tokens": CONTEXT - len(prompt), "top_k": 1 << 30,
                                                        "temperature": 1.0}}  # fmt: skip
    status, body, (tokenized,) = _post(served, "/generate", json.dumps(payload).encode())
    assert status == 200, body
    assert tokenized.sampling_params.top_k == 1 << 30


def test_a_batch_is_checked_prompt_by_prompt(served):
    payload = {"input_ids": [list(CTX.prompt), [1, VOCAB]], "sampling_params": {"max_new_tokens": 4}}
    status, body, reached = _post(served, "/generate", json.dumps(payload).encode())
    assert status == 400 and "outside the vocabulary" in error_message(body) and not reached
    payload = {"input_ids": [list(CTX.prompt)] * 2, "sampling_params": [{"max_new_tokens": 4}, {"top_k": "x"}]}
    status, body, reached = _post(served, "/generate", json.dumps(payload).encode())
    assert status == 400 and "sampling_params" not in error_message(body) and "top_k" in error_message(body)


@pytest.mark.parametrize("name", [c.name for c in CASES if c.spec_only])
def test_spec_only_cases_are_refused_by_upstreams_dflash_check(served, name):
    """Served without speculation; on DFLASH and DDTREE servers the scheduler's
    ``validate_dflash_request`` refuses what it was sent, with a 400 (``set_finish_with_abort``)."""
    from sglang.srt.speculative.dflash_utils import validate_dflash_request

    case = BY_NAME[name]
    status, body, (tokenized,) = _post(served, case.path, case.payload(CTX))
    assert status == 200, body[:300]
    message = validate_dflash_request(SimpleNamespace(return_logprob=tokenized.return_logprob,
                                                      return_hidden_states=False), enable_overlap=True)  # fmt: skip
    assert message and case.expect in message


# ------------------------------------------------------------------ upstream without the checks


def _upstream_params(**kw):
    """Sampling parameters as upstream's tokenizer manager builds and verifies them."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    sp = SamplingParams(**kw)
    sp.normalize(SimpleNamespace(encode=lambda s, add_special_tokens=False: [5]))
    sp.verify(VOCAB)
    return sp


@pytest.mark.parametrize("params", [{"max_tokens": 8}, {"temperature": "hot"}, {"max_new_tokens": "ten"}])
def test_upstream_raises_type_errors(params):
    with pytest.raises(TypeError):
        _upstream_params(**params)


class _Batch:
    """What ``SamplingBatchInfo.from_schedule_batch`` reads of a ScheduleBatch."""

    def __init__(self, reqs):
        self.reqs, self.device = reqs, "cpu"

    def batch_size(self):
        return len(self.reqs)


@pytest.mark.parametrize("params,error", [
    ({"top_k": 10**12, "temperature": 1.0}, "int32"),
    ({"logit_bias": {"17": "x"}}, "str"),
    ({"min_new_tokens": 2, "max_new_tokens": 8, "stop_token_ids": [VOCAB + 100], "temperature": 1.0}, "out of bounds"),
])  # fmt: skip
def test_upstream_scheduler_batch_raises(params, error, tmp_path):
    """Upstream's checks pass these; the scheduler's batch construction then raises."""
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from tests.cpu.request_checks.conftest import write_model_dir

    sp = _upstream_params(**params)
    set_global_server_args_for_scheduler(ServerArgs(model_path=str(write_model_dir(tmp_path)), device="cpu"))
    tok = SimpleNamespace(additional_stop_token_ids=None, eos_token_id=2)
    req = SimpleNamespace(sampling_params=sp, custom_logit_processor=None, return_sampling_mask=False, tokenizer=tok,
                          output_ids=[], origin_input_ids=[1, 17])  # fmt: skip
    ok = SimpleNamespace(**{**vars(req), "sampling_params": _upstream_params(temperature=1.0, top_k=5)})
    SamplingBatchInfo.from_schedule_batch(_Batch([ok]), VOCAB)
    with pytest.raises((RuntimeError, TypeError, IndexError), match=error):
        SamplingBatchInfo.from_schedule_batch(_Batch([ok, req]), VOCAB)



# ------------------------------------------------------------------ upstream alone, on the same table


@pytest.fixture
def upstream_alone(served, monkeypatch):
    """The served app with patch 0084's two checks switched off: upstream 0.5.17's own answers."""
    from sglang.srt.managers import request_checks, tokenizer_manager

    monkeypatch.setattr(request_checks, "check_sampling_params", lambda params: None)
    monkeypatch.setattr(tokenizer_manager, "check_generate_input", lambda *a, **k: None)
    return served


@pytest.mark.parametrize("name", [c.name for c in CASES if not c.spec_only])
def test_fixed_here_marks_what_upstream_does_not_refuse(upstream_alone, name):
    """``fixed_here`` is exact: without patch 0084 upstream refuses every other case as the
    table expects, and none of the ``fixed_here`` ones (it answers 500, passes the request on
    to the scheduler, or refuses with a message that does not name the parameter)."""
    case = BY_NAME[name]
    status, body, reached = _post(upstream_alone, case.path, case.payload(CTX))
    problem = rejection_problem(case, status, body)
    if case.fixed_here:
        assert problem is not None, f"upstream alone already answers {name} as expected"
        assert status == 500 or reached or status == 400, (status, body[:300])
    else:
        assert problem is None, problem
        assert not reached
