"""HF-format checkpoints: ``config.json`` + safetensors (+ tokenizer files).

``load_model(path)`` returns a :class:`Model`: the static config, the params
pytree (the HF state dict nested on its dots) and the tokenizer, if any.
Every problem is reported with the file or key it concerns.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from funcspec.nn.llama import ModelConfig

# Buffers some exporters include that are not parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass
class Model:
    """A loaded checkpoint.

    Attributes:
        cfg: static decoder config.
        params: nested params pytree under HF names.
        tokenizer: a transformers tokenizer, or ``None`` if the checkpoint has none.
        path: the checkpoint directory.
        hf_config: the raw ``config.json`` dict.
    """

    cfg: ModelConfig
    params: dict
    tokenizer: Any
    path: str
    hf_config: dict

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from the config, the generation config and the tokenizer."""
        ids = set(self.cfg.eos_token_ids)
        gen = Path(self.path) / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))


def nest(flat: dict[str, torch.Tensor]) -> dict:
    """``{"a.0.b": t}`` -> ``{"a": [{"b": t}]}``: numeric parts become list indices."""
    root: dict = {}
    for name, t in flat.items():
        node = root
        parts = name.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = t
    return _lists(root)


def _lists(node):
    if not isinstance(node, dict):
        return node
    if node and all(k.isdigit() for k in node):
        n = max(int(k) for k in node) + 1
        if sorted(int(k) for k in node) == list(range(n)):
            return [_lists(node[str(i)]) for i in range(n)]
    return {k: _lists(v) for k, v in node.items()}


def flatten(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """Inverse of :func:`nest`."""
    if isinstance(tree, torch.Tensor):
        return {prefix[:-1]: tree}
    items = enumerate(tree) if isinstance(tree, list) else tree.items()
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}{k}."))
    return out


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name of a decoder with ``cfg`` and its shape."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        proj = {"q_proj": cfg.num_heads * d, "k_proj": cfg.num_kv_heads * d, "v_proj": cfg.num_kv_heads * d}
        for name, out in proj.items():
            shapes[p + f"self_attn.{name}.weight"] = (out, h)
            if cfg.attention_bias:
                shapes[p + f"self_attn.{name}.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_heads * d)
        if cfg.attention_bias and cfg.arch == "llama":
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        for name, shape in (("gate_proj", (cfg.intermediate_size, h)), ("up_proj", (cfg.intermediate_size, h)),
                            ("down_proj", (h, cfg.intermediate_size))):
            shapes[p + f"mlp.{name}.weight"] = shape
            if cfg.mlp_bias:
                shapes[p + f"mlp.{name}.bias"] = shape[:1]
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    return shapes


def read_safetensors(path: Path, names=None) -> dict[str, torch.Tensor]:
    """All tensors (or those in ``names``) of a single-file or sharded checkpoint in ``path``."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.exists():
        files = [single]
    elif index.exists():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    out = {}
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"{f}: shard listed in model.safetensors.index.json is missing")
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    if names is None or name in names:
                        out[name] = sf.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{f}: corrupt safetensors file ({e})") from e
    return out


def check_keys(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple], where: str) -> None:
    """Raise ``ValueError`` naming missing, unexpected or mis-shaped keys."""
    missing = sorted(set(shapes) - set(tensors))
    unexpected = sorted(set(tensors) - set(shapes))
    bad = [f"{k}: expected {shapes[k]}, got {tuple(t.shape)}" for k, t in tensors.items()
           if k in shapes and tuple(t.shape) != shapes[k]]
    problems = []
    if missing:
        problems.append(f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    if bad:
        problems.append(f"mis-shaped keys {bad[:8]}")
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))


def read_config(path: str | os.PathLike) -> tuple[Path, dict]:
    """The checkpoint directory and its parsed ``config.json``."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist or is not a directory")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file}: missing config.json")
    return path, json.loads(cfg_file.read_text())


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer via ``AutoTokenizer``, or ``None`` if it ships none."""
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device="cpu") -> Model:
    """Load an HF Llama / Qwen2 / Qwen3 checkpoint directory.

    Raises ``FileNotFoundError`` for a missing directory or file and
    ``ValueError`` for an unsupported architecture, a corrupt safetensors
    file, or missing / unexpected / mis-shaped keys.
    """
    path, hf = read_config(path)
    cfg = ModelConfig.from_hf(hf)
    shapes = expected_shapes(cfg)
    tensors = read_safetensors(path)
    tensors = {k: v for k, v in tensors.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some exporters save the tied copy
    # NOTE: DeepSeek-style checkpoints append MTP layers after the last decoder
    # layer; they belong to the mtp proposer, not the target.
    extra = [k for k in tensors if k.startswith(f"model.layers.{cfg.num_layers}.")]
    for k in extra:
        tensors.pop(k)
    check_keys(tensors, shapes, str(path))
    params = nest({k: v.to(device=device, dtype=dtype) for k, v in tensors.items()})
    return Model(cfg, params, load_tokenizer(path), str(path), hf)


def save_params(path: str | os.PathLike, params: dict, hf_config: dict) -> None:
    """Write ``config.json`` and ``model.safetensors`` for a params pytree."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2))
    flat = {k: v.detach().contiguous().cpu() for k, v in flatten(params).items()}
    save_file(flat, str(path / "model.safetensors"), metadata={"format": "pt"})


def init_draft_head(method: str, target_model, path, seed: int = 0, **sizes) -> Path:
    """Write a randomly initialised ``method`` draft head for ``target_model`` in its published format.

    ``method``: medusa | eagle | eagle3 | mtp | dflash | dspark. ``target_model``
    is a checkpoint path or a loaded :class:`Model`; ``sizes`` go to the head's
    ``init_params`` (e.g. ``num_heads`` for medusa, ``num_layers``). Returns
    ``path``, which ``speculative_config["model"]`` can point at.
    """
    from funcspec.nn import dflash, eagle, medusa, mtp  # NOTE: heads import this module

    heads = {"medusa": (medusa, {}), "eagle": (eagle, {"version": 1}), "eagle3": (eagle, {"version": 3}),
             "mtp": (mtp, {}), "dflash": (dflash, {"method": "dflash"}), "dspark": (dflash, {"method": "dspark"})}
    if method not in heads:
        raise ValueError(f"method must be one of {sorted(heads)}, got {method!r}")
    target = target_model if isinstance(target_model, Model) else load_model(target_model)
    module, kwargs = heads[method]
    hf_config, params = module.init_params(target.cfg, seed, **kwargs, **sizes)
    save_params(path, params, hf_config)
    return Path(path)
