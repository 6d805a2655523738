# SPDX-License-Identifier: Apache-2.0
"""backend_support's table against the real registry, and the registry guard."""

import types

import pytest
import torch

from sglang.srt.layers.attention import backend_support as bs
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.utils import common

# Backends with no kernel at all on compute capability 12.x (see docs/sm120.md).
NO_SM12X_KERNEL = {
    "fa3", "fa4", "flashmla", "cutlass_mla", "trtllm_mla", "tokenspeed_mla",
    "cutedsl_mla", "hpc_ops", "dual_chunk_flash_attn",
    "aiter", "wave", "ascend", "intel_amx", "intel_xpu",
}


def test_every_registered_backend_has_an_sm12x_entry():
    assert set(bs.SM12X_SUPPORT) == set(ATTENTION_BACKENDS)


@pytest.mark.parametrize("name", sorted(NO_SM12X_KERNEL))
def test_backends_without_sm12x_kernels_serve_nothing(name):
    s = bs.SM12X_SUPPORT[name]
    assert not s.mla and not s.mha
    assert s.reason


def test_every_partial_entry_says_why():
    for name, s in bs.SM12X_SUPPORT.items():
        if s.mla != bs.ALL_ROLES or s.mha != bs.ALL_ROLES:
            assert len(s.reason) > 20, name


@pytest.mark.parametrize("cap", [(12, 0), (12, 1)])
@pytest.mark.parametrize("kind", [bs.MLA, bs.MHA])
def test_defaults_work_in_every_role(cap, kind):
    default = bs.default_backend(cap, kind)
    assert default == ("triton" if kind == bs.MLA else "flashinfer")
    for role in bs.ROLES:
        assert default in bs.backends_for(cap, kind, role)
        bs.check_backend(default, role, kind, cap, "GPU")  # does not raise


@pytest.mark.parametrize("cap", [(8, 0), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0)])
def test_other_gpus_are_not_judged(cap):
    assert bs.support_for("fa3", cap) is None
    assert bs.backends_for(cap, bs.MLA, bs.DECODE) == ()
    bs.check_backend("cutlass_mla", bs.DECODE, bs.MHA, cap, "GPU")  # upstream decides


def test_refusal_names_gpu_reason_and_alternatives():
    with pytest.raises(bs.UnsupportedAttentionBackendError) as e:
        bs.check_backend("flashmla", bs.DECODE, bs.MLA, (12, 1), "NVIDIA GB10",
                         "--decode-attention-backend")
    msg = str(e.value)
    for part in ("'flashmla'", "--decode-attention-backend", "NVIDIA GB10", "12.1",
                 "sm_121", "sm_90a", "triton", "flashinfer"):
        assert part in msg
    assert isinstance(e.value, ValueError)


def test_trtllm_mha_is_decode_only_on_sm12x():
    cap = (12, 0)
    bs.check_backend("trtllm_mha", bs.DECODE, bs.MHA, cap, "GPU")
    for role in (bs.PREFILL, bs.DRAFT):
        with pytest.raises(bs.UnsupportedAttentionBackendError):
            bs.check_backend("trtllm_mha", role, bs.MHA, cap, "GPU")
    with pytest.raises(bs.UnsupportedAttentionBackendError):
        bs.check_backend("trtllm_mha", bs.DECODE, bs.MLA, cap, "GPU")


def test_tree_verify_table():
    from sglang.srt.layers.attention.tree_verify import support

    assert support.supports_tree_verify("triton", (12, 0), bs.MLA)
    assert support.supports_tree_verify("flashinfer", (12, 0), bs.MHA)
    assert support.supports_tree_verify("flashinfer", (12, 0), bs.MLA)  # through the hook (0031)
    assert not support.supports_tree_verify("fa3", (9, 0), bs.MHA)
    assert not support.supports_tree_verify("triton", (7, 5), bs.MHA)


# -- registry guard (patch 0012) -------------------------------------------


@pytest.fixture
def fake_cap(monkeypatch):
    def set_cap(cap):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "FAKE GPU")
        common.is_cuda.cache_clear()

    yield set_cap
    common.is_cuda.cache_clear()


def _runner(mla):
    # The factories only read these; the guard must decide before using them.
    return types.SimpleNamespace(use_mla_backend=mla, server_args=None, model_config=None)


def test_registry_factories_are_guarded():
    for name, factory in ATTENTION_BACKENDS.items():
        assert getattr(factory, "__wrapped__", None) is not None, name


@pytest.mark.parametrize("name", ["fa3", "flashmla", "cutlass_mla", "hpc_ops", "aiter"])
def test_registry_refuses_on_sm12x(fake_cap, name):
    fake_cap((12, 0))
    with pytest.raises(bs.UnsupportedAttentionBackendError, match="FAKE GPU"):
        ATTENTION_BACKENDS[name](_runner(mla=False))


def test_fa3_assert_became_a_refusal(fake_cap):
    """Upstream's fa3 factory asserts on sm_12x (after the weights are loaded); the
    guard refuses first, with a message naming the GPU, the backend and why."""
    fake_cap((12, 1))
    with pytest.raises(AssertionError, match="FlashAttention v3"):
        ATTENTION_BACKENDS["fa3"].__wrapped__(_runner(mla=True))  # upstream's own factory
    with pytest.raises(bs.UnsupportedAttentionBackendError) as e:
        ATTENTION_BACKENDS["fa3"](_runner(mla=True))
    msg = str(e.value)
    for part in ("'fa3'", "FAKE GPU", "12.1", "sm_121", "FlashAttention-3", "triton"):
        assert part in msg, part


def test_registry_delegates_on_hopper(fake_cap):
    """Upstream's own factory runs on sm_90: its MLA check fires, not ours."""
    fake_cap((9, 0))
    with pytest.raises(ValueError, match="non-MLA") as e:
        ATTENTION_BACKENDS["hpc_ops"](_runner(mla=True))
    assert not isinstance(e.value, bs.UnsupportedAttentionBackendError)


def test_registry_delegates_for_working_backends_on_sm12x(fake_cap):
    fake_cap((12, 0))
    # triton's factory reads runner.model_config first (None here): reaching it
    # proves the guard let the backend through.
    with pytest.raises(AttributeError, match="is_encoder_decoder"):
        ATTENTION_BACKENDS["triton"](_runner(mla=True))


def test_registry_refuses_mha_only_backend_for_mla_on_sm12x(fake_cap):
    fake_cap((12, 0))
    with pytest.raises(bs.UnsupportedAttentionBackendError, match="MHA models only"):
        ATTENTION_BACKENDS["trtllm_mha"](_runner(mla=True))
