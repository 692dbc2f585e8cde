"""Pytree state: frozen dataclasses registered with ``torch.utils._pytree``, with declared fields.

Decorate a state class with :func:`pytree_dataclass` and it becomes a frozen
dataclass whose fields are the pytree's children, so it can be passed into and
returned from ``torch.compile(fullgraph=True)`` functions and flattened into
static input buffers for device graphs.

A field says what it is with its constructor, and the code that moves,
copies or captures state reads that declaration instead of guessing from
shapes:

- :func:`slot_field`: a per-slot leaf (or sub-tree) whose slot index is on
  ``axis``. Slot leaves are *donated*: a step or a prefill updates them in place.
  :func:`slot_leaves` lists them; :func:`move_slot` copies one slot to another.
- :func:`static_field`: part of the tree's structure, never a leaf and never
  traced (say, a bucket's context length). Two trees with different static
  values have different tree specs.
- a plain field: a child sub-tree with its own declarations, or a per-call
  tensor (step inputs and outputs, whose rows are the batch).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, TypeVar, dataclass_transform

import torch
import torch.utils._pytree as pytree

T = TypeVar("T")

SLOT_AXIS = "funcspec_slot_axis"
STATIC = "funcspec_static"


def slot_field(axis: int = 0, **kwargs: Any) -> Any:
    """A per-slot, donated field: slot ``s`` of a tensor leaf is ``x.select(axis, s)``;
    a sub-tree value declares its own leaves (``kwargs`` go to ``dataclasses.field``)."""
    return dataclasses.field(metadata={SLOT_AXIS: axis}, **kwargs)


def static_field(**kwargs: Any) -> Any:
    """A static field: kept in the tree spec, not a leaf (``kwargs`` go to ``dataclasses.field``)."""
    return dataclasses.field(metadata={STATIC: True}, **kwargs)


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, slot_field, static_field))
def pytree_dataclass(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen dataclass and register it as a pytree node (static fields in its spec)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]  # a dataclass since the line above
    names = [f.name for f in fields if not f.metadata.get(STATIC)]
    statics = [f.name for f in fields if f.metadata.get(STATIC)]

    def flatten(obj):
        return [getattr(obj, n) for n in names], tuple(getattr(obj, n) for n in statics)

    def unflatten(children, context):
        return cls(**dict(zip(names, children)), **dict(zip(statics, context)))

    pytree.register_pytree_node(
        cls,
        flatten,
        unflatten,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=lambda obj: (
            [(pytree.GetAttrKey(n), getattr(obj, n)) for n in names],
            tuple(getattr(obj, n) for n in statics),
        ),
    )
    return cls


def replace(obj: T, **changes: Any) -> T:
    """A copy of the frozen dataclass ``obj`` with some fields changed."""
    return dataclasses.replace(obj, **changes)  # type: ignore[type-var]  # obj: a dataclass instance


def tree_map(fn: Callable, tree: Any) -> Any:
    """Apply ``fn`` to every tensor leaf of ``tree``; other leaves pass through."""
    return pytree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, tree)


def tree_leaves(tree: Any) -> list:
    """The leaves of ``tree`` in a fixed order."""
    return pytree.tree_leaves(tree)


def clone_state(tree: Any) -> Any:
    """A deep copy of every tensor of ``tree``: what a caller keeps before handing a state to a
    function that donates it (updates it in place)."""
    return tree_map(torch.clone, tree)


def slot_leaves(tree: Any, where: str = "state") -> Iterator[tuple[torch.Tensor, int]]:
    """Every tensor of the state ``tree`` with its declared slot axis: ``(tensor, axis)``.

    A tensor reached through a field that declares no slot axis is an error
    (naming the field), not a guess: per-slot state must say where its slots are.
    """
    if tree is None:
        return
    if isinstance(tree, (tuple, list)):
        for i, x in enumerate(tree):
            yield from slot_leaves(x, f"{where}[{i}]")
        return
    if not dataclasses.is_dataclass(tree):
        raise TypeError(f"{where}: a state holds tensors and pytree dataclasses, got {type(tree).__name__}")
    for f in dataclasses.fields(tree):
        value, name = getattr(tree, f.name), f"{where}.{f.name}"
        if f.metadata.get(STATIC) or value is None:
            continue
        axis = f.metadata.get(SLOT_AXIS)
        if isinstance(value, torch.Tensor):
            if axis is None:
                raise TypeError(f"{name} declares no slot axis: declare it with tree.slot_field(axis)")
            yield value, axis
        else:
            yield from slot_leaves(value, name)


def move_slot(tree: Any, src: int, dst: int) -> None:
    """Copy slot ``src`` of every slot leaf of ``tree`` into slot ``dst``, in place (donates ``tree``)."""
    for leaf, axis in slot_leaves(tree):
        leaf.select(axis, dst).copy_(leaf.select(axis, src))


def tree_signature(tree: Any) -> tuple:
    """Structure, shapes and dtypes of ``tree``: equal iff two states are interchangeable."""
    leaves, spec = pytree.tree_flatten(tree)
    sig = tuple(
        (tuple(x.shape), x.dtype, x.device.type) if isinstance(x, torch.Tensor) else ("static", x)
        for x in leaves
    )
    return (str(spec), sig)
