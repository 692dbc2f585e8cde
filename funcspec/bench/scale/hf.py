"""``bench scale``'s baseline: HF ``generate`` greedy on the same checkpoint, whose tokens funcspec's AR rows
must reproduce."""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import torch

from funcspec.bench.scale.checkpoint import DTYPES


class _Clock:
    """A ``generate`` streamer that only timestamps each ``put``: the prompt, then every new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        """Called with the prompt, then with each new token: record when."""
        self.times.append(time.perf_counter())

    def end(self) -> None:
        """Called once generation is done."""


def hf_greedy(path: Path, dtype: str, prompt: list[int], n: int, reps: int = 1) -> dict:
    """HF ``generate`` greedy, batch 1: the n new tokens, prefill seconds and decode ms/token.

    Decode time runs from the first new token to the last (timestamped by a
    streamer), as funcspec's ``e2e - ttft``; the median over ``reps`` runs.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype]).eval()
    model.generation_config.eos_token_id = None  # ignore EOS, as funcspec's ignore_eos
    model.generation_config.pad_token_id = 0
    ids = torch.tensor([prompt])  # [1, P]

    def gen(k):
        clock = _Clock()
        t0 = time.perf_counter()
        out = model.generate(  # noqa: F821 (called only before the del below)
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, do_sample=False, streamer=clock)
        new = clock.times[1:]  # one stamp per new token
        return out[0, len(prompt):].tolist(), new[0] - t0, (new[-1] - new[0]) / max(len(new) - 1, 1)

    with torch.no_grad():
        gen(2)  # warm-up
        runs = [gen(n) for _ in range(reps)]
    del model
    gc.collect()
    tokens = runs[0][0]
    return {"tokens": tokens, "prefill_s": statistics.median(r[1] for r in runs),
            "ms_per_token": statistics.median(r[2] for r in runs) * 1e3, "distinct_tokens": len(set(tokens))}


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), ``None`` when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_tokens(tokens: list[int], hf: dict | None) -> dict:
    """``tokens_equal_hf`` and ``first_mismatch_hf`` of a row's greedy tokens (both ``None`` without HF's)."""
    ref = None if hf is None else hf["tokens"]
    return {"tokens_equal_hf": None if ref is None else tokens == ref,
            "first_mismatch_hf": None if ref is None else first_mismatch(tokens, ref)}
