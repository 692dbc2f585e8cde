"""vLLM-shaped request outputs."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional


class Logprob(NamedTuple):
    """vLLM's ``Logprob``: one token's log-probability, its 1-based rank and its text.

    Attributes:
        logprob: the target's raw log-probability (log-softmax of its logits
            before temperature, top-k and top-p: vLLM's default ``logprobs_mode``).
        rank: 1-based rank among the vocabulary (1 + the other tokens at least as likely).
        decoded_token: the token's text, or ``None`` without a tokenizer.
    """

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


SampleLogprobs = list  # list[dict[int, Logprob]]: one dict per generated token
PromptLogprobs = list  # list[Optional[dict[int, Logprob]]]: None for the first prompt token


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence: ``text``, ``token_ids`` and why it stopped (``stop`` | ``length`` | ``abort`` |
    ``error``).

    ``logprobs`` (when the request asked for them): one dict per token of
    ``token_ids``, token id -> :class:`Logprob`, holding the generated token and
    the request's top ``logprobs`` tokens; ``cumulative_logprob`` is the sum of
    the generated tokens' logprobs. ``metrics`` holds this completion's own
    speculation counters (``num_accepted_tokens_per_pos``, τ, ...). ``error``
    (funcspec's; vLLM's ``finish_reason="error"`` carries no text) says why a
    request that failed alone (``finish_reason="error"``) did, as
    ``"ExceptionType: message"``; ``None`` otherwise.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    stop_reason: Any = None
    logprobs: Optional[SampleLogprobs] = None
    cumulative_logprob: Optional[float] = None
    metrics: dict = dataclasses.field(default_factory=dict)
    error: Optional[str] = None


@dataclasses.dataclass
class RequestOutput:
    """The result of one request, as vLLM's ``RequestOutput``.

    ``outputs`` holds ``SamplingParams.n`` completions, by ``index``.
    ``prompt_logprobs`` (when asked for): one entry per prompt token, ``None``
    for the first (nothing predicts it), else a dict as in
    :attr:`CompletionOutput.logprobs`. ``metrics`` holds ``num_draft_tokens``,
    ``num_accepted_tokens``, ``acceptance_length`` (τ: emitted tokens per decode
    step), ``num_accepted_tokens_per_pos`` (how many steps accepted the draft at
    each position), ``steps`` and timings, summed over the completions.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict = dataclasses.field(default_factory=dict)
    kv_transfer_params: Optional[dict] = None
    prompt_logprobs: Optional[PromptLogprobs] = None
