#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Record which JIT kernel modules the server builds, on the GPU host, for docker/jit_modules.json.

Starts the patched server for an MHA target (Qwen3-8B shape, dummy weights) on the flashinfer
backend and an MLA target (DeepSeek-V2-Lite shape) on the triton backend, the backends sm_12x
picks for them (forced here: sm_90 would pick others), each without and with DDTree, and sends
what a first user sends: a greedy chat request, the same prompt again (a cached prefix), a
sampled request (top-k/top-p), a min-p request and a few at once. Every process of every
server runs with scripts/gpu_host/jit_recorder on PYTHONPATH, which appends each FlashInfer
module and each sglang JIT kernel it loads to one JSONL file. Then it compares that file with
docker/jit_modules.json (sm_90's fa3 modules count as their fa2 twins, which sm_12x builds)
and exits 1 if a recorded module is missing from the list.

Usage, on the host after scripts/gpu_host/install.sh and `source scripts/gpu_host/env.sh`:
  python3 scripts/gpu_host/record_jit_modules.py        # writes /tmp/ddtree-out/jit_modules_recorded.jsonl
  python3 scripts/gpu_host/record_jit_modules.py --configs mha-nospec,mla-ddtree
A fresh FlashInfer workspace is used (--workspace), so modules an earlier run left in the
cache are not mistaken for this run's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Run by path on the GPU host: make_test_models and the GPU tier's conftest belong to no package.
sys.path.insert(0, str(REPO / "tests" / "gpu"))
sys.path.insert(0, str(REPO / "scripts"))

COMMON = ["--load-format", "dummy", "--mem-fraction-static", "0.6", "--max-total-tokens", "32768",
          "--cuda-graph-max-bs", "4", "--trust-remote-code"]
BACKEND = {"mha": "flashinfer", "mla": "triton"}  # the sm_12x defaults (server_args.py)
CONFIGS = ("mha-nospec", "mha-ddtree", "mla-nospec", "mla-ddtree")


def mha_config(num_layers: int = 4) -> dict:
    """Qwen3-8B's attention shape (32 query / 8 KV heads of 128, bf16) with few layers."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": num_layers,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
        "max_position_embeddings": 40960, "rope_theta": 1000000, "rope_scaling": None,
        "rms_norm_eps": 1e-6, "attention_bias": False, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    }


def mha_drafter_config(target: dict) -> dict:
    from make_test_models import BLOCK_SIZE, MASK_ID

    cfg = {k: target[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                  "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
                                  "rope_theta", "rope_scaling", "rms_norm_eps", "attention_bias",
                                  "tie_word_embeddings", "torch_dtype")}
    cfg.update(architectures=["DFlashDraftModel"], model_type="qwen3", num_hidden_layers=1,
               block_size=BLOCK_SIZE, dflash_config={
                   "target_layer_ids": [0, 1], "mask_token": "<|MASK|>", "mask_token_id": MASK_ID,
                   "num_target_layers": target["num_hidden_layers"]})
    return cfg


def make_models(root: Path) -> dict:
    """{target: (model dir, drafter dir)}: the MLA pair from make_test_models' shapes, the MHA pair here."""
    import make_test_models as mtm
    import numpy as np

    if not (root / "v2lite-shape" / "config.json").exists():
        mtm.generate(root, which=("shapes",))
    vocab_words = mtm.words(np.random.default_rng(0))
    mha, draft = root / "qwen3-8b-shape", root / "qwen3-8b-shape-dflash"
    if not (mha / "config.json").exists():
        cfg = mha_config()
        mtm.save_model(mha, None, cfg)
        mtm.save_tokenizer(mha, vocab_words)
        mtm.save_model(draft, None, mha_drafter_config(cfg))
    return {"mha": (mha, draft), "mla": (root / "v2lite-shape", root / "v2lite-shape-dflash")}


def exercise(server) -> list[str]:
    """What a first user sends; returns one line per request."""
    prompt = [{"role": "user", "content": "Tell me a story about a lighthouse keeper. " * 8}]
    done = []

    def chat(**sampling):
        r = server.post("/v1/chat/completions", {"model": "default", "messages": prompt,
                                                 "max_tokens": 24, **sampling})
        return f"{sampling or 'greedy'}: {r['usage']['completion_tokens']} tokens"

    done.append(chat(temperature=0))
    done.append(chat(temperature=0))  # the cached prefix: extend with a prefix
    done.append(chat(temperature=0.8, top_p=0.9, top_k=40))
    done.append(chat(temperature=0.8, min_p=0.1))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        done += list(pool.map(lambda t: chat(temperature=t), (0, 0.5, 0.7, 1.0)))
    return done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/ddtree-out")) / "jit_modules_recorded.jsonl",
                    help="the JSONL record (default: jit_modules_recorded.jsonl in /tmp/ddtree-out, or in OUT if set)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--models", type=Path, default=Path(os.environ.get("DDTREE_TEST_MODELS", "/tmp/ddtree-models")))
    ap.add_argument("--workspace", type=Path, help="FlashInfer/tvm-ffi JIT caches (default: a fresh temp dir)")
    ap.add_argument("--log-dir", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for one server to become healthy")
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    bad = set(configs) - set(CONFIGS)
    if bad:
        ap.error(f"unknown configs {sorted(bad)}; choose from {', '.join(CONFIGS)}")

    from conftest import launch_server  # tests/gpu/conftest.py: the GPU tier's own launcher

    models = make_models(args.models)
    work = args.workspace or Path(tempfile.mkdtemp(prefix="ddtree-jit-record-"))
    log_dir = args.log_dir or work / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("")
    env = {
        "DDTREE_JIT_RECORD": str(args.out.resolve()),
        "PYTHONPATH": os.pathsep.join([str(REPO / "scripts" / "gpu_host" / "jit_recorder"),
                                       os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "FLASHINFER_WORKSPACE_BASE": str(work / "flashinfer"),
        "TVM_FFI_CACHE_DIR": str(work / "tvm-ffi"),
    }
    failed = []
    for name in configs:
        target, spec = name.split("-")
        model, drafter = models[target]
        server_args = [*COMMON, "--attention-backend", BACKEND[target]]
        if spec == "ddtree":
            server_args += ["--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(drafter)]
        t0 = time.time()
        print(f"== {name}: {model.name} {' '.join(server_args)}", flush=True)
        try:
            with launch_server(name, str(model), server_args, log_dir, timeout=args.timeout, env=env) as server:
                print(f"   healthy after {server.ready_s:.0f} s", flush=True)
                for line in exercise(server):
                    print(f"   {line}", flush=True)
        except Exception as e:  # record the rest; say which one failed
            failed.append(name)
            print(f"   FAILED: {e}", flush=True)
        print(f"   {time.time() - t0:.0f} s", flush=True)

    records = [json.loads(x) for x in args.out.read_text().splitlines() if x.strip()]
    summary = {}
    for r in records:
        key = r["name"] if r["kind"] == "flashinfer" else f"{r['factory']}{tuple(map(str, r['args']))}"
        summary.setdefault((r["kind"], key), set()).add(r.get("caller") or "?")
    print(f"== {len(records)} loads, {len(summary)} distinct modules (recorded in {args.out})")
    for (kind, key), callers in sorted(summary.items()):
        print(f"   {kind:10s} {key}  <- {'; '.join(sorted(callers))}")
    cmp = subprocess.run([sys.executable, str(REPO / "docker" / "compile_kernels.py"),
                          "--compare-recorded", str(args.out)])
    if failed:
        print(f"servers that failed: {', '.join(failed)} (logs in {log_dir})")
    return 1 if failed or cmp.returncode else 0


if __name__ == "__main__":
    sys.exit(main())
