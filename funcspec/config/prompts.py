"""Prompts and sampling parameters as ``generate`` and ``add_request`` take them, checked before any request exists.

A prompt is a string, a sequence of token ids, or a vLLM prompt dict
(``{"prompt": str}``, ``{"prompt_token_ids": [...]}``, or both). Anything else
is a ``ValueError`` naming the argument (``prompts[2]``, ``prompt[5]``), raised
before the engine takes any request, so a refused call leaves nothing queued.
What depends on the engine (the vocabulary, ``max_model_len``, a tokenizer) is
the scheduler's to check.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

from funcspec.config.checks import check_text, no_unknown_keys
from funcspec.config.sampling_params import SamplingParams

PROMPT_KEYS = ("prompt", "prompt_token_ids")
"""The keys of a vLLM prompt dict that funcspec reads (a text prompt, token ids, or both)."""

_WHAT = "a string, a list of token ids or a dict with 'prompt' or 'prompt_token_ids'"


def generate_args(prompts: Any, sampling_params: Any) -> tuple[list, list[SamplingParams]]:
    """``generate``'s arguments as one checked prompt and one :class:`SamplingParams` per request.

    ``prompts`` is one prompt (a string, a dict, or a list of token ids) or a
    list of them; ``sampling_params`` is ``None`` (the defaults), one
    ``SamplingParams`` for every prompt, or a list with one per prompt.
    """
    if _is_one_prompt(prompts):
        check_prompt(prompts, "prompts")
        prompts = [prompts]
    elif isinstance(prompts, bytes) or not _is_sequence(prompts):
        raise ValueError(f"prompts must be {_WHAT}, or a list of them, got {_kind(prompts)}")
    else:
        prompts = list(prompts)
        for i, prompt in enumerate(prompts):
            check_prompt(prompt, f"prompts[{i}]")
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return prompts, [sampling_params or SamplingParams()] * len(prompts)
    if not isinstance(sampling_params, (list, tuple)):
        raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {_kind(sampling_params)}")
    if len(sampling_params) != len(prompts):
        raise ValueError(f"sampling_params: got {len(sampling_params)} for {len(prompts)} prompts")
    for i, params in enumerate(sampling_params):
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {_kind(params)}")
    return prompts, list(sampling_params)


def request_args(prompt: Any, sampling_params: Any) -> tuple[Any, SamplingParams]:
    """``add_request``'s arguments: one checked prompt and its :class:`SamplingParams` (``None``: the defaults)."""
    check_prompt(prompt, "prompt")
    if sampling_params is None:
        return prompt, SamplingParams()
    if not isinstance(sampling_params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {_kind(sampling_params)}")
    return prompt, sampling_params


def check_prompt(prompt: Any, name: str = "prompt") -> None:
    """Refuse anything but a string (valid Unicode), a sequence of token ids or a vLLM prompt dict; ``ValueError``
    naming ``name``."""
    if isinstance(prompt, str):
        check_text(name, prompt)
        return
    if isinstance(prompt, Mapping):
        no_unknown_keys(f"{name}: key ", prompt, PROMPT_KEYS)
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{name}['prompt'] must be a string, got {_kind(text)}")
        if text is not None:
            check_text(f"{name}['prompt']", text)
        if "prompt_token_ids" in prompt:
            check_token_ids(prompt["prompt_token_ids"], f"{name}['prompt_token_ids']")
        elif text is None:
            raise ValueError(f"{name}: a prompt dict needs 'prompt_token_ids' or 'prompt'")
        return
    if isinstance(prompt, bytes) or not _is_sequence(prompt):
        raise ValueError(f"{name} must be {_WHAT}, got {_kind(prompt)}")
    check_token_ids(prompt, name)


def check_token_ids(ids: Any, name: str) -> None:
    """``ids`` is a sequence of integers (range checks against the vocabulary are the scheduler's)."""
    if isinstance(ids, (str, bytes, Mapping)) or not _is_sequence(ids):
        raise ValueError(f"{name} must be a list of token ids, got {_kind(ids)}")
    for i, token in enumerate(ids):
        if not _is_token(token):
            raise ValueError(f"{name}[{i}] must be a token id (an integer), got {token!r}")


def _is_one_prompt(prompts: Any) -> bool:
    """One prompt rather than a list of them: a string, a dict, or a sequence whose first item is a number
    (a token id, or what was meant as one: its own check then names it)."""
    if isinstance(prompts, (str, Mapping)):
        return True
    if not _is_sequence(prompts) or isinstance(prompts, bytes) or len(prompts) == 0:
        return False
    first = prompts[0]
    return _is_token(first) or isinstance(first, (int, float)) or _is_index(first)


def _is_sequence(value: Any) -> bool:
    """A list, a tuple, or another sized iterable with items (an array, a 1-D tensor), not a scalar."""
    if isinstance(value, Sequence):
        return True
    try:
        len(value)
        iter(value)
    except TypeError:  # a scalar, None, a 0-d tensor, a generator
        return False
    return True


def _is_index(value: Any) -> bool:
    """True for anything Python takes as an integer index (int, numpy integers, an integer 0-d tensor)."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _is_token(value: Any) -> bool:
    """A token id: an integer, never a bool (``True`` is not a token)."""
    return not isinstance(value, bool) and _is_index(value)


def _kind(value: Any) -> str:
    """How a message names a bad value: ``None`` as itself, else its type (a prompt may be long)."""
    return "None" if value is None else type(value).__name__
