"""The method registry: every speculative method funcspec knows, one row each.

A row says everything the rest of the package asks about a method: which
proposer module drafts for it, whether it takes a draft checkpoint, which vLLM
options apply to it, whether the zoo trains a checkpoint for it and which draft
head family writes its random init. ``config`` (validation), ``proposers``
(``PROPOSERS``), ``zoo`` and ``train`` derive their lists from ``METHODS``, so
adding a method is adding a row here plus its proposer module.

Names are vLLM's canonical method names; vLLM's aliases (``ngram_gpu``,
``<model>_mtp``, ...) are a parsing matter and live in ``config.vllm``.

This module sits at the bottom of the layers, beside ``types``: it imports
nothing from funcspec and nothing heavy (modules are named as strings), so
every layer, and tools that must start fast, can read it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

REQUIRED, OPTIONAL, NONE = "required", "optional", "none"
"""The values of :attr:`Method.model`."""


@dataclasses.dataclass(frozen=True)
class Method:
    """One speculative method and what it needs.

    Attributes:
        name: the canonical method name, as in ``speculative_config["method"]``.
        proposer: the module path of its proposer, or ``None`` when it has none
            (extract_hidden_states does not draft; out-of-scope methods are not built).
        model: whether ``speculative_config["model"]``, a local draft checkpoint,
            is ``REQUIRED``, ``OPTIONAL`` (mtp defaults to the target's own MTP
            layers) or ``NONE`` (refused: the method has no draft weights).
        supported: ``False`` for vLLM methods outside funcspec's feature set:
            they are recognised and refused, rather than called unknown.
        speculates: ``False`` when the method drafts nothing, so its
            ``num_speculative_tokens`` must be exactly 1 (extract_hidden_states).
        aux_layers: reads target hidden states of chosen layers
            (``draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids``).
        draft_window: has its own draft attention, so vLLM-Ascend's
            ``draft_window_size`` applies.
        batch_table: ``num_speculative_tokens_per_batch_size`` applies.
        host: drafts on the host (the proposer module's ``runs_on_host``).
        dynamic_spec: vLLM-Ascend's ``dynamic_spec_config`` can name it.
        tree: it drafts token trees (``speculative_token_tree`` or an EAGLE-2
            dynamic tree): draft networks with ``proposers.tree_draft``,
            ngram and suffix from the continuations their history offers.
        zoo: the zoo trains a checkpoint for it (``funcspec train <name>``
            writes ``models/<name>``).
        head: the draft-head family whose random init ``init_draft_head``
            writes (``funcspec.checkpoints.<head>``), or ``None``.
        head_args: keyword arguments to that family's ``init_params`` that pick
            this method's layout, as ``(key, value)`` pairs (a dict is not hashable).

    The defaults are those of a draft-model method, and also what
    :func:`lookup` gives an unknown name.
    """

    name: str
    proposer: Optional[str] = None
    model: str = REQUIRED
    supported: bool = True
    speculates: bool = True
    aux_layers: bool = False
    draft_window: bool = False
    batch_table: bool = True
    host: bool = False
    dynamic_spec: bool = False
    tree: bool = False
    zoo: bool = False
    head: Optional[str] = None
    head_args: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.model not in (REQUIRED, OPTIONAL, NONE):
            raise ValueError(f"Method.model must be one of {(REQUIRED, OPTIONAL, NONE)}, got {self.model!r}")


def _proposer(name: str) -> str:
    """The module path of the proposer file named after the method."""
    return f"funcspec.proposers.{name}"


# Row order is the order in which ``funcspec train all`` trains the zoo's heads
# (after the target, which every head is distilled from).
_ROWS = (
    Method("ngram", _proposer("ngram"), model=NONE, tree=True),
    # The guide: suffix is already per-request dynamic, so it takes no batch table.
    Method("suffix", _proposer("suffix"), model=NONE, batch_table=False, host=True, tree=True),
    # funcspec's own benchmark proposer (not vLLM): always drafts, at no cost.
    Method("echo", _proposer("echo"), model=NONE),
    Method("draft_model", _proposer("draft_model"), draft_window=True, tree=True, zoo=True),
    Method("medusa", _proposer("medusa"), zoo=True, head="medusa"),
    # mtp's window is forced off by vLLM-Ascend: MTP reuses the target's own layers.
    Method("mtp", _proposer("mtp"), model=OPTIONAL, tree=True, zoo=True, head="mtp"),
    Method("eagle", _proposer("eagle"), draft_window=True, tree=True, head="eagle", head_args=(("version", 1),)),
    Method("eagle3", _proposer("eagle3"), aux_layers=True, draft_window=True, tree=True, zoo=True,
           head="eagle", head_args=(("version", 3),)),
    Method("dflash", _proposer("dflash"), aux_layers=True, draft_window=True, dynamic_spec=True, zoo=True,
           head="dflash", head_args=(("method", "dflash"),)),
    # The guide: DSpark is not supported on the batch-size path.
    Method("dspark", _proposer("dspark"), aux_layers=True, draft_window=True, batch_table=False,
           dynamic_spec=True, zoo=True, head="dflash", head_args=(("method", "dspark"),)),
    # Saves hidden states and emits one token per request (engine + extract.py): no proposer.
    Method("extract_hidden_states", model=NONE, speculates=False, aux_layers=True, batch_table=False),
    # Valid vLLM methods that funcspec does not implement.
    Method("mlp_speculator", supported=False),
    Method("custom_class", supported=False),
)

METHODS: dict[str, Method] = {m.name: m for m in _ROWS}
"""Canonical method name -> :class:`Method`, in training order."""


def lookup(name: Any) -> Method:
    """The row for ``name``; an unknown name gets the defaults.

    Parsing asks about a method before it has refused an unknown one, so that
    errors come in vLLM's order; the default row keeps those questions harmless.
    """
    row = METHODS.get(name) if isinstance(name, str) else None
    return row if row is not None else Method(name=str(name))


def select(**fields: Any) -> tuple[str, ...]:
    """The names, in registry order, of the methods whose ``fields`` have the given values.

    ``select(zoo=True)``, ``select(model=NONE)``, ``select(supported=False)``.
    """
    known = {f.name for f in dataclasses.fields(Method)}
    if not fields.keys() <= known:
        raise ValueError(f"select() takes Method fields {sorted(known)}, got {sorted(fields)}")
    return tuple(m.name for m in _ROWS if all(getattr(m, k) == v for k, v in fields.items()))


def supported() -> frozenset[str]:
    """The method names ``SpecConfig`` accepts."""
    return frozenset(select(supported=True))


def proposer_modules() -> dict[str, str]:
    """Method name -> proposer module path, for the methods that have a proposer."""
    return {m.name: m.proposer for m in _ROWS if m.proposer is not None}
