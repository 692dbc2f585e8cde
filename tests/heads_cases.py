"""The neural-head zoo shared by the head tests (engine and tools tiers): a 3-layer random target, one random
head per method, the MTP module appended to a copy of the target, and the cases run against them.
``tests/conftest.py`` builds it once per session as the ``zoo`` fixture."""

from __future__ import annotations

import shutil
import types
from pathlib import Path

from safetensors.torch import save_file

from conftest import make_hf_model
from funcspec import Engine, SamplingParams, load_model
from funcspec.checkpoints import eagle, medusa, mtp, read_weights, save_params

K_MAX = 3
HEADS = {"medusa": (medusa, {}), "eagle": (eagle, {"version": 1}), "eagle3": (eagle, {"version": 3}),
         "mtp": (mtp, {})}
METHODS = ["medusa", "eagle", "eagle3", "mtp", "mtp_in_target"]
PROMPTS = [[5, 17, 33], list(range(10, 30)), [44, 9, 71, 8, 3, 90, 12, 6, 51, 7, 23], [7, 7, 7, 7, 8]]


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def build_zoo(root: Path):
    """A 3-layer target (EAGLE-3's default aux layers [2, 1, 0] fit it), one random head per method,
    and a copy of the target with the MTP module appended as ``model.layers.3.*``."""
    make_hf_model(root / "target", num_hidden_layers=3)
    target = load_model(root / "target")
    paths = {"target": str(root / "target")}
    for name, (mod, kw) in HEADS.items():
        hf, params = mod.init_params(target.cfg, seed=1, **kw)
        save_params(root / name, params, hf)
        paths[name] = str(root / name)
    make_hf_model(root / "draft_model", seed=1, num_hidden_layers=1)  # a separate small LM
    paths["draft_model"] = str(root / "draft_model")
    both = root / "target_mtp"
    both.mkdir()
    shutil.copy(root / "target" / "config.json", both)
    tensors = {**read_weights(root / "target"), **read_weights(root / "mtp")}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(both / "model.safetensors"))
    paths["mtp_in_target"] = str(both)
    ar = Engine(target, max_num_seqs=4, max_model_len=96, enforce_eager=True).generate(PROMPTS, greedy(24))
    return types.SimpleNamespace(target=target, paths=paths, ar=[o.outputs[0].token_ids for o in ar])


def spec_engine(zoo, method, k=K_MAX, max_num_seqs=4, spec=None, **kw):
    if method == "mtp_in_target":
        return Engine(zoo.paths["mtp_in_target"], {"method": "mtp", "num_speculative_tokens": k, **(spec or {})},
                      max_num_seqs=max_num_seqs, max_model_len=96, **kw, enforce_eager=True)
    return Engine(zoo.target, {"method": method, "model": zoo.paths[method], "num_speculative_tokens": k,
                               **(spec or {})}, max_num_seqs=max_num_seqs, max_model_len=96, **kw,
                               enforce_eager=True)


# the tree the tree tests draft: 7 nodes, depth 3
TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
