"""The model zoo under ``models/``: the manifest and the recipe of the default model.

Until the trained zoo exists, the default model is a small *random* Llama
with a byte-level BPE tokenizer trained on a slice of the Python standard
library. ``make run`` builds it on first use (seconds, deterministic, no
network) with ``python -m funcspec.zoo build-default``.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models"
MANIFEST = MODELS / "zoo.json"


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


def stdlib_files() -> list[Path]:
    """Sorted ``.py`` files of the running interpreter's stdlib, without tests and site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3")
    return sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))


def train_tokenizer(out: Path, vocab_size: int, files: list[Path]) -> None:
    """A byte-level BPE with BOS/EOS/PAD/MASK, saved for ``AutoTokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(f) for f in files], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1],
                                   pad_token=specials[2], mask_token=specials[3])
    fast.save_pretrained(str(out))


def build_default(out: Path | None = None, seed: int = 0) -> Path:
    """Build the random default Llama (about 1M params) and its tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = out or model_path("default")
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out, 2048, stdlib_files()[:60])
    tok = AutoTokenizer.from_pretrained(str(out))
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(str(out))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m funcspec.zoo")
    ap.add_argument("command", choices=["build-default"])
    args = ap.parse_args(argv)
    if args.command == "build-default":
        print(build_default())


if __name__ == "__main__":
    main()
