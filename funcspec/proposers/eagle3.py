"""``eagle3``: the EAGLE-3 head (fc over auxiliary target layers, reduced draft vocabulary).

Drafting is the feature chain of :mod:`funcspec.proposers.chain`: the stored
target features are the concatenated auxiliary hidden states [.., A·H], which
the head's ``fc`` maps to H; later steps feed back the midlayer's pre-norm
output. Drafts are mapped to target ids with ``d2t``. The draft KV window
(``draft_window_size``) applies.
"""

from __future__ import annotations

from funcspec.checkpoints import eagle as ckpt
from funcspec.nn import eagle as net
from funcspec.nn.llama import capture_index
from funcspec.proposers import chain

runs_on_host = False
# NOTE: everything but loading is the shared chain runtime.
hidden_layers, init_state, prefill = chain.hidden_layers, chain.init_state, chain.prefill
propose, commit = chain.propose, chain.commit


def build(spec, target, ctx):
    """Load the EAGLE-3 head ``speculative_config["model"]``.

    Its auxiliary layers come from ``speculative_config.draft_model_config.hf_config``
    if given, else the head's ``config.json``, else ``[2, L//2, L-3]``; id L is the
    last layer's output before the final norm (hidden index L + 1).
    """
    if not spec.model:
        raise ValueError("speculative_config.model: method 'eagle3' needs a head checkpoint path")
    head, params = ckpt.load_params(spec.model, target, version=3, aux_layers=spec.eagle_aux_hidden_state_layer_ids)
    layers = tuple(capture_index(i, target.cfg.num_layers) for i in head.aux_layers)
    return chain.chain_config(head, net, spec, target, layers), params
