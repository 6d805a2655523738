# SPDX-License-Identifier: Apache-2.0
"""Run the DFlash ecosystem's own benchmark client, ``dflash benchmark openai`` (pip
package ``dflash``, 0.1.0), against a server, with local prompts.

Only its dataset loader is replaced: ``dflash.benchmark.load_and_process_dataset``
fetches the named dataset from the Hugging Face hub at run time, which the GPU host
cannot reach. The loader's output format (``[{"turns": [prompt]}]``) is kept, so the
client's own selection, warm-up, requests, and the parsing and printing of the
responses run unchanged.

The client is imported as installed, else from a wheel: ``DDTREE_DFLASH_WHEEL`` or
``.whl-dflash/dflash-*.whl`` in the repository (a pure-Python wheel imports as a zip).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[3]


def import_client():
    """``dflash.cli`` and ``dflash.benchmark``; ImportError says where it looked."""
    try:
        return importlib.import_module("dflash.cli"), importlib.import_module("dflash.benchmark")
    except ImportError:
        pass
    wheels = [Path(os.environ["DDTREE_DFLASH_WHEEL"])] if os.environ.get("DDTREE_DFLASH_WHEEL") else []
    wheels += sorted((REPO / ".whl-dflash").glob("dflash-*.whl"))
    for wheel in wheels:
        if wheel.is_file():
            sys.path.insert(0, str(wheel))
            return importlib.import_module("dflash.cli"), importlib.import_module("dflash.benchmark")
    raise ImportError(
        "the dflash client is neither installed nor found as DDTREE_DFLASH_WHEEL or "
        f"{REPO / '.whl-dflash'}/dflash-*.whl (where there is network: pip download --no-deps dflash==0.1.0 -d .whl-dflash, then copy that folder)"
    )


def run_benchmark(base_url: str, model: str, prompts: List[str], num_prompts: int, concurrency: int,
                  max_new_tokens: int, dataset: str = "gsm8k") -> str:
    """The client's stdout for ``dflash benchmark openai`` with ``prompts`` as the dataset."""
    cli, benchmark = import_client()

    def local_dataset(data_name: str) -> List[Dict]:
        if data_name not in benchmark.DATASETS:  # the client's own check, kept
            raise ValueError(f"Unknown dataset '{data_name}'")
        return [{"turns": [p]} for p in prompts]

    argv = ["benchmark", "openai", "--model", model, "--base-url", base_url, "--dataset", dataset,
            "--num-prompts", str(num_prompts), "--concurrency", str(concurrency),
            "--max-new-tokens", str(max_new_tokens), "--timeout-s", "600"]  # fmt: skip
    saved = benchmark.load_and_process_dataset
    benchmark.load_and_process_dataset = local_dataset
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            cli.main(argv)
    finally:
        benchmark.load_and_process_dataset = saved
    return out.getvalue()


def reported(text: str, label: str) -> Optional[float]:
    """The number the client printed after ``label:``, or None if it printed none."""
    m = re.search(rf"^{re.escape(label)}:\s+([0-9][0-9,]*(?:\.[0-9]+)?)", text, re.M)
    return float(m.group(1).replace(",", "")) if m else None
