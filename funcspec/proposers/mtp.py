"""``mtp``: DeepSeek-V3- or MiMo-style multi-token prediction, applied autoregressively for K > 1.

Drafting is the feature chain of :mod:`funcspec.proposers.chain` with the MTP
module as the head: it reads the target's final hidden state (normed for
DeepSeek, before the final norm for MiMo) and feeds its own output back. The
module comes from ``speculative_config["model"]`` if given, else from the
target checkpoint itself (``model.layers.{L}.*`` or ``model.mtp_layers.*``,
which :func:`funcspec.checkpoints.load_model` leaves out of the target).
The draft KV window does not apply (vLLM-Ascend turns it off for MTP).
"""

from __future__ import annotations

from funcspec.checkpoints import mtp as ckpt
from funcspec.nn import mtp as net
from funcspec.proposers import chain

runs_on_host = False
# NOTE: everything but loading is the shared chain runtime.
hidden_layers, init_state, prefill = chain.hidden_layers, chain.init_state, chain.prefill
propose, commit = chain.propose, chain.commit


def build(spec, target, ctx):
    """Load the MTP module from ``speculative_config["model"]`` or the target's own checkpoint."""
    head, params = ckpt.load_params(spec.model or target.path, target)
    return chain.chain_config(head, net, spec, target, (head.hidden_layer,)), params
