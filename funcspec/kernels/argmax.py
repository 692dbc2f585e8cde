"""Greedy argmax over a vocabulary: the index every greedy draw, draft and verification takes.

Compiled by inductor on the CPU, ``argmax`` over bf16 logits runs far slower than reading them (its fused
index-value reduction); the same index from two passes inductor vectorizes (the maximum, then the first index
holding it) is several times faster at the vocabulary sizes models have
(graphs/results/cpu/argmax-20261205-161200.md).
"""

from __future__ import annotations

import torch


def first_max(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` (int64 [...]) for x [..., V]: the first index of the maximum, or of the first NaN where a
    row holds one, exactly torch's index (ties, NaN, -inf rows). Eager it is torch's own; compiled, two passes.
    """
    if not torch.compiler.is_compiling():
        return x.argmax(-1)
    m = x.amax(-1, keepdim=True)  # [..., 1], NaN where the row holds one
    hit = (x == m) | (x != x)  # [..., V]: the maximum, or a NaN
    idx = torch.arange(x.shape[-1], device=x.device, dtype=torch.int32)  # [V]; int32: half int64's bytes
    return torch.where(hit, idx, x.shape[-1]).amin(-1).long()
