"""Routed expert products of a mixture-of-experts layer: ``[T, top_k]`` tokens-to-experts, static shapes.

A MoE layer's experts are held stacked, as transformers holds them:
``gate_up_proj`` [E, 2I, H] (each expert's gate rows, then its up rows) and
``down_proj`` [E, H, I]. Token t routed to experts ``ids[t]`` with weights
``weights[t]`` gets ``sum_j weights[t, j] · down_e(silu(gate_e x_t) · up_e x_t)``,
``e = ids[t, j]``.

The expert ids are data, not shapes: every function here has the same shapes
whatever the routing, so one captured graph serves every step of a bucket.
:func:`reference` is the torch path that runs on every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    """The routed experts of x [T, H] (ids, weights [T, k]; gate_up [E, 2I, H], down [E, H, I]) -> [T, H].

    Every expert runs on every token, weighted by the token's routing weight
    for it (0 when it is not routed there): E products whatever the routing, a
    path with no data-dependent shape, for any device. Summed in fp32, in
    expert order.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    for e in range(gate_up.shape[0]):
        w = (weights.float() * (ids == e)).sum(-1, keepdim=True)  # [T, 1]: 0 unless routed to e
        gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)  # [T, I] each
        out = out + w * F.linear(F.silu(gate) * up, down[e]).float()
    return out.to(x.dtype)
