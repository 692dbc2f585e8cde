"""``echo``: a benchmark proposer that always drafts, at no cost (funcspec extension, not vLLM).

Drafts K copies of the pending token. Paired with
``rejection_sample_method="synthetic"`` it measures what verification alone
costs at a chosen acceptance rate: unlike ngram or a draft model, it never
runs out of drafts and adds no draft compute, so ``step cost at K / step cost
at 0`` is the price of verifying K+1 tokens. With a lossless verifier it is a
valid (if useless) proposer: the output still equals the target's.
"""

from __future__ import annotations

from funcspec.proposers import keep_state, no_prefill
from funcspec.types import Proposal

runs_on_host = False
prefill = no_prefill
commit = keep_state


def build(spec, target, ctx):
    """No static config and no params."""
    return None, None


def hidden_layers(cfg) -> tuple[int, ...]:
    """echo reads no hidden states."""
    return ()


def init_state(cfg, params, num_slots, max_len):
    """echo keeps no state."""
    return None


def propose(cfg, params, state, ctx, k: int):
    """Drafts [B, K]: the pending token ``history[slot, lens]``, K times."""
    pending = ctx.history[ctx.slots, ctx.lens]  # [B]
    return Proposal.chain(pending.unsqueeze(1).expand(-1, k).contiguous()), state
