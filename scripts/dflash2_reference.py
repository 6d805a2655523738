#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Record upstream SGLang's DFlash 2 drafter on a small random case, for the CPU tests.

Runs upstream's own ``DFlash2DraftModel`` (``sglang.srt.models.dflash``, SGLang 0.5.23)
on the case of ``tests/cpu/dflash2/harness.py``: it writes the drafter's
``config.json`` and random weights (``model.safetensors``, the checkpoint's tensor
names, loaded through upstream's ``load_weights``), runs the block forward over two
requests' context K/V, then upstream's candidate top-K and unary transform
(``compute_candidates``), transition lattice (``candidate_selector.build_lattice``) and
path walk (``candidate_selector.sample_path``: greedy, sampled at two temperatures, and
a batch mixing both), and writes inputs and outputs to ``reference.safetensors`` with
the versions that produced them in ``provenance.json``.
``tests/cpu/dflash2/test_dflash2_reference.py`` replays the case on this project's
drafter and compares.

It needs an environment with SGLang 0.5.23, which the project's ``.venv`` (0.5.17) is
not. The fixture in the repository was made with this command, from the repository
root, on the 2-core CPU build machine (2026-12-03)::

    python3 -m venv /tmp/sg523venv
    /tmp/sg523venv/bin/pip install torch==2.14.1 torchvision transformers==5.19.0 \\
        numpy safetensors orjson psutil pybase64 requests triton packaging pillow starlette \\
        msgspec pydantic pyzmq tqdm ipython aiohttp dill apache-tvm-ffi sentencepiece \\
        compressed-tensors gguf einops openai partial-json-parser
    /tmp/sg523venv/bin/pip install --no-deps sglang==0.5.23
    TORCH_COMPILE_DISABLE=1 PYTHONPATH=. /tmp/sg523venv/bin/python \\
        scripts/dflash2_reference.py --out tests/cpu/dflash2/fixtures

(the packages after torch are what importing upstream's model module pulls in; CUDA is
neither needed nor used). Stand-ins, the same on both sides (``harness.py``): the
attention backend (plain softmax attention over each request's context and block
K/V), the parallel state (one rank, set through upstream's ``get_parallel()``
override rather than a process group) and RoPE's platform switch (the native torch
path). ``TORCH_COMPILE_DISABLE=1`` runs upstream's ``torch.compile``-decorated
helpers eagerly: the same operations without a C++ toolchain for Inductor.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import save_file

from tests.cpu.dflash2 import harness

COMMAND = (
    "TORCH_COMPILE_DISABLE=1 PYTHONPATH=. /tmp/sg523venv/bin/python "
    "scripts/dflash2_reference.py --out tests/cpu/dflash2/fixtures"
)


def _one_rank() -> None:
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(
        tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0, pp_size=1, pp_rank=0,
        dp_size=1, attn_dp_size=1, attn_dp_rank=0, enable_dp_attention=False,
        attn_cp_size=1, attn_cp_rank=0, moe_ep_size=1, moe_tp_size=1, ep_size=1,
        tp_group=None, attn_tp_group=None,
    )


def record(out: Path) -> dict:
    import sglang
    import transformers
    from transformers import AutoConfig

    _one_rank()
    from sglang.srt.layers import radix_attention
    from sglang.srt.layers.rotary_embedding import base as rope_base
    from sglang.srt.models.dflash import DFlash2DraftModel

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(harness.CONFIG, indent=2) + "\n")
    weights = harness.make_weights()
    save_file(weights, str(out / "model.safetensors"))
    inputs = harness.make_inputs()

    config = AutoConfig.from_pretrained(str(out))
    with mock.patch.object(rope_base, "_is_cpu", True):
        model = DFlash2DraftModel(config).eval()
    model.load_weights(list(weights.items()))
    model.lm_head = harness.LMHead(inputs["lm_head"])

    block = harness.block_size()
    bs = len(harness.PREFIX_LENS)
    hidden = harness.drafter_hidden(model, inputs, radix_attention)
    slot_hidden = hidden.view(bs, block, -1)[:, 1:]
    slots = block - 1

    with torch.no_grad():
        ids, unary = model.compute_candidates(slot_hidden.reshape(bs * slots, -1))
        ids, unary = ids.view(bs, slots, -1), unary.view(bs, slots, -1)
        scores = model.candidate_selector.build_lattice(
            candidate_ids=ids, unary_logits=unary, hidden_states=slot_hidden, anchor_token_ids=inputs["anchor_ids"]
        )
        walks = {}
        cases = {
            "greedy": (torch.ones(bs, dtype=torch.bool), torch.ones(bs)),
            "sampled": (torch.zeros(bs, dtype=torch.bool), inputs["temperatures"]),
            "mixed": (torch.tensor([True, False]), inputs["temperatures"]),
        }
        for name, (greedy, temps) in cases.items():
            tokens, q = model.candidate_selector.sample_path(
                candidate_ids=ids, scores=scores, uniforms=inputs["uniforms"], temperatures=temps, greedy_mask=greedy
            )
            walks[f"{name}_tokens"] = tokens
            walks[f"{name}_q"] = q
            walks[f"{name}_greedy_mask"] = greedy
            walks[f"{name}_temperatures"] = temps

    tensors = {f"input.{k}": v for k, v in inputs.items()}
    tensors.update({
        "output.hidden": hidden,
        "output.candidate_ids": ids,
        "output.unary": unary,
        "output.scores": scores,
    })
    tensors.update({f"output.walk.{k}": v for k, v in walks.items()})
    save_file({k: v.detach().clone().contiguous() for k, v in tensors.items()}, str(out / "reference.safetensors"))

    provenance = {
        "what": "upstream SGLang's DFlash2DraftModel on the random case of tests/cpu/dflash2/harness.py",
        "command": COMMAND,
        "date": datetime.date.today().isoformat(),
        "sglang": sglang.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "torch_compile_disabled": os.environ.get("TORCH_COMPILE_DISABLE") == "1",
        "seed": harness.SEED,
    }
    (out / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    return provenance


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=harness.FIXTURES)
    args = parser.parse_args(argv)
    if os.environ.get("TORCH_COMPILE_DISABLE") != "1":
        print("set TORCH_COMPILE_DISABLE=1 (upstream's compiled helpers run eagerly)", file=sys.stderr)
        return 2
    print(json.dumps(record(args.out), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
