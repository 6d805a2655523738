# SPDX-License-Identifier: Apache-2.0
"""A learned target + DFlash drafter pair, built offline on the GPU host in one run.

The target is a small Qwen3 (``model.Target``) trained from scratch on the Python sources
and docs of the interpreter that runs the build (``corpus``), with a byte-level BPE
tokenizer trained on the same text (``tokenizer``). The drafter is a DFlash draft model
(``model.Drafter``, the checkpoint SGLang's ``models/dflash.py`` loads) trained on the
target's own continuations with the target's hidden states as context features
(``dflash_batch``, ``train``). ``evaluate`` measures the pair offline, ``checkpoint`` writes
it and moves it in parts; ``build`` runs everything under one deadline.

Run from the repository root: ``python3 -m scripts.learned_pair build --out DIR``
(docs/learned-pair.md).
"""
