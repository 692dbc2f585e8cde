"""vLLM-Ascend's ``additional_config`` sections: ``rejection_sampler_config`` and ``dynamic_spec_config``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Optional

from funcspec import methods
from funcspec.config.checks import (DYN, RS, check_bool, check_float, check_int, check_mapping, no_unknown_keys,
                                    set_field)

DYNAMIC_SPEC_METHODS = methods.select(dynamic_spec=True)
"""The methods whose drafts carry the confidence that ``dynamic_spec_config`` budgets with."""
DYNAMIC_SPEC_PARAMS = ("initial_verify_budget_per_req", "budget_update_interval", "budget_threshold",
                       "min_verify_tokens")


@dataclasses.dataclass(frozen=True)
class RejectionSamplerConfig:
    """vLLM-Ascend's ``additional_config["rejection_sampler_config"]``.

    Attributes:
        enable_block_verify: MagicMTP block verification (lossy). vLLM-Ascend
            applies it only when K >= 3; the verifier enforces that.
        enable_entropy_verify: entropy verification (lossy).
        posterior_threshold: upper bound of the entropy threshold, in (0, 1].
        posterior_alpha: how strongly entropy lowers the threshold, >= 0.
    """

    enable_block_verify: bool = False
    enable_entropy_verify: bool = False
    posterior_threshold: float = 0.95
    posterior_alpha: float = 0.4

    def __post_init__(self) -> None:
        check_bool(RS + "enable_block_verify", self.enable_block_verify)
        check_bool(RS + "enable_entropy_verify", self.enable_entropy_verify)
        set_field(self, "posterior_threshold",
                  check_float(RS + "posterior_threshold", self.posterior_threshold, lo=0.0, hi=1.0, lo_open=True))
        set_field(self, "posterior_alpha", check_float(RS + "posterior_alpha", self.posterior_alpha, lo=0.0))

    @classmethod
    def from_dict(cls, d: Optional[Mapping]) -> "RejectionSamplerConfig":
        """Parse the dict. ``None`` gives the defaults. An unknown key is a ValueError."""
        if d is None:
            return cls()
        no_unknown_keys(RS, check_mapping(RS[:-1], d), {f.name for f in dataclasses.fields(cls)})
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class DynamicSpecConfig:
    """vLLM-Ascend's confidence-based verify length (``additional_config["dynamic_spec_config"]``).

    Attributes:
        method: "dspark" (confidence head) or "dflash" (max softmax). It must
            equal the speculative method.
        initial_verify_budget_per_req: the verify budget per request before the
            first update, >= 1.
        budget_update_interval: steps between budget updates, >= 1.
        budget_threshold: survival probability that counts a token toward the
            budget, in (0, 1].
        min_verify_tokens: every request verifies at least this many drafts, >= 1.
    """

    method: str
    initial_verify_budget_per_req: int = 5
    budget_update_interval: int = 16
    budget_threshold: float = 0.3
    min_verify_tokens: int = 1

    def __post_init__(self) -> None:
        if self.method not in DYNAMIC_SPEC_METHODS:
            raise ValueError(f"{DYN}method must be one of {DYNAMIC_SPEC_METHODS}, got {self.method!r}")
        params = DYN + "method_params."
        check_int(params + "initial_verify_budget_per_req", self.initial_verify_budget_per_req, lo=1)
        check_int(params + "budget_update_interval", self.budget_update_interval, lo=1)
        set_field(self, "budget_threshold",
                  check_float(params + "budget_threshold", self.budget_threshold, lo=0.0, hi=1.0, lo_open=True))
        check_int(params + "min_verify_tokens", self.min_verify_tokens, lo=1)

    @classmethod
    def from_dict(cls, d: Optional[Mapping]) -> Optional["DynamicSpecConfig"]:
        """Parse ``{"method": ..., "method_params": {...}}``.

        Returns ``None`` for ``None`` or a missing method: in vLLM-Ascend that
        disables the feature. Unknown keys are a ValueError.
        """
        if d is None:
            return None
        no_unknown_keys(DYN, check_mapping(DYN[:-1], d), ("method", "method_params"))
        if d.get("method") is None:
            return None
        params = d.get("method_params") or {}
        no_unknown_keys(DYN + "method_params.", check_mapping(DYN + "method_params", params), DYNAMIC_SPEC_PARAMS)
        return cls(method=d["method"], **params)
