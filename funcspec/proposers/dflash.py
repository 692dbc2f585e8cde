"""``dflash``: a block-diffusion drafter proposes all K tokens in one forward, inside the bucket graph.

The block is ``[pending, MASK × K]`` at positions ``lens .. lens+K``; the drafts are
the argmax of the target's LM head at the K mask rows, so q is one-hot (exact
under every verifier) and the confidence is ``max softmax`` of those logits.

The draft attends to a per-slot context K/V cache holding committed tokens
only. ``commit`` cannot project features (it gets no params), so it stages the
raw target hidden states of the verified block; the next ``propose`` projects
them first, as z-lab's reference appends the new context rows in its next
draft call. Staged rows past the accepted ones land at positions >= the slot's
length, where the attention mask ignores them until real context overwrites them.
``dspark`` reuses this file with ``shifted=True`` (see ``proposers/dspark.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from funcspec.checkpoints import dflash as ckpt
from funcspec.kernels.argmax import first_max
from funcspec.nn import dflash
from funcspec.nn.llama import window_start
from funcspec.pytree import pytree_dataclass, replace, slot_field
from funcspec.types import Proposal

runs_on_host = False


@dataclasses.dataclass(frozen=True)
class DFlashProposerConfig:
    """Static config: the network, the engine's largest K, the draft KV window (or ``None``)."""

    net: dflash.DFlashConfig
    max_k: int
    window: Optional[int] = None


@pytree_dataclass
class DFlashState:
    """The drafter's per-slot state.

    Attributes:
        kv: context K/V, each [L_d, S+1, H_kv, T_max, D].
        staged: [S+1, max_k+1, n·H] raw target features of the last verified block, not yet in ``kv``.
        staged_pos: [S+1] int64 position of ``staged[:, 0]``.
    """

    kv: dflash.ContextKV
    staged: torch.Tensor = slot_field()
    staged_pos: torch.Tensor = slot_field()


def build_for(spec, target, method: str):
    """Load ``speculative_config["model"]`` as a ``method`` drafter for ``target``."""
    if not spec.model:
        raise ValueError(f"speculative_config.model: method {method!r} needs a draft checkpoint path")
    net, params = ckpt.load_params(spec.model, target, method, spec.eagle_aux_hidden_state_layer_ids)
    return DFlashProposerConfig(net, spec.num_speculative_tokens, spec.draft_window_size), params


def build(spec, target, ctx):
    """Load ``speculative_config["model"]`` as a DFlash drafter."""
    return build_for(spec, target, "dflash")


def hidden_layers(cfg: DFlashProposerConfig) -> tuple[int, ...]:
    """The target hidden indices the context reads (z-lab's layer ``i`` is index ``i + 1``, -1 the embeddings)."""
    return cfg.net.hidden_layers


def init_state(cfg: DFlashProposerConfig, params, num_slots: int, max_len: int) -> DFlashState:
    """Zeroed context K/V, staged target features [S+1, max_k+1, n·H] and their start positions."""
    w, fc = params["embed_tokens"]["weight"], params["fc"]  # the activations' dtype; fc may be quantized
    width = fc["format"].in_features if "format" in fc else fc["weight"].shape[1]  # n·H
    return DFlashState(
        dflash.init_context_kv(cfg.net, num_slots, max_len, w.dtype, w.device),
        torch.zeros(num_slots + 1, cfg.max_k + 1, width, dtype=w.dtype, device=w.device),
        torch.zeros(num_slots + 1, dtype=torch.int64, device=w.device),
    )


def prefill(cfg: DFlashProposerConfig, params, state: DFlashState, tokens, slot: int, n: int, hiddens) -> DFlashState:
    """Write the context of the padded prompt [1, T]; nothing is staged (``staged_pos = n``).
    Donates: state.kv, state.staged_pos."""
    slots = torch.tensor([slot], device=tokens.device)
    kv = dflash.write_context(cfg.net, params, state.kv, torch.cat(hiddens, -1), slots, torch.zeros_like(slots))
    state.staged_pos.index_put_((slots,), torch.full_like(slots, n))
    return DFlashState(kv, state.staged, state.staged_pos)


def commit(cfg: DFlashProposerConfig, state: DFlashState, result) -> DFlashState:
    """Stage the target features of the verified block [B, K+1] for the next ``propose``.

    Donates: state.staged, state.staged_pos.
    """
    raw = torch.cat(result.hiddens, -1).to(state.staged.dtype)  # [B, K+1, n·H]
    cols = torch.arange(raw.shape[1], device=raw.device)
    state.staged.index_put_((result.slots.unsqueeze(1), cols.unsqueeze(0)), raw)
    state.staged_pos.index_put_((result.slots,), result.lens)
    return state


def draft_block(cfg: DFlashProposerConfig, params, state: DFlashState, ctx, rows: int):
    """Project the staged context, then run ``[pending, MASK × (rows-1)]``.

    Returns (pending [B], h [B, rows, H] or ``None`` when rows = 0, new state).
    Donates: state.kv.
    """
    slots = ctx.slots
    kv = dflash.write_context(cfg.net, params, state.kv, state.staged[slots], slots, state.staged_pos[slots])
    pending = ctx.history[slots, ctx.lens]  # [B]
    if rows == 0:
        return pending, None, replace(state, kv=kv)
    masks = torch.full((slots.shape[0], rows - 1), cfg.net.mask_token_id, dtype=torch.int64, device=slots.device)
    block = torch.cat([pending.unsqueeze(1), masks], 1)  # [B, rows]
    first = window_start(ctx.lens, cfg.window)  # [B] or None: the context the block reads
    h, kv = dflash.block_forward(cfg.net, params, kv, block, slots, ctx.lens, first, ctx.read)
    return pending, h, replace(state, kv=kv)


def empty_proposal(ctx, vocab: int, with_probs: bool) -> Proposal:
    """A K = 0 proposal: no drafts (with an empty q when the method samples)."""
    b, dev = ctx.slots.shape[0], ctx.slots.device
    return Proposal.chain(torch.zeros(b, 0, dtype=torch.int64, device=dev),
                          torch.zeros(b, 0, vocab, device=dev) if with_probs else None, torch.zeros(b, 0, device=dev))


def propose(cfg: DFlashProposerConfig, params, state: DFlashState, ctx, k: int):
    """K argmax drafts [B, K] from one block forward; confidence = max softmax [B, K].

    Donates: state.kv.
    """
    _, h, state = draft_block(cfg, params, state, ctx, k + 1 if k else 0)
    if k == 0:
        return empty_proposal(ctx, cfg.net.model.vocab_size, False), state
    x = dflash.logits(cfg.net, params, h[:, 1:])  # [B, K, V]: the mask rows
    return Proposal.chain(dflash.target_ids(cfg.net, params, first_max(x)), None, dflash.max_prob(x)), state
