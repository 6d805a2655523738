# SPDX-License-Identifier: Apache-2.0
"""Which attention backends can run on which GPU, checked at startup.

Upstream 0.5.17 lets several backends through its argument checks on
workstation Blackwell (compute capability 12.x: RTX PRO 6000, RTX 5090,
DGX Spark) that then fail at the first forward: no SASS for the arch, a trap
stub, or an assert. This module holds the table of what each registered
backend can do on sm_12x, and the checks ``ServerArgs`` runs before any
weight is loaded:

* an explicitly requested backend that cannot run is refused with a message
  that names the GPU, the reason and the backends that work instead;
* a backend that a model override picked by default and that cannot run is
  replaced by triton (upstream's generic defaults, MLA: triton and MHA:
  flashinfer, already work there and are kept).

Only the 12.x family is judged (``GATED_FAMILIES``). On every other GPU the
checks return without touching anything, so behaviour there is upstream's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, Iterable, Optional, Tuple

from sglang.srt.utils import gpu_arch

logger = logging.getLogger(__name__)

PREFILL = "prefill"
DECODE = "decode"
TARGET_VERIFY = "target_verify"
DRAFT = "draft"
ROLES = (PREFILL, DECODE, TARGET_VERIFY, DRAFT)

MLA = "mla"
MHA = "mha"

ALL_ROLES: FrozenSet[str] = frozenset(ROLES)
NO_ROLES: FrozenSet[str] = frozenset()

#: Arch families whose backend choices this module enforces.
GATED_FAMILIES = ("sm12x",)


@dataclass(frozen=True)
class Support:
    """What one backend can do on one arch family.

    ``mla`` / ``mha``: the roles it can serve for that kind of model.
    ``reason``: why roles are missing (shown to the user when refused).
    ``model_specific``: the backend serves one model family only (DeepSeek
    sparse attention); the arch table does not judge those models.
    """

    mla: FrozenSet[str] = NO_ROLES
    mha: FrozenSet[str] = NO_ROLES
    reason: str = ""
    model_specific: bool = False

    def roles(self, kind: str) -> FrozenSet[str]:
        return self.mla if kind == MLA else self.mha


def _only(*roles: str) -> FrozenSet[str]:
    return frozenset(roles)


_NOT_CUDA = "not a CUDA backend"

# Compute capability 12.x. Every name that 0.5.17 registers in
# attention_registry.ATTENTION_BACKENDS must have an entry (a test enforces it).
SM12X_SUPPORT: Dict[str, Support] = {
    "triton": Support(
        mla=ALL_ROLES,
        mha=ALL_ROLES,
        reason="Triton compiles for sm_120; upstream has sm_12x tile sizes",
    ),
    "flashinfer": Support(
        mla=ALL_ROLES,
        mha=ALL_ROLES,
        reason="FlashInfer's FA2 kernels (and its FA2 MLA kernel) run on sm_12x",
    ),
    "torch_native": Support(
        mla=ALL_ROLES, mha=ALL_ROLES, reason="plain PyTorch (SDPA); slow"
    ),
    "flex_attention": Support(
        mla=_only(PREFILL, DECODE),
        mha=_only(PREFILL, DECODE),
        reason="SGLang's flex_attention backend has no speculative-decoding "
        "support on any GPU",
    ),
    "trtllm_mha": Support(
        mha=_only(DECODE, TARGET_VERIFY),
        reason="on sm_12x FlashInfer runs trtllm_mha through its XQA decode "
        "kernels only; the trtllm-gen prefill kernels are SM100-only, and the "
        "backend serves MHA models only",
    ),
    "fa3": Support(
        reason="FlashAttention-3 in sgl-kernel ships SASS for sm_80/sm_90a only "
        "(wgmma and TMA kernels); upstream asserts at backend creation",
    ),
    "fa4": Support(
        reason="FlashAttention-4's sm_120 kernel has no paged-KV (page_table) and "
        "no split-KV support, which SGLang's fa4 backend always uses, and its "
        "absorbed-MLA (qv) path is SM100/SM110-only",
    ),
    "flashmla": Support(
        reason="FlashMLA ships SASS for sm_90a/sm_100a/sm_103a only",
    ),
    "cutlass_mla": Support(
        reason="the CUTLASS MLA kernel is built for sm_100a only (a trap stub "
        "on sm_120)",
    ),
    "trtllm_mla": Support(
        reason="prefill needs trtllm-gen (SM100-only); FlashInfer routes sm_12x "
        "MLA decode to XQA, which takes one query per request, 128 heads only "
        "and returns no LSE",
    ),
    "tokenspeed_mla": Support(
        reason="tokenspeed_mla's CuTe DSL kernels target sm_100/sm_103 "
        "(tcgen05/TMEM) only",
    ),
    "cutedsl_mla": Support(
        reason="the CuTe DSL MLA decode kernel uses tcgen05/TMEM (SM100-only)",
    ),
    "hpc_ops": Support(reason="HPC-Ops kernels ship sm_90a only"),
    "dual_chunk_flash_attn": Support(
        reason="built on sgl-kernel's FlashAttention-3 kernels (sm_80/sm_90a only)",
    ),
    "aiter": Support(reason=f"an AMD ROCm backend, {_NOT_CUDA}"),
    "wave": Support(reason=f"an AMD ROCm backend, {_NOT_CUDA}"),
    "ascend": Support(reason=f"a Huawei Ascend NPU backend, {_NOT_CUDA}"),
    "intel_amx": Support(reason=f"an Intel AMX CPU backend, {_NOT_CUDA}"),
    "intel_xpu": Support(reason=f"an Intel XPU backend, {_NOT_CUDA}"),
    "dsa": Support(
        reason="serves DeepSeek sparse-attention (DSA) models only",
        model_specific=True,
    ),
    "nsa": Support(
        reason="deprecated alias of dsa; serves DeepSeek sparse-attention (DSA) "
        "models only",
        model_specific=True,
    ),
    "dsv4": Support(
        reason="serves DeepSeek-V4 compressed-attention models only",
        model_specific=True,
    ),
}

SUPPORT_BY_FAMILY: Dict[str, Dict[str, Support]] = {"sm12x": SM12X_SUPPORT}


def support_for(backend: str, cap: Tuple[int, int]) -> Optional[Support]:
    """The table entry for ``backend`` on ``cap``; None when ``cap`` is not gated."""
    family = gpu_arch.arch_family(cap)
    if family not in GATED_FAMILIES:
        return None
    table = SUPPORT_BY_FAMILY[family]
    if backend not in table:
        return Support(reason=f"'{backend}' is not known to run on {family}")
    return table[backend]


def backends_for(cap: Tuple[int, int], kind: str, role: str) -> Tuple[str, ...]:
    """Backends that can serve ``role`` for a ``kind`` model on ``cap``."""
    family = gpu_arch.arch_family(cap)
    if family not in GATED_FAMILIES:
        return ()
    table = SUPPORT_BY_FAMILY[family]
    return tuple(
        name
        for name, s in table.items()
        if not s.model_specific and role in s.roles(kind)
    )


def default_backend(cap: Tuple[int, int], kind: str, has_attention_sinks=False) -> str:
    """Upstream's generic default on a gated GPU, which works there (named in
    refusals): MLA -> triton, MHA -> flashinfer, or triton for models with
    attention sinks (FlashInfer has none)."""
    if kind == MLA or has_attention_sinks:
        return "triton"
    return "flashinfer"


# What a defaulted backend that cannot run on the GPU is replaced with. Only a
# model override can pick such a default on sm_12x (upstream's generic pick is
# already triton/flashinfer there), and the models with overrides (GPT-OSS,
# Llama 4, Gemma 4, Exaone, Olmo 2, Step 3.5, ...) all accept triton, while
# some reject flashinfer.
REPLACEMENT_BACKEND = "triton"


class UnsupportedAttentionBackendError(ValueError):
    """An attention backend was requested that the GPU cannot run."""


def refusal_message(
    backend: str,
    role: str,
    kind: str,
    cap: Tuple[int, int],
    gpu_name: str,
    flag: Optional[str] = None,
) -> str:
    support = support_for(backend, cap) or Support()
    works = ", ".join(backends_for(cap, kind, role))
    role_text = {
        PREFILL: "prefill",
        DECODE: "decode",
        TARGET_VERIFY: "speculative target verify",
        DRAFT: "speculative draft",
    }[role]
    chosen = f" (set by {flag})" if flag else ""
    return (
        f"Attention backend '{backend}'{chosen} cannot run {role_text} for "
        f"{kind.upper()} models on this GPU: {gpu_name}, compute capability "
        f"{cap[0]}.{cap[1]} ({gpu_arch.arch_name(cap)}). Reason: {support.reason}. "
        f"Backends that work here: {works} (leave the attention-backend flags "
        f"unset to get {default_backend(cap, kind)})."
    )


def check_backend(
    backend: Optional[str],
    role: str,
    kind: str,
    cap: Tuple[int, int],
    gpu_name: str,
    flag: Optional[str] = None,
) -> None:
    """Raise UnsupportedAttentionBackendError if ``backend`` cannot serve ``role``."""
    if backend is None:
        return
    support = support_for(backend, cap)
    if support is None:
        return
    # Sparse-attention models never reach here (they pick their own backends),
    # so a model-specific backend is refused for every other model.
    if support.model_specific or role not in support.roles(kind):
        raise UnsupportedAttentionBackendError(
            refusal_message(backend, role, kind, cap, gpu_name, flag)
        )


# ---------------------------------------------------------------------------
# Startup hooks (called from patched upstream code)
# ---------------------------------------------------------------------------


def _nvidia_capability() -> Optional[Tuple[int, int]]:
    """Capability of the NVIDIA GPU in use, or None (no GPU, ROCm, MUSA, ...)."""
    try:
        import torch
    except ImportError:
        return None
    if torch.version.cuda is None or getattr(torch.version, "hip", None):
        return None
    try:
        return gpu_arch.device_capability()
    except RuntimeError:
        return None


def _gated_gpu(server_args: Any) -> Optional[Tuple[Tuple[int, int], str]]:
    if not str(getattr(server_args, "device", "cuda") or "cuda").startswith("cuda"):
        return None
    cap = _nvidia_capability()
    if cap is None or gpu_arch.arch_family(cap) not in GATED_FAMILIES:
        return None
    return cap, gpu_arch.device_name()


def _model_kind(view: Any) -> str:
    return MLA if view.use_mla_backend() else MHA


def _is_sparse_attention_model(view: Any) -> bool:
    """DSA (DeepSeek-V3.2, GLM-5) and DeepSeek-V4 pick their own backends."""
    from sglang.srt.configs.model_config import is_deepseek_dsa

    hf_config = view.get_model_config().hf_config
    archs = getattr(hf_config, "architectures", None) or []
    return is_deepseek_dsa(hf_config) or "DeepseekV4ForCausalLM" in archs


# Draft models of these algorithms are plain MHA models (Qwen3/Llama-style
# DFlash drafters) whatever the target is.
_MHA_DRAFT_ALGORITHMS = frozenset({"DFLASH", "DDTREE"})


def _draft_kind(algorithm: Optional[str], target_kind: str) -> str:
    if (algorithm or "").upper() in _MHA_DRAFT_ALGORITHMS:
        return MHA
    return target_kind


_ROLE_FIELDS = (
    (PREFILL, "prefill_attention_backend", "--prefill-attention-backend"),
    (DECODE, "decode_attention_backend", "--decode-attention-backend"),
)


def attention_backend_gate(server_args: Any) -> Callable[[Any], dict]:
    """A post-process pass that enforces the table on prefill, decode and verify.

    Runs right after upstream fills in the default backend. It closes over the
    pristine ``server_args`` (whose fields still hold what the user typed)
    and reads the view (what resolution made of it), so it can tell a
    requested backend, which it refuses, from a defaulted one, which it
    replaces.
    """

    def sm12x_attention_backend_gate(view: Any) -> dict:
        gpu = _gated_gpu(server_args)
        if gpu is None or _is_sparse_attention_model(view):
            return {}
        cap, gpu_name = gpu
        kind = _model_kind(view)
        fallback = REPLACEMENT_BACKEND
        declared: Dict[str, Any] = {}
        chosen: Dict[str, Tuple[str, Optional[str]]] = {}

        for role, split_field, split_flag in _ROLE_FIELDS:
            split = declared.get(split_field, getattr(view, split_field))
            backend = split or declared.get("attention_backend", view.attention_backend)
            if getattr(server_args, split_field) is not None:
                flag = split_flag
            elif split is None and server_args.attention_backend is not None:
                flag = "--attention-backend"
            else:
                flag = None  # picked by upstream or a model override
            support = support_for(backend, cap)
            if support is not None and role not in support.roles(kind):
                if flag is not None:
                    check_backend(backend, role, kind, cap, gpu_name, flag)
                logger.warning(
                    "Attention backend %s was picked by default for %s but cannot "
                    "run on %s (%s): %s. Using %s instead.",
                    backend, role, gpu_name, gpu_arch.arch_name(cap),
                    support.reason, fallback,
                )
                declared[split_field if split else "attention_backend"] = fallback
                backend, flag = fallback, None
            chosen[role] = (backend, flag)

        if server_args.speculative_algorithm is not None:
            mode = declared.get(
                "speculative_attention_mode", view.speculative_attention_mode
            )
            verify, flag = chosen[DECODE if mode == "decode" else PREFILL]
            check_backend(verify, TARGET_VERIFY, kind, cap, gpu_name, flag)
            check_backend(
                server_args.speculative_draft_attention_backend,
                DRAFT,
                _draft_kind(server_args.speculative_algorithm, kind),
                cap,
                gpu_name,
                "--speculative-draft-attention-backend",
            )
        return declared

    return sm12x_attention_backend_gate


def check_speculative_backends(server_args: Any) -> None:
    """Refuse a draft backend the GPU cannot run, once speculative args resolved."""
    if server_args.speculative_algorithm is None:
        return
    gpu = _gated_gpu(server_args)
    if gpu is None:
        return
    from sglang.srt.arg_groups.overrides import resolved_view

    view = resolved_view(server_args)
    if _is_sparse_attention_model(view):
        return
    cap, gpu_name = gpu
    check_backend(
        server_args.speculative_draft_attention_backend,
        DRAFT,
        _draft_kind(server_args.speculative_algorithm, _model_kind(view)),
        cap,
        gpu_name,
        "--speculative-draft-attention-backend",
    )


def guard_backend_factory(name: str, factory: Callable) -> Callable:
    """Wrap a registry factory so a backend the GPU cannot run is refused
    cleanly (instead of asserting or crashing at the first forward), even on
    paths that did not go through ServerArgs."""

    def create(runner):
        cap = _nvidia_capability()
        if cap is not None and gpu_arch.arch_family(cap) in GATED_FAMILIES:
            support = support_for(name, cap)
            kind = MLA if getattr(runner, "use_mla_backend", False) else MHA
            if support is not None and not support.model_specific:
                if not support.roles(kind):
                    raise UnsupportedAttentionBackendError(
                        refusal_message(name, DECODE, kind, cap, gpu_arch.device_name())
                    )
        return factory(runner)

    create.__name__ = getattr(factory, "__name__", "create")
    create.__qualname__ = getattr(factory, "__qualname__", create.__name__)
    create.__wrapped__ = factory
    return create


def support_table_rows(family: str = "sm12x") -> Iterable[Tuple[str, str, str, str]]:
    """(backend, MLA roles, MHA roles, reason) rows, for docs and debugging."""
    for name, s in SUPPORT_BY_FAMILY[family].items():
        fmt = lambda r: ", ".join(x for x in ROLES if x in r) or "-"  # noqa: E731
        yield name, fmt(s.mla), fmt(s.mha), s.reason
