"""Explicit, counter-based random numbers.

A *key* is an int64 tensor of any shape: one independent stream per element.
Every draw is a pure function of (key, counter), computed with plain integer
tensor arithmetic (a splitmix64 finaliser), so it is

- the same in eager mode, under ``torch.compile`` and inside device graphs
  (which allow no RNG ops), and
- independent of batch composition: a row's draws depend on its key only.

Functions (``...`` is the key's shape):

    key(seed)                -> key []
    split(key, n)            -> keys [..., n]
    fold_in(key, data)       -> key [...]   (data broadcasts against key)
    bits23(key, shape)       -> int64 [..., *shape] in [0, 2^23)
    uniform(key, shape)      -> float32 [..., *shape] in (0, 1)
    exponential(key, shape)  -> float32 [..., *shape], Exp(1), strictly > 0
    categorical(key, probs)  -> int64 [...]   probs [..., V], need not sum to 1

and, on the host, ``completion_seed(seed, i)``: the seed of completion ``i`` of a request.
"""

from __future__ import annotations

import torch

# NOTE: constants of splitmix64, written as signed int64 so tensor arithmetic
# wraps on overflow exactly like uint64 arithmetic does (two's complement).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)


def _srl(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (``>>`` on int64 is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser: a bijective avalanche hash of int64."""
    x = (x ^ _srl(x, 30)) * _M1
    x = (x ^ _srl(x, 27)) * _M2
    return x ^ _srl(x, 31)


def key(seed: int, device: torch.device | str | None = None) -> torch.Tensor:
    """A key [] from an integer seed (any Python int, reduced mod 2^64)."""
    seed = int(seed) & ((1 << 64) - 1)
    if seed >= 1 << 63:
        seed -= 1 << 64
    return _mix(torch.tensor(seed, dtype=torch.int64, device=device) + _GOLDEN)


def completion_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of a request with ``n`` > 1 (host integers only).

    Completion 0 keeps ``seed``, so ``n=1`` is unchanged; completion ``i`` > 0
    takes ``fold_in(key(seed), i)`` as an integer seed in [0, 2^63), so
    ``SamplingParams(seed=completion_seed(seed, i))`` reproduces it alone.
    """
    if index == 0:
        return int(seed)
    return int(fold_in(key(seed), index)) & ((1 << 63) - 1)


def fold_in(key: torch.Tensor, data) -> torch.Tensor:
    """A new key derived from ``key`` and integer ``data`` (int or int64 tensor)."""
    if not isinstance(data, int):  # NOTE: a Python int stays a scalar: a tensor of it would be a host-to-device
        data = torch.as_tensor(data, dtype=torch.int64, device=key.device)  # copy, which CUDA graph capture forbids
    # NOTE: ``data`` is added to a *value* before any multiply. Inductor folds
    # ``arange(n) * const`` into an index expression whose vectorised int64
    # multiply saturates instead of wrapping (seen on torch 2.13 CPU), which
    # broke eager/compiled bit-identity.
    return _mix((_mix(key ^ _M2) + data) * _GOLDEN)


def split(key: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` independent keys [..., n] from ``key`` [...]."""
    return fold_in(key.unsqueeze(-1), torch.arange(n, device=key.device))


def bits23(key: torch.Tensor, shape: tuple[int, ...] | int) -> torch.Tensor:
    """Uniform 23-bit integers [..., *shape]: the top bits of draw ``i`` = ``mix((key + i + 1)·γ)``.

    That is the splitmix64 stream seeded with ``key·γ``; the counter is added
    before the multiply for the reason given in :func:`fold_in`.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    n = 1
    for s in shape:
        n *= s
    counter = (torch.arange(n, device=key.device, dtype=torch.int64) + 1).view(shape)
    state = (key.reshape(key.shape + (1,) * len(shape)) + counter) * _GOLDEN
    return _srl(_mix(state), 41)


def uniform(key: torch.Tensor, shape: tuple[int, ...] | int) -> torch.Tensor:
    """Float32 uniforms in the open interval (0, 1), shape [..., *shape]."""
    # NOTE: (bits + 0.5)·2^-23 needs 24 significant bits, exactly float32's, so
    # u lies in [2^-24, 1 - 2^-24]: never 0 or 1. Then -log(u) > 0, the race
    # p/E never divides by zero (0/0 = NaN won argmax: a greedy row once emitted
    # a zero-probability token), and p/q >= u never accepts a zero-probability
    # token. A 24-bit version rounded its top value up to exactly 1.0.
    return (bits23(key, shape).to(torch.float32) + 0.5) * (2.0**-23)


def exponential(key: torch.Tensor, shape: tuple[int, ...] | int) -> torch.Tensor:
    """Exp(1) draws [..., *shape] float32, strictly positive."""
    u = uniform(key, shape)
    # NOTE: float32 log differs by 1 ulp between eager ATen and inductor's
    # vectorised log on CPU. The float64 log rounded to float32 agrees (a
    # differing double ulp almost never crosses a float32 rounding boundary).
    # Ascend has no fast fp64, so NPUs keep float32.
    wide = torch.float32 if u.device.type == "npu" else torch.float64
    return (-torch.log(u.to(wide))).to(torch.float32)


def categorical(key: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Sample indices [...] from unnormalised ``probs`` [..., V] by the exponential race.

    ``argmax(p / E)`` with ``E ~ Exp(1)`` picks ``v`` with probability ``p_v / Σp``;
    zero-probability entries are never picked unless the whole row is zero.
    """
    e = exponential(key, probs.shape[-1])  # [..., V]
    return torch.argmax(probs / e, dim=-1)
