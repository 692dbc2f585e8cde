"""``ScaleContext``: what ``bench scale``'s phases share in one run (the checkpoint, the main prompt, and what
earlier phases measured), with a named field for each."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from funcspec.bench.scale.checkpoint import SHAPES, make_prompts

MAX_LEN_SLACK = 8
"""Positions a batch-1 engine holds beyond the prompt and its new tokens."""


@dataclasses.dataclass
class ScaleContext:
    """One run's shared state. The first fields are fixed when the run starts; ``model``, ``hf``,
    ``ar_rows`` and ``ar_engines`` are filled in by the phases, in their order."""

    shape: str  # a key of SHAPES
    dtype: str  # a key of checkpoint.DTYPES: the checkpoint's and every engine's
    path: Path  # the random checkpoint's directory
    new_tokens: int  # n: tokens each request generates
    prompt_tokens: int  # P: the main prompt's length (and the batch sweep's)
    seed: int  # prompts are derived from it (the weights too, through the checkpoint)
    reps: int  # timed runs per measurement
    prompt: list[int]  # [P] ids: the main prompt of the hf, ar, sweep, profile and llamacpp phases
    max_len: int  # max_model_len of the batch-1 engines: P + n + MAX_LEN_SLACK
    model: Any = None  # the loaded funcspec Model, before the first phase that builds an engine
    hf: dict | None = None  # the hf phase's row: the greedy tokens every other engine must reproduce
    ar_rows: dict[str, dict] = dataclasses.field(default_factory=dict)  # backend -> its AR row, measured once
    ar_engines: dict[str, Any] = dataclasses.field(default_factory=dict)  # backend -> its warm AR engine

    @classmethod
    def create(cls, shape: str, dtype: str, path: Path, new_tokens: int, prompt_tokens: int, seed: int,
               reps: int) -> ScaleContext:
        """A fresh context: the main prompt drawn from ``seed``, nothing measured yet (the options are
        checked already: :func:`funcspec.bench.scale.options.parse_options`)."""
        return cls(shape=shape, dtype=dtype, path=Path(path), new_tokens=new_tokens, prompt_tokens=prompt_tokens,
                   seed=seed, reps=reps, prompt=make_prompts(shape, 1, prompt_tokens, seed)[0],
                   max_len=prompt_tokens + new_tokens + MAX_LEN_SLACK)

    @property
    def prompt_ids(self) -> tuple[int, int]:
        """[lo, hi): the shape's non-special ids that prompts are drawn from."""
        return SHAPES[self.shape].prompt_ids

    def quant_keys(self) -> dict:
        """The context under the keys :func:`funcspec.bench.quant.phase` reads (it takes a dict)."""
        return {"model": self.model, "path": self.path, "n": self.new_tokens, "p": self.prompt_tokens,
                "reps": self.reps, "max_len": self.max_len, "prompt": self.prompt, "prompt_ids": self.prompt_ids,
                "seed": self.seed}
