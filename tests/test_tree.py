"""Pytree state: frozen dataclasses flow through torch.compile(fullgraph=True) and keep their structure."""

import dataclasses

import pytest
import torch

from funcspec.tree import pytree_dataclass, replace, tree_signature


@pytree_dataclass
class Counter:
    """count: [] int64; buf: [N] float32."""

    count: torch.Tensor
    buf: torch.Tensor


def bump(state: Counter, x: torch.Tensor) -> tuple[torch.Tensor, Counter]:
    return x.sum(), replace(state, count=state.count + 1, buf=state.buf + x)


def test_state_compiles_with_fullgraph_and_keeps_structure():
    state = Counter(torch.tensor(0), torch.zeros(4))
    compiled = torch.compile(bump, fullgraph=True, dynamic=False)
    out, new = compiled(state, torch.ones(4))
    assert isinstance(new, Counter) and int(new.count) == 1 and new.buf.tolist() == [1.0] * 4
    assert tree_signature(new) == tree_signature(state) and float(out) == 4.0


def test_state_is_frozen():
    state = Counter(torch.tensor(0), torch.zeros(4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.count = torch.tensor(1)
