# SPDX-License-Identifier: Apache-2.0
"""Run ServerArgs for a list of cells with a faked GPU capability; print outcomes as JSON.

Executed in a subprocess (``python _cells.py SPEC.json``) so that the faked
torch.cuda state and the upstream tree under test (patched venv, or the
pristine 0.5.17 tree put first on sys.path) never leak into the pytest process.
Only the GPU's *reported* capability, name and memory are faked; everything
else is upstream's real argument handling.
"""

import json
import logging
import sys
import warnings


def _prepare(pristine_root):
    if pristine_root:
        sys.path.insert(0, pristine_root)
    warnings.filterwarnings("ignore")
    logging.disable(logging.CRITICAL)
    # Import everything that touches CUDA at import time before any faking
    # (on a CPU machine sgl_kernel must see that there is no GPU).
    import sglang.srt.arg_groups.speculative_hook  # noqa: F401
    import sglang.srt.configs.model_config  # noqa: F401
    import sglang.srt.layers.attention.attention_registry as registry
    import sglang.srt.speculative.dflash_utils  # noqa: F401
    import sglang.srt.speculative.spec_info  # noqa: F401
    from sglang.srt import server_args as sa_mod

    return sa_mod, registry


def _fake_gpu(cap, name):
    import torch

    from sglang.srt.utils import common

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_capability = lambda device=None: tuple(cap)
    torch.cuda.get_device_name = lambda device=None: name
    for attr in dir(common):
        fn = getattr(common, attr)
        if callable(fn) and hasattr(fn, "cache_clear"):
            fn.cache_clear()


def _run_cell(sa_mod, cell, models):
    kwargs = {"model_path": models[cell["model"]], "device": "cuda"}
    kwargs.update(cell.get("args", {}))
    if cell.get("spec"):
        kwargs.update(
            speculative_algorithm="DFLASH",
            speculative_draft_model_path=models["draft"],
        )
    try:
        args = sa_mod.ServerArgs(**kwargs)
    except BaseException as e:  # noqa: BLE001 - the outcome is the data
        return {"ok": False, "type": type(e).__name__, "msg": str(e)}
    prefill, decode = args.get_attention_backends()
    return {
        "ok": True,
        "prefill": prefill,
        "decode": decode,
        "draft": args.speculative_draft_attention_backend,
        "verify_mode": args.speculative_attention_mode,
        "page_size": args.page_size,
    }


def main(spec_path):
    spec = json.load(open(spec_path))
    sa_mod, registry = _prepare(spec.get("pristine_root"))
    real_gpu = spec.get("real_gpu", False)  # GPU tier: nothing is faked
    if not real_gpu:
        sa_mod.get_device_memory_capacity = lambda device=None: 96 * 1024
    out = {"registered": sorted(registry.ATTENTION_BACKENDS), "cells": []}
    for cell in spec["cells"]:
        if not real_gpu:
            _fake_gpu(cell["cap"], spec["gpu_name"])
        out["cells"].append(_run_cell(sa_mod, cell, spec["models"]))
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
