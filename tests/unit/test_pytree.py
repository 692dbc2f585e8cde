"""Pytree state: frozen dataclasses flow through torch.compile(fullgraph=True) and keep their structure;
declared fields (slot axes, static fields) drive moving and copying slots."""

import dataclasses

import pytest
import torch

import torch.utils._pytree as pytree

from funcspec.pytree import (clone_state, move_slot, pytree_dataclass, replace, slot_field, slot_leaves, static_field,
                           tree_map, tree_signature)


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


# ----------------------------------------------------------------------------- declared fields


@pytree_dataclass
class Cache:
    """k: [L, S+1, T] slots on axis 1; lens: [S+1]; length: static."""

    k: torch.Tensor = slot_field(axis=1)
    lens: torch.Tensor = slot_field()
    length: int = static_field(default=8)


@pytree_dataclass
class Holder:
    """A sub-tree field (its own declarations) beside a plain per-slot tensor."""

    cache: Cache
    last: torch.Tensor = slot_field()
    extra: object = None


def test_static_fields_live_in_the_tree_spec_not_the_leaves():
    a, b = Cache(torch.zeros(2, 3, 4), torch.zeros(3), 8), Cache(torch.zeros(2, 3, 4), torch.zeros(3), 16)
    leaves, spec = pytree.tree_flatten(a)
    assert len(leaves) == 2 and all(isinstance(x, torch.Tensor) for x in leaves)
    assert spec != pytree.tree_flatten(b)[1]  # another static value is another structure
    assert pytree.tree_unflatten(leaves, spec).length == 8
    assert tree_map(torch.clone, b).length == 16


def test_slot_leaves_follow_the_declarations_and_move_slot_moves_every_slot_leaf():
    k = torch.arange(2 * 3 * 4.0).reshape(2, 3, 4)
    state = Holder(Cache(k.clone(), torch.tensor([5, 6, 7])), torch.tensor([[1.0], [2.0], [3.0]]))
    assert [(tuple(x.shape), axis) for x, axis in slot_leaves(state)] == [((2, 3, 4), 1), ((3,), 0), ((3, 1), 0)]
    move_slot(state, 2, 0)
    assert torch.equal(state.cache.k[:, 0], k[:, 2]) and torch.equal(state.cache.k[:, 1:], k[:, 1:])
    assert state.cache.lens.tolist() == [7, 6, 7] and state.last.flatten().tolist() == [3.0, 2.0, 3.0]


def test_a_tensor_without_a_declared_slot_axis_is_refused_by_name():
    state = Holder(Cache(torch.zeros(1, 2, 1), torch.zeros(2)), torch.zeros(2), extra=Counter(torch.tensor(0), torch.zeros(2)))
    with pytest.raises(TypeError, match=r"state\.extra\.count declares no slot axis"):
        move_slot(state, 1, 0)


def test_clone_state_copies_every_tensor():
    state = Holder(Cache(torch.zeros(1, 2, 1), torch.zeros(2)), torch.zeros(2))
    copy = clone_state(state)
    copy.cache.k.add_(1)
    assert float(state.cache.k.sum()) == 0.0 and tree_signature(copy) == tree_signature(state)
