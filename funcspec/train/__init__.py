"""Recipes of the model zoo: ``funcspec train <role>`` (or ``python -m funcspec.train <role>``).

Roles, in dependency order: ``target`` (tokenizer + Llama), then the drafters
distilled from it. Every recipe uses fixed seeds, shows tqdm progress and keeps
a resumable state under ``--work`` (default ``models/.work``, not committed);
rerunning a role continues where it stopped. Each writes its checkpoint into
``models/<role>/`` and its facts (sizes, tokens, loss, wall time) into
``models/<role>/train.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import torch

from funcspec import methods

ROLES = ("target",) + methods.select(zoo=True)
"""The target first (every head is distilled from it), then the registry's ``zoo`` methods."""


def run_role(role: str, models: Path, work: Path, seed: int = 0, steps: int | None = None,
             stop_after: int | None = None) -> dict:
    """Train one role into ``models/<role>`` and write its ``train.json``."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    module = importlib.import_module(f"funcspec.train.{'target' if role == 'target' else 'drafters'}")
    kwargs = {} if role == "target" else {"role": role, "target": models / "target"}
    facts = module.run(out=models / role, work=work, seed=seed, steps=steps, stop_after=stop_after, **kwargs)
    (models / role / "train.json").write_text(json.dumps(facts, indent=2) + "\n")
    return facts


def main(argv=None) -> None:
    """``funcspec train``: train the given roles in order, or write the model cards."""
    from funcspec.zoo import MODELS

    ap = argparse.ArgumentParser(prog="funcspec train", description=__doc__.splitlines()[0])
    ap.add_argument("roles", nargs="+", choices=ROLES + ("all", "card"),
                    help="roles to train in order; 'card' rewrites models/README.md")
    ap.add_argument("--bench", type=Path, action="append", default=[],
                    help="bench spec JSON for the cards' acceptance table (repeat: the first on the held-out stdlib, "
                         "where goals are judged, then other corpora)")
    ap.add_argument("--models", type=Path, default=MODELS)
    ap.add_argument("--work", type=Path, default=MODELS / ".work")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="override the recipe's step count")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--stop-after", type=int, default=None, help="end this run after N total steps (resumable)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.roles == ["card"]:
        from funcspec.train import card

        print(card.write(args.models, args.bench))
        return
    for role in ROLES if "all" in args.roles else args.roles:
        facts = run_role(role, args.models, args.work, args.seed, args.steps, args.stop_after)
        print(role, json.dumps({k: facts[k] for k in ("steps", "final_loss", "wall_s")}))
