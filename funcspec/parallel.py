"""Tensor parallelism's static description and its one collective (a base module: ``nn`` imports it).

A tensor-parallel target is split across ``size`` ranks the Megatron way:
q/k/v and gate/up are column-parallel (each rank holds whole heads, and a
slice of the MLP's intermediate dimension), ``o_proj`` and ``down_proj`` are
row-parallel (each rank holds the matching input slice and produces a partial
sum), and everything else is replicated. A row-parallel product is therefore
followed by :func:`all_reduce`; that is the only communication of a step.

The group is a static value (part of ``ModelConfig`` and so of every bucket's
key), and the all-reduce is a functional collective
(``torch.distributed._functional_collectives``): Dynamo traces it into the
step's one graph, with no graph break. With ``size == 1`` nothing is emitted,
so a single-device graph is unchanged.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class TPGroup:
    """One rank's view of its tensor-parallel group (static, hashable).

    Attributes:
        size: ranks in the group (``tensor_parallel_size``); 1 is no parallelism.
        rank: this process's rank in the group, ``0 <= rank < size``.
        group: the ``torch.distributed`` group name the all-reduces run on: a spawned engine's own
            group (``funcspec-tp0``, ...), or the world group's under ``torchrun``.
    """

    size: int = 1
    rank: int = 0
    group: str = ""


SINGLE = TPGroup()
"""No tensor parallelism: the default of every config."""


def all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The sum of x over the ranks of ``tp`` (x itself on one rank).

    NOTE: a functional collective returns a new tensor and waits lazily, which
    is what lets ``torch.compile(fullgraph=True)`` keep it in the graph; the
    in-place ``dist.all_reduce`` would break the graph.
    """
    if tp.size == 1:
        return x
    from torch.distributed import _functional_collectives as fc

    return fc.all_reduce(x, "sum", tp.group)  # type: ignore[arg-type]  # a group name (torch's GroupName)
