# SPDX-License-Identifier: Apache-2.0
"""A byte-level BPE tokenizer trained on the corpus, saved as a transformers fast tokenizer.

Only the ``tokenizers`` library is used to train and save, and ``tokenizer_config.json`` is
written here, so the files do not depend on the transformers version of the machine that
trains (the server loads them with its own). The chat template passes message contents
through unchanged: a prompt is raw source text, and ``/v1/chat/completions`` continues it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

EOS = "<|endoftext|>"
PAD = "<|pad|>"
MASK = "<|MASK|>"
SPECIALS = [EOS, PAD, MASK]  # ids 0, 1, 2
EOS_ID, PAD_ID, MASK_ID = 0, 1, 2
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def train_bpe(texts: Iterable[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, f"special token {s} is not id {i}"
    return tok


def save(tok, out: Path, model_max_length: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": PAD,
        "mask_token": MASK,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS, "pad_token": PAD, "mask_token": MASK}, indent=1) + "\n")


def load(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


def _batches(items: Sequence, n: int) -> Iterator[Sequence]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def encode_docs(tok, texts: Sequence[str], batch: int = 512) -> np.ndarray:
    """Every text's ids followed by EOS, concatenated (uint16: the vocabulary fits)."""
    if tok.get_vocab_size() > 2**16:
        raise ValueError("vocabulary too large for uint16 token arrays")
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # no offsets: faster
    parts = []
    eos = np.array([EOS_ID], dtype=np.uint16)
    for chunk in _batches(texts, batch):
        for enc in encode(list(chunk), add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=np.uint16))
            parts.append(eos)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)
