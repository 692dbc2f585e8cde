"""One resumable training loop for every recipe: AdamW, warmup + cosine, tqdm, checkpoints.

A recipe gives the trainable tensors and ``loss_fn(step) -> (loss, metrics)``;
batches are pure functions of the step (:func:`funcspec.train.data.batch`), so
``resume`` reloads params, optimizer state and the step and continues exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm  # NOTE: not tqdm.auto: no ipywidgets warning in notebooks


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Optimiser settings of one recipe."""

    steps: int
    lr: float
    warmup: int = 50
    weight_decay: float = 0.0
    clip: float = 1.0
    log_every: int = 25
    save_every: int = 200


def lr_at(s: Schedule, step: int) -> float:
    """Linear warmup, then cosine to 10% of ``lr``."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    frac = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


PROBE = (5, 15)
"""Steps whose pace a time budget is judged by (after the first few, which warm caches up), inside the warmup."""


def train(params: dict[str, torch.Tensor], loss_fn: Callable, schedule: Schedule, work: Path,
          desc: str = "train", tokens_per_step: int = 0, stop_after: int | None = None,
          time_budget: float | None = None, buffers: dict[str, torch.Tensor] | None = None) -> dict:
    """Minimise ``loss_fn(step)`` over ``params`` (name -> leaf tensor, trained in place).

    ``work/state.pt`` holds the resumable state; ``work/log.jsonl`` the loss curve.
    ``stop_after`` ends this run after that many total steps (a checkpoint is
    written), as an interruption would; the schedule is unchanged. Returns a
    summary: final loss (mean of the last ``log_every`` steps), the last logged
    row (``final_metrics``), steps, tokens and wall seconds (summed over resumed runs).

    ``time_budget`` (seconds, this run): the pace of steps ``PROBE`` sets the
    schedule's length to what fits, if less (``planned_steps`` in the summary).
    Those steps are in the warmup, whose rates do not depend on the length, so
    the run is the one a schedule of that length would have made. Why: a
    lent GPU runs for a fixed time on a machine nobody timed beforehand.

    ``buffers`` (name -> tensor): state the recipe updates itself, outside the
    optimiser (a router's bias); saved and restored with the params, so a
    resumed run continues exactly.
    """
    work.mkdir(parents=True, exist_ok=True)
    buffers = buffers or {}
    leaves = list(params.values())
    for p in leaves:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(leaves, lr=schedule.lr, betas=(0.9, 0.95), weight_decay=schedule.weight_decay)
    ckpt, start, wall = work / "state.pt", 0, 0.0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state["params"][name])
            for name, b in buffers.items():
                b.copy_(state["buffers"][name])
        opt.load_state_dict(state["opt"])
        start, wall = state["step"], state["wall"]
    log = (work / "log.jsonl").open("a")
    recent: list[float] = []
    t0 = time.perf_counter()

    def save(step: int) -> None:
        torch.save({"params": {k: v.detach() for k, v in params.items()}, "buffers": dict(buffers),
                    "opt": opt.state_dict(), "step": step,
                    "wall": wall + time.perf_counter() - t0}, work / "state.tmp")
        (work / "state.tmp").replace(ckpt)

    end = schedule.steps if stop_after is None else min(stop_after, schedule.steps)
    planned, probe_t = schedule.steps, None
    bar = tqdm(range(start, end), desc=desc, initial=start, total=schedule.steps, mininterval=5)
    for step in bar:
        if step >= end:
            break
        if time_budget is not None and step == start + PROBE[0]:
            probe_t = time.perf_counter()
        if probe_t is not None and step == start + PROBE[1] and step < schedule.warmup:
            pace = (time.perf_counter() - probe_t) / (PROBE[1] - PROBE[0])
            fits = step + int((time_budget - (time.perf_counter() - t0)) / pace)  # type: ignore[operator]  # a probe: a budget
            if fits < schedule.steps:
                schedule = dataclasses.replace(schedule, steps=max(fits, step + 1))
                end, bar.total = min(end, schedule.steps), schedule.steps
            bar.write(f"{desc}: {pace * 1e3:.1f} ms a step; {schedule.steps} of {planned} steps fit "
                      f"{time_budget:.0f} s")
        for group in opt.param_groups:
            group["lr"] = lr_at(schedule, step)
        loss, metrics = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(leaves, schedule.clip)
        opt.step()
        recent = (recent + [loss.item()])[-schedule.log_every:]
        if (step + 1) % schedule.log_every == 0:
            row = {"step": step + 1, "loss": sum(recent) / len(recent), **{k: float(v) for k, v in metrics.items()}}
            log.write(json.dumps(row) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{row['loss']:.3f}")
        if (step + 1) % schedule.save_every == 0:
            save(step + 1)
    save(max(start, end))
    for p in leaves:
        p.requires_grad_(False)
    rows = [json.loads(line) for line in (work / "log.jsonl").read_text().splitlines()]
    return {"steps": max(start, end), "tokens": max(start, end) * tokens_per_step,
            "final_loss": rows[-1]["loss"] if rows else (sum(recent) / len(recent) if recent else float("nan")),
            "final_metrics": rows[-1] if rows else {},
            "wall_s": round(wall + time.perf_counter() - t0, 1),
            **({"planned_steps": planned} if schedule.steps < planned else {})}
