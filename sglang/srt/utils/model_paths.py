# SPDX-License-Identifier: Apache-2.0
"""Refuse a local model path that does not exist before anything looks it up.

Upstream hands every ``--model-path`` to transformers, which takes a path it cannot
find for a Hugging Face repo id and fails some sixty lines of traceback later with
"Repo id must be in the form 'repo_name' or 'namespace/repo_name'". A path that is
plainly local (absolute, or starting with ``./``, ``../`` or ``~``) and missing is
reported here instead, in one sentence that names the flag and the path. The
drafter's message names the algorithm that drafts with it.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator, Optional, Tuple

_LOCAL_PREFIXES = ("./", "../", "~")


def looks_local(path: str) -> bool:
    """A filesystem path, never a Hugging Face id (those are ``name`` or ``org/name``)."""
    return os.path.isabs(path) or path.startswith(_LOCAL_PREFIXES)


def drafter_role(algorithm: Optional[str]) -> str:
    """How the draft model is named in messages, by the algorithm that drafts with it."""
    name = (algorithm or "").upper()
    if name == "DDTREE":
        return "the DFlash drafter DDTREE drafts with"
    if name in ("DFLASH", "DSPARK"):
        return f"the {name} drafter"
    return "the draft model"


def model_paths(server_args: Any) -> Iterator[Tuple[str, str, Optional[str]]]:
    """(flag, path, role) of each model path set on ``server_args``."""
    yield "--model-path", server_args.model_path, None
    tokenizer = getattr(server_args, "tokenizer_path", None)
    if tokenizer and tokenizer != server_args.model_path:
        yield "--tokenizer-path", tokenizer, "the tokenizer"
    draft = getattr(server_args, "speculative_draft_model_path", None)
    if draft:
        yield "--speculative-draft-model-path", draft, drafter_role(
            getattr(server_args, "speculative_algorithm", None)
        )


def missing_path_message(flag: str, path: str, role: Optional[str], hint: str = "") -> str:
    what = f" ({role})" if role else ""
    return f"{flag} {path}{what} does not exist on this machine{hint}."


def check_local_model_paths(
    server_args: Any, exists: Callable[[str], bool] = os.path.exists
) -> None:
    """Raise ValueError naming the first local model path that does not exist."""
    for flag, path, role in model_paths(server_args):
        if path and looks_local(path) and not exists(os.path.expanduser(path)):
            raise ValueError(
                missing_path_message(
                    flag, path, role,
                    hint=": a local checkpoint must be a directory here (a Hugging Face "
                    "model is named like org/name)",
                )  # fmt: skip
            )
