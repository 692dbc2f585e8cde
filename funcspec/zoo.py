"""The model zoo under ``models/``: the manifest, and a speculative config per method.

``models/zoo.json`` maps each role (``target``, ``draft_model``, ``eagle3``,
``medusa``, ``mtp``, ``dflash``, ``dspark``, the MoE pair ``moe_target`` /
``moe_eagle3``, and ``mtp_target``, a DeepSeek-V3 with its own MTP module) to
its directory. The zoo is trained from the Python standard library by the
recipes in :mod:`funcspec.train` (``funcspec train all``; the MoE pair on a GPU,
``tools/train_zoo_gpu.sh``, and ``mtp_target``, ``tools/train_zoo_gpu.sh``);
``models/README.md`` holds the model cards. A role's directory may be absent until its recipe has run
(:func:`trained`).

``build_default`` keeps the small *random* Llama that tests use as a cheap
stand-in (``python -m funcspec.zoo build-default``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from funcspec import methods
from funcspec.kernels import locks
from funcspec.train.data import stdlib_files

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models"
MANIFEST = MODELS / "zoo.json"
RANDOM_DEFAULT = MODELS / "_default_random"

RUN_PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n", "class Stack:\n    def __init__(self):\n",
               "def parse_args(args):\n    \"\"\"Parse the command line.\"\"\"\n"]
"""The prompts ``make run`` (``funcspec run-default``) decodes, and ``bench runtime --contention`` with it."""

HEAD_METHODS = methods.select(zoo=True)
"""Methods whose draft comes from a zoo checkpoint (the role of the same name): the registry's ``zoo`` rows."""


def manifest() -> dict:
    """``models/zoo.json``: role -> directory under ``models/``."""
    return json.loads(MANIFEST.read_text())


def model_path(role: str = "default") -> Path:
    """The directory of a zoo role; ``default`` follows the manifest's pointer."""
    m = manifest()
    if role == "default":
        role = m["default"]
    if role not in m["roles"]:
        raise ValueError(f"role {role!r} is not in {MANIFEST} (roles: {sorted(m['roles'])})")
    return MODELS / m["roles"][role]


def trained(role: str) -> bool:
    """Whether the zoo holds ``role``'s checkpoint (its weights and ``train.json``), not only its name."""
    path = model_path(role)
    return (path / "train.json").exists() and any(path.glob("*.safetensors"))


def speculative_config(method: str, k: int = 4, model=None, **extra) -> dict:
    """A vLLM ``speculative_config`` for ``method`` with K = ``k``.

    Neural methods point ``model`` at the given checkpoint, else at the zoo's
    head of that name; ngram looks up 1..4-grams. ``extra`` keys are added as they are.
    """
    spec = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=4)
    if model is not None:
        spec["model"] = str(model)
    elif method in HEAD_METHODS:
        spec["model"] = str(model_path(method))
    spec.update(extra)
    return spec


def build_default(out: Path | None = None, seed: int = 0) -> Path:
    """Build the random stand-in Llama (about 1M params) and its tokenizer (tests use it)."""
    out = out or RANDOM_DEFAULT
    # NOTE: one process builds it; a concurrent one (two test workers, two `make run`s) waits and reads it
    locks.once(out / "model.safetensors", out.parent / f".{out.name}.lock", lambda: _build_default(out, seed))
    return out


def _build_default(out: Path, seed: int) -> Path:
    """:func:`build_default`'s checkpoint, built in a private directory and renamed into place (a killed build
    leaves no half-written checkpoint)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from funcspec.train.target import train_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        train_tokenizer(tmp, 2048, stdlib_files()[:60])
        tok = AutoTokenizer.from_pretrained(str(tmp))
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
        LlamaForCausalLM(cfg).save_pretrained(str(tmp))
        if out.exists() and not (out / "model.safetensors").exists():
            shutil.rmtree(out)  # an incomplete build of an older version
        os.replace(tmp, out)
    except OSError:
        if not (out / "model.safetensors").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv=None) -> None:
    """``python -m funcspec.zoo build-default``."""
    ap = argparse.ArgumentParser(prog="python -m funcspec.zoo")
    ap.add_argument("command", choices=["build-default"])
    args = ap.parse_args(argv)
    if args.command == "build-default":
        print(build_default())


if __name__ == "__main__":
    main()
