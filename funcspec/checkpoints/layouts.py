"""Published draft-head layouts: one declared table, one loader path.

A :class:`Layout` is one way a draft head is published: the method it serves,
where it comes from, the files it is read from, how to recognise it, and its
key table, ``(published pattern, funcspec name)`` pairs. ``{i}``, ``{j}``,
``{k}`` in a pattern match an integer and ``{rest}`` any dotted tail; names
that the layout fixes from its config (``{L}``: the target's layer count,
``{n}``: a Medusa head's ResBlock count) are filled in first. A funcspec name
of ``None`` marks keys that belong to the target model saved beside the head
(Medusa-2, MTP modules inside the target's checkpoint): they are skipped and
counted, never read as head weights.

:func:`read_head` is the one path from a directory to a head's tensors under
funcspec's names (what :mod:`funcspec.nn` reads): find the config and the
weight files, :func:`detect` the layout, rename every key through its table.
The family modules (``eagle``, ``mtp``, ``medusa``, ``dflash``) then parse the
config and check shapes; :func:`inspect` reports what was recognised.

Where each layout was read (file names, config fields, key names):

- ``eagle-safeailab``: SafeAILab/EAGLE ``eagle/model/cnets1.py`` (EAGLE-1 heads,
  ``yuhuili/EAGLE-*``), loaded by ``ea_model.py``: ``pytorch_model.bin`` first,
  then ``model.safetensors``; ``qkv_bias`` (Qwen2 heads) and ``bias`` (``fc``) in config.json.
- ``eagle3-safeailab``: SafeAILab/EAGLE ``eagle/model/cnets.py`` (``yuhuili/EAGLE3-*``):
  ``midlayer.*``, ``d2t``/``t2d``, ``draft_vocab_size``, ``target_hidden_size``.
- ``eagle3-vllm``: vLLM ``llama_eagle3.py`` / ``qwen3_eagle3.py`` names (``layers.0.hidden_norm``)
  with EAGLE config keys at the top level.
- ``eagle3-speculators``: vllm-project/speculators ``Eagle3DraftModel`` (``*-speculator.eagle3``),
  read as vLLM's ``transformers_utils/configs/speculators`` reads it.
- ``dflash-zlab``: z-lab/dflash ``DFlashDraftModel`` (``dflash_config``).
- ``dflash-speculators``: speculators' DFlash (``*-speculator.dflash``), as vLLM reads it.
- ``dspark-deepspec``: deepseek-ai/DeepSpec ``Qwen3DSparkModel``.
- ``mtp-deepseek``: DeepSeek-V3's / V3.2's and GLM-4.5's ``model.layers.{L}`` module (vLLM
  ``deepseek_mtp.py``, ``glm4_moe_mtp.py``): one decoder layer of the host, a MoE one with its experts
  stored one by one.
- ``mtp-mimo``: XiaomiMiMo ``MiMoForCausalLM``'s ``model.mtp_layers.{i}`` (vLLM ``mimo_mtp.py``).
- ``medusa-fasterdecoding``: FasterDecoding/Medusa ``medusa_lm_head.{safetensors,pt}``
  (``medusa_model.py``, ``train_legacy.py``).
- ``medusa-2``: FasterDecoding's Medusa-2 whole models (the axolotl fork's ``add_medusa_heads``):
  ``medusa_head.*`` beside the target's weights, or alone.
- ``medusa-vllm``: vLLM ``medusa.py`` (``blocks.{k}.layers.{j}``, ``lm_heads.{k}``, ``token_map``).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Callable, Optional

import torch

from funcspec.checkpoints.files import WEIGHT_FILES, Weights, find_weights, has_weights, looked_for, read_config

MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
"""FasterDecoding's Medusa-1 head files, safetensors first (the same tensors; no pickle when both exist)."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """One published checkpoint layout of a draft head.

    Attributes:
        name: the layout's id (what ``funcspec inspect`` prints).
        method: the speculative method its heads draft for.
        family: the :mod:`funcspec.checkpoints` module that parses it (``eagle``, ``mtp``, ``medusa``, ``dflash``).
        source: where it is published and whose loader was read.
        matches: ``(config, keys) -> bool``: whether a checkpoint is in this layout.
        keys: ``(published pattern, funcspec name or None)`` pairs, the first match wins.
        files: the weight files it is read from (patterns; the first that matches, :func:`find_weights`).
        constants: ``(config, keys) -> {name: value}`` for the patterns' fixed parts.
    """

    name: str
    method: str
    family: str
    source: str
    matches: Callable[[dict, frozenset], bool]
    keys: tuple[tuple[str, Optional[str]], ...]
    files: tuple[str, ...] = WEIGHT_FILES
    constants: Callable[[dict, frozenset], dict] = lambda hf, keys: {}


# ----------------------------------------------------------------------------- recognising layouts


def speculators_type(hf: dict) -> Optional[str]:
    """The ``speculators_model_type`` of a speculators config (vLLM: any config.json with ``speculators_config``)."""
    return hf.get("speculators_model_type") if "speculators_config" in hf else None


def _archs(hf: dict) -> list[str]:
    return [a for a in hf.get("architectures") or [] if isinstance(a, str)]


def _has(keys: frozenset, prefix: str) -> bool:
    return any(k.startswith(prefix) for k in keys)


def _layers(hf: dict) -> dict:
    return {"L": hf.get("num_hidden_layers")}


def _medusa_layers(hf: dict, keys: frozenset) -> dict:
    return {"n": hf.get("num_hidden_layers", hf.get("medusa_num_layers", 1))}


_EAGLE3_TAIL = (("fc.weight", "fc.weight"), ("norm.weight", "norm.weight"), ("lm_head.weight", "lm_head.weight"),
                ("d2t", "d2t"), ("t2d", "t2d"), ("embed_tokens.weight", "embed_tokens.weight"))
_DFLASH = (("fc.weight", "fc.weight"), ("hidden_norm.weight", "hidden_norm.weight"), ("norm.weight", "norm.weight"),
           ("layers.{i}.{rest}", "layers.{i}.{rest}"), ("embed_tokens.weight", "embed_tokens.weight"),
           ("lm_head.weight", "lm_head.weight"))
_MEDUSA_VLLM = tuple((pre + src, dst) for pre in ("", "medusa_heads.") for src, dst in (
    ("blocks.{k}.layers.{j}.{rest}", "medusa_head.{k}.{j}.linear.{rest}"),
    ("lm_heads.{k}.weight", "medusa_head.{k}.{n}.weight"),
    ("lm_head.weight", "lm_head.weight"), ("token_map", "token_map")))

LAYOUTS: tuple[Layout, ...] = (
    Layout("dflash-speculators", "dflash", "dflash", "vllm-project/speculators DFlash (*-speculator.dflash)",
           lambda hf, keys: speculators_type(hf) == "dflash",
           _DFLASH + (("d2t", "d2t"), ("t2d", "t2d"))),
    Layout("dspark-deepspec", "dspark", "dflash", "deepseek-ai/DeepSpec Qwen3DSparkModel",
           lambda hf, keys: any("DSpark" in a for a in _archs(hf)) and "speculators_config" not in hf,
           _DFLASH + (("markov_head.{rest}", "markov_head.{rest}"),
                      ("confidence_head.{rest}", "confidence_head.{rest}"))),
    Layout("dflash-zlab", "dflash", "dflash", "z-lab/dflash DFlashDraftModel",
           lambda hf, keys: ("dflash_config" in hf or any("DFlash" in a for a in _archs(hf)))
           and "speculators_config" not in hf, _DFLASH),
    Layout("mtp-mimo", "mtp", "mtp", "XiaomiMiMo MiMoForCausalLM model.mtp_layers (vLLM mimo_mtp.py)",
           lambda hf, keys: _has(keys, "model.mtp_layers.0."),
           (("model.mtp_layers.0.token_layernorm.weight", "enorm.weight"),
            ("model.mtp_layers.0.hidden_layernorm.weight", "hnorm.weight"),
            ("model.mtp_layers.0.input_proj.weight", "eh_proj.weight"),
            ("model.mtp_layers.0.final_layernorm.weight", "norm.weight"),
            ("model.mtp_layers.0.{rest}", "{rest}"), ("model.{rest}", None), ("lm_head.weight", None))),
    Layout("mtp-deepseek", "mtp", "mtp",
           "DeepSeek-V3 / V3.2, GLM-4.5 model.layers.{L} (vLLM deepseek_mtp.py, glm4_moe_mtp.py)",
           lambda hf, keys: isinstance(hf.get("num_hidden_layers"), int)
           and _has(keys, f"model.layers.{hf['num_hidden_layers']}."),
           (("model.layers.{L}.shared_head.norm.weight", "norm.weight"),
            ("model.layers.{L}.shared_head.head.weight", "head.weight"),
            ("model.layers.{L}.{rest}", "{rest}"), ("model.{rest}", None), ("lm_head.weight", None)),
           constants=lambda hf, keys: _layers(hf)),
    Layout("medusa-fasterdecoding", "medusa", "medusa",
           "FasterDecoding/Medusa medusa_lm_head.{safetensors,pt} (medusa_model.py, train_legacy.py)",
           lambda hf, keys: True,  # recognised by its file name
           (("{k}.{j}.linear.{rest}", "medusa_head.{k}.{j}.linear.{rest}"),
            ("{k}.{j}.weight", "medusa_head.{k}.{j}.weight")),
           files=MEDUSA_FILES),
    Layout("medusa-vllm", "medusa", "medusa", "vLLM medusa.py (blocks.{k}.layers.{j}, lm_heads.{k}, token_map)",
           lambda hf, keys: hf.get("model_type") == "medusa" or _has(keys, "blocks.") or _has(keys, "medusa_heads."),
           _MEDUSA_VLLM, constants=_medusa_layers),
    Layout("medusa-2", "medusa", "medusa",
           "FasterDecoding Medusa-2 (axolotl add_medusa_heads): medusa_head.* beside the target, or alone",
           lambda hf, keys: _has(keys, "medusa_head."),
           (("medusa_head.{rest}", "medusa_head.{rest}"), ("model.{rest}", None), ("lm_head.weight", None))),
    Layout("eagle3-speculators", "eagle3", "eagle", "vllm-project/speculators Eagle3DraftModel (*-speculator.eagle3)",
           lambda hf, keys: speculators_type(hf) == "eagle3",
           (("layers.{i}.{rest}", "layers.{i}.{rest}"), ("input_norm.weight", "input_norm.weight"),
            ("fc_norm.{i}.weight", "fc_norm.{i}.weight")) + _EAGLE3_TAIL),
    Layout("eagle3-safeailab", "eagle3", "eagle", "SafeAILab/EAGLE cnets.py (yuhuili/EAGLE3-*)",
           lambda hf, keys: _has(keys, "midlayer."),
           (("midlayer.{rest}", "layers.0.{rest}"),) + _EAGLE3_TAIL),
    Layout("eagle3-vllm", "eagle3", "eagle", "vLLM llama_eagle3.py / qwen3_eagle3.py (layers.0.hidden_norm)",
           lambda hf, keys: "layers.0.hidden_norm.weight" in keys and "speculators_config" not in hf,
           (("layers.{i}.{rest}", "layers.{i}.{rest}"),) + _EAGLE3_TAIL),
    Layout("eagle-safeailab", "eagle", "eagle", "SafeAILab/EAGLE cnets1.py (yuhuili/EAGLE-*)",
           lambda hf, keys: ("fc.weight" in keys or _has(keys, "layers.0.")) and "speculators_config" not in hf,
           (("fc.{rest}", "fc.{rest}"), ("layers.{i}.{rest}", "layers.{i}.{rest}"),
            ("embed_tokens.weight", "embed_tokens.weight"))),
)
"""Every layout funcspec reads, in detection order (the first that matches wins)."""

FAMILIES = {"eagle": "EAGLE head", "mtp": "MTP module", "medusa": "Medusa head", "dflash": "DFlash / DSpark drafter"}
"""What each family's checkpoints hold, for messages."""


# ----------------------------------------------------------------------------- key tables


def _pattern(template: str, constants: dict) -> re.Pattern:
    """A regex for a published key pattern: constants filled in, ``{rest}`` a dotted tail, others integers."""
    out = []
    for part in re.split(r"(\{\w+\})", template):
        name = part[1:-1] if part.startswith("{") else None
        if name is None:
            out.append(re.escape(part))
        elif name in constants:
            out.append(re.escape(str(constants[name])))
        else:
            out.append(f"(?P<{name}>.+)" if name == "rest" else f"(?P<{name}>\\d+)")
    return re.compile("".join(out))


def rename(layout: Layout, keys, constants: dict) -> tuple[dict[str, str], list[str], list[str]]:
    """Map published keys to funcspec names through ``layout``'s table.

    Returns ``(published -> funcspec name, skipped keys (the target's), unknown keys)``.
    """
    rules = [(_pattern(src, constants), dst) for src, dst in layout.keys]
    names, skipped, unknown = {}, [], []
    for key in keys:
        for pat, dst in rules:
            m = pat.fullmatch(key)
            if m:
                if dst is None:
                    skipped.append(key)
                else:
                    names[key] = dst.format(**constants, **m.groupdict())
                break
        else:
            unknown.append(key)
    return names, skipped, unknown


def publish(layout: Layout, names, constants: dict) -> dict[str, str]:
    """The inverse of :func:`rename` for funcspec names ``names``: funcspec name -> published key."""
    rules = [(_pattern(dst, constants), src) for src, dst in layout.keys if dst is not None]
    out = {}
    for name in names:
        for pat, src in rules:
            m = pat.fullmatch(name)
            if m:
                out[name] = src.format(**constants, **m.groupdict())
                break
        else:
            raise ValueError(f"layout {layout.name}: no published name for {name!r}")
    return out


# ----------------------------------------------------------------------------- reading a head


@dataclasses.dataclass
class Head:
    """A draft head as found on disk, its tensors under funcspec's names.

    Attributes:
        layout: the recognised layout.
        path: the checkpoint directory.
        config: its config.json as published.
        weights: the weight files read.
        tensors: funcspec name -> tensor (as stored: dtype and device unchanged).
        names: funcspec name -> the key in the file.
        skipped: keys that belong to the target saved beside the head (not read).
        constants: the key table's fixed parts (``{L}``, ``{n}``).
    """

    layout: Layout
    path: Path
    config: dict
    weights: Weights
    tensors: dict[str, torch.Tensor]
    names: dict[str, str]
    skipped: tuple[str, ...]
    constants: dict

    @property
    def where(self) -> str:
        """How messages name the head: its weight files and layout."""
        return f"{self.weights} (layout {self.layout.name})"

    def published(self, name: str) -> str:
        """The key in the file of funcspec's ``name`` (for a key the file lacks: what the layout calls it)."""
        if name in self.names:
            return self.names[name]
        try:
            return publish(self.layout, [name], self.constants)[name]
        except ValueError:
            return name


def _probe(path: Path, layout: Layout, hf: dict) -> Optional[tuple[Weights, frozenset]]:
    """The layout's weight files and their keys, or ``None`` when it has none of its files."""
    if not has_weights(path, layout.files):
        return None
    weights = find_weights(path, layout.files)
    return weights, frozenset(weights.keys())


def detect(path, family: Optional[str] = None) -> tuple[Layout, Weights, dict, frozenset]:
    """The layout of checkpoint directory ``path`` (of ``family``, if given): ``(layout, weights, config, keys)``.

    Raises ``FileNotFoundError`` (no directory, config.json or weight file) or
    ``ValueError`` naming the layouts tried and the keys found.
    """
    path, hf = read_config(path)
    _refuse_known(path, hf)
    tried = [lay for lay in LAYOUTS if family in (None, lay.family)]
    seen: dict[tuple[str, ...], Optional[tuple]] = {}
    for layout in tried:
        probe = seen.get(layout.files) if layout.files in seen else _probe(path, layout, hf)
        seen[layout.files] = probe
        if probe is not None and layout.matches(hf, probe[1]):
            return layout, probe[0], hf, probe[1]
    found = next((p for p in seen.values() if p is not None), None)
    if found is None:
        files = dict.fromkeys(f for lay in tried for f in lay.files)
        raise FileNotFoundError(f"{path}: no weight file; looked for {looked_for(files)}")
    what = FAMILIES.get(family, "draft head")  # type: ignore[arg-type]  # None: the default
    raise ValueError(f"{path}: no {what} in a layout funcspec reads ({', '.join(lay.name for lay in tried)}); "
                     f"config architectures={_archs(hf)}, {len(found[1])} keys in {found[0]}, e.g. "
                     f"{sorted(found[1])[:6]}")


# vLLM speculators algorithms, and heads whose host model funcspec cannot run, refused by name.
_SPECULATORS_REFUSED = {"peagle": "P-EAGLE (parallel drafting)", "dflash2": "DFlash2 (conv + candidate selector)",
                        "dspark": "speculators DSpark", "mlp_speculator": "MLP speculator"}


def speculators_layers(hf: dict, path) -> dict:
    """A speculators config's ``transformer_layer_config``: the draft decoder's own HF config."""
    layer = hf.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{Path(path) / 'config.json'}: a speculators config needs a transformer_layer_config "
                         f"object (the draft layers' config), got {type(layer).__name__}")
    return layer


def _refuse_known(path: Path, hf: dict) -> None:
    """``ValueError`` for a speculators algorithm funcspec does not run, naming it."""
    kind = speculators_type(hf)
    if kind is not None and kind not in ("eagle3", "dflash"):
        what = _SPECULATORS_REFUSED.get(kind, "an unknown algorithm")
        raise ValueError(f"{path / 'config.json'}: speculators_model_type {kind!r} ({what}) is not supported; "
                         f"funcspec reads speculators 'eagle3' and 'dflash' checkpoints")


def read_head(path, family: str, method: str) -> Head:
    """Read a ``method`` head of ``family`` from ``path``: recognise its layout, rename its keys.

    Raises ``ValueError`` when the layout serves another method (naming it),
    or when keys match nothing in its table.
    """
    layout, weights, hf, keys = detect(path, family)
    if layout.method != method:
        raise ValueError(f"{path}: a {layout.method} checkpoint (layout {layout.name}: {layout.source}); "
                         f"use method {layout.method!r}, not {method!r}")
    constants = layout.constants(hf, keys)
    names, skipped, unknown = rename(layout, keys, constants)
    if unknown:
        raise ValueError(f"{weights} (layout {layout.name}): unexpected keys {sorted(unknown)[:8]}"
                         f"{' ...' if len(unknown) > 8 else ''}")
    tensors = weights.read(names)
    return Head(layout, Path(path), hf, weights, {names[k]: v for k, v in tensors.items()},
                {v: k for k, v in names.items()}, tuple(sorted(skipped)), constants)


def share(shipped: Optional[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """The tensor a head uses where it may ship its own copy of a target tensor (embedding, LM head).

    vLLM's rule: the target's when the head ships none or an identical one
    (no second copy in memory), else the head's own, cast to the target's dtype.
    """
    if shipped is None:
        return target
    own = shipped.to(device=target.device, dtype=target.dtype)
    return target if own.shape == target.shape and torch.equal(own, target) else own


def share_linear(shipped: Optional[torch.Tensor], target: dict, dtype: torch.dtype) -> dict:
    """:func:`share` for a linear's params (the LM head): the target's own dict (with whatever it was prepared
    with) when shared, else the head's weight. A target whose LM head is stored quantized (a GGUF file's) shares
    it only with a head that ships none: a shipped float copy is the head's own, in the target's activation
    ``dtype``."""
    if shipped is None:
        return target
    if "weight" not in target:
        return {"weight": shipped.to(dtype)}
    weight = share(shipped, target["weight"])
    return target if weight is target["weight"] else {"weight": weight}
