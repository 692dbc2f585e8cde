"""Proposers: one file per method, all behind one protocol (DESIGN §4).

Each proposer module defines::

    runs_on_host: bool
    build(spec, target, engine) -> (cfg, params)        # static cfg, params pytree
    init_state(cfg, params, num_slots, max_len) -> State
    propose(cfg, params, state, ctx, k) -> (Proposal, State)   # in the bucket graph
    commit(cfg, state, result) -> State                         # in the bucket graph
    prefill(cfg, params, state, tokens, slot, n, hiddens) -> State   # eager, once per request
    hidden_layers(cfg) -> tuple[int, ...]                # target hidden states it reads

Host proposers (``runs_on_host = True``) also provide ``HostDrafter(cfg, engine)``
whose ``drafts(rows, b, k)`` fills the ``[B, K]`` draft input of the graph.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from funcspec import methods

PROPOSERS = methods.proposer_modules()
"""Method name -> proposer module path, from the method registry (``funcspec.methods``)."""


def no_prefill(cfg, params, state, tokens, slot, n, hiddens):
    """Prefill hook for proposers that keep no per-request state."""
    return state


def keep_state(cfg, state, result):
    """Commit hook for proposers that keep no per-request state."""
    return state


@dataclasses.dataclass
class ProposerHandle:
    """A built proposer as the engine uses it: module, static cfg, params, host drafter."""

    module: Any
    cfg: Any
    params: Any
    spec: Any
    host: Any = None

    @property
    def runs_on_host(self) -> bool:
        """Whether drafts come from a host-side drafter (suffix trees) instead of the graph."""
        return self.module.runs_on_host

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target hidden-state indices the proposer reads."""
        return self.module.hidden_layers(self.cfg)

    def init_state(self, num_slots: int, max_len: int):
        """The proposer's zeroed state pytree for ``num_slots`` slots of ``max_len`` positions."""
        return self.module.init_state(self.cfg, self.params, num_slots, max_len)

    def prefill(self, params, state, tokens, slot, n, hiddens):
        """Fold a prefilled prompt into the proposer's state (eager, outside the bucket graphs)."""
        return self.module.prefill(self.cfg, params, state, tokens, slot, n, hiddens)

    def verify_config(self, k: int):
        """The verifier rule for this engine's config (static per bucket)."""
        from funcspec.verifiers import VerifyConfig

        rs = self.spec.rejection_sampler
        return VerifyConfig(
            method=self.spec.verifier_method,
            posterior_threshold=rs.posterior_threshold,
            posterior_alpha=rs.posterior_alpha,
            entropy=self.spec.verify_entropy,
            synthetic_rates=None if self.spec.synthetic_acceptance_rates is None
            else tuple(self.spec.synthetic_acceptance_rates)[:k],
        )

    def host_drafts(self, rows, b: int, k: int):
        """Host drafts [B, K] for the running rows, or ``None`` for in-graph proposers."""
        return self.host.drafts(rows, b, k)

    def on_finish(self, req) -> None:
        """Tell a host drafter that a request finished (it may keep the tokens for later lookups)."""
        if self.host is not None:
            self.host.finish(req)


def build_proposer(spec, target, engine) -> ProposerHandle:
    """Load the proposer for ``spec.method`` against the ``target`` model."""
    if spec.method not in PROPOSERS:
        raise ValueError(f"speculative_config.method {spec.method!r} is not built yet")
    module = importlib.import_module(PROPOSERS[spec.method])
    cfg, params = module.build(spec, target, engine)
    host = module.HostDrafter(cfg, engine) if module.runs_on_host else None
    return ProposerHandle(module, cfg, params, spec, host)
