"""Proposers: one module per method, all behind one contract (ARCHITECTURE.md, "Contract").

Each proposer module implements :class:`~funcspec.proposers.base.Proposer`::

    runs_on_host: bool
    build(spec, target, ctx: BuildContext) -> (cfg, params)   # static cfg, params pytree
    hidden_layers(cfg) -> tuple[int, ...]                      # target hidden states it reads
    init_state(cfg, params, num_slots, max_len) -> State
    prefill(cfg, params, state, tokens, slot, n, hiddens) -> State   # eager, once per request
    propose(cfg, params, state, ctx, k) -> (Proposal, State)   # in the bucket graph
    commit(cfg, state, result) -> State                         # in the bucket graph

``build`` sees a small :class:`~funcspec.proposers.base.BuildContext`, never the
engine. Host proposers (``runs_on_host = True``) also provide
``HostDrafter(cfg, ctx)`` whose ``drafts(rows, b, k, tree)`` fills the ``[B, K]``
draft and parent inputs of the graph from the running requests ``rows``.

Every proposal carries its drafts' parents: a chain's are i - 1
(``Proposal.chain``), a token tree's come from the tree it drafts
(``StepContext.tree``, the bucket's shape).

:class:`BoundProposer` is the one object an engine holds per proposer: the module
bound to its cfg once, its params and its host drafter. The engine calls it
eagerly (``init_state``, ``prefill``, ``host_drafts``) and the bucket's
``StepConfig`` holds it, a static value equal by ``(module, cfg)``, for the
graph (``propose``, ``commit``). ``chain.py`` is not a method: it is the feature-chain
runtime that ``eagle``, ``eagle3`` and ``mtp`` share.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Optional

from funcspec.proposers.base import BuildContext, HostDrafter, Proposer, contract_errors

__all__ = ["PROPOSERS", "BoundProposer", "BuildContext", "HostDrafter", "Proposer", "build_proposer",
           "contract_errors", "keep_state", "no_prefill"]

from funcspec import methods

PROPOSERS = methods.proposer_modules()
"""Method name -> proposer module path, from the method registry (``funcspec.methods``)."""


def no_prefill(cfg, params, state, tokens, slot, n, hiddens):
    """Prefill hook for proposers that keep no per-request state."""
    return state


def keep_state(cfg, state, result):
    """Commit hook for proposers that keep no per-request state."""
    return state


@dataclasses.dataclass(frozen=True)
class BoundProposer:
    """A built proposer, one per engine: its module's functions bound to its static cfg once, its params and
    its host drafter.

    Equal and hashable by ``(module, cfg)`` only, so a bucket's ``StepConfig`` holds this very object as a
    static value. ``params`` (the one place an engine holds the draft params) and ``host`` are carried, never
    compared: the graph takes the params as an input (``propose`` and ``commit`` are handed them, and never
    read ``self.params``), and the eager calls (``init_state``, ``prefill``) read them here.
    """

    module: Proposer
    cfg: Any
    params: Any = dataclasses.field(default=None, compare=False, repr=False)
    host: Optional[HostDrafter] = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def runs_on_host(self) -> bool:
        """Whether drafts come from a host-side drafter (suffix trees) instead of the graph."""
        return self.module.runs_on_host

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target hidden-state indices the proposer reads."""
        return self.module.hidden_layers(self.cfg)

    def init_state(self, num_slots: int, max_len: int):
        """The zeroed state pytree for ``num_slots`` slots of ``max_len`` positions (eager)."""
        return self.module.init_state(self.cfg, self.params, num_slots, max_len)

    def prefill(self, state, tokens, slot: int, n: int, hiddens):
        """Fold a prefilled prompt into the state (eager, outside the bucket graphs)."""
        return self.module.prefill(self.cfg, self.params, state, tokens, slot, n, hiddens)

    def propose(self, params, state, ctx, k: int):
        """K drafts [B, K] and the new state (in the bucket graph: ``params`` is the graph's input)."""
        return self.module.propose(self.cfg, params, state, ctx, k)

    def commit(self, state, result):
        """The state after verification (in the bucket graph)."""
        return self.module.commit(self.cfg, state, result)

    def host_drafts(self, rows, b: int, k: int, tree):
        """Host drafts (tokens, parents), [B, K] each, for the running rows in the bucket's shape ``tree``
        (``EnginePlan.bucket_tree``); host proposers only."""
        if self.host is None:
            raise ValueError(f"{self.module.__name__} has no host drafter: host_drafts is for runs_on_host proposers")
        return self.host.drafts(rows, b, k, tree)

    def on_finish(self, req) -> None:
        """Tell a host drafter that a request finished (it may keep the tokens for later lookups)."""
        if self.host is not None:
            self.host.finish(req)

    def shard(self, tp, quantization=None) -> "BoundProposer":
        """This proposer split across tensor-parallel group ``tp`` (``draft_tensor_parallel_size`` > 1), its layers
        quantized to ``quantization`` on load first (``speculative_config["quantization"]``)."""
        shard = getattr(self.module, "shard", None)  # NOTE: optional, not in the Proposer contract
        if shard is None:
            raise ValueError(f"{self.module.__name__} has no shard: it cannot be split across tensor-parallel ranks")
        cfg, params = shard(self.cfg, self.params, tp, quantization)
        return dataclasses.replace(self, cfg=cfg, params=params)


def build_proposer(spec, target, ctx: BuildContext) -> BoundProposer:
    """Load the proposer for ``spec.method`` against the ``target`` model."""
    if spec.method not in PROPOSERS:
        raise ValueError(f"speculative_config.method {spec.method!r} is not built yet")
    module = importlib.import_module(PROPOSERS[spec.method])
    cfg, params = module.build(spec, target, ctx)
    host = module.HostDrafter(cfg, ctx) if module.runs_on_host else None
    return BoundProposer(module, cfg, params, host)
