# SPDX-License-Identifier: Apache-2.0
"""Build a DFlash drafter the way the server's model loader does (architecture -> class
through upstream's registry, then the class's own ``load_weights``), on the CPU."""

from __future__ import annotations

from pathlib import Path
from unittest import mock


def model_class(architecture: str):
    from sglang.srt.models.registry import ModelRegistry

    cls, arch = ModelRegistry.resolve_model_cls([architecture])
    return cls


def build_drafter(config_dir: Path, weights=None):
    """A drafter from ``config_dir`` (its architecture through the registry), filled
    by its own ``load_weights`` from ``weights`` or the directory's safetensors."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from sglang.srt.layers.rotary_embedding import base as rope_base

    config = AutoConfig.from_pretrained(str(config_dir))
    cls = model_class(config.architectures[0])
    with mock.patch.object(rope_base, "_is_cpu", True):
        model = cls(config).eval()
    if weights is None:
        weights = load_file(str(Path(config_dir) / "model.safetensors"))
    model.load_weights(list(weights.items()))
    return model
