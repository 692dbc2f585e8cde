"""MagicMTP block verify (vLLM-Ascend ``enable_block_verify``; lossy).

A cumulative product against a product of uniforms, with no residual
correction (hence lossy):

    π_k = min(1, π_{k-1} · p_k/q_k),  π_{-1} = 1   (π = 0 from a PLACEHOLDER or q = 0 on)
    U_k = Π_{j<=k} u_j
    last = max{k : q_k > 0 and π_k >= thr_k · U_k}   (thr = 1 unless ``cfg.entropy``)

Emit drafts ``0..last``; position ``last+1`` gets the standard recovered token
from ``norm(max(0, p - q))``, or the bonus if ``last+1 == K``. With
``cfg.entropy`` the cumulative acceptance is compared with the entropy-scaled
``thr_k · U_k`` (:func:`funcspec.verifiers.entropy.threshold`), as vLLM-Ascend
does when both flags are on.

NOTE: this follows vLLM-Ascend's Triton kernel (and ALGORITHMS.md): the clamp
is on the running product, and q = 0 drops π to 0. Its PyTorch fallback differs
(clamps each ratio before a cumprod; recovers from ``max(0, π·p - q)``).

Active only for K >= 3; below that it is standard verification (entropy
verification with ``cfg.entropy``), as in vLLM-Ascend. Uses stream 0 (u) and
stream 1 (final race) of ``common``.
"""

from __future__ import annotations

import dataclasses

import torch

from funcspec.verifiers import common, entropy, standard

MIN_K = 3
"""vLLM-Ascend enables block verify only when ``max_spec_len >= 3``."""


def verify(cfg, vin: common.VerifyInput) -> common.Verdict:
    """MagicMTP block verify, combined with entropy verify when ``cfg.entropy``."""
    key, target_logits = vin.key, vin.logits
    if vin.proposal.tokens.shape[-1] < MIN_K:  # static shape, not a tensor value
        # NOTE: vLLM-Ascend's fallback is the uniform-coupled rule, not decoding's draws (keys=None).
        fallback = entropy.verify if cfg.entropy else standard.verify
        return fallback(cfg, dataclasses.replace(vin, keys=None))
    inp = common.prepare(target_logits, vin.proposal, vin.sampling, key, cfg.filters)
    pi = common.cumulative_ratio(inp.ratio)  # [B, K]
    bound = torch.cumprod(common.acceptance_uniforms(key, inp.drafts.shape[1]), dim=1)  # [B, K]
    if cfg.entropy:
        bound = entropy.threshold(cfg, target_logits) * bound
    return common.finish(key, inp, common.num_through_last(inp.supported & (pi >= bound)))
