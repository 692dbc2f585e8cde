"""Random initialisation of draft heads: the one place that draws random weights.

Drawn with funcspec's counter-based :mod:`funcspec.rng` (no torch RNG), one
stream per parameter name in sorted order, so a seed gives the same head on
every machine and in every process, whatever else was drawn before.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from funcspec import rng


def random_tensors(shapes: dict, seed: int, scale: Optional[float] = None,
                   zero_biases: bool = False) -> dict[str, torch.Tensor]:
    """Float32 tensors for ``shapes`` (name -> shape).

    ``*norm.weight``: ones. ``*bias`` with ``zero_biases``: zeros. Matrices
    ``[out, fan_in]``: U(±1/√fan_in), or U(±scale/√fan_in) when ``scale`` is
    given. Other vectors: U(±0.02).

    NOTE: the two matrix forms round differently (``u / √n`` against
    ``u · (scale / √n)``); EAGLE, MTP and Medusa heads were first drawn with
    the one, DFlash and DSpark heads with the other, and a seed must keep
    giving the same bits.
    """
    base, out = rng.key(seed), {}
    for i, name in enumerate(sorted(shapes)):
        shape = tuple(shapes[name])
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape)
        elif zero_biases and name.endswith("bias"):
            out[name] = torch.zeros(shape)
        else:
            u = rng.uniform(rng.fold_in(base, i), shape) * 2 - 1  # U(-1, 1)
            if len(shape) != 2:
                out[name] = u * 0.02
            elif scale is None:
                out[name] = u / math.sqrt(shape[1])
            else:
                out[name] = u * (scale / math.sqrt(shape[1]))
    return out
