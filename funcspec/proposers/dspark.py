"""``dspark``: DFlash's block drafter plus a sequential Markov head and a confidence head (DeepSpec).

Unlike DFlash, the anchor row is the first prediction (DeepSpec's "shifted"
convention): the block is ``[pending, MASK × (K-1)]`` at positions
``lens .. lens+K-1`` and row k gives the backbone logits ``U_k`` of draft k.
The Markov head then runs left to right inside the graph::

    q_k = process(U_k + W2(W1[x_{k-1}]))   x_{-1} = pending   (row's temperature / top-k / top-p)
    x_k ~ q_k  (argmax on greedy rows)      c_k = sigmoid(w·[h_k; W1[x_{k-1}]])

and returns ``Proposal(x, q, c)``, so standard verification stays lossless.
Context handling (staging, prefill, commit, window) is shared with ``dflash``.
"""

from __future__ import annotations

from funcspec import rng, sampling
from funcspec.nn import dflash as net
from funcspec.proposers.dflash import (  # noqa: F401  (the shared protocol functions)
    DFlashProposerConfig, DFlashState, build_for, commit, draft_block, empty_proposal, hidden_layers, init_state,
    prefill,
)
from funcspec.types import Proposal

runs_on_host = False


def build(spec, target, ctx):
    """Load ``speculative_config["model"]`` as a DSpark drafter (DFlash backbone + Markov and confidence heads)."""
    return build_for(spec, target, "dspark")


def propose(cfg: DFlashProposerConfig, params, state: DFlashState, ctx, k: int):
    """K drafts [B, K] sampled from the Markov-corrected q [B, K, V], with confidence [B, K].

    Donates: state.kv.
    """
    pending, h, state = draft_block(cfg, params, state, ctx, k)
    if k == 0:
        return empty_proposal(ctx, cfg.net.model.vocab_size, True), state
    s = ctx.sampling

    def choose(i, logits):  # logits [B, V] -> token [B], q [B, V] (None when every row is greedy)
        return sampling.draw(rng.fold_in(ctx.key, i), logits, s.temperature, s.top_k, s.top_p, ctx.mode)

    tokens, corrected, q, prev_emb = net.markov_decode(cfg.net, params, net.logits(cfg.net, params, h), pending, choose)
    if cfg.net.confidence == "none":
        conf = net.max_prob(corrected)  # NOTE: a checkpoint without the head falls back to DFlash's proxy
    else:
        conf = net.confidence(cfg.net, params, h, prev_emb).clamp(1e-6, 1.0)
    return Proposal.chain(tokens, q, conf), state
