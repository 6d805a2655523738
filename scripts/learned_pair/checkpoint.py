# SPDX-License-Identifier: Apache-2.0
"""The pair on disk, and its transport in parts (for hosts that receive files in pieces).

Layout of a pair directory::

    target/    config.json generation_config.json model.safetensors tokenizer*.json
    drafter/   config.json model.safetensors
    prompts.jsonl            held-out prompts ({"prompt": text, "prompt_ids": [...], "source": file})
    sampling_prompts.json    the prompts of the two-sample sampling test
    corpus_files.jsonl.gz    every corpus file: name, sha256, split
    manifest.json            shapes, training record, held-out and offline accept-length numbers

``pack`` writes it (the corpus file list aside) as one tar split into ``pair.tar.NN`` parts of
at most ``part_mib`` MiB plus ``pair.sha256``; ``unpack`` checks the sha256 before extracting.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path

import torch

from . import tokenizer as tokmod
from .model import Drafter, DrafterShape, Target, TargetShape


def save_safetensors(module: torch.nn.Module, path: Path, skip: tuple = ()) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in module.state_dict().items()
             if not k.startswith(skip)}
    save_file(state, str(path), metadata={"format": "pt"})


def save_target(model: Target, tok, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    config = model.hf_config(eos_token_id=tokmod.EOS_ID, pad_token_id=tokmod.PAD_ID)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": tokmod.EOS_ID, "pad_token_id": tokmod.PAD_ID, "do_sample": False}, indent=1) + "\n")
    save_safetensors(model, out / "model.safetensors", skip=("rope.",))
    tokmod.save(tok, out, model.shape.max_position_embeddings)
    return config


def save_drafter(drafter: Drafter, target_config: dict, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    config = drafter.hf_config(target_config, tokmod.MASK, tokmod.MASK_ID)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    save_safetensors(drafter, out / "model.safetensors", skip=("rope.",))
    return config


def added_drafters(manifest: dict) -> dict:
    """The drafters ``build --drafter both`` or ``add-drafter`` recorded beside the pair's own,
    by directory: {dir: record}."""
    return {r["dir"]: r for k, r in manifest.items() if k.startswith("drafter_") and isinstance(r, dict) and "dir" in r}


def drafter_shape_of(manifest: dict, drafter: str = "drafter") -> DrafterShape:
    """The shape of the pair's drafter in directory ``drafter``: the pair's own, or an added one."""
    if drafter == "drafter":
        d = manifest["shapes"]["drafter"]
    else:
        added = added_drafters(manifest)
        if drafter not in added:
            raise SystemExit(f"the pair has no drafter directory {drafter!r} in its manifest; it has "
                             f"{['drafter', *added]}")
        d = added[drafter]["shape"]
    return DrafterShape(**{**d, "target_layer_ids": tuple(d["target_layer_ids"])})


def load_pair(pair: Path, device="cpu", dtype=torch.float32, drafter: str = "drafter") -> tuple[Target, Drafter]:
    """The torch models back from a pair directory (for evaluation and tests), with the
    drafter in directory ``drafter``."""
    from safetensors.torch import load_file

    pair = Path(pair)
    manifest = json.loads((pair / "manifest.json").read_text())
    tshape = TargetShape(**manifest["shapes"]["target"])
    target, draft = Target(tshape), Drafter(tshape, drafter_shape_of(manifest, drafter))
    target.load_state_dict(load_file(str(pair / "target" / "model.safetensors")), strict=False)
    draft.load_state_dict(load_file(str(pair / drafter / "model.safetensors")), strict=False)
    return target.to(device, dtype).eval(), draft.to(device, dtype).eval()


#: Files of a pair that travel beside the parts, not in them (records, not needed to serve).
RECORDS = ("corpus_files.jsonl.gz", "manifest.json")


def pack(pair: Path, out: Path, part_mib: float = 15.5) -> list[Path]:
    """The pair as ``pair.tar.NN`` parts of at most ``part_mib`` MiB (the h200 profile's pair makes
    two of 15.5 MiB) plus ``pair.sha256``; the records are also copied as
    they are. The manifest is in the tar too; the corpus file list only beside it."""
    buf = io.BytesIO()
    out.mkdir(parents=True, exist_ok=True)
    for name in RECORDS:
        if (Path(pair) / name).is_file():
            shutil.copyfile(Path(pair) / name, out / name)
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in sorted(Path(pair).rglob("*")):
            if p.is_file() and p.name != "corpus_files.jsonl.gz":
                info = tar.gettarinfo(str(p), arcname=str(p.relative_to(pair)))
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                with open(p, "rb") as f:
                    tar.addfile(info, f)
    data = buf.getvalue()
    size = int(part_mib * 2**20)
    parts = []
    for i in range(0, max(1, len(data)), size):
        part = out / f"pair.tar.{i // size:02d}"
        part.write_bytes(data[i : i + size])
        parts.append(part)
    (out / "pair.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  {len(parts)}\n")
    return parts


def unpack(dirs: list[Path], to: Path) -> Path:
    """Reassemble ``pair.tar.NN`` parts found in ``dirs`` (any split of them) into ``to``."""
    parts, sums = {}, set()
    for d in dirs:
        for p in Path(d).glob("pair.tar.[0-9][0-9]"):
            parts[p.name] = p
        if (Path(d) / "pair.sha256").exists():
            sums.add(tuple((Path(d) / "pair.sha256").read_text().split()[:2]))
    if not sums:
        raise SystemExit(f"no pair.sha256 in {', '.join(map(str, dirs))}")
    if len(sums) > 1:
        raise SystemExit(f"the pair.sha256 files in {', '.join(map(str, dirs))} disagree: parts of different builds")
    want, nparts = sums.pop()
    names = [f"pair.tar.{i:02d}" for i in range(int(nparts))]
    missing = [n for n in names if n not in parts]
    if missing:
        raise SystemExit(f"missing parts {missing} (found {sorted(parts)} in {', '.join(map(str, dirs))})")
    data = b"".join(parts[n].read_bytes() for n in names)
    if hashlib.sha256(data).hexdigest() != want:
        raise SystemExit("the reassembled pair does not match pair.sha256: a part is damaged or from another build")
    if to.exists():
        shutil.rmtree(to)
    to.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(to, filter="data")
    return to
