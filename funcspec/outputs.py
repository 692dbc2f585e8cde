"""vLLM-shaped request outputs."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence: ``text``, ``token_ids`` and why it stopped (``stop`` | ``length``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    stop_reason: Any = None


@dataclasses.dataclass
class RequestOutput:
    """The result of one request, as vLLM's ``RequestOutput``.

    ``metrics`` holds ``num_draft_tokens``, ``num_accepted_tokens``,
    ``acceptance_length`` (emitted tokens per decode step), ``steps`` and timings.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict = dataclasses.field(default_factory=dict)
    kv_transfer_params: Optional[dict] = None
