# SPDX-License-Identifier: Apache-2.0
"""What DFLASH/DDTREE refuse per request, through upstream's own arrival check (patch 0083)."""

from _upstream import VOCAB, Batch, Req, params

from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

from sglang.srt.speculative.dflash_utils import validate_dflash_request


def test_plain_sampling_requests_pass(published):
    req = Req(params(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.1), [1], [])
    assert validate_dflash_request(req, enable_overlap=True) is None


def test_sampling_masks_are_refused(published):
    req = Req(params(temperature=1.0), [1], [])
    req.return_sampling_mask = True
    assert "return_sampling_mask" in validate_dflash_request(req, enable_overlap=True)


def test_min_p_under_deterministic_inference_is_refused(deterministic):
    req = Req(params(temperature=1.0, min_p=0.1, sampling_seed=3), [1], [])
    msg = validate_dflash_request(req, enable_overlap=True)
    assert "min_p" in msg and "deterministic" in msg
    # Upstream aborts it after a one-token prefill that samples with its parameters: that
    # prefill must not reach the seeded sampler's min-p assertion (which stops the server).
    assert not SamplingBatchInfo.from_schedule_batch(Batch([req]), VOCAB).need_min_p_sampling
    assert validate_dflash_request(Req(params(temperature=1.0, sampling_seed=3), [1], []), True) is None
