"""The small validators every config shares, and the field paths their messages name.

Each check returns the value (normalised where noted) or raises ``ValueError``
whose message starts with the field's dotted path, for example
``speculative_config.num_speculative_tokens must be >= 1 ...``. Synthetic
acceptance rates are checked by the synthetic verifier's own rule
(:func:`synthetic_rates` only adds the field path), so config, verifier and
engine accept the same rates.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any, Optional

import torch

from funcspec.verifiers.synthetic import validate_synthetic

# The field paths that error messages name.
SPEC = "speculative_config."
EXTRA = "additional_config."
RS = EXTRA + "rejection_sampler_config."
DYN = EXTRA + "dynamic_spec_config."

# The SpecConfig fields whose vLLM key is not ``speculative_config.<field>``.
_PATHS = {
    "eagle_aux_hidden_state_layer_ids": SPEC + "draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids",
    "draft_window_size": EXTRA + "draft_window_size",
    "dynamic_spec": DYN[:-1],
    "rejection_sampler": RS[:-1],
    "dynamic_tree": SPEC + "speculative_eagle_topk",  # the first of SGLang's keys names the dynamic tree
}


def field_path(field: str) -> str:
    """The dotted vLLM path that messages name for SpecConfig field ``field``."""
    return _PATHS.get(field, SPEC + field)

MAX_DRAFT_TOKENS = 63
"""The most drafts a row verifies in one step (``num_speculative_tokens``: a chain's K, a token tree's node count
N): a verify block is at most 64 tokens per row (K + 1), for chains and trees alike."""


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
"""The range of int64, the dtype of every integer a request writes to a tensor (token ids, ``top_k``, keys)."""
FLOAT32_MAX = torch.finfo(torch.float32).max
"""The largest float32: a float field written to a float32 tensor (``temperature``) must not exceed it (torch
refuses the write: "value cannot be converted to type float without overflow")."""
FLOAT32_TINY = torch.finfo(torch.float32).tiny
"""The smallest normal float32: a ``top_p`` below it (7e-46 rounds to 0) runs as it, the most likely token alone."""


def is_int(value: Any) -> bool:
    """True for a real integer. ``bool`` is excluded: ``True`` is never a count."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """True for an int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` as a message shows it, cut to ``limit`` characters: a client's value may be megabytes, or an
    integer too long for ``repr`` itself (Python refuses ints of more than 4300 digits)."""
    if isinstance(value, int) and abs(value) >= 10 ** limit:
        return f"an integer of about {int(abs(value).bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_int(name: str, value: Any, lo: int, hi: Optional[int] = None, where: str = "") -> int:
    """``value`` if it is an integer in ``[lo, hi]``; otherwise a ValueError naming ``name``."""
    if not is_int(value):
        raise ValueError(f"{name} must be an integer{where}, got {short(value)}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}{where}, got {short(value)}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}{where}, got {short(value)}")
    return value


def check_float(name: str, value: Any, lo: float, hi: Optional[float] = None, lo_open: bool = False) -> float:
    """``value`` as a float if it is finite and in the range; otherwise a ValueError naming ``name``."""
    try:
        finite = is_number(value) and math.isfinite(value)
    except OverflowError:  # an int beyond every float
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number, got {short(value)}")
    too_low = value <= lo if lo_open else value < lo
    if hi is None and too_low:
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo:g}, got {short(value)}")
    if hi is not None and (too_low or value > hi):
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {short(value)}")
    return float(value)


def check_text(name: str, text: str) -> str:
    """``text`` if it is valid Unicode (encodable as UTF-8); a lone surrogate (``"\\ud800"``, as JSON can
    spell it) is a ValueError naming ``name`` and the position, not a tokenizer's own exception."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} must be valid Unicode text: {text[e.start]!r} at position {e.start} is a lone "
                         f"surrogate") from None
    return text


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool; otherwise a ValueError naming ``name``."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {short(value)}")
    return value


def check_mapping(name: str, value: Any) -> Mapping:
    """``value`` if it is a mapping (a dict); otherwise a ValueError naming ``name``."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a dict, got {type(value).__name__}")
    return value


def no_unknown_keys(prefix: str, d: Mapping, known) -> None:
    """Refuse keys of ``d`` outside ``known``, suggesting the closest known key."""
    for key in d:
        if key not in known:
            close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {sorted(known)}"
            raise ValueError(f"{prefix}{key} is not a known key{hint}")


def set_field(obj: Any, name: str, value: Any) -> None:
    """Store a normalised value on a frozen dataclass during ``__post_init__``."""
    object.__setattr__(obj, name, value)


def synthetic_rates(rates: Any, length: Any, max_k: int) -> tuple[float, ...]:
    """The synthetic rates [max_k], from exactly one of ``rates`` and ``length``.

    The synthetic verifier's own check decides (one rule for config, verifier
    and engine); this only puts the ``speculative_config.`` path on its message.
    """
    try:
        return validate_synthetic(rates, length, max_k)
    except ValueError as err:
        msg = str(err)
        raise ValueError(SPEC + msg if msg.startswith("synthetic_") else f"{SPEC[:-1]}: {msg}") from err
