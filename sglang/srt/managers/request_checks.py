# SPDX-License-Identifier: Apache-2.0
"""Generation requests the scheduler cannot serve, refused with a 400 before they reach it.

Upstream 0.5.17 checks a request's sampling parameters in ``SamplingParams.verify`` and its
length in ``TokenizerManager._validate_one_request``; a ``ValueError`` raised there becomes an
HTTP 400 with its message. Some requests get past both and then fail where no handler turns
the failure into a 400:

* in the HTTP worker, a ``TypeError`` (a string where a number belongs, a misspelt parameter
  name, which ``SamplingParams(**params)`` refuses) is a 500 Internal Server Error on
  ``/generate``, whose ``sampling_params`` object no schema types;
* in the scheduler, where any exception kills the server with every request it holds:
  ``top_k`` above what an int32 holds (``SamplingBatchInfo`` packs top-k as int32), a
  ``logit_bias`` value that is not a number (written into a float tensor there),
  ``stop_token_ids`` outside the vocabulary with ``min_new_tokens`` (the penalizer scatters
  them into a vocabulary-wide row), a token id outside the vocabulary or negative (the
  embedding lookup indexes out of bounds on the GPU), a ``stream_interval`` that is not a
  number (compared with one for every streamed chunk).

Refused here too, as nothing can be served for them: a prompt that tokenizes to nothing
(the native API's ``"text": "   "``; upstream refuses only an empty string or id list), a
``sampling_seed`` beyond int64 (seeded sampling packs it as int64), and any other parameter
of the wrong type.

Two checks, hooked in by patch 0084:

``check_sampling_params`` runs first in ``GenerateReqInput.normalize_batch_and_arguments``
(so for the native API, the OpenAI API and the engine alike), on the parameters as the
client sent them: known names, a type per parameter, and the bounds that need no model.
``check_generate_input`` runs in ``TokenizerManager._validate_one_request``, once the
prompt is tokenized: at least one token, every id inside the vocabulary, stop token ids
inside the vocabulary.

Both raise ``ValueError`` with one sentence naming the parameter, what it must be and what
came; what upstream already refuses keeps upstream's message.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any, Dict, Iterable, Optional

#: Largest top-k the sampler packs (upstream's TOP_K_ALL, "the whole vocabulary").
TOP_K_MAX = 1 << 30
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

INTEGER_PARAMS = ("max_new_tokens", "min_new_tokens", "top_k", "n", "stream_interval", "sampling_seed")
NUMBER_PARAMS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
BOOL_PARAMS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
STRING_PARAMS = ("json_schema", "regex", "ebnf", "structural_tag")
STRING_OR_LIST_PARAMS = ("stop", "stop_regex")

#: Names clients of other APIs use, and the native API's own.
NATIVE_NAMES = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
    "stop_sequences": "stop",
}


def _known_params() -> frozenset:
    from sglang.srt.sampling.sampling_params import SamplingParams

    return frozenset(SamplingParams.__struct_fields__)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_integer(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, Integral):
        return True
    return isinstance(value, float) and value.is_integer()


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def check_sampling_params(sampling_params: Any) -> None:
    """The ``sampling_params`` of one generate request as sent: None, an object, or a list
    of objects (one per prompt of a batch). Integral floats (``16.0``) become ints."""
    if sampling_params is None:
        return
    if isinstance(sampling_params, dict):
        _check_one(sampling_params)
        return
    if isinstance(sampling_params, list):
        for i, params in enumerate(sampling_params):
            if not isinstance(params, dict):
                raise ValueError(
                    f"sampling_params[{i}] must be an object of sampling parameters, got {_shown(params)}."
                )
            _check_one(params)
        return
    raise ValueError(
        f"sampling_params must be an object (or a list of objects, one per prompt), got {_shown(sampling_params)}."
    )


def _check_one(params: Dict[str, Any]) -> None:
    known = _known_params()
    unknown = sorted(k for k in params if k not in known)
    if unknown:
        name = unknown[0]
        hint = f" (this API calls it {NATIVE_NAMES[name]!r})" if name in NATIVE_NAMES else ""
        raise ValueError(f"Unknown sampling parameter {name!r}{hint}.")
    for name in INTEGER_PARAMS:
        value = params.get(name)
        if value is None:
            continue
        if not _is_integer(value):
            raise ValueError(f"{name} must be an integer, got {_shown(value)}.")
        params[name] = value = int(value)
        if name == "top_k" and value > TOP_K_MAX:
            raise ValueError(f"top_k must be -1 (disable) or between 1 and {TOP_K_MAX}, got {value}.")
        if name == "sampling_seed" and not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"sampling_seed must fit a signed 64-bit integer, got {value}.")
    for name in NUMBER_PARAMS:
        value = params.get(name)
        if value is not None and not _is_number(value):
            raise ValueError(f"{name} must be a number, got {_shown(value)}.")
    for name in BOOL_PARAMS:
        value = params.get(name)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {_shown(value)}.")
    for name in STRING_PARAMS:
        value = params.get(name)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {_shown(value)}.")
    for name in STRING_OR_LIST_PARAMS:
        value = params.get(name)
        if value is None or isinstance(value, str):
            continue
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError(f"{name} must be a string or a list of strings, got {_shown(value)}.")
    stop_ids = params.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, (list, tuple, set)) or not all(_is_integer(t) for t in stop_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {_shown(stop_ids)}.")
    bias = params.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be an object mapping token ids to numbers, got {_shown(bias)}.")
        for token, value in bias.items():
            if not _is_number(value) or not math.isfinite(value):
                raise ValueError(f"logit_bias[{token!r}] must be a finite number, got {_shown(value)}.")
    custom = params.get("custom_params")
    if custom is not None and not isinstance(custom, dict):
        raise ValueError(f"custom_params must be an object, got {_shown(custom)}.")


def _outside(ids: Iterable[Any], vocab_size: int) -> Optional[tuple]:
    """(position, id) of the first id outside [0, vocab_size), or None."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            return i, t
    return None


def check_generate_input(obj: Any, input_ids: Optional[list], vocab_size: int) -> None:
    """A single generate request once tokenized (``GenerateReqInput`` after normalizing,
    ``input_ids`` its prompt). Requests with multimodal data or input embeddings carry
    placeholder ids and are left to upstream; so are the length checks."""
    sampling = obj.sampling_params if isinstance(obj.sampling_params, dict) else {}
    if input_ids is not None and obj.input_embeds is None and not obj.contains_mm_input():
        if len(input_ids) == 0:
            raise ValueError("The prompt is empty after tokenization: a generate request needs at least one input token.")
        if min(input_ids) < 0 or max(input_ids) >= vocab_size:
            pos, token = _outside(input_ids, vocab_size)
            raise ValueError(
                f"Input token id {token} at position {pos} is outside the vocabulary: ids must be in [0, {vocab_size})."
            )
    stop_ids = sampling.get("stop_token_ids")
    if stop_ids:
        bad = _outside((int(t) for t in stop_ids), vocab_size)
        if bad is not None:
            raise ValueError(f"stop_token_ids contains {bad[1]}, outside the vocabulary: ids must be in [0, {vocab_size}).")
