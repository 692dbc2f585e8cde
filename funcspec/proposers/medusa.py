"""``medusa``: K parallel heads over the target's last hidden state, chain-drafted by argmax (vLLM's top-1).

Alignment: at propose time the pending token x_n (n = lens) was sampled from
the target's final normed hidden state h_{n-1}, the latest one available. Head
k reads h_t and predicts x_{t+k+2}, so with t = n-1 head i guesses x_{n+1+i}:
``drafts[:, i] = argmax head_i(h_{n-1})``, the token after pending + drafts[:, :i].
``commit`` keeps h at the last committed position, ``hiddens[:, num_emitted-1]``.
"""

from __future__ import annotations

import dataclasses

import torch

from funcspec.checkpoints import medusa as ckpt
from funcspec.nn import medusa as net
from funcspec.nn.llama import activation_ref
from funcspec.pytree import pytree_dataclass, slot_field
from funcspec.types import Proposal

runs_on_host = False


@dataclasses.dataclass(frozen=True)
class MedusaProposerConfig:
    """The heads' static config and the target layer they read (L: the final normed state)."""

    head: net.MedusaConfig
    layer: int


@pytree_dataclass
class MedusaState:
    """feat: [S+1, H] the target's final normed hidden state at each slot's last committed position."""

    feat: torch.Tensor = slot_field()


def build(spec, target, ctx):
    """Load ``speculative_config["model"]``; K may not exceed ``medusa_num_heads``."""
    if not spec.model:
        raise ValueError("speculative_config.model: method 'medusa' needs a Medusa head checkpoint path")
    head, params = ckpt.load_params(spec.model, target)
    if spec.num_speculative_tokens > head.num_heads:
        raise ValueError(f"speculative_config.num_speculative_tokens ({spec.num_speculative_tokens}) must be <= "
                         f"the checkpoint's medusa_num_heads ({head.num_heads})")
    return MedusaProposerConfig(head, target.cfg.num_layers), params


def hidden_layers(cfg: MedusaProposerConfig) -> tuple[int, ...]:
    """Medusa reads the target's final normed hidden state."""
    return (cfg.layer,)


def init_state(cfg: MedusaProposerConfig, params, num_slots: int, max_len: int) -> MedusaState:
    """The last committed hidden state per slot, zeroed: [S+1, H]."""
    w = activation_ref(params)
    return MedusaState(torch.zeros(num_slots + 1, cfg.head.hidden_size, dtype=w.dtype, device=w.device))


def prefill(cfg: MedusaProposerConfig, params, state: MedusaState, tokens, slot: int, n: int, hiddens):
    """Keep the prompt's last hidden state h_{n-1} (hiddens[0]: [1, T, H]). Donates: state.feat."""
    state.feat[slot] = hiddens[0][0, n - 1]
    return MedusaState(state.feat)


def propose(cfg: MedusaProposerConfig, params, state: MedusaState, ctx, k: int):
    """drafts[:, i] = argmax of head i on h_{lens-1}; tokens [B, K]."""
    h = state.feat[ctx.slots]  # [B, H]
    drafts = [net.draft_tokens(cfg.head, params, h, i) for i in range(k)]  # K × [B]
    b = ctx.slots.shape[0]
    out = torch.stack(drafts, 1) if drafts else torch.zeros(b, 0, dtype=torch.int64, device=h.device)
    return Proposal.chain(out), state


def commit(cfg: MedusaProposerConfig, state: MedusaState, result) -> MedusaState:
    """Keep h at the last committed position, hiddens[:, num_emitted-1]. Donates: state.feat."""
    hid = result.hiddens[0]  # [B, K+1, H]
    rows = torch.arange(hid.shape[0], device=hid.device)
    last = hid[rows, result.num_emitted.to(torch.int64) - 1]  # [B, H]
    state.feat.index_put_((result.slots,), last.to(state.feat.dtype))
    return MedusaState(state.feat)
