# SPDX-License-Identifier: Apache-2.0
"""A local model path that does not exist is refused by the real patched ServerArgs in
one sentence naming the flag and the path (patch 0080), before the hub lookup that
would otherwise take it for a repo id."""

from __future__ import annotations

import pytest

from sglang.srt.server_args import ServerArgs
from sglang.srt.utils import model_paths


def _make(**kw):
    kw.setdefault("device", "cuda")
    return ServerArgs(skip_tokenizer_init=True, **kw)


@pytest.mark.parametrize("path", ["/models/no-such-model", "./no-such-model", "~/no-such-model-dir"])
def test_missing_target(path):
    with pytest.raises(ValueError) as e:
        _make(model_path=path)
    msg = str(e.value)
    assert msg.startswith(f"--model-path {path} does not exist on this machine")
    assert "Repo id" not in msg and "\n" not in msg


@pytest.mark.parametrize(
    "algorithm,role",
    [("DDTREE", "the DFlash drafter DDTREE drafts with"), ("ddtree", "the DFlash drafter DDTREE drafts with"),
     ("DFLASH", "the DFLASH drafter")],
)  # fmt: skip
def test_missing_drafter_names_the_algorithm(model_dirs, algorithm, role):
    with pytest.raises(ValueError, match=f"^--speculative-draft-model-path /models/drafter \\({role}\\) does not exist"):
        _make(model_path=model_dirs["mla"], speculative_algorithm=algorithm,
              speculative_draft_model_path="/models/drafter")  # fmt: skip


def test_missing_tokenizer(model_dirs):
    with pytest.raises(ValueError, match="^--tokenizer-path /tok/none \\(the tokenizer\\) does not exist"):
        _make(model_path=model_dirs["mla"], tokenizer_path="/tok/none")


def test_existing_paths_pass(model_dirs):
    sa = _make(model_path=model_dirs["mla"], speculative_algorithm="DDTREE",
               speculative_draft_model_path=model_dirs["draft"])  # fmt: skip
    assert sa.speculative_algorithm == "DDTREE"


@pytest.mark.parametrize(
    "path,local",
    [("/abs/x", True), ("./x", True), ("../x", True), ("~/x", True),
     ("Qwen/Qwen3-8B", False), ("deepseek-ai/DeepSeek-V2-Lite", False), ("gpt2", False)],
)  # fmt: skip
def test_hub_ids_are_not_taken_for_paths(path, local):
    assert model_paths.looks_local(path) is local
