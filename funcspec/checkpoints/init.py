"""Random initialisation of EAGLE, MTP and Medusa heads.

Drawn with funcspec's counter-based :mod:`funcspec.rng` (no torch RNG), one
stream per parameter name in sorted order, so a seed gives the same head on
every machine and in every process, whatever else was drawn before.
"""

from __future__ import annotations

import math
import torch

from funcspec import rng


def random_tensors(shapes: dict, seed: int) -> dict[str, torch.Tensor]:
    """Float32 tensors for ``shapes``: norms 1, matrices U(±1/√fan_in), vectors U(±0.02)."""
    base, out = rng.key(seed), {}
    for i, name in enumerate(sorted(shapes)):
        shape = tuple(shapes[name])
        u = rng.uniform(rng.fold_in(base, i), shape) * 2 - 1
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape)
        else:
            out[name] = u / math.sqrt(shape[1]) if len(shape) == 2 else u * 0.02
    return out
