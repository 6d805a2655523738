# SPDX-License-Identifier: Apache-2.0
"""gpu_arch: exact predicates, per-arch limits, the kernel-arch override."""

import importlib.util
import logging
import subprocess
import sys

import pytest
import torch

from sglang.srt.utils import gpu_arch

CAPS = [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)]


@pytest.mark.parametrize("cap", CAPS)
def test_predicates_are_exact(cap):
    assert gpu_arch.is_sm120(cap) == (cap == (12, 0))
    assert gpu_arch.is_sm121(cap) == (cap == (12, 1))
    assert gpu_arch.is_sm12x(cap) == (cap[0] == 12)
    assert gpu_arch.is_datacenter_blackwell(cap) == (cap[0] in (10, 11))
    assert gpu_arch.is_sm100(cap) == (cap[0] == 10)
    assert gpu_arch.is_hopper(cap) == (cap == (9, 0))
    assert gpu_arch.has_wgmma(cap) == (cap == (9, 0))
    assert gpu_arch.has_tcgen05(cap) == (cap[0] in (10, 11))
    # Workstation and datacenter Blackwell never overlap (the upstream trap).
    assert not (gpu_arch.is_sm12x(cap) and gpu_arch.is_datacenter_blackwell(cap))


@pytest.mark.parametrize(
    "cap,limit",
    [
        ((8, 0), 166912),  # 163 KB
        ((8, 6), 101376),  # 99 KB
        ((8, 9), 101376),
        ((9, 0), 232448),  # 227 KB
        ((10, 0), 232448),
        ((10, 3), 232448),
        ((12, 0), 101376),
        ((12, 1), 101376),
    ],
)
def test_max_shared_memory_per_block(cap, limit):
    assert gpu_arch.max_shared_memory_per_block(cap) == limit


def test_limit_for_unknown_arch_is_an_error():
    with pytest.raises(ValueError, match="13.0"):
        gpu_arch.max_shared_memory_per_block((13, 0))
    with pytest.raises(TypeError):
        gpu_arch.max_shared_memory_per_block("12.0")


@pytest.mark.parametrize(
    "text,cap",
    [("12.0", (12, 0)), (" 12.1 ", (12, 1)), ("sm_120", (12, 0)), ("SM120a", (12, 0)),
     ("sm_90a", (9, 0)), ("10.3", (10, 3)), ("sm_100f", (10, 0)), ("8.9", (8, 9))],
)
def test_parse_capability(text, cap):
    assert gpu_arch.parse_capability(text) == cap


@pytest.mark.parametrize("text", ["", "12", "120", "13.0", "12.0.1", "sm_1", "blackwell", "12,0"])
def test_parse_capability_rejects(text):
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        gpu_arch.parse_capability(text)


@pytest.fixture
def fresh_override(monkeypatch):
    monkeypatch.delenv(gpu_arch.KERNEL_ARCH_ENV, raising=False)
    monkeypatch.delenv(gpu_arch.SM120_PROXY_ENV, raising=False)
    gpu_arch._override_from_env.cache_clear()
    gpu_arch._warn_proxy.cache_clear()
    yield
    gpu_arch._override_from_env.cache_clear()
    gpu_arch._warn_proxy.cache_clear()


@pytest.fixture
def fake_h200(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")


def _override_warnings(caplog):
    return [r for r in caplog.records if gpu_arch.KERNEL_ARCH_ENV in r.getMessage()]


def test_kernel_arch_follows_the_device_without_override(fresh_override, fake_h200, caplog):
    with caplog.at_level(logging.WARNING, logger=gpu_arch.__name__):
        assert gpu_arch.kernel_arch() == (9, 0)
        assert gpu_arch.device_capability() == (9, 0)
    assert gpu_arch.kernel_arch_override() is None
    assert not _override_warnings(caplog)


def test_override_selects_configs_and_warns_once(fresh_override, fake_h200, monkeypatch, caplog):
    monkeypatch.setenv(gpu_arch.KERNEL_ARCH_ENV, "12.0")
    with caplog.at_level(logging.WARNING, logger=gpu_arch.__name__):
        assert gpu_arch.kernel_arch() == (12, 0)
        assert gpu_arch.kernel_arch() == (12, 0)
        # The override never changes what the device reports (gating uses this).
        assert gpu_arch.device_capability() == (9, 0)
    warns = _override_warnings(caplog)
    assert len(warns) == 1
    assert warns[0].levelno == logging.WARNING
    assert "sm_120" in warns[0].getMessage() and "gating" in warns[0].getMessage()

    monkeypatch.setenv(gpu_arch.KERNEL_ARCH_ENV, "sm_121")
    with caplog.at_level(logging.WARNING, logger=gpu_arch.__name__):
        assert gpu_arch.kernel_arch() == (12, 1)
    assert len(_override_warnings(caplog)) == 2


def test_bad_override_is_a_clear_error(fresh_override, fake_h200, monkeypatch):
    monkeypatch.setenv(gpu_arch.KERNEL_ARCH_ENV, "blackwell")
    for _ in range(2):  # not cached as valid
        with pytest.raises(ValueError) as e:
            gpu_arch.kernel_arch()
        assert gpu_arch.KERNEL_ARCH_ENV in str(e.value) and "12.0" in str(e.value)


def test_empty_override_means_unset(fresh_override, fake_h200, monkeypatch):
    monkeypatch.setenv(gpu_arch.KERNEL_ARCH_ENV, "  ")
    assert gpu_arch.kernel_arch() == (9, 0)


def test_no_gpu(fresh_override, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        gpu_arch.device_capability()
    with pytest.raises(RuntimeError):
        gpu_arch.kernel_arch()
    assert gpu_arch.is_sm12x() is False  # "the current GPU" is none
    assert gpu_arch.device_name() == "unknown GPU"
    monkeypatch.setenv(gpu_arch.KERNEL_ARCH_ENV, "12.0")
    assert gpu_arch.kernel_arch() == (12, 0)  # configs can still be chosen


def test_module_is_import_light_and_never_initialises_cuda():
    """Loaded on its own it pulls in no torch; with the override (read through the
    fork's environment registry, which imports sglang) it never touches CUDA."""
    code = (
        "import importlib.util, os, sys\n"
        f"spec = importlib.util.spec_from_file_location('ga', {gpu_arch.__file__!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "assert 'torch' not in sys.modules, 'import pulled in torch'\n"
        "assert m.is_sm120((12, 0)) and m.max_shared_memory_per_block((12, 1)) == 101376\n"
        "os.environ[m.KERNEL_ARCH_ENV] = '12.0'\n"
        "assert m.kernel_arch() == (12, 0)\n"
        "import torch\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_sm120_proxy_serves_the_sm120_tiles_and_policy(fresh_override, fake_h200, monkeypatch, caplog):
    """SGLANG_DDTREE_SM120_PROXY=1: the kernel tiles and the verify policy are sm_120's on
    the H200, announced once; gating still sees the H200."""
    assert gpu_arch.policy_arch() == (9, 0) and not gpu_arch.sm120_proxy()
    monkeypatch.setenv(gpu_arch.SM120_PROXY_ENV, "1")
    with caplog.at_level(logging.WARNING, logger=gpu_arch.__name__):
        assert gpu_arch.kernel_arch() == (12, 0)
        assert gpu_arch.policy_arch() == (12, 0)
        assert gpu_arch.policy_arch() == (12, 0)
        assert gpu_arch.device_capability() == (9, 0)
    warns = [r for r in caplog.records if gpu_arch.SM120_PROXY_ENV in r.getMessage()]
    assert len(warns) == 1 and "9.0" in warns[0].getMessage() and "no FlashMLA" in warns[0].getMessage()


def test_kernel_arch_alone_keeps_the_policy(fresh_override, fake_h200, monkeypatch):
    monkeypatch.setenv(gpu_arch.KERNEL_ARCH_ENV, "12.0")
    assert gpu_arch.kernel_arch() == (12, 0)
    assert gpu_arch.policy_arch() == (9, 0)


def test_proxy_and_another_kernel_arch_conflict(fresh_override, fake_h200, monkeypatch):
    monkeypatch.setenv(gpu_arch.SM120_PROXY_ENV, "1")
    monkeypatch.setenv(gpu_arch.KERNEL_ARCH_ENV, "12.0")
    assert gpu_arch.kernel_arch() == (12, 0)  # the same arch: consistent
    monkeypatch.setenv(gpu_arch.KERNEL_ARCH_ENV, "9.0")
    with pytest.raises(ValueError, match="unset one of them"):
        gpu_arch.kernel_arch()
