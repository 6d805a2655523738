# SPDX-License-Identifier: Apache-2.0
"""Split prefill/decode flags, speculative roles and defaults on sm_12x.

Same harness as the matrix (real ServerArgs, faked capability, compared with
pristine upstream), for the cases the single --attention-backend flag does
not reach.
"""

import pytest

GPU = "FAKE RTX PRO 6000 Blackwell"
SM120, SM121, SM100, SM90 = [12, 0], [12, 1], [10, 0], [9, 0]


def _cell(cap, model, spec=False, **args):
    return {"cap": cap, "model": model, "spec": spec, "args": args}


# (id, cell, expectation). Expectations: ("ok", prefill, decode, draft) or
# ("refused", [substrings]) or ("upstream",) = identical to pristine 0.5.17.
CASES = [
    # Defaults: upstream's own picks work on sm_12x and are kept.
    ("default-mla", _cell(SM120, "mla"), ("ok", "triton", "triton", None)),
    ("default-mha", _cell(SM120, "mha"), ("ok", "flashinfer", "flashinfer", None)),
    ("default-mla-spec", _cell(SM121, "mla", spec=True), ("ok", "triton", "triton", "triton")),
    ("default-mha-spec", _cell(SM120, "mha", spec=True),
     ("ok", "flashinfer", "flashinfer", "flashinfer")),
    # Model overrides that pick a backend with no sm_12x kernel: replaced by
    # triton on sm_12x (Step 3.5: fa4 on every "Blackwell"; Olmo 2: fa3 on any
    # sm >= 80, and it refuses flashinfer), untouched elsewhere.
    ("step3p5-default-sm120", _cell(SM120, "step3p5"), ("ok", "triton", "triton", None)),
    ("step3p5-default-sm100", _cell(SM100, "step3p5"), ("upstream",)),
    ("olmo2-default-sm121", _cell(SM121, "olmo2"), ("ok", "triton", "triton", None)),
    ("olmo2-default-sm90", _cell(SM90, "olmo2"), ("upstream",)),
    ("olmo2-explicit-fa3-sm120", _cell(SM120, "olmo2", attention_backend="fa3"),
     ("refused", ["'fa3' (set by --attention-backend)"])),
    # Split flags.
    ("mha-decode-trtllm_mha", _cell(SM120, "mha", decode_attention_backend="trtllm_mha"),
     ("ok", "flashinfer", "trtllm_mha", None)),
    ("mha-decode-trtllm_mha-verify-on-decode",
     _cell(SM120, "mha", spec=True, decode_attention_backend="trtllm_mha",
           speculative_attention_mode="decode"),
     ("ok", "flashinfer", "trtllm_mha", "flashinfer")),
    ("mha-prefill-fa3", _cell(SM120, "mha", prefill_attention_backend="fa3"),
     ("refused", ["'fa3' (set by --prefill-attention-backend)", "cannot run prefill", GPU])),
    ("mla-decode-flashmla", _cell(SM121, "mla", decode_attention_backend="flashmla"),
     ("refused", ["'flashmla' (set by --decode-attention-backend)", "cannot run decode",
                  "sm_121"])),
    ("mla-decode-trtllm_mla", _cell(SM120, "mla", decode_attention_backend="trtllm_mla"),
     ("refused", ["'trtllm_mla'", "XQA", "no LSE"])),
    ("mla-decode-cutedsl_mla", _cell(SM120, "mla", decode_attention_backend="cutedsl_mla"),
     ("refused", ["'cutedsl_mla'", "tcgen05"])),
    ("mla-decode-trtllm_mha", _cell(SM120, "mla", decode_attention_backend="trtllm_mha"),
     ("refused", ["'trtllm_mha'", "MHA models only"])),
    ("mla-tokenspeed-fp8", _cell(SM120, "mla", attention_backend="tokenspeed_mla",
                                 kv_cache_dtype="fp8_e4m3"),
     ("refused", ["'tokenspeed_mla'", "sm_100/sm_103"])),
    # Speculative roles.
    ("mha-draft-fa3", _cell(SM120, "mha", spec=True,
                            speculative_draft_attention_backend="fa3"),
     ("refused", ["'fa3' (set by --speculative-draft-attention-backend)",
                  "speculative draft"])),
    ("mla-draft-fa4", _cell(SM120, "mla", spec=True,
                            speculative_draft_attention_backend="fa4"),
     ("refused", ["'fa4'", "speculative draft for MHA models"])),
    ("mla-draft-flashinfer", _cell(SM120, "mla", spec=True,
                                   speculative_draft_attention_backend="flashinfer"),
     ("ok", "triton", "triton", "flashinfer")),
    ("mha-flex-spec", _cell(SM120, "mha", spec=True, attention_backend="flex_attention"),
     ("refused", ["cannot run speculative target verify"])),
    ("mha-draft-fa3-hopper", _cell(SM90, "mha", spec=True,
                                   speculative_draft_attention_backend="fa3"),
     ("upstream",)),
    ("mha-prefill-fa3-hopper", _cell(SM90, "mha", prefill_attention_backend="fa3"),
     ("upstream",)),
]


@pytest.fixture(scope="module")
def outcomes(cell_runner):
    res = cell_runner([c for _, c, _ in CASES])
    return {
        name: (got, upstream)
        for (name, _, _), got, upstream in zip(
            CASES, res["patched"]["cells"], res["pristine"]["cells"]
        )
    }


@pytest.mark.parametrize("name,cell,expect", CASES, ids=[c[0] for c in CASES])
def test_case(outcomes, name, cell, expect):
    got, upstream = outcomes[name]
    if expect[0] == "upstream":
        assert got == upstream
    elif expect[0] == "ok":
        assert got["ok"], got
        assert (got["prefill"], got["decode"], got["draft"]) == expect[1:], got
    else:
        assert not got["ok"], f"accepted: {got}"
        assert got["type"] == "UnsupportedAttentionBackendError", got
        for part in expect[1]:
            assert part in got["msg"], (part, got["msg"])


def test_kept_defaults_equal_upstream(outcomes):
    """Where upstream's choice works on sm_12x we change nothing."""
    for name in ("default-mla", "default-mha", "default-mla-spec", "default-mha-spec",
                 "mha-decode-trtllm_mha", "mla-draft-flashinfer"):
        got, upstream = outcomes[name]
        assert got == upstream, name


@pytest.mark.parametrize("name,upstream_pick", [("step3p5-default-sm120", "fa4"),
                                                ("olmo2-default-sm121", "fa3")])
def test_replaced_default_differs_from_upstream(outcomes, name, upstream_pick):
    """Upstream would start these on a backend with no sm_12x kernel."""
    got, upstream = outcomes[name]
    assert upstream["ok"] and upstream["prefill"] == upstream_pick
    assert got["prefill"] == "triton"
