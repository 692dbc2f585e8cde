"""``funcspec inspect``: what a draft-head directory is, as funcspec reads it, and whether it fits a target;
for a target model, how its weights are stored (quantized as published, or float) layer by layer.

:func:`inspect` recognises the layout (:mod:`funcspec.checkpoints.layouts`),
reads the key names and shapes (tensor data is not loaded for safetensors),
collects the config fields that decide the head's shape (draft vocabulary,
auxiliary layers, heads, norms), and, given a target, loads the head for it
exactly as the proposer would: it fits, or the report says precisely why not.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any, Optional

from funcspec.checkpoints import gguf, layouts, quantized
from funcspec.checkpoints.files import read_config
from funcspec.checkpoints.llama import load_model, model_config
from funcspec.nn.llama import ModelConfig

# config.json fields that decide each family's shape, in the order they are reported (speculators' nested
# transformer_layer_config is read too).
_FIELDS = {
    "eagle": ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
              "draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "qkv_bias", "bias",
              "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "model_type"),
    "mtp": ("architectures", "num_hidden_layers", "hidden_size", "vocab_size", "num_nextn_predict_layers"),
    "medusa": ("medusa_num_heads", "medusa_num_layers", "num_heads", "num_hidden_layers", "version",
               "medusa_fc_bias", "original_lm_head", "truncated_vocab_size", "vocab_size"),
    "dflash": ("hidden_size", "num_hidden_layers", "vocab_size", "draft_vocab_size", "target_hidden_size",
               "aux_hidden_state_layer_ids", "target_layer_ids", "mask_token_id", "block_size", "markov_rank"),
}


@dataclasses.dataclass
class Report:
    """What :func:`inspect` found.

    Attributes:
        path: the directory.
        layout: the recognised layout, or ``None`` (then ``problem`` says why).
        weights: the weight files read.
        shapes: funcspec name -> (published key, shape, dtype) of every head tensor.
        skipped: how many keys belong to a target saved beside the head.
        fields: the config fields that decide the head's shape.
        speculative_tokens: the K its config proposes (speculators), if any.
        target: the target checked against, if any.
        parsed: the head's static config as loaded for ``target``.
        problem: why it does not load (for ``target``, or at all), or ``None``.
        model: for a target model rather than a head: its decoder, its stored quantization and which linears
            are quantized (:func:`funcspec.checkpoints.quantized.layer_report`).
    """

    path: str
    layout: Optional[layouts.Layout] = None
    weights: str = ""
    shapes: dict = dataclasses.field(default_factory=dict)
    skipped: int = 0
    fields: dict = dataclasses.field(default_factory=dict)
    speculative_tokens: Optional[int] = None
    target: Optional[str] = None
    parsed: Any = None
    problem: Optional[str] = None
    model: Optional[dict] = None

    @property
    def fits(self) -> bool:
        """Whether the head (or the target model) loads (for the target, when one was given)."""
        return (self.layout is not None or self.model is not None) and self.problem is None

    def __str__(self) -> str:
        lines = [f"{self.path}"]
        if self.model is not None:
            m = self.model
            lines += [f"  target model: {_show(m['cfg'])}", f"  quantization: {m['quantization']}"]
            for name, modules in m["layers"]["quantized"].items():
                lines.append(f"    {name}: {', '.join(modules)}")
            lines.append(f"    float: {', '.join(m['layers']['float']) or '-'}")
            return "\n".join(lines)
        if self.layout is None:
            return "\n".join(lines + [f"  not a draft head funcspec reads: {self.problem}"])
        lines += [f"  layout:  {self.layout.name} ({self.layout.source})",
                  f"  method:  {self.layout.method}" + (f"  (speculative_tokens {self.speculative_tokens})"
                                                        if self.speculative_tokens else ""),
                  f"  weights: {self.weights}, {len(self.shapes)} head tensors"
                  + (f", {self.skipped} target tensors beside them (not read)" if self.skipped else "")]
        lines += ["  config:"] + [f"    {k}: {v}" for k, v in self.fields.items()]
        lines += ["  tensors (funcspec name <- key in the file: shape dtype):"]
        for name, (key, shape, dtype) in sorted(self.shapes.items()):
            src = "" if key == name else f" <- {key}"
            lines.append(f"    {name}{src}: {list(shape)} {str(dtype).replace('torch.', '')}")
        if self.target is not None:
            lines.append(f"  target:  {self.target}")
            if self.problem is None:
                lines += ["  fits:    yes", f"  loaded as {type(self.parsed).__name__}:"]
                lines += [f"    {f.name}: {_show(getattr(self.parsed, f.name))}"
                          for f in dataclasses.fields(self.parsed)]
        if self.problem is not None:
            lines.append(f"  fits:    no: {self.problem}")
        return "\n".join(lines)


def _show(value) -> str:
    """A field of a head's static config; its decoder dims in one line."""
    if isinstance(value, ModelConfig):
        m = value
        heads = (f"{m.num_heads} latent-attention heads (latent {m.mla.kv_lora_rank} + {m.mla.qk_rope_head_dim})"
                 if m.mla.kv_lora_rank else f"{m.num_heads}/{m.num_kv_heads} heads of {m.head_dim}")
        return (f"{m.arch} hidden {m.hidden_size}, {m.num_layers} layer(s), {heads}, vocab {m.vocab_size}"
                + (", q/k norm" if m.qk_norm else "")
                + (", attention bias" if m.attention_bias else ""))
    return str(value)


def _fields(hf: dict, family: str) -> dict:
    flat = {**(hf.get("transformer_layer_config") or {}), **hf, **(hf.get("dflash_config") or {})}
    return {k: flat[k] for k in _FIELDS[family] if flat.get(k) is not None}


def _shapes(head: layouts.Head) -> dict:
    return {name: (head.names[name], tuple(t.shape), t.dtype) for name, t in head.tensors.items()}


def inspect(path, target=None) -> Report:
    """Recognise the draft head in ``path`` and, given ``target`` (a directory or a loaded Model), load it
    for that target. Never raises for a head that does not fit: the report's ``problem`` says why."""
    report = Report(str(path))
    try:
        layout, weights, hf, _ = layouts.detect(path)
        head = layouts.read_head(path, layout.family, layout.method)
    except (ValueError, FileNotFoundError) as e:
        report.problem = str(e)
        if _target_arch(path) or gguf.path_of(path) is not None:
            return _target_report(path, report)
        return report
    report.layout, report.weights, report.skipped = layout, str(weights), len(head.skipped)
    report.shapes, report.fields = _shapes(head), _fields(hf, layout.family)
    proposals = (hf.get("speculators_config") or {}).get("proposal_methods") or [{}]
    report.speculative_tokens = proposals[0].get("speculative_tokens") if isinstance(proposals[0], dict) else None
    if target is None:
        return report
    model = target if not isinstance(target, (str, Path)) else load_model(target)
    report.target = model.path
    module = importlib.import_module(f"funcspec.checkpoints.{layout.family}")
    try:
        if layout.family == "eagle":
            report.parsed = module.load_params(path, model, version=1 if layout.method == "eagle" else 3)[0]
        elif layout.family == "dflash":
            report.parsed = module.load_params(path, model, layout.method)[0]
        else:
            report.parsed = module.load_params(path, model)[0]
    except (ValueError, FileNotFoundError) as e:
        report.problem = str(e)
    return report


def _target_report(path, report: Report) -> Report:
    """A target model's report: its decoder and how each linear is stored (or why it does not load)."""
    try:
        model = load_model(path)
    except (ValueError, FileNotFoundError) as e:
        report.problem = f"a target model that does not load: {e}"
        return report
    q = model.quantization
    report.problem = None
    report.model = {"cfg": model.cfg, "quantization": q.summary if q else "none (float weights)",
                    "layers": quantized.layer_report(model.params)}
    return report


def _target_arch(path) -> Optional[str]:
    """The decoder family of a target model funcspec loads from ``path``, or ``None``."""
    try:
        return model_config(read_config(path)[1]).arch
    except (ValueError, FileNotFoundError):
        return None
