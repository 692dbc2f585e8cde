"""``eagle``: the EAGLE-1 head, drafting by the feature chain of :mod:`funcspec.proposers.chain`.

The head reads the target's final normed hidden state (one layer) and feeds
its own output back as the next feature; drafts are greedy over the target
vocabulary. The draft KV window (``draft_window_size``) applies.
"""

from __future__ import annotations

from funcspec.checkpoints import eagle as ckpt
from funcspec.nn import eagle as net
from funcspec.proposers import chain

runs_on_host = False
# NOTE: everything but loading is the shared chain runtime.
hidden_layers, init_state, prefill = chain.hidden_layers, chain.init_state, chain.prefill
propose, commit = chain.propose, chain.commit


def build(spec, target, ctx):
    """Load the EAGLE-1 head ``speculative_config["model"]`` against ``target``."""
    if not spec.model:
        raise ValueError("speculative_config.model: method 'eagle' needs a head checkpoint path")
    head, params = ckpt.load_params(spec.model, target, version=1)
    return chain.chain_config(head, net, spec, target, (target.cfg.num_layers,)), params
