# SPDX-License-Identifier: Apache-2.0
"""The DFlash 2 fields of a drafter checkpoint's ``config.json``, and what is refused.

A DFlash 2 checkpoint is an ordinary DFlash ``config.json`` whose architecture is
``DFlash2DraftModel`` and whose ``dflash_config`` adds:

- ``conv_kernel_size`` / ``conv_group_size``: the grouped dynamic convolution's taps
  and channels per group (both or neither; 0 = no convolution);
- ``selector_rank`` / ``selector_top_k``: the candidate selector's codebook rank and
  candidates per block slot (both; a DFlash 2 drafter needs them);
- ``output_multiplier`` (default 1) and ``final_logit_softcapping`` (default none):
  applied to the candidates' logits before the selector scores them.

Parsed with the same defaults and the same consistency rules as upstream SGLang
(0.5.19 on). Features some DFlash checkpoints carry that this release's drafter
does not implement are refused at start-up, when the draft model is built, with
the field that asked for them (``unsupported_features``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

#: Architectures that load as a DFlash 2 drafter (the second and third are names
#: some published checkpoints declare for the same model).
DFLASH2_ARCHITECTURES = (
    "DFlash2DraftModel",
    "DFlash2BeamDraftModel",
    "MiniMaxDFlash2DraftModel",
)


class UnsupportedDFlash2Checkpoint(ValueError):
    """A DFlash 2 checkpoint this server cannot serve; the message says why."""


@dataclass(frozen=True)
class DFlash2Config:
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    output_multiplier: float
    final_logit_softcapping: Optional[float]

    @property
    def has_conv(self) -> bool:
        return self.conv_kernel_size > 0


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def dflash_section(config: Any) -> dict:
    """The checkpoint's ``dflash_config`` as a dict (empty when absent)."""
    section = _get(config, "dflash_config", None)
    if section is None:
        return {}
    return section if isinstance(section, dict) else dict(section)


def architectures(config: Any) -> List[str]:
    return list(_get(config, "architectures", None) or [])


def is_dflash2_config(config: Any) -> bool:
    """Whether the checkpoint declares a DFlash 2 architecture."""
    return any(a in DFLASH2_ARCHITECTURES for a in architectures(config))


def _non_negative_int(section: dict, key: str) -> int:
    raw = section.get(key, 0)
    try:
        value = int(raw if raw is not None else 0)
    except (TypeError, ValueError):
        raise UnsupportedDFlash2Checkpoint(
            f"DFlash 2 dflash_config.{key} must be an integer, got {raw!r}."
        ) from None
    if isinstance(raw, bool) or value < 0 or (isinstance(raw, float) and raw != value):
        raise UnsupportedDFlash2Checkpoint(
            f"DFlash 2 dflash_config.{key} must be a non-negative integer, got {raw!r}."
        )
    return value


def _pair(section: dict, first: str, second: str, what: str):
    a, b = _non_negative_int(section, first), _non_negative_int(section, second)
    if bool(a) != bool(b):
        raise UnsupportedDFlash2Checkpoint(
            f"DFlash 2 {what} needs {first} and {second} together; the checkpoint has "
            f"{first}={a}, {second}={b}."
        )
    return a, b


def parse_dflash2_config(config: Any) -> DFlash2Config:
    """The DFlash 2 fields, checked for consistency (not for support: see
    ``unsupported_features``)."""
    section = dflash_section(config)
    conv_kernel_size, conv_group_size = _pair(
        section, "conv_kernel_size", "conv_group_size", "grouped convolution"
    )
    selector_rank, selector_top_k = _pair(section, "selector_rank", "selector_top_k", "candidate selector")
    try:
        output_multiplier = float(section.get("output_multiplier", 1.0))
    except (TypeError, ValueError):
        output_multiplier = float("nan")
    if not output_multiplier > 0:
        raise UnsupportedDFlash2Checkpoint(
            "DFlash 2 dflash_config.output_multiplier must be positive, "
            f"got {section.get('output_multiplier')!r}."
        )
    softcap = float(section.get("final_logit_softcapping") or 0.0)
    return DFlash2Config(
        conv_kernel_size=conv_kernel_size,
        conv_group_size=conv_group_size,
        selector_rank=selector_rank,
        selector_top_k=selector_top_k,
        output_multiplier=output_multiplier,
        final_logit_softcapping=softcap if softcap > 0 else None,
    )


def _text_config(config: Any) -> Any:
    text = _get(config, "text_config", None)
    return text if text is not None else config


def unsupported_features(config: Any) -> List[str]:
    """One sentence per feature of a DFlash 2 checkpoint that this release's
    drafter does not implement (empty: the checkpoint can be served)."""
    reasons: List[str] = []
    section = dflash_section(config)
    text = _text_config(config)
    try:
        parsed = parse_dflash2_config(config)
    except UnsupportedDFlash2Checkpoint as e:
        return [str(e)]
    if not parsed.selector_rank:
        reasons.append(
            "it declares a DFlash 2 architecture but its dflash_config has no candidate "
            "selector (selector_rank / selector_top_k)"
        )
    hidden_size = int(_get(text, "hidden_size", 0) or 0)
    if parsed.has_conv and (hidden_size <= 0 or hidden_size % parsed.conv_group_size):
        reasons.append(
            f"conv_group_size={parsed.conv_group_size} does not divide hidden_size={hidden_size}"
        )
    vocab_size = int(_get(text, "vocab_size", 0) or 0)
    if parsed.selector_top_k and vocab_size and parsed.selector_top_k > vocab_size:
        reasons.append(
            f"selector_top_k={parsed.selector_top_k} exceeds vocab_size={vocab_size}"
        )
    if _get(text, "use_gemma_norm", False):
        reasons.append("use_gemma_norm (Gemma-style RMSNorm weights)")
    hidden_act = _get(text, "hidden_act", "silu")
    if hidden_act != "silu":
        reasons.append(f"hidden_act={hidden_act!r} (only silu)")
    if section.get("attention_sink_bias", False):
        reasons.append("dflash_config.attention_sink_bias (per-head attention sinks in the drafter)")
    if section.get("attention_value_scale") is not None:
        reasons.append("dflash_config.attention_value_scale")
    projector = section.get("projector_type", _get(config, "projector_type", None))
    if projector is not None:
        reasons.append(f"projector_type={projector!r} (only the linear context projection)")
    if _get(config, "has_embed_tokens", False) or _get(config, "has_lm_head", False):
        reasons.append("a drafter-owned embedding or LM head (has_embed_tokens / has_lm_head)")
    if _get(config, "quantization_config", None) is not None:
        reasons.append("a quantized drafter (quantization_config)")
    layer_types = _get(text, "layer_types", None)
    if layer_types and "sliding_attention" in layer_types and _get(text, "is_causal", None) is False:
        reasons.append("bidirectional sliding-window layers (layer_types with is_causal=false)")
    return reasons


def check_supported(config: Any) -> DFlash2Config:
    """The parsed DFlash 2 fields, or ``UnsupportedDFlash2Checkpoint`` naming every
    feature of the checkpoint that cannot be served."""
    reasons = unsupported_features(config)
    if reasons:
        archs = ", ".join(architectures(config)) or "DFlash 2"
        raise UnsupportedDFlash2Checkpoint(
            f"This DFlash 2 drafter ({archs}) cannot be served by ddtree-sglang on SGLang "
            "0.5.17: " + "; ".join(reasons) + ". Serve it with an upstream SGLang release "
            "that supports the feature, or use a drafter without it."
        )
    return parse_dflash2_config(config)
