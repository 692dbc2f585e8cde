"""Recipes of the model zoo: ``funcspec train <role>`` (or ``python -m funcspec.train <role>``).

Roles, in dependency order: ``target`` (tokenizer + Llama), then the drafters
distilled from it, then ``moe_target`` (a Qwen3-MoE on the same tokens and
tokenizer), ``moe_eagle3`` (EAGLE-3 distilled from it) and ``mtp_target`` (a
DeepSeek-V3 trained with its own MTP module, :mod:`funcspec.train.mtp_target`). Every recipe uses
fixed seeds, shows tqdm progress and keeps a resumable state under ``--work``
(default ``models/.work``, not committed); rerunning a role continues where it
stopped. Each writes its checkpoint into ``models/<role>/`` and its facts
(sizes, tokens, loss, wall time, device) into ``models/<role>/train.json``.

``--device cuda`` trains on a GPU; ``--corpus-cache DIR`` reads the corpus from
a folder that ``funcspec train prepare --out DIR`` wrote where the stdlib is
(the token stream, manifests and tokenizer), for a machine without it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from funcspec import methods

HEADS = {**{m: (m, "target") for m in methods.select(zoo=True)}, "moe_eagle3": ("eagle3", "moe_target")}
"""Head roles: role -> (recipe in :mod:`funcspec.train.drafters`, the target role it is distilled from)."""

ROLES = ("target",) + methods.select(zoo=True) + ("moe_target", "moe_eagle3", "mtp_target")
"""The target first (every head is distilled from it), then the registry's ``zoo`` methods, then the MoE
target and its head, then the DeepSeek-V3 target that carries its own MTP module."""

GPU_ROLES = ("moe_target", "moe_eagle3", "mtp_target")
"""Roles trained on a lent GPU (``tools/train_zoo_gpu.sh``): the zoo names them
before their checkpoints arrive."""


def run_role(role: str, models: Path, work: Path, seed: int = 0, steps: int | None = None,
             stop_after: int | None = None, device: str = "cpu", time_budget: float | None = None) -> dict:
    """Train one role into ``models/<role>`` on ``device`` and write its ``train.json``; ``time_budget``
    (seconds) shortens its schedule to what fits (:func:`funcspec.train.loop.train`)."""
    from funcspec.train import data

    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    common: dict[str, Any] = dict(out=models / role, work=work, seed=seed, steps=steps, stop_after=stop_after,
                                  device=device, time_budget=time_budget)
    if role == "target":
        from funcspec.train.target import run as recipe

        facts = recipe(**common)
    elif role == "moe_target":
        from funcspec.train.target import run_moe

        facts = run_moe(tokenizer=data.tokenizer_dir(models / "target"), **common)
    elif role == "mtp_target":
        from funcspec.train import mtp_target

        facts = mtp_target.run(tokenizer=data.tokenizer_dir(models / "target"), **common)
    else:
        from funcspec.train import drafters

        name, target = HEADS[role]
        facts = drafters.run(role=role, target=models / target, recipe=name, **common)
    (models / role / "train.json").write_text(json.dumps(facts, indent=2) + "\n")
    return facts


def main(argv=None) -> None:
    """``funcspec train``: train the given roles in order, write the model cards, or prepare a corpus folder."""
    from funcspec.train import data
    from funcspec.zoo import MODELS

    ap = argparse.ArgumentParser(prog="funcspec train", description=__doc__.splitlines()[0])
    ap.add_argument("roles", nargs="+", choices=ROLES + ("all", "card", "prepare"),
                    help="roles to train in order; 'card' rewrites models/README.md; 'prepare' writes --out, "
                         "the corpus folder for --corpus-cache")
    ap.add_argument("--bench", type=Path, action="append", default=[],
                    help="bench spec JSON for the cards' acceptance table (repeat: the first on the held-out stdlib, "
                         "where goals are judged, then other corpora)")
    ap.add_argument("--models", type=Path, default=MODELS)
    ap.add_argument("--work", type=Path, default=MODELS / ".work")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="override the recipe's step count")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--stop-after", type=int, default=None, help="end this run after N total steps (resumable)")
    ap.add_argument("--device", default="cpu", help="where the recipes train (cpu, cuda, cuda:1, ...)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds a role may train: its schedule is shortened to what fits at the pace measured")
    ap.add_argument("--corpus-cache", type=Path, default=None,
                    help="read the token stream, manifests and tokenizer from this prepared folder, not the stdlib")
    ap.add_argument("--out", type=Path, default=None, help="'prepare': the folder to write (default .gpu)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.roles == ["card"]:
        from funcspec.train import card

        print(card.write(args.models, args.bench))
        return
    if args.roles == ["prepare"]:
        print(data.prepare_cache(args.models / "target", args.work, args.out or MODELS.parent / ".gpu"))
        return
    if torch.device(args.device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # NOTE: this process only trains: TF32 products are enough
        torch.backends.cudnn.allow_tf32 = True
    data.use_corpus_cache(args.corpus_cache)
    for role in ROLES if "all" in args.roles else args.roles:
        facts = run_role(role, args.models, args.work, args.seed, args.steps, args.stop_after, args.device,
                         args.time_budget)
        print(role, json.dumps({k: facts[k] for k in ("steps", "final_loss", "wall_s")}))
