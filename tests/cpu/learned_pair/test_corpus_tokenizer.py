# SPDX-License-Identifier: Apache-2.0
"""The corpus rule (deterministic, held out by file, deduplicated, capped) and the BPE
tokenizer (deterministic, special ids, loads in transformers with the raw chat template)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from scripts.learned_pair import corpus, tokenizer


def _tree(root, files: dict[str, str]):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def _code(i: int) -> str:
    return "".join(f"def function_{i}_{j}(x, y):\n    return x * {j} + y  # line {j}\n" for j in range(12))


@pytest.fixture
def roots(tmp_path):
    a, b = tmp_path / "lib", tmp_path / "site"
    files_a = {f"pkg{i % 5}/mod{i}.py": _code(i) for i in range(60)}
    files_a["pkg0/__pycache__/mod0.cpython-311.py"] = _code(999)  # skipped dir
    files_a["pkg0/tiny.py"] = "x = 1\n"  # below MIN_BYTES
    files_a["pkg0/data.bin.py"] = "# table\n" + "0," * (corpus.MAX_BYTES // 2 + 10)  # above MAX_BYTES
    files_a["site-packages/inner/mod.py"] = _code(1234)  # a site-packages nested in the stdlib: not walked
    files_a["pkg1/notes.txt"] = _code(77)  # extension not taken
    files_b = {f"lib{i}/core.py": _code(100 + i) for i in range(20)}
    files_b["lib0/vendored_copy.py"] = _code(3)  # same content as stdlib/pkg3/mod3.py
    files_b["lib0-1.0.dist-info/README.md"] = "# metadata\n" * 40
    files_b["lib1/README.md"] = "# Lib one\n\nSome prose about the library.\n" * 20
    _tree(a, files_a)
    _tree(b, files_b)
    (b / "lib2" / "latin1.py").write_bytes(b"# caf\xe9\n" * 60)  # not UTF-8
    return {"stdlib": a, "site-packages": b}


def test_selection_rule(roots):
    c = corpus.build_corpus(roots, max_bytes=10**9, heldout_fraction=0.2)
    names = [d.name for d in c.train + c.heldout]
    assert len(names) == len(set(names))
    assert not any("__pycache__" in n or "dist-info" in n or n.endswith(".txt") for n in names)
    assert "stdlib/pkg0/tiny.py" not in names and "stdlib/pkg0/data.bin.py" not in names
    assert not any(n.startswith("stdlib/site-packages/") for n in names)
    assert "site-packages/lib1/README.md" in names
    # duplicate content: the first name in sorted order stays ("site-packages/" < "stdlib/")
    assert "site-packages/lib0/vendored_copy.py" in names and "stdlib/pkg3/mod3.py" not in names
    assert c.dropped_duplicate == 1 and c.dropped_undecodable == 1
    # candidates: 60 + 20 modules, the vendored copy, the README, the latin-1 file
    assert c.candidates == 83 and len(names) == 83 - 2
    # held out by file, by a hash of its name
    held = {d.name for d in c.heldout}
    assert held == {n for n in names if corpus.unit_hash("heldout", n) < 0.2}
    assert 0 < len(held) < len(names)


def test_deterministic_and_independent_of_walk_order(roots):
    a = corpus.build_corpus(roots, max_bytes=10**9, heldout_fraction=0.2)
    b = corpus.build_corpus(dict(reversed(list(roots.items()))), max_bytes=10**9, heldout_fraction=0.2)
    assert a.file_list() == b.file_list()
    assert [d.text for d in a.train] == [d.text for d in b.train]


def test_cap_keeps_a_fixed_subset(roots):
    full = corpus.build_corpus(roots, max_bytes=10**9, heldout_fraction=0.2)
    total = full.bytes("train") + full.bytes("heldout")
    capped = corpus.build_corpus(roots, max_bytes=total // 2, heldout_fraction=0.2)
    kept = {d.name for d in capped.train + capped.heldout}
    assert kept < {d.name for d in full.train + full.heldout}
    assert 0.25 * total < capped.bytes("train") + capped.bytes("heldout") < 0.75 * total
    assert capped.dropped_by_cap == len(full.train) + len(full.heldout) - len(kept)
    # a capped file keeps its split: held-out files stay held out
    assert {d.name for d in capped.heldout} == kept & {d.name for d in full.heldout}


def test_exclude(roots):
    c = corpus.build_corpus(roots, max_bytes=10**9, exclude=[roots["stdlib"] / "pkg1"])
    assert not any(d.name.startswith("stdlib/pkg1/") for d in c.train + c.heldout)


@pytest.fixture(scope="module")
def texts():
    return [_code(i) + f"\nclass Thing{i}:\n    '''Docs for thing {i}.'''\n    value = {i}\n" for i in range(40)]


def test_bpe_is_deterministic_and_round_trips(texts):
    a = tokenizer.train_bpe(texts, 300)
    b = tokenizer.train_bpe(list(texts), 300)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 300
    assert [a.token_to_id(s) for s in tokenizer.SPECIALS] == [tokenizer.EOS_ID, tokenizer.PAD_ID, tokenizer.MASK_ID]
    s = "def f(x):\n        return {'é': x}  # ünïcode\n"
    assert a.decode(a.encode(s).ids) == s
    ids = tokenizer.encode_docs(a, texts[:3])
    assert ids.dtype == np.uint16
    assert np.flatnonzero(ids == tokenizer.EOS_ID).size == 3 and ids[-1] == tokenizer.EOS_ID
    first = a.encode(texts[0]).ids
    assert ids[: len(first)].tolist() == first


def test_saved_tokenizer_loads_in_transformers(texts, tmp_path):
    from transformers import AutoTokenizer

    tok = tokenizer.train_bpe(texts, 300)
    tokenizer.save(tok, tmp_path, model_max_length=4096)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (hf.eos_token_id, hf.pad_token_id, hf.mask_token_id) == (0, 1, 2)
    assert hf.bos_token is None
    src = "import os\n\ndef main():\n    print(os.getcwd())\n"
    assert hf.encode(src, add_special_tokens=False) == tok.encode(src).ids
    # the chat template passes the source through: a prompt is continued as code
    text = hf.apply_chat_template([{"role": "user", "content": src}], tokenize=False, add_generation_prompt=True)
    assert text == src
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["mask_token"] == tokenizer.MASK and cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
