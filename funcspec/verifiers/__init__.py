"""Verifiers: accept or reject draft tokens against the target model (ARCHITECTURE.md, "Contract").

Glossary (after vLLM's ``rejection_sampler.py``), for one row of the batch:

    draft tokens      the K tokens a proposer guessed, ``[B, K]``; ``PLACEHOLDER``
                      (-1) where it has none. A ``PLACEHOLDER`` is always rejected.
    accepted tokens   the leading drafts the rule keeps (``num_accepted`` of them).
    recovered token   drawn at the first rejected position from the residual
                      ``norm(max(0, p - q))`` (block: ``max(0, p_τ·p - q)``), so
                      that the output follows the target; never a one-hot draft.
    bonus token       drawn from the target's last position ``p_K`` when all K
                      drafts are accepted; one more token for free.
    emitted tokens    accepted tokens followed by exactly one recovered or bonus
                      token: ``num_emitted = num_accepted + 1`` in ``[1, K+1]``.

Every rule, chain or tree, has the signature

    verify(cfg, vin) -> (tokens, num_emitted, path)
    #  vin: common.VerifyInput (key [B], logits [B, N+1, V], proposal.tokens/parents [B, N], sampling,
    #         keys [B, D+1] decoding's key per position, rates [K] for synthetic)
    #  -> tokens [B, D+1] int64 (PLACEHOLDER after the emitted ones) · num_emitted [B] int32
    #     · path [B, D+1] the tree indices of the accepted root path (a chain's: 0..K)

(a chain of K is the tree of depth D = K whose node i's parent is i - 1), and is
a pure function: no host syncs, randomness only from ``funcspec.rng`` (sub-streams
in ``common``), so it captures with ``fullgraph=True`` and gives the same tokens
eager and compiled. ``p`` is always
``funcspec.sampling.target_probs(target_logits, temperature, top_k, top_p)``;
``q`` is ``proposal.probs``, or one-hot at the draft when that is ``None``.
Rows with temperature 0 reduce to greedy verification under every rule except
synthetic (which accepts by rate, then emits the target argmax).

Token trees are verified by the rule ``"tree"`` (``verifiers.tree``; lossless),
which an engine's plan picks for every bucket that drafts a tree; the step moves
the KV of the path it returns into place. Every rule sees the rows' sampling
mode through ``VerifyConfig.greedy`` and ``filters``: an engine's plan builds each
bucket's complete config once (``plan.verify_rule``), per K and sampling mode.

Reproducibility: the step hands the standard rule and the tree rule the keys
that autoregressive decoding draws each position with (``step.row_keys``). With
deterministic drafts (every method but ``draft_model`` and ``dspark`` in sampled
buckets, whose drafts carry q) they draw the target's token at each position
exactly as decoding without speculation would, so a seeded sampled request
emits the same tokens with and without speculation, not only the same law.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from funcspec import rng
from funcspec.types import Proposal, Sampling
from funcspec.verifiers import block, common, entropy, greedy, magicmtp, standard, synthetic, tree
from funcspec.verifiers.common import Verdict, VerifyInput

VERIFIERS: dict[str, Callable[..., Verdict]] = {
    "greedy": greedy.verify,
    "standard": standard.verify,
    "block": block.verify,
    "magicmtp": magicmtp.verify,
    "entropy": entropy.verify,
    "synthetic": synthetic.verify,
    "tree": tree.verify,
}
"""Rule name -> ``verify(cfg, vin)`` function."""

OWN_GREEDY = ("synthetic", "tree")
"""Rules that do not reduce to the greedy rule when every row is greedy: synthetic accepts by
rate whatever the target says; the tree rule takes argmax at each node itself."""

ENTROPY_METHODS = ("entropy", "magicmtp")
"""Methods that ``VerifyConfig.entropy=True`` combines with."""


def check_method(method: str) -> None:
    """Raise ``ValueError`` naming ``method`` unless it is a known rule."""
    if method not in VERIFIERS:
        raise ValueError(f"method must be one of {sorted(VERIFIERS)}, got {method!r}")


@dataclasses.dataclass(frozen=True)
class VerifyConfig:
    """Static verifier settings (hashable: part of a bucket's key).

    Attributes:
        method: one of ``VERIFIERS``.
        posterior_threshold: entropy verify's cap on the threshold, in (0, 1].
        posterior_alpha: entropy verify's sensitivity to entropy, >= 0.
        entropy: with ``method="magicmtp"``, also scale by the entropy threshold
            (vLLM-Ascend with both ``enable_block_verify`` and
            ``enable_entropy_verify``). Allowed only for "magicmtp" and "entropy".
        synthetic_rates: per-position acceptance rates [K] for
            ``method="synthetic"`` (required there, refused elsewhere).
        filters: apply top-k/top-p to ``p``. ``False`` skips the sort and is
            valid only when every row has both off (see ``sampling.Mode``).
        greedy: every row is greedy (the bucket's ``sampling.Mode``): the greedy
            rule then runs, which every rule but those of :data:`OWN_GREEDY`
            reduces to on greedy rows, at O(K·V) argmax cost instead of
            probabilities, ratios and a race.
        depth: the tree rule's static depth D (required by ``"tree"``, refused elsewhere).
    """

    method: str = "standard"
    posterior_threshold: float = 0.95
    posterior_alpha: float = 0.4
    entropy: bool = False
    synthetic_rates: Optional[tuple[float, ...]] = None
    filters: bool = True
    greedy: bool = False
    depth: Optional[int] = None

    def __post_init__(self):
        check_method(self.method)
        if not 0.0 < self.posterior_threshold <= 1.0:
            raise ValueError(f"posterior_threshold must be in (0, 1], got {self.posterior_threshold}")
        if not self.posterior_alpha >= 0.0:
            raise ValueError(f"posterior_alpha must be >= 0, got {self.posterior_alpha}")
        if self.entropy and self.method not in ENTROPY_METHODS:
            raise ValueError(f"entropy=True combines only with method in {ENTROPY_METHODS}, got {self.method!r}")
        if (self.synthetic_rates is not None) != (self.method == "synthetic"):
            raise ValueError(
                "synthetic_rates must be given exactly when method is 'synthetic', "
                f"got method={self.method!r}, synthetic_rates={self.synthetic_rates!r}"
            )
        if (self.depth is not None) != (self.method == "tree"):
            raise ValueError(f"depth must be given exactly when method is 'tree', got method={self.method!r}, "
                             f"depth={self.depth!r}")
        if self.depth is not None and not (isinstance(self.depth, int) and self.depth >= 1):
            raise ValueError(f"depth must be an int >= 1, got {self.depth!r}")
        if self.synthetic_rates is not None:
            # NOTE: stored as a tuple of floats so the config stays hashable.
            rates = synthetic.check_rates(self.synthetic_rates, name="synthetic_rates")
            object.__setattr__(self, "synthetic_rates", rates)


def verify(cfg: VerifyConfig, vin: VerifyInput) -> Verdict:
    """Run the rule of ``cfg``; see the module docstring for shapes.

    With ``cfg.greedy`` (static: the host knows every row has temperature 0)
    every rule but those of :data:`OWN_GREEDY` runs as the greedy rule.
    """
    method = "greedy" if cfg.greedy and cfg.method not in OWN_GREEDY else cfg.method
    return VERIFIERS[method](cfg, vin)


def _row_keys(key: torch.Tensor, batch: int) -> torch.Tensor:
    """[B] keys from a scalar key (split) or a [B] key tensor."""
    if key.dim() == 0:
        return rng.split(key, batch)
    if tuple(key.shape) != (batch,):
        raise ValueError(f"key must be a scalar key or a [B] = [{batch}] key tensor, got shape {tuple(key.shape)}")
    return key


def _checked_row_tensor(name: str, value, batch: int, dtype: torch.dtype, device, ok: Callable[[float], bool],
                        want: str) -> torch.Tensor:
    """A [B] tensor from a Python number (range-checked) or a [B] / [] tensor."""
    if isinstance(value, torch.Tensor):
        if value.dim() > 1 or (value.dim() == 1 and value.shape[0] != batch):
            raise ValueError(f"{name} must be a number or a [B] = [{batch}] tensor, got shape {tuple(value.shape)}")
        return value.to(device=device, dtype=dtype).expand(batch)
    if not ok(value):
        raise ValueError(f"{name} must be {want}, got {value}")
    return torch.full((batch,), value, dtype=dtype, device=device)


def rejection_sample(
    key: torch.Tensor,
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: Optional[torch.Tensor] = None,
    *,
    method: str = "standard",
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    posterior_threshold: float = 0.95,
    posterior_alpha: float = 0.4,
    entropy: bool = False,
    synthetic_acceptance_rates=None,
    synthetic_acceptance_length=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify drafts with one call: builds the config, row keys and sampling tensors.

    Args:
        key: a scalar key from ``rng.key(seed)`` (split into B row keys) or [B] keys.
        target_logits: [B, K+1, V] raw target logits.
        draft_tokens: [B, K] int64, ``PLACEHOLDER`` where there is no draft.
        draft_probs: [B, K, V] draft distribution, or None (one-hot drafts).
        method: one of ``VERIFIERS`` but ``"tree"`` (the drafts are a chain).
        temperature, top_k, top_p: numbers or [B] tensors; temperature 0 is greedy.
        entropy: combine "magicmtp" with entropy verify (see :class:`VerifyConfig`).
        synthetic_acceptance_rates, synthetic_acceptance_length: for "synthetic",
            exactly one of them (see ``synthetic.validate_synthetic``).

    Returns:
        tokens [B, K+1] int64 and num_emitted [B] int32.

    Raises:
        ValueError: naming the argument or field that is invalid.
    """
    check_method(method)
    if method == "tree":
        raise ValueError("method 'tree' verifies token trees, whose drafts need parents: call verifiers.verify "
                         "with a common.VerifyInput whose proposal carries them")
    common.check_inputs(None, target_logits, draft_tokens, draft_probs)
    batch, k = draft_tokens.shape
    rates = None
    if method == "synthetic":
        rates = synthetic.validate_synthetic(synthetic_acceptance_rates, synthetic_acceptance_length, k)
    elif synthetic_acceptance_rates is not None or synthetic_acceptance_length is not None:
        raise ValueError(
            f"synthetic_acceptance_rates / synthetic_acceptance_length apply only to method 'synthetic', got {method!r}"
        )
    cfg = VerifyConfig(method, posterior_threshold, posterior_alpha, entropy, rates)
    device = target_logits.device
    sampling = Sampling(
        _checked_row_tensor("temperature", temperature, batch, torch.float32, device, lambda t: t >= 0, ">= 0"),
        _checked_row_tensor("top_k", top_k, batch, torch.int64, device, lambda t: t >= 0 and int(t) == t,
                 "an integer >= 0 (0 disables)"),
        _checked_row_tensor("top_p", top_p, batch, torch.float32, device, lambda t: 0 < t <= 1, "in (0, 1]"),
    )
    proposal = Proposal.chain(draft_tokens, draft_probs)
    tokens, num_emitted, _ = verify(cfg, VerifyInput(_row_keys(key, batch), target_logits, proposal, sampling))
    return tokens, num_emitted


__all__ = ["VERIFIERS", "Verdict", "VerifyConfig", "VerifyInput", "verify", "rejection_sample",
           "check_method"]
