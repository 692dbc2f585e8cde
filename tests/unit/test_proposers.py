"""The proposer contract: every registered module satisfies it, proposers are built from a BuildContext
(never the engine), the verifier rule comes from the spec alone, and the one draft-window rule."""

from __future__ import annotations

import importlib
import types

import pytest
import torch

from funcspec import verifiers
from funcspec.config import SpecConfig
from funcspec.nn.llama import window_start
from funcspec.proposers import (PROPOSERS, BoundProposer, BuildContext, HostDrafter, Proposer, build_proposer,
                                contract_errors)
from funcspec.token_tree import Chain, TokenTree
from funcspec.types import PLACEHOLDER

CTX = BuildContext(max_model_len=20, device=torch.device("cpu"))


@pytest.mark.parametrize("method", sorted(PROPOSERS))
def test_every_registered_proposer_satisfies_the_protocol(method):
    module = importlib.import_module(PROPOSERS[method])
    assert isinstance(module, Proposer)
    assert contract_errors(module) == []


def test_the_contract_check_can_fail():
    echo = importlib.import_module(PROPOSERS["echo"])
    missing = types.ModuleType("no_commit")
    missing.__dict__.update({k: v for k, v in vars(echo).items() if k != "commit"})
    assert not isinstance(missing, Proposer) and contract_errors(missing) == ["missing commit"]
    wrong = types.ModuleType("old_propose")
    wrong.__dict__.update(vars(echo))
    wrong.propose = lambda cfg, params, state, ctx: None  # no k
    assert contract_errors(wrong) == ["propose('cfg', 'params', 'state', 'ctx') must take "
                                      "('cfg', 'params', 'state', 'ctx', 'k')"]
    host = types.ModuleType("host_without_drafter")
    host.__dict__.update(vars(echo))
    host.runs_on_host = True
    assert contract_errors(host) == ["runs_on_host proposers need a HostDrafter class"]


def test_proposers_are_built_from_the_context_only():
    """ngram and suffix take max_model_len (and suffix the device) from the BuildContext; no engine needed."""
    ngram = build_proposer(SpecConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=2), None, CTX)
    assert ngram.cfg.max_model_len == 20 and ngram.host is None
    suffix = build_proposer(SpecConfig("suffix", 4), None, CTX)
    assert isinstance(suffix.host, HostDrafter) and suffix.runs_on_host
    row = types.SimpleNamespace(request_id="r", seq_id="r", prompt_ids=[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6],
                                output_ids=[7, 5, 6, 7], total_len=18)
    drafts, parents = suffix.host_drafts([row], 2, 4, Chain(4))  # 2 positions left before max_model_len
    assert drafts.tolist() == [[5, 6, PLACEHOLDER, PLACEHOLDER], [PLACEHOLDER] * 4]
    assert parents.tolist() == [[-1, 0, 1, 2]] * 2  # a chain's parents, i - 1
    suffix.on_finish(row)


def test_bound_proposer_is_static_and_calls_the_module():
    bound = build_proposer(SpecConfig("echo", 2), None, CTX)
    # equal and hashable by (module, cfg): the params and the host drafter are carried, not compared
    assert bound == BoundProposer(bound.module, None, params={"other": 1}) and hash(bound) == hash(
        BoundProposer(bound.module, None))
    ctx = types.SimpleNamespace(history=torch.tensor([[4, 9, 3], [0, 0, 0]]), slots=torch.tensor([0]),
                                lens=torch.tensor([1]))
    proposal, state = bound.propose(None, "state", ctx, 3)
    assert proposal.tokens.tolist() == [[9, 9, 9]] and state == "state"
    assert proposal.parents.tolist() == [[-1, 0, 1]]  # every proposal carries parents: a chain's are i - 1
    assert bound.commit("state", None) == "state" and bound.hidden_layers == ()


def test_window_start_reads_the_last_w_committed_positions():
    """max(lens - W, 0): exact (no block alignment) and without a look-ahead by K (see nn.llama.window_start)."""
    lens = torch.tensor([0, 5, 8, 45])
    assert window_start(lens, None) is None
    assert window_start(lens, 8).tolist() == [0, 0, 0, 37]
    assert window_start(lens, 1).tolist() == [0, 4, 7, 44]  # W = 1 still sees the last committed token
