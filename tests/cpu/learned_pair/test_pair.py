# SPDX-License-Identifier: Apache-2.0
"""The toy pair from the real build: its files load in transformers and in upstream
SGLang's model classes with the same forward as the torch models that trained it, the
server's argument checks accept it, and it travels in parts."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.learned_pair import checkpoint
from scripts.learned_pair.__main__ import main as cli
from scripts.learned_pair.tokenizer import MASK, MASK_ID

REPO = Path(__file__).resolve().parents[3]


def test_build_writes_the_pair(toy_pair):
    pair, m = toy_pair
    for f in ("target/config.json", "target/model.safetensors", "target/tokenizer.json",
              "target/tokenizer_config.json", "target/generation_config.json", "drafter/config.json",
              "drafter/model.safetensors", "prompts.jsonl", "sampling_prompts.json", "corpus_files.jsonl.gz",
              "manifest.json"):
        assert (pair / f).is_file(), f
    assert m["profile"] == "toy" and m["target_train"]["steps"] == 30 and m["drafter_train"]["steps"] == 12
    assert m["corpus"]["heldout_files"] >= 1 and m["tokens"]["train"] > 1000
    assert set(m["offline_accept_t0"]) >= {"dflash", "ddtree4", "ddtree16"}
    assert all(1.0 <= m["offline_accept_t0"][k] <= 16.0 for k in ("dflash", "ddtree4", "ddtree16"))
    prompts = [json.loads(line) for line in (pair / "prompts.jsonl").read_text().splitlines()]
    files = [json.loads(line) for line in gzip.open(pair / "corpus_files.jsonl.gz", "rt")]
    held = {f["name"] for f in files if f["split"] == "heldout"}
    assert prompts and all(p["source"] in held for p in prompts)  # prompts come from held-out files only
    assert all(len(p["prompt_ids"]) == 32 for p in prompts)
    sampling = json.loads((pair / "sampling_prompts.json").read_text())
    assert len(sampling) == 2 and all(len(s["greedy_entropy"]) == 8 for s in sampling)


def test_configs_are_what_upstream_parses(toy_pair):
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    pair, m = toy_pair
    target = json.loads((pair / "target" / "config.json").read_text())
    draft = json.loads((pair / "drafter" / "config.json").read_text())
    parsed = parse_dflash_draft_config(draft_hf_config=draft)
    assert parsed.block_size == 16 and parsed.mask_token == MASK and parsed.mask_token_id == MASK_ID
    assert parsed.resolve_target_layer_ids(target_num_layers=target["num_hidden_layers"],
                                           draft_num_layers=draft["num_hidden_layers"]) == [0, 2]
    assert draft["hidden_size"] == target["hidden_size"] and draft["vocab_size"] == target["vocab_size"]
    assert target["architectures"] == ["Qwen3ForCausalLM"] and target["tie_word_embeddings"] is True


def test_target_and_tokenizer_load_in_transformers(toy_pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pair, _ = toy_pair
    hf, info = AutoModelForCausalLM.from_pretrained(str(pair / "target"), dtype=torch.float32,
                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    target, _ = checkpoint.load_pair(pair)
    tok = AutoTokenizer.from_pretrained(str(pair / "target"))
    assert tok.convert_tokens_to_ids(MASK) == MASK_ID
    prompt = json.loads((pair / "prompts.jsonl").read_text().splitlines()[0])
    ids = torch.tensor([prompt["prompt_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(target(ids)[0], hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_upstream_sglang_models_match_the_trained_ones(toy_pair):
    """Upstream's Qwen3ForCausalLM and DFlashDraftModel, built from the pair's configs and loaded
    with their own load_weights, compute what the training code computes (separate process)."""
    pair, _ = toy_pair
    proc = subprocess.run([sys.executable, "-m", "tests.cpu.learned_pair._upstream_forward", str(pair)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["dflash_block"] == 16 and r["ddtree_verify_width"] == {"4": 5, "16": 17, "128": 129}
    assert r["tied_head"]
    assert r["target_hidden_max_abs_diff"] < 1e-4 * max(1.0, r["hidden_scale"])
    assert r["target_logits_max_abs_diff"] < 1e-3
    assert r["aux_hidden_max_abs_diff"] < 1e-4 * max(1.0, r["hidden_scale"])
    assert r["drafter_hidden_max_abs_diff"] < 1e-4 * max(1.0, r["drafter_hidden_scale"])


def test_pack_unpack_across_two_folders(toy_pair, tmp_path):
    pair, _ = toy_pair
    parts = checkpoint.pack(pair, tmp_path / "parts", part_mib=1)
    assert len(parts) >= 1
    # a split of the parts over two folders (parts copied to the host separately)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    for i, p in enumerate(parts):
        (a if i % 2 == 0 else b).joinpath(p.name).write_bytes(p.read_bytes())
    (a / "pair.sha256").write_text((tmp_path / "parts" / "pair.sha256").read_text())
    assert cli(["unpack", str(a), str(b), "--to", str(tmp_path / "back")]) == 0
    for f in sorted(pair.rglob("*")):
        if f.is_file() and f.name != "corpus_files.jsonl.gz":  # a record: beside the parts, not in them
            assert (tmp_path / "back" / f.relative_to(pair)).read_bytes() == f.read_bytes(), f
    assert not (tmp_path / "back" / "corpus_files.jsonl.gz").exists()
    assert (tmp_path / "parts" / "corpus_files.jsonl.gz").read_bytes() == (pair / "corpus_files.jsonl.gz").read_bytes()
    assert (tmp_path / "parts" / "manifest.json").is_file()
    # a damaged part is refused, not extracted
    damaged = tmp_path / "parts" / parts[0].name
    data = bytearray(damaged.read_bytes())
    data[100] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="does not match"):
        checkpoint.unpack([tmp_path / "parts"], tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    with pytest.raises(SystemExit, match="no pair.sha256"):
        checkpoint.unpack([tmp_path / "back"], tmp_path / "bad")


def test_cli_refuses_bad_input(tmp_path, capsys):
    with pytest.raises(SystemExit, match="LABEL=DIRECTORY"):
        cli(["build", "--out", str(tmp_path), "--root", "nolabel"])
    with pytest.raises(SystemExit):
        cli(["build", "--out", str(tmp_path), "--target-decay-start", "5"])
    assert "--target-decay-start needs --target-steps" in capsys.readouterr().err
    for bad in (["--tree-temperatures", "0.7,x", "--oracle"], ["--tree-temperatures", "0,1", "--oracle"],
                ["--tree-temperatures", "0.7"]):
        with pytest.raises(SystemExit, match="--tree-temperatures takes"):
            cli(["offline", str(tmp_path / "no-pair"), *bad])


def test_the_h200_pair_shapes_train_and_fit_two_parts():
    """The benchmark pair's shapes (profile h200): one training step of each network on the CPU,
    and bf16 weights small enough that the pair travels as two parts of 15.5 MiB."""
    from scripts.learned_pair import train
    from scripts.learned_pair.build import PROFILES
    from scripts.learned_pair.model import Drafter, DrafterShape, Target, TargetShape

    prof = PROFILES["h200"]
    tshape, dshape = TargetShape(**prof.target), DrafterShape(**prof.drafter)
    target, drafter = Target(tshape), Drafter(tshape, dshape)
    nt, nd = (sum(p.numel() for p in m.parameters()) for m in (target, drafter))
    assert nt == tshape.n_params()
    assert 10e6 < nt < 20e6  # big enough for non-trivial predictions, small enough to train in minutes
    assert 2 * (nt + nd) + 2**20 < 2 * 15.5 * 2**20  # + tokenizer, prompts, configs
    target.init_weights(torch.Generator().manual_seed(0))
    drafter.init_weights(torch.Generator().manual_seed(1))
    tokens = torch.randint(3, tshape.vocab_size, (4000,), dtype=torch.int32)
    rec = train.train_target(target, tokens, train.TargetTrainConfig(seq_len=32, batch=2, steps=1, warmup=1),
                             seconds=1e9, seed=0, log=lambda m: None)
    assert rec["steps"] == 1 and rec["final_loss"] > 0
    seqs = torch.randint(3, tshape.vocab_size, (2, 48))
    rec = train.train_drafter(drafter, target.eval(), seqs, 8, MASK_ID,
                              train.DrafterTrainConfig(batch=2, anchors=3, steps=1, warmup=1), seconds=1e9, seed=0,
                              log=lambda m: None)
    assert rec["steps"] == 1 and len(rec["accuracy_by_offset"]) == dshape.block_size
