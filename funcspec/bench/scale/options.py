"""``bench scale``'s options: their defaults (the CLI's and :func:`funcspec.bench.scale.run`'s keyword
arguments) and their parsing, with a ValueError naming the option for a bad value."""

from __future__ import annotations

from typing import Any

from funcspec.bench.scale.checkpoint import DTYPES, SHAPES
from funcspec.bench.scale.phases import PHASE_FNS

PHASES = tuple(PHASE_FNS)
DEFAULT_PHASES = PHASES[:-1]
"""Every phase but ``quant`` (its formats, heads and pairings take as long as the rest together)."""

DEFAULTS = dict(shape="llama-600m", dtype="float32", cache_dir=None, out=None, backends="eager,inductor",
                sweep_backend="inductor", alphas="0.6,0.7,0.8,0.9", ks="1,2,4,8", contexts="128,512,1024,2048,4096",
                batches="1,4,8", phases=",".join(DEFAULT_PHASES), new_tokens=64, prompt_tokens=128, threads=None,
                allow_mismatch=False, copy_mb=None, profile_steps=4, seed=0, reps=3,
                quantization="int8,int4,q8_0,q4_0,q4_k_m", quant_k=4, quant_alpha=0.8, quant_parts="heads,batch")

_LISTS = (("backends", str), ("alphas", float), ("ks", int), ("contexts", int), ("batches", int), ("phases", str),
          ("quantization", str), ("quant_parts", str))
"""The options that hold a list: a comma string or a sequence, and the type of each item."""


def _list(value, cast) -> list:
    if isinstance(value, str):
        return [cast(x) for x in value.split(",") if x.strip()]
    return [cast(x) for x in value]


def parse_options(args, kwargs) -> dict:
    """DEFAULTS, overridden by an argparse namespace and then by keyword arguments; lists parsed."""
    o: dict[str, Any] = dict(DEFAULTS)
    if args is not None:
        o.update({k: v for k, v in vars(args).items() if k in DEFAULTS})
    o.update(kwargs)
    unknown = set(kwargs) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"bench scale: unknown options {sorted(unknown)}")
    for key, cast in _LISTS:
        o[key] = _list(o[key], cast)
    o["sweep_backend"] = _list(o["sweep_backend"], str)[0]
    if o["shape"] not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {o['shape']!r}")
    if o["dtype"] not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {o['dtype']!r}")
    bad = [p for p in o["phases"] if p not in PHASES]
    if bad:
        raise ValueError(f"phases {bad} unknown; choose from {list(PHASES)}")
    from funcspec.bench.quant import FORMATS

    bad = [f for f in o["quantization"] if f not in FORMATS]
    if bad:
        raise ValueError(f"quantization formats {bad} unknown; choose from {list(FORMATS)}")
    if o["new_tokens"] < 2:
        raise ValueError("new_tokens must be >= 2 (decode time excludes the first token)")
    return o
