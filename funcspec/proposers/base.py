"""The proposer contract: what every ``proposers/<method>.py`` module defines, and what it is built from.

A proposer is a *module* of pure functions over an explicit static ``cfg`` (hashable,
part of a bucket's key), a ``params`` pytree (a graph input) and a ``state`` pytree
(per slot, donated). :class:`Proposer` states the module-level names and signatures;
:func:`contract_errors` checks a module against it (the registry test runs it on
every registered method).

NOTE: ``prefill``, ``propose`` and ``commit`` are pure in what they return but
*donate* their ``state``: they write its caches in place (a copy of a
multi-megabyte KV cache per step would cost more than the step) and return the
state that holds the result. Each function's docstring names the leaves it
donates. A caller that needs the state from before the call keeps a
``funcspec.pytree.clone_state`` copy. Every tensor of a state declares its slot
axis (``funcspec.pytree.slot_field``), which is how the engine moves and copies slots.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Protocol, runtime_checkable

import torch

from funcspec.types import Proposal


@dataclasses.dataclass(frozen=True)
class BuildContext:
    """The engine facts a proposer may read when it is built; a proposer never holds the engine.

    Attributes:
        max_model_len: prompt + output limit; ngram and suffix never draft past it.
        device: where draft params, state and host drafts live.
    """

    max_model_len: int
    device: torch.device


@runtime_checkable
class Proposer(Protocol):
    """The module-level contract of ``proposers/<method>.py`` (write the functions without ``self``).

    ``propose`` and ``commit`` run inside the bucket graph: no host sync, static
    shapes, randomness from ``ctx.key`` only. ``build``, ``init_state`` and
    ``prefill`` run eagerly, outside any graph.
    """

    __name__: str
    """The module's dotted name (every module has one), for messages."""

    runs_on_host: bool
    """Whether drafts come from a host-side ``HostDrafter`` (fed in as ``ctx.drafts``)."""

    def build(self, spec, target, ctx: BuildContext) -> tuple[Any, Any]:
        """(static cfg, params pytree or ``None``) for the parsed ``SpecConfig`` and the loaded target."""

    def hidden_layers(self, cfg) -> tuple[int, ...]:
        """HF hidden-state indices of the target that ``prefill`` and ``commit`` receive."""

    def init_state(self, cfg, params, num_slots: int, max_len: int) -> Any:
        """The zeroed state pytree for ``num_slots`` slots (plus the scratch slot) of ``max_len`` positions."""

    def prefill(self, cfg, params, state, tokens, slot: int, n: int, hiddens) -> Any:
        """Fold a new request's padded prompt tokens [1, T] (n real) and target ``hiddens`` into slot ``slot``."""

    def propose(self, cfg, params, state, ctx, k: int) -> tuple[Proposal, Any]:
        """K drafts per row with their parents (``Proposal.chain`` for a chain; a token tree where ``ctx.tree``,
        the bucket's shape, is not a ``token_tree.Chain``) and the new state; in the graph (``ctx``: a
        ``step.StepContext``)."""

    def commit(self, cfg, state, result) -> Any:
        """The new state after verification (``result``: a ``step.VerifyResult``); in the graph."""


@runtime_checkable
class HostDrafter(Protocol):
    """The host side of a ``runs_on_host`` proposer, built as ``module.HostDrafter(cfg, ctx: BuildContext)``.

    It sees the running requests only through ``drafts``' ``rows`` (row i is slot i).
    """

    def drafts(self, rows, b: int, k: int, tree):
        """(tokens, parents), [b, k] int64 each, on ``ctx.device``: drafts for the running ``rows``
        (``PLACEHOLDER``-padded) in the bucket's shape ``tree`` (``token_tree.Shape`` of k nodes, cut by
        the engine: a ``Chain``, whose parents are i - 1, or a token tree)."""

    def finish(self, req) -> None:
        """A request finished: stop tracking it (it may be kept for later lookups)."""


def _positional(fn) -> list[str]:
    """Names of ``fn``'s positional parameters, without ``self``."""
    names = [p.name for p in inspect.signature(fn).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return names[1:] if names[:1] == ["self"] else names


def _arity_errors(where: str, fn, want) -> list[str]:
    if not callable(fn):
        return [f"{where} is not callable"]
    got = _positional(fn)
    return [] if len(got) == len(_positional(want)) else [f"{where}{tuple(got)} must take {tuple(_positional(want))}"]


def contract_errors(module) -> list[str]:
    """What ``module`` lacks of :class:`Proposer` (and :class:`HostDrafter` when it runs on the host); [] if none."""
    errors = [f"missing {name}" for name in ("runs_on_host", *_METHODS) if not hasattr(module, name)]
    if errors:
        return errors
    if not isinstance(module.runs_on_host, bool):
        errors.append("runs_on_host must be a bool")
    for name in _METHODS:
        errors += _arity_errors(name, getattr(module, name), getattr(Proposer, name))
    if module.runs_on_host:
        drafter = getattr(module, "HostDrafter", None)
        if not isinstance(drafter, type):
            return errors + ["runs_on_host proposers need a HostDrafter class"]
        errors += _arity_errors("HostDrafter.__init__", drafter.__init__, lambda self, cfg, ctx: None)  # type: ignore[misc]  # the class's own
        for name in ("drafts", "finish"):
            errors += _arity_errors(f"HostDrafter.{name}", getattr(drafter, name, None), getattr(HostDrafter, name))
    return errors


_METHODS = ("build", "hidden_layers", "init_state", "prefill", "propose", "commit")
