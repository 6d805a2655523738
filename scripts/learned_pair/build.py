# SPDX-License-Identifier: Apache-2.0
"""Build the learned pair end to end: corpus, tokenizer, target, drafter, evaluation, files.

Every phase after the data preparation gets a share of what is left of ``--deadline-s``
(the target 60 %, the drafter 40 %, after a reserve for generation, evaluation and
writing), so a build ends within its deadline whatever the machine's speed; the steps
each phase ran and where its learning-rate decay began are recorded in the manifest, and
``--target-steps/--target-decay-start/--drafter-steps/--drafter-decay-start`` replay them.
"""

from __future__ import annotations

import gzip
import json
import os
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

import numpy as np


@dataclass
class Profile:
    """Sizes of one build. ``h200`` is the pair the benchmarks use; ``toy`` runs on a CPU in
    seconds and exercises every phase (the CPU tests build it)."""

    target: dict
    drafter: dict
    corpus_max_bytes: int
    heldout_fraction: float
    tokenizer_sample_bytes: int
    target_train: dict
    drafter_train: dict
    gen_sequences: int
    gen_prompt_len: int
    gen_new_tokens: int
    gen_chunk: int
    prompts: int
    prompt_len: int
    eval_prompts: int
    eval_new_tokens: int
    heldout_windows: int
    heldout_window_len: int
    sampling_prompts: int = 2
    sampling_positions: int = 8
    budgets: tuple = (4, 8, 16, 32, 64, 128)
    reserve_s: float = 75.0  # generation, evaluation and writing, kept out of the training budget
    final_reserve_s: float = 45.0  # of which the offline evaluation and writing after the drafter
    target_share: float = 0.6


PROFILES = {
    "h200": Profile(
        target={},  # TargetShape defaults
        drafter={},  # DrafterShape defaults
        corpus_max_bytes=224 * 2**20,
        heldout_fraction=0.02,
        tokenizer_sample_bytes=32 * 2**20,
        target_train={"seq_len": 1024, "batch": 96},
        drafter_train={"batch": 48, "anchors": 64},
        gen_sequences=16384,
        gen_prompt_len=128,
        gen_new_tokens=512,
        gen_chunk=8192,
        prompts=64,
        prompt_len=256,
        eval_prompts=24,
        eval_new_tokens=192,
        heldout_windows=64,
        heldout_window_len=1024,
    ),
    "toy": Profile(
        target={"vocab_size": 384, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
                "max_position_embeddings": 512},
        drafter={"num_hidden_layers": 1, "intermediate_size": 128, "target_layer_ids": (0, 2)},
        corpus_max_bytes=600_000,
        heldout_fraction=0.1,
        tokenizer_sample_bytes=300_000,
        target_train={"seq_len": 64, "batch": 8, "steps": 30, "warmup": 5, "log_every": 10},
        drafter_train={"batch": 4, "anchors": 4, "steps": 12, "warmup": 3, "log_every": 4},
        gen_sequences=8,
        gen_prompt_len=24,
        gen_new_tokens=40,
        gen_chunk=8,
        prompts=4,
        prompt_len=32,
        eval_prompts=2,
        eval_new_tokens=32,
        heldout_windows=2,
        heldout_window_len=64,
        budgets=(4, 16),
        reserve_s=0.0,
        final_reserve_s=0.0,
    ),
}


@dataclass
class BuildArgs:
    out: Path
    profile: str = "h200"
    seed: int = 0
    deadline_s: float = 480.0
    roots: Optional[dict] = None
    exclude: list = field(default_factory=list)
    target_steps: Optional[int] = None
    target_decay_start: Optional[int] = None
    drafter_steps: Optional[int] = None
    drafter_decay_start: Optional[int] = None
    device: Optional[str] = None
    # "dflash", "dflash2" (a DFlash 2 drafter, model.dflash2_shape) or "both": a DFlash
    # drafter in drafter/ and a DFlash 2 drafter of the same target in drafter-dflash2/.
    drafter: str = "dflash"


def _corpus(roots, prof: Profile, exclude: list, log):
    from . import corpus as corpus_mod

    corp = corpus_mod.build_corpus(roots, prof.corpus_max_bytes, prof.heldout_fraction, exclude=exclude)
    if len(corp.train) < 2 or len(corp.heldout) < 1:
        raise SystemExit(f"corpus too small: {corp.manifest()}")
    log(f"corpus: {json.dumps(corp.manifest())}")
    return corp


#: The temperatures the drafter's training sequences are generated at, row by row in turn.
DATA_TEMPERATURES = (0.0, 1.0)


def _drafter_data(target, train_tokens, prof: Profile, seed: int, dev, temperatures=DATA_TEMPERATURES):
    """The target's own continuations of random training windows, rows in turn at each of
    ``temperatures`` (0 = greedy; by default half greedy, half at T=1): a drafter learns what
    the target says, not what the corpus says."""
    import torch

    from . import train

    gen = torch.Generator(device=dev).manual_seed(seed + 3)
    cycle = torch.tensor(temperatures, dtype=torch.float32, device=dev)
    seqs = []
    for i in range(0, prof.gen_sequences, prof.gen_chunk):
        n = min(prof.gen_chunk, prof.gen_sequences - i)
        p = train.random_windows(train_tokens, n, prof.gen_prompt_len, gen)
        temps = cycle[torch.arange(i, i + n, device=dev) % len(temperatures)]
        seqs.append(train.generate(target, p, prof.gen_new_tokens, temps, gen))
    return torch.cat(seqs)


def _drafter_config(prof: Profile, steps: Optional[int], decay_start: Optional[int]):
    from . import train

    dcfg = train.DrafterTrainConfig(**prof.drafter_train)
    return dcfg if steps is None else replace(dcfg, steps=steps, decay_start=decay_start)


def _drafter_shape(kind: str, prof: Profile, hidden_size: int):
    from .model import DrafterShape, dflash2_shape

    dshape = DrafterShape(**prof.drafter)
    return dflash2_shape(dshape, hidden_size) if kind == "dflash2" else dshape


def _train_drafter(kind: str, target, seqs, prof: Profile, dcfg, seconds: float, seed: int, dev, log,
                   init=None):
    """One drafter of ``kind`` ("dflash" or "dflash2") for ``target``, from random weights or
    continuing ``init`` (a drafter of that kind, ``_drafter_from``): (kind, shape, drafter,
    training record), the drafter in the target's dtype."""
    import torch

    from . import tokenizer as tokmod, train
    from .model import Drafter

    dshape = _drafter_shape(kind, prof, target.shape.hidden_size)
    if init is None:
        drafter = Drafter(target.shape, dshape)
        drafter.init_weights(torch.Generator().manual_seed(seed + 4))
    else:
        drafter = init.float()
    drafter.to(dev)
    record = train.train_drafter(drafter, target, seqs, prof.gen_prompt_len, tokmod.MASK_ID, dcfg,
                                 seconds, seed + 5, log)
    drafter.to(target.lm_head_weight.dtype)
    return kind, dshape, drafter, record


def build(args: BuildArgs, log=print) -> dict:
    # The GPU host's env.sh turns tokenizer threads off for the servers; training wants them.
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    import torch

    from . import checkpoint, corpus as corpus_mod, evaluate, tokenizer as tokmod, train
    from .model import Target, TargetShape, shapes_dict

    t0 = time.monotonic()
    prof = PROFILES[args.profile]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    timings = {}

    def mark(name, since):
        timings[name] = round(time.monotonic() - since, 2)
        log(f"[{time.monotonic() - t0:6.1f} s] {name}: {timings[name]} s")
        return time.monotonic()

    # -- data ------------------------------------------------------------------------------
    t = time.monotonic()
    corp = _corpus(args.roots, prof, [out, *args.exclude], log)
    t = mark("corpus", t)
    keep = min(1.0, prof.tokenizer_sample_bytes / max(1, corp.bytes("train")))
    sample = [d.text for d in corp.train if corpus_mod.unit_hash("tokenizer", d.name) < keep] or [corp.train[0].text]
    tshape = TargetShape(**prof.target)
    tok = tokmod.train_bpe(sample, tshape.vocab_size)
    t = mark("tokenizer", t)
    train_ids = tokmod.encode_docs(tok, [d.text for d in corp.train])
    heldout_ids = tokmod.encode_docs(tok, [d.text for d in corp.heldout])
    log(f"tokens: train {train_ids.size:,} heldout {heldout_ids.size:,} "
        f"({corp.bytes('train') / max(1, train_ids.size):.2f} bytes/token)")
    t = mark("encode", t)
    train_tokens = torch.from_numpy(train_ids.astype(np.int32)).to(dev)
    heldout_tokens = torch.from_numpy(heldout_ids.astype(np.int32)).to(dev)

    def left():
        return args.deadline_s - (time.monotonic() - t0)

    budget = max(0.0, left() - prof.reserve_s)

    # -- target ----------------------------------------------------------------------------
    target = Target(tshape)
    target.init_weights(torch.Generator().manual_seed(args.seed))
    target.to(dev)
    tcfg = train.TargetTrainConfig(**prof.target_train)
    if args.target_steps is not None:
        tcfg = replace(tcfg, steps=args.target_steps, decay_start=args.target_decay_start)
    target_record = train.train_target(target, train_tokens, tcfg, prof.target_share * budget, args.seed + 1, log)
    t = mark("target_train", t)
    target.to(torch.bfloat16 if dev.type == "cuda" else torch.float32)
    for p in target.parameters():
        p.requires_grad_(False)
    held = evaluate.heldout_stats(target, heldout_tokens, prof.heldout_windows,
                                  min(prof.heldout_window_len, heldout_tokens.numel() - 2), args.seed + 2)
    log(f"held-out: {json.dumps(held)}")
    prompts = evaluate.pick_prompts(tok, corp.heldout, prof.prompts, prof.prompt_len, min_tail=32)
    if not prompts:
        raise SystemExit("no held-out document is long enough for a prompt")
    t = mark("target_eval", t)

    # -- drafter data: the target's own continuations, half greedy and half sampled at T=1 --
    seqs = _drafter_data(target, train_tokens, prof, args.seed, dev)
    t = mark("drafter_data", t)

    # -- drafter(s) ------------------------------------------------------------------------
    kinds = {"dflash": ["dflash"], "dflash2": ["dflash2"], "both": ["dflash", "dflash2"]}.get(args.drafter)
    if kinds is None:
        raise ValueError(f"drafter must be dflash, dflash2 or both, got {args.drafter!r}")
    dcfg = _drafter_config(prof, args.drafter_steps, args.drafter_decay_start)
    drafters = []  # (kind, shape, drafter, training record): the first is drafter/
    for i, kind in enumerate(kinds):
        seconds = max(1.0, (left() - prof.final_reserve_s) / (len(kinds) - i))
        drafters.append(_train_drafter(kind, target, seqs, prof, dcfg, seconds, args.seed, dev, log))
        t = mark(f"drafter_train_{kind}" if len(kinds) > 1 else "drafter_train", t)
    _, dshape, drafter, drafter_record = drafters[0]

    # -- offline evaluation ----------------------------------------------------------------
    offline = evaluate.offline_accept(drafter, target, [p["prompt_ids"] for p in prompts[: prof.eval_prompts]],
                                      prof.eval_new_tokens, prof.budgets, tokmod.MASK_ID, args.seed + 6)
    log(f"offline accept length at T=0: {json.dumps(offline)}")
    sampling = evaluate.sampling_prompts(target, prompts, prof.sampling_prompts, prof.sampling_positions)
    t = mark("offline_eval", t)

    # -- files -----------------------------------------------------------------------------
    tcfg_json = checkpoint.save_target(target, tok, out / "target")
    checkpoint.save_drafter(drafter, tcfg_json, out / "drafter")
    for kind, _, other, _ in drafters[1:]:
        checkpoint.save_drafter(other, tcfg_json, out / f"drafter-{kind}")
    with open(out / "prompts.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
    (out / "sampling_prompts.json").write_text(json.dumps(sampling, indent=1) + "\n")
    with gzip.open(out / "corpus_files.jsonl.gz", "wt") as f:
        for row in corp.file_list():
            f.write(json.dumps(row) + "\n")
    manifest = {
        "what": "learned Qwen3 target + DFlash drafter (scripts/learned_pair)",
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else platform.processor() or "cpu",
        "argv": sys.argv[1:],
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "tokenizers": __import__("tokenizers").__version__},
        "profile": args.profile,
        "seed": args.seed,
        "shapes": shapes_dict(tshape, dshape),
        "params": {"target": sum(p.numel() for p in target.parameters()),
                   "drafter": sum(p.numel() for p in drafter.parameters())},
        "corpus": corp.manifest(),
        "tokens": {"train": int(train_ids.size), "heldout": int(heldout_ids.size)},
        "target_train": {**asdict(tcfg), **target_record},
        "drafter_data": {"sequences": int(seqs.shape[0]), "prompt_len": prof.gen_prompt_len,
                         "new_tokens": prof.gen_new_tokens, "temperatures": "half 0 (greedy), half 1"},
        "drafter_train": {**asdict(dcfg), **drafter_record},
        **{f"drafter_{kind}": {"dir": f"drafter-{kind}", "shape": shapes_dict(tshape, shape)["drafter"],
                               "train": {**asdict(dcfg), **record}}
           for kind, shape, _, record in drafters[1:]},
        "heldout": held,
        "offline_accept_t0": offline,
        "prompts": len(prompts),
        "timings_s": timings,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    mark("write", t)
    log(f"pair written to {out} in {time.monotonic() - t0:.0f} s")
    return manifest


@dataclass
class AddDrafterArgs:
    pair: Path
    kind: str = "dflash2"
    seed: int = 0
    deadline_s: float = 300.0
    roots: Optional[dict] = None
    exclude: list = field(default_factory=list)
    drafter_steps: Optional[int] = None
    drafter_decay_start: Optional[int] = None
    device: Optional[str] = None
    # The directory name is drafter-<name> (default: the kind), the manifest key drafter_<name>.
    name: Optional[str] = None
    # A drafter directory of the pair (e.g. "drafter") whose weights training starts from.
    init_from: Optional[str] = None
    soft_labels: float = 0.0
    temperatures: tuple = DATA_TEMPERATURES
    # Overrides of the pair profile's sizes (None: the profile's).
    sequences: Optional[int] = None
    new_tokens: Optional[int] = None
    batch: Optional[int] = None
    anchors: Optional[int] = None
    lr: Optional[float] = None


#: What a DFlash 2 drafter has beyond a DFlash drafter's layers (model.py's names).
DFLASH2_ONLY = ("attention_conv.", "mlp_conv.", "candidate_selector.")


def _drafter_from(pair: Path, name: str, kind: str, prof: Profile, target_shape, seed: int):
    """The pair's drafter in directory ``name`` as a ``kind`` drafter of the profile's shape,
    to continue training from (refused unless its weights are exactly that shape's). A DFlash 2
    drafter may start from a DFlash one: its convolutions and selector start as ``build``
    starts them (the convolutions near the identity), the rest is the DFlash drafter's."""
    import torch
    from safetensors.torch import load_file

    from .model import Drafter

    path = pair / name / "model.safetensors"
    if not path.is_file():
        raise SystemExit(f"--init-from {name}: no {path}")
    drafter = Drafter(target_shape, _drafter_shape(kind, prof, target_shape.hidden_size))
    drafter.init_weights(torch.Generator().manual_seed(seed + 4))
    try:
        missing, unexpected = drafter.load_state_dict(load_file(str(path)), strict=False)
    except RuntimeError as e:  # a tensor of another size
        raise SystemExit(f"--init-from {name}: not a {kind} drafter of this pair's shape: {e}") from None
    missing = [k for k in missing if not k.startswith("rope.")]
    if kind == "dflash2" and missing and all(any(part in k for part in DFLASH2_ONLY) for k in missing):
        missing = []  # a DFlash drafter under a DFlash 2 one
    if missing or unexpected:
        raise SystemExit(f"--init-from {name}: not a {kind} drafter of this pair's shape (missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]})")
    return drafter


def add_drafter(args: AddDrafterArgs, log=print) -> dict:
    """Train one more drafter for a pair's existing target into ``drafter-<name>/``, its record
    in the manifest under ``drafter_<name>``. The pair stays the reference it was: its target,
    tokenizer, drafter and prompts are not touched, so a new drafter is measured beside the old
    one on the same target (training data as ``build`` makes it, from the same corpus roots,
    unless the sizes, temperatures or loss are overridden; from random weights, or continuing
    one of the pair's drafters with ``init_from``)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    import torch

    from . import checkpoint, evaluate, tokenizer as tokmod
    from .model import shapes_dict

    t0 = time.monotonic()
    pair = Path(args.pair)
    if args.kind not in ("dflash", "dflash2"):
        raise SystemExit(f"--kind must be dflash or dflash2, got {args.kind!r}")
    manifest_path = pair / "manifest.json"
    if not manifest_path.is_file():
        raise SystemExit(f"{pair} is not a learned pair (no manifest.json)")
    manifest = json.loads(manifest_path.read_text())
    name = args.name or args.kind
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name):
        raise SystemExit(f"--name {name!r}: lower-case letters, digits and '-' only")
    out = pair / f"drafter-{name}"
    if out.exists():
        raise SystemExit(f"{out} exists: remove it to train that drafter again")
    if not 0.0 <= args.soft_labels <= 1.0:
        raise SystemExit(f"--soft-labels is a share of the loss in [0, 1], got {args.soft_labels}")
    if not args.temperatures or any(t < 0 for t in args.temperatures):
        raise SystemExit(f"--temperatures takes one or more temperatures >= 0 (0 = greedy), got {args.temperatures}")
    given = {"sequences": args.sequences, "new_tokens": args.new_tokens, "batch": args.batch,
             "anchors": args.anchors, "lr": args.lr}
    bad = [f"--{k.replace('_', '-')} {v}" for k, v in given.items() if v is not None and not v > 0]
    if bad:
        raise SystemExit(f"sizes and the learning rate must be positive: {', '.join(bad)}")
    prof = PROFILES[manifest["profile"]]
    sizes = {k: v for k, v in (("gen_sequences", args.sequences), ("gen_new_tokens", args.new_tokens)) if v}
    prof = replace(prof, **sizes, gen_chunk=min(prof.gen_chunk, sizes.get("gen_sequences", prof.gen_chunk)))
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target, _ = checkpoint.load_pair(pair, dev, dtype)
    for p in target.parameters():
        p.requires_grad_(False)
    init = _drafter_from(pair, args.init_from, args.kind, prof, target.shape, args.seed) if args.init_from else None
    tok = tokmod.load(pair / "target")

    corp = _corpus(args.roots, prof, [pair, *args.exclude], log)
    train_ids = tokmod.encode_docs(tok, [d.text for d in corp.train])
    train_tokens = torch.from_numpy(train_ids.astype(np.int32)).to(dev)
    seqs = _drafter_data(target, train_tokens, prof, args.seed, dev, args.temperatures)
    log(f"[{time.monotonic() - t0:6.1f} s] drafter data: {tuple(seqs.shape)} at temperatures {args.temperatures}")
    left = args.deadline_s - (time.monotonic() - t0) - prof.final_reserve_s
    dcfg = _drafter_config(prof, args.drafter_steps, args.drafter_decay_start)
    overrides = {k: v for k, v in (("batch", args.batch), ("anchors", args.anchors), ("lr", args.lr)) if v}
    dcfg = replace(dcfg, **overrides, soft_labels=args.soft_labels)
    kind, dshape, drafter, record = _train_drafter(args.kind, target, seqs, prof, dcfg, max(1.0, left),
                                                   args.seed, dev, log, init)
    prompts = [json.loads(line) for line in (pair / "prompts.jsonl").read_text().splitlines() if line.strip()]
    offline = evaluate.offline_accept(drafter, target, [p["prompt_ids"] for p in prompts[: prof.eval_prompts]],
                                      prof.eval_new_tokens, prof.budgets, tokmod.MASK_ID, args.seed + 6)
    log(f"offline accept length at T=0 (tree from marginals): {json.dumps(offline)}")
    checkpoint.save_drafter(drafter, json.loads((pair / "target" / "config.json").read_text()), out)
    manifest[f"drafter_{name}"] = {
        "dir": out.name, "kind": kind, "shape": shapes_dict(target.shape, dshape)["drafter"],
        "init_from": args.init_from,
        "data": {"sequences": int(seqs.shape[0]), "prompt_len": prof.gen_prompt_len,
                 "new_tokens": prof.gen_new_tokens, "temperatures": list(args.temperatures)},
        "train": {**asdict(dcfg), **record}, "offline_accept_t0": offline,
        "added": {"date": time.strftime("%Y-%m-%d"),
                  "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else platform.processor() or "cpu",
                  "argv": sys.argv[1:], "corpus": corp.manifest(), "wall_s": round(time.monotonic() - t0, 1)},
    }
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"{out} written in {time.monotonic() - t0:.0f} s")
    return manifest[f"drafter_{name}"]
