"""Per-request sampling parameters: vLLM's ``SamplingParams``, its names, defaults and checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

from funcspec.config.checks import check_bool, check_float, check_int, is_int, set_field
from funcspec.sampling import MAX_LOGPROBS


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling parameters, with vLLM's names, defaults and checks.

    Construct it with keywords, as in vLLM: ``SamplingParams(temperature=0.8, top_p=0.95)``.

    Attributes:
        temperature: >= 0. 0 makes the request greedy.
        top_p: nucleus mass in (0, 1]. 1 disables top-p.
        top_k: 0 disables top-k. vLLM's other "off" value, -1, is stored as 0.
        max_tokens: the most tokens to generate, >= 1. ``None`` means generate
            until ``max_model_len`` (or a stop rule) ends the request.
        min_tokens: EOS and stop rules are not applied before this many
            tokens. Must be <= ``max_tokens``.
        seed: the request's seed. ``None`` lets the engine choose one.
        stop: stop strings, always stored as a tuple (empty for none). A
            single string is one stop string.
        stop_token_ids: extra stop token ids, always stored as a tuple.
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
        set_field(self, "temperature", check_float("SamplingParams.temperature", self.temperature, lo=0.0))
        set_field(self, "top_p", check_float("SamplingParams.top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True))
        # vLLM quietly accepts -1 as "off". One spelling keeps equal configs equal.
        set_field(self, "top_k", max(check_int("SamplingParams.top_k", self.top_k, lo=-1), 0))
        _check_lengths(self)
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"SamplingParams.seed must be an integer or None, got {self.seed!r}")
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


def _check_lengths(p: SamplingParams) -> None:
    """Check ``max_tokens`` (>= 1 or None) and ``min_tokens`` (0..max_tokens)."""
    if p.max_tokens is not None:
        check_int("SamplingParams.max_tokens", p.max_tokens, lo=1)
    check_int("SamplingParams.min_tokens", p.min_tokens, lo=0)
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise ValueError(
            f"SamplingParams.min_tokens must be <= max_tokens ({p.max_tokens}), got {p.min_tokens}"
        )


def _stop_strings(stop: Any) -> tuple[str, ...]:
    """``stop`` (None, a string, or a list of strings) as a tuple of non-empty strings."""
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, Sequence) or not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"SamplingParams.stop must be a non-empty string or a list of them, got {stop!r}")
    return tuple(items)


def _stop_ids(ids: Any) -> tuple[int, ...]:
    """``stop_token_ids`` (None or a list of ints >= 0) as a tuple."""
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not all(
        is_int(t) and t >= 0 for t in ids
    ):
        raise ValueError(f"SamplingParams.stop_token_ids must be a list of token ids >= 0, got {ids!r}")
    return tuple(ids)


def _check_unsupported_sampling(p: SamplingParams) -> None:
    """Refuse the logit processors funcspec does not implement."""
    neutral = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}
    for name, value in neutral.items():
        if getattr(p, name) != value:
            raise ValueError(
                f"SamplingParams.{name}={getattr(p, name)!r} is not supported by funcspec "
                f"(only the neutral value {value})"
            )
