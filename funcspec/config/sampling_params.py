"""Per-request sampling parameters: vLLM's ``SamplingParams``, its names, defaults and checks."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any, Optional

from funcspec.config.checks import (FLOAT32_MAX, INT64_MAX, INT64_MIN, check_bool, check_float, check_int,
                                    check_text, is_int, set_field, short)
from funcspec.logprobs import MAX_LOGPROBS

MAX_STOPS = 256
"""The most ``stop`` strings, and ``stop_token_ids``, a request may give: the scheduler checks each one at every
emitted token, so a longer list would slow every request the engine runs beside it."""

MIN_TEMPERATURE = 0.01
"""vLLM's ``_MAX_TEMP``: a temperature in (0, 0.01) is raised to it, with a warning. Smaller divisors overflow
the scaled logits to inf (a subnormal float32 one made every token id 0)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling parameters, with vLLM's names, defaults and checks.

    Construct it with keywords, as in vLLM: ``SamplingParams(temperature=0.8, top_p=0.95)``.

    Attributes:
        temperature: 0, or in [0.01, the largest float32]. 0 makes the request
            greedy; a value in (0, 0.01) is raised to 0.01 with one warning, as
            vLLM does (:data:`MIN_TEMPERATURE`).
        top_p: nucleus mass in (0, 1]. 1 disables top-p.
        top_k: 0 disables top-k. vLLM's other "off" value, -1, is stored as 0.
            At most int64's largest value; the engine treats a ``top_k`` at or
            above its vocabulary size as off, as vLLM does.
        max_tokens: the most tokens to generate, >= 1. The engine refuses a
            prompt plus ``max_tokens`` beyond its ``max_model_len``. ``None``
            means generate until ``max_model_len`` (or a stop rule) ends the request.
        min_tokens: EOS and stop rules are not applied before this many
            tokens. Must be <= ``max_tokens``.
        seed: the request's seed, an int64. ``None`` lets the engine choose one.
        stop: stop strings (valid Unicode, at most :data:`MAX_STOPS`), always
            stored as a tuple (empty for none). A single string is one stop string.
        stop_token_ids: extra stop token ids (int64s >= 0, at most
            :data:`MAX_STOPS`), always stored as a tuple.
        ignore_eos: keep generating past EOS.
        n: completions per prompt, >= 1 (at most the engine's ``max_num_seqs``:
            each completion holds a KV slot). The prompt is prefilled once;
            completion ``i`` samples with seed ``funcspec.rng.completion_seed(seed, i)``
            (completion 0 with ``seed`` itself), so it is reproducible alone.
        logprobs: return the target's log-probability of each generated token
            and of the ``logprobs`` most likely tokens at its position (0: the
            generated token only), up to ``MAX_LOGPROBS`` (20, vLLM's default
            ``max_logprobs``). ``None``: none. The values are vLLM's default
            ``logprobs_mode="raw_logprobs"``: the log-softmax of the target's raw
            logits, before temperature, top-k and top-p; under speculation they
            are the target's, at every emitted token, bit for bit what decoding
            without speculation returns.
        prompt_logprobs: the same for every prompt token after the first
            (``None`` for the first, as vLLM), from the prefill's logits.
        repetition_penalty, presence_penalty, frequency_penalty, min_p: accepted
            only at their neutral values (1, 0, 0, 0). funcspec's verifiers do not
            implement these logit processors.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    seed: Optional[int] = None
    stop: Any = None
    stop_token_ids: Any = None
    ignore_eos: bool = False
    n: int = 1
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        set_field(self, "temperature", _temperature(self.temperature))
        set_field(self, "top_p", check_float("SamplingParams.top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True))
        # vLLM quietly accepts -1 as "off". One spelling keeps equal configs equal.
        set_field(self, "top_k", max(check_int("SamplingParams.top_k", self.top_k, lo=-1, hi=INT64_MAX), 0))
        _check_lengths(self)
        if self.seed is not None:
            check_int("SamplingParams.seed", self.seed, lo=INT64_MIN, hi=INT64_MAX, where=" or None")
        set_field(self, "stop", _stop_strings(self.stop))
        set_field(self, "stop_token_ids", _stop_ids(self.stop_token_ids))
        check_bool("SamplingParams.ignore_eos", self.ignore_eos)
        check_int("SamplingParams.n", self.n, lo=1)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                check_int(f"SamplingParams.{name}", getattr(self, name), lo=0, hi=MAX_LOGPROBS,
                          where=" or None")
        _check_unsupported_sampling(self)

    @property
    def greedy(self) -> bool:
        """True when the request decodes greedily (temperature 0)."""
        return self.temperature == 0.0


def _temperature(t: Any) -> float:
    """``temperature`` checked (0, or positive and at most the largest float32), a value in (0, 0.01) raised to
    :data:`MIN_TEMPERATURE` with one warning."""
    t = check_float("SamplingParams.temperature", t, lo=0.0, hi=FLOAT32_MAX)
    if 0.0 < t < MIN_TEMPERATURE:
        # NOTE: stacklevel 4: warnings.warn <- _temperature <- __post_init__ <- __init__ <- the caller
        warnings.warn(f"SamplingParams.temperature={t!r} is below {MIN_TEMPERATURE}, which makes inf or NaN "
                      f"probabilities; raised to {MIN_TEMPERATURE}", stacklevel=4)
        return MIN_TEMPERATURE
    return t


def _check_lengths(p: SamplingParams) -> None:
    """Check ``max_tokens`` (>= 1 or None) and ``min_tokens`` (0..max_tokens)."""
    if p.max_tokens is not None:
        check_int("SamplingParams.max_tokens", p.max_tokens, lo=1)
    check_int("SamplingParams.min_tokens", p.min_tokens, lo=0)
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise ValueError(
            f"SamplingParams.min_tokens must be <= max_tokens ({short(p.max_tokens)}), got {short(p.min_tokens)}"
        )


def _stop_strings(stop: Any) -> tuple[str, ...]:
    """``stop`` (None, a string, or a list of strings) as a tuple of non-empty, valid Unicode strings."""
    if stop is None:
        return ()
    items = _stop_list("stop", (stop,) if isinstance(stop, str) else stop, "a non-empty string or a list of them")
    for i, s in enumerate(items):
        if not isinstance(s, str) or not s:
            raise ValueError(f"SamplingParams.stop[{i}] must be a non-empty string, got {short(s)}")
        check_text(f"SamplingParams.stop[{i}]", s)
    return items


def _stop_ids(ids: Any) -> tuple[int, ...]:
    """``stop_token_ids`` (None or a list of int64s >= 0) as a tuple."""
    if ids is None:
        return ()
    items = _stop_list("stop_token_ids", ids, "a list of token ids")
    for i, t in enumerate(items):
        if not is_int(t) or not 0 <= t <= INT64_MAX:
            raise ValueError(f"SamplingParams.stop_token_ids[{i}] must be a token id in [0, 2**63), got {short(t)}")
    return items


def _stop_list(name: str, items: Any, what: str) -> tuple:
    """``items`` as a tuple of at most :data:`MAX_STOPS` entries: the scheduler checks each at every emitted token,
    so a longer list would slow every request running beside this one."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise ValueError(f"SamplingParams.{name} must be {what}, got {short(items)}")
    if len(items) > MAX_STOPS:
        raise ValueError(f"SamplingParams.{name} holds {len(items)} entries; at most {MAX_STOPS} are accepted "
                         "(each is checked at every emitted token)")
    return tuple(items)


def _check_unsupported_sampling(p: SamplingParams) -> None:
    """Refuse the logit processors funcspec does not implement."""
    neutral = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}
    for name, value in neutral.items():
        if getattr(p, name) != value:
            raise ValueError(
                f"SamplingParams.{name}={short(getattr(p, name))} is not supported by funcspec "
                f"(only the neutral value {value})"
            )
