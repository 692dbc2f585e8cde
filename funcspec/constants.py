"""Small integer tables a step needs as tensors (a static tree's parents, a level's indices), made on the host once.

A captured device graph may not copy host data to the device while it
captures (CUDA and Ascend graphs refuse a pageable copy), and
``torch.tensor(list, device=...)`` or indexing by a Python list is such a
copy. :func:`constant` makes the tensor once per (values, dtype, device),
outside the capture: a device graph's warm-up calls run the step before it
captures, and the capture then reads the cached tensor at its fixed address.
Under ``torch.compile`` the values are a graph constant, as before.
"""

from __future__ import annotations

import torch

_CACHE: dict = {}


def constant(values, dtype: torch.dtype = torch.int64, device=None) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``, made once and kept (never write to it)."""
    values = tuple(values)
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=dtype, device=device)
    key = (values, dtype, str(torch.device(device or "cpu")))
    if key not in _CACHE:
        _CACHE[key] = torch.tensor(values, dtype=dtype, device=device)
    return _CACHE[key]
