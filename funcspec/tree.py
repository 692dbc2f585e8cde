"""Pytree state: frozen dataclasses registered with ``torch.utils._pytree``.

Decorate a state class with :func:`pytree_dataclass` and it becomes a frozen
dataclass whose fields are the pytree's children, so it can be passed into and
returned from ``torch.compile(fullgraph=True)`` functions and flattened into
static input buffers for device graphs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, TypeVar

import torch
import torch.utils._pytree as pytree

T = TypeVar("T")


def pytree_dataclass(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen dataclass and register it as a pytree node."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    names = [f.name for f in dataclasses.fields(cls)]

    def flatten(obj):
        return [getattr(obj, n) for n in names], None

    def unflatten(children, _ctx):
        return cls(**dict(zip(names, children)))

    pytree.register_pytree_node(
        cls,
        flatten,
        unflatten,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=lambda obj: (
            [(pytree.GetAttrKey(n), getattr(obj, n)) for n in names],
            None,
        ),
    )
    return cls


def replace(obj: T, **changes: Any) -> T:
    """A copy of the frozen dataclass ``obj`` with some fields changed."""
    return dataclasses.replace(obj, **changes)


def tree_map(fn: Callable, tree: Any) -> Any:
    """Apply ``fn`` to every tensor leaf of ``tree``; other leaves pass through."""
    return pytree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, tree)


def tree_leaves(tree: Any) -> list:
    """The leaves of ``tree`` in a fixed order."""
    return pytree.tree_leaves(tree)


def tree_signature(tree: Any) -> tuple:
    """Structure, shapes and dtypes of ``tree``: equal iff two states are interchangeable."""
    leaves, spec = pytree.tree_flatten(tree)
    sig = tuple(
        (tuple(x.shape), x.dtype, x.device.type) if isinstance(x, torch.Tensor) else ("static", x)
        for x in leaves
    )
    return (str(spec), sig)
