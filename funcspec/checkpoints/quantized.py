"""Quantized checkpoints as they are published: GPTQ, AWQ, compressed-tensors and vLLM-Ascend's W8A8.

``load_model`` (and ``LLM(model)``) recognises the format from ``config.json``'s
``quantization_config`` (or vLLM-Ascend's ``quant_model_description.json``
beside it) and maps each quantized linear, value for value, onto funcspec's
8- / 4-bit family (:mod:`funcspec.kernels.quant`); layers the file keeps in
float (``lm_head`` usually, ``ignore`` lists, ``FLOAT`` entries) load as floats.

===================  ===========================================================  ==============================
format               tensors of a linear [N out, K in] (layouts read from)         funcspec's format
===================  ===========================================================  ==============================
GPTQ                 ``qweight`` int32 [K/(32/b), N]: b-bit values packed along     b = 4 / 8, G = group_size (K
(``gptq``)           K, value j of a word at bits j b; ``qzeros`` int32 [K/G,       for -1); z == 2^(b-1): sym.,
                     N/(32/b)] packed along N; ``scales`` fp16 [K/G, N];            else offsets s z; act-order:
                     ``g_idx`` [K] (each input's group); W = s (q - z), z the       an input permutation
                     stored value + 1 (AutoGPTQ's ``checkpoint_format`` "gptq";
                     "gptq_v2" stores z itself). AutoGPTQ ``qlinear_cuda_old``,
                     vLLM ``gptq.py``.
AWQ (``awq``,        ``qweight`` int32 [K, N/8] and ``qzeros`` int32 [K/G, N/8]:    4-bit, G = group_size,
GEMM)                8 nibbles a word along N, column 8c + [0, 2, 4, 6, 1, 3, 5,    offsets s z
                     7][i] at bits 4i; ``scales`` fp16 [K/G, N]; W = s (q - z).
                     AutoAWQ ``WQLinear_GEMM.from_linear``, vLLM ``awq.py``.
compressed-tensors   ``pack-quantized``: ``weight_packed`` int32 [N, K b/32]        b-bit, G per ``strategy``
(``compressed-       packed along K (value j at bits j b), values + 2^(b-1);        (group / channel / tensor);
tensors``)           ``weight_scale`` [N, K/G] or [N, 1]; ``weight_zero_point``     sym. or offsets
                     int32 [N/(32/b), K/G] packed along N; ``weight_shape``;
                     ``weight_g_idx`` (actorder). ``int-quantized``: ``weight``
                     int8 [N, K], ``weight_scale`` [N, 1] / [1], ``input_scale``
                     (static activations). compressed-tensors
                     ``pack_quantized``, vLLM ``compressed_tensors_wNa16`` /
                     ``_w8a8_int8``.
vLLM-Ascend          ``quant_model_description.json``: each ``<module>.weight``     8-bit per channel
(``ascend``)         -> ``W8A8`` / ``W8A8_DYNAMIC`` / ``W8A16`` / ``FLOAT``;
                     ``weight`` int8 [N, K], ``weight_scale`` / ``weight_offset``
                     [N, 1]; W8A8 adds ``input_scale``, ``input_offset``,
                     ``deq_scale``, ``quant_bias`` (the bias and the activation
                     offset folded in). vLLM-Ascend ``w8a8_static.py``,
                     ``w8a8_dynamic.py``, ``modelslim_config.py``.
===================  ===========================================================  ==============================

A DeepSeek checkpoint as msmodelslim writes its W8A8 keeps ``kv_b_proj`` float (MLA
absorbs its heads into the query and the output); a file that stores it
quantized anyway is dequantized at load
(:func:`funcspec.checkpoints.deepseek.dequantize_absorbed`), as vLLM does after
loading.

NOTE on activations: funcspec's kernel quantizes activations to int8 per row
and block of 32 k, whatever the file says (A16, per-token dynamic, or a static
per-tensor ``input_scale``): finer than any of them, so the result is at least
as close to the float product. A static scale is read and checked, and used
only where the file folds something into it (Ascend's ``quant_bias``:
b = deq_scale (quant_bias + input_offset sum_k q)).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional

import torch

from funcspec.checkpoints.files import read_json_object
from funcspec.quant import formats

DESCRIPTION = "quant_model_description.json"
"""vLLM-Ascend's (ModelSlim's) per-tensor description file, beside ``config.json``: the name funcspec writes."""
DESCRIPTIONS = "quant_model_description*.json"
"""The description files read (older msmodelslim writes ``quant_model_description_w8a8.json``)."""

ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "gptq_bitblas": "gptq",
           "compressed_tensors": "compressed-tensors"}
"""vLLM ``quantization`` names that read the same stored format (a kernel choice, not a layout)."""

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AutoAWQ's GEMM packing: nibble i of a word holds column 8c + AWQ_ORDER[i]."""

ASCEND_TYPES = ("W8A8", "W8A8_DYNAMIC", "W8A16")
"""vLLM-Ascend quant types of linears funcspec reads (``FLOAT``: a float layer)."""


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A checkpoint's quantization as declared.

    Attributes:
        method: ``gptq``, ``awq``, ``compressed-tensors`` or ``ascend`` (``gguf`` for GGUF files).
        summary: the declared bits, group size and options, for reports.
        config: ``quantization_config``, or the Ascend description.
        where: the file it was read from.
    """

    method: str
    summary: str
    config: dict
    where: str


# ----------------------------------------------------------------------------- detection


def detect(path: Path, hf: dict) -> Optional[Scheme]:
    """The quantization a checkpoint directory declares, or ``None``; ``ValueError`` for one funcspec does not
    read (naming it and what it reads)."""
    descriptions = sorted(Path(path).glob(DESCRIPTIONS))
    if len(descriptions) > 1:
        raise ValueError(f"{path}: several vLLM-Ascend descriptions ({[d.name for d in descriptions]}); "
                         f"keep the one that describes the weight files")
    if descriptions:
        return _ascend_scheme(descriptions[0])
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    where = f"{Path(path) / 'config.json'}: quantization_config"
    if not isinstance(qc, dict):
        raise ValueError(f"{where} must be an object, got {type(qc).__name__}")
    method = ALIASES.get(qc.get("quant_method"), qc.get("quant_method"))  # type: ignore[arg-type]  # None: no alias
    if method not in _SCHEMES:
        raise ValueError(f"{where}.quant_method {qc.get('quant_method')!r} is not a format funcspec reads "
                         f"(it reads {sorted(_SCHEMES)} and vLLM-Ascend's {DESCRIPTIONS})")
    return _SCHEMES[method](qc, where)


def check_requested(requested: Optional[str], scheme: Optional[Scheme], where: str) -> None:
    """``ValueError`` when ``quantization=`` names a stored format the checkpoint is not in (as vLLM does)."""
    if requested is None:
        return
    want = ALIASES.get(requested, requested)
    have = scheme.method if scheme is not None else None
    if want != have:
        found = f"is stored as {have!r}" if have else "declares no quantization (no quantization_config)"
        raise ValueError(f"quantization={requested!r}, but {where} {found}")


def _bits(value, allowed, where: str) -> int:
    if value not in allowed:
        raise ValueError(f"{where}: {value}-bit weights are not run by funcspec (it runs {list(allowed)})")
    return value


def _group(value, where: str) -> int:
    """A declared group size: -1 / None per channel (0 here), else a positive integer."""
    if value in (None, -1, 0):
        return 0
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: group_size must be a positive integer or -1, got {value!r}")
    return value


def _gptq_scheme(qc: dict, where: str) -> Scheme:
    bits = _bits(qc.get("bits"), (4, 8), f"{where}.bits")
    group = _group(qc.get("group_size", 128), f"{where}.group_size")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{where}.checkpoint_format {fmt!r} is not read (funcspec reads 'gptq' and 'gptq_v2')")
    if qc.get("dynamic"):
        raise ValueError(f"{where}.dynamic (per-module overrides) is not read: every quantized module must have "
                         f"the declared bits and group size")
    symmetry = "symmetric" if qc.get("sym", True) else "asymmetric"
    summary = (f"GPTQ {bits}-bit, group {group or 'per channel'}, {symmetry}"
               f"{', act-order (desc_act)' if qc.get('desc_act') else ''}, checkpoint_format {fmt}")
    return Scheme("gptq", summary, qc, where)


def _awq_scheme(qc: dict, where: str) -> Scheme:
    bits = _bits(qc.get("bits", qc.get("w_bit")), (4,), f"{where}.bits")
    group = _group(qc.get("group_size", qc.get("q_group_size")), f"{where}.group_size")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{where}.version {version!r} is not read (funcspec reads AWQ's GEMM layout)")
    zp = qc.get("zero_point", True)
    return Scheme("awq", f"AWQ {bits}-bit GEMM, group {group or 'per channel'}, "
                         f"{'zero points' if zp else 'no zero points'}", qc, where)


CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
"""compressed-tensors formats of int weights funcspec reads."""


def _ct_scheme(qc: dict, where: str) -> Scheme:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where}.config_groups: missing or empty")
    parts = []
    for name, g in groups.items():
        w = (g or {}).get("weights") or {}
        fmt = g.get("format") or qc.get("format")
        at = f"{where}.config_groups.{name}"
        if fmt not in CT_FORMATS:
            raise ValueError(f"{at}: format {fmt!r} is not read (funcspec reads {list(CT_FORMATS)})")
        if w.get("type", "int") != "int":
            raise ValueError(f"{at}.weights.type {w.get('type')!r} is not read (funcspec reads int weights)")
        _bits(w.get("num_bits"), (4, 8), f"{at}.weights.num_bits")
        if w.get("strategy", "tensor") not in ("tensor", "channel", "group"):
            raise ValueError(f"{at}.weights.strategy {w.get('strategy')!r} is not read "
                             f"(funcspec reads tensor, channel and group)")
        act = g.get("input_activations")
        if act and (act.get("type", "int") != "int" or act.get("num_bits") != 8):
            raise ValueError(f"{at}.input_activations: {act.get('type')} {act.get('num_bits')}-bit activations are "
                             f"not run (funcspec's kernel takes int8 activations)")
        acts = "A16" if not act else f"A8 {'dynamic' if act.get('dynamic') else 'static'} {act.get('strategy')}"
        parts.append(f"{fmt} W{w['num_bits']}{acts}, {w.get('strategy', 'tensor')}"
                     + (f" {w.get('group_size')}" if w.get("strategy") == "group" else "")
                     + f", {'symmetric' if w.get('symmetric', True) else 'asymmetric'} -> {g.get('targets')}")
    ignore = qc.get("ignore") or []
    return Scheme("compressed-tensors", "compressed-tensors " + "; ".join(parts)
                  + (f"; ignore {ignore}" if ignore else ""), qc, where)


def _ascend_scheme(path: Path) -> Scheme:
    desc = read_json_object(path)  # tensor name -> quant type
    kinds = sorted({v for k, v in desc.items() if k.endswith(".weight") and isinstance(v, str)})
    bad = [k for k in kinds if k not in (*ASCEND_TYPES, "FLOAT")]
    if bad:
        raise ValueError(f"{path}: quant types {bad} are not read (funcspec reads {list(ASCEND_TYPES)} and FLOAT)")
    return Scheme("ascend", f"vLLM-Ascend {desc.get('model_quant_type', '/'.join(kinds))} ({', '.join(kinds)})",
                  desc, str(path))


_SCHEMES = {"gptq": _gptq_scheme, "awq": _awq_scheme, "compressed-tensors": _ct_scheme}


# ----------------------------------------------------------------------------- reading linears


def read(tensors: dict[str, torch.Tensor], scheme: Scheme, linears: dict[str, tuple], dtype,
         where: str) -> tuple[dict, set]:
    """The quantized linears of ``tensors`` as funcspec params ``{module: params}`` and the keys they used.

    ``linears``: module path -> (N, K) of every linear of the model; a module
    the file keeps in float is not returned (its ``weight`` stays in
    ``tensors`` for the float loader). Biases are cast to ``dtype``.
    """
    out, used = {}, set()
    for module, (n, k) in linears.items():
        t = _Module(tensors, module, where)
        try:
            p = _READERS[scheme.method](t, n, k, scheme)
        except ValueError as e:  # the kernel's own checks (in_features, group) do not know the module
            raise e if str(e).startswith(where) else ValueError(f"{where}: {module}: {e}") from e
        if p is None:
            continue
        if "bias" in p:
            p["bias"] = p["bias"].to(dtype)
        out[module] = p
        used |= t.used
    return out, used


class _Module:
    """One module's tensors (``<module>.<name>``), recording which were read."""

    def __init__(self, tensors: dict, module: str, where: str):
        self.tensors, self.module, self.where = tensors, module, where
        self.used: set[str] = set()

    def get(self, name: str) -> Optional[torch.Tensor]:
        key = f"{self.module}.{name}"
        if key in self.tensors:
            self.used.add(key)
        return self.tensors.get(key)

    def need(self, name: str, shape: Optional[tuple] = None, integer: Optional[bool] = None) -> torch.Tensor:
        """Tensor ``name``; ``ValueError`` naming it when it is missing, mis-shaped or of the wrong kind."""
        t = self.get(name)
        key = f"{self.module}.{name}"
        if t is None:
            raise ValueError(f"{self.where}: missing {key} (a quantized linear's {name})")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"{self.where}: {key}: expected {list(shape)}, got {list(t.shape)}")
        if integer is not None and integer == t.is_floating_point():
            raise ValueError(f"{self.where}: {key}: expected {'an integer' if integer else 'a float'} tensor, "
                             f"got {t.dtype}")
        return t

    def fail(self, msg: str) -> NoReturn:
        raise ValueError(f"{self.where}: {self.module}: {msg}")


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Values of ``bits`` packed into int32 words along ``dim`` (value j of a word at bits j b; ``order``: the
    column each position holds, AWQ's interleave), as int32 [..., words * 32/b along dim]."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    x = packed.to(torch.int32).movedim(dim, -1)  # [..., W]
    v = (x.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., W, per]
    if order is not None:
        v = v[..., [order.index(j) for j in range(per)]]
    return v.flatten(-2).movedim(-1, dim)


def _gptq(t: _Module, n: int, k: int, s: Scheme) -> Optional[dict]:
    """GPTQ (AutoGPTQ / GPTQModel, as vLLM's ``gptq.py`` reads it)."""
    if t.get("qweight") is None:
        return None
    bits, per = s.config["bits"], 32 // s.config["bits"]
    group = _group(s.config.get("group_size", 128), "") or k
    if k % group:
        t.fail(f"in_features {k} is not a multiple of group_size {group}")
    qweight = t.need("qweight", (k // per, n), integer=True)
    scales = t.need("scales", (k // group, n), integer=False)
    qzeros = t.need("qzeros", (k // group, -(-n // per)), integer=True)
    q = unpack_int32(qweight, bits, 0)  # [K, N]
    z = unpack_int32(qzeros, bits, 1)[:, :n]  # [K/G, N]
    if s.config.get("checkpoint_format", "gptq") == "gptq":
        z = z + 1  # AutoGPTQ stores z - 1
    perm = formats.act_order(t.get("g_idx"), k, group, f"{t.where}: {t.module}")
    return formats.linear(q.t(), scales.t(), bits, f"gptq-int{bits}-g{group}", zeros=z.t(), perm=perm,
                          bias=t.get("bias"))


def _awq(t: _Module, n: int, k: int, s: Scheme) -> Optional[dict]:
    """AWQ's GEMM layout (AutoAWQ ``WQLinear_GEMM``, as vLLM's ``awq.py`` reads it)."""
    if t.get("qweight") is None:
        return None
    group = _group(s.config.get("group_size", s.config.get("q_group_size")), "") or k
    if k % group or n % 8:
        t.fail(f"[{n}, {k}] does not hold whole AWQ groups of {group} inputs and words of 8 outputs")
    q = unpack_int32(t.need("qweight", (k, n // 8), integer=True), 4, 1, AWQ_ORDER)  # [K, N]
    scales = t.need("scales", (k // group, n), integer=False)
    zeros = t.get("qzeros")
    if zeros is None and s.config.get("zero_point", True):
        t.need("qzeros")
    z = None if zeros is None else unpack_int32(t.need("qzeros", (k // group, n // 8), integer=True), 4, 1,
                                                AWQ_ORDER).t()
    return formats.linear(q.t(), scales.t(), 4, f"awq-int4-g{group}", zeros=z, bias=t.get("bias"))


def _ct_group(module: str, qc: dict) -> Optional[dict]:
    """The ``config_groups`` entry that quantizes ``module`` (the first whose targets match, as vLLM picks),
    or ``None`` for a module the ``ignore`` list or no target names."""
    def matches(pattern: str) -> bool:
        if pattern.startswith("re:"):
            return re.match(pattern[3:], module) is not None
        return pattern in ("Linear", module)

    if any(matches(p) for p in qc.get("ignore") or []):
        return None
    return next((g for g in qc["config_groups"].values() if any(matches(p) for p in g.get("targets") or [])), None)


def _ct_scales(t: _Module, n: int, k: int, w: dict) -> torch.Tensor:
    """``weight_scale`` as [N, K/G] for the group's strategy (a tensor's one scale repeated per channel)."""
    strategy = w.get("strategy", "tensor")
    if strategy == "group":
        g = w.get("group_size")
        if not isinstance(g, int) or g <= 0 or k % g:
            t.fail(f"group_size {g!r} does not divide in_features {k}")
        return t.need("weight_scale", (n, k // g), integer=False)
    if strategy == "channel":
        return t.need("weight_scale", (n, 1), integer=False)
    scale = t.need("weight_scale", integer=False)
    if scale.numel() != 1:
        t.fail(f"weight_scale of a tensor-wise scheme must hold one value, got {list(scale.shape)}")
    return scale.reshape(1, 1).expand(n, 1)


def _compressed_tensors(t: _Module, n: int, k: int, s: Scheme) -> Optional[dict]:
    """compressed-tensors ``pack-quantized`` and ``int-quantized`` (vLLM's ``compressed_tensors_wNa16`` /
    ``compressed_tensors_w8a8_int8``)."""
    g = _ct_group(t.module, s.config)
    if g is None:
        return None
    w, act = g["weights"], g.get("input_activations")
    bits, fmt = w["num_bits"], g.get("format") or s.config.get("format")
    half = 1 << (bits - 1)
    scales = _ct_scales(t, n, k, w)
    if fmt == "pack-quantized":
        packed = t.need("weight_packed", (n, -(-k * bits // 32)), integer=True)
        shape = t.get("weight_shape")
        if shape is not None and [int(x) for x in shape.flatten()] != [n, k]:
            t.fail(f"weight_shape {shape.tolist()} is not [{n}, {k}]")
        q = unpack_int32(packed, bits, 1)[:, :k]  # [N, K]: stored + 2^(b-1)
        zp = t.get("weight_zero_point")
        zeros = None if zp is None else unpack_int32(zp, bits, 0)[:n]  # [N, K/G], offset the same way
    else:
        q = t.need("weight", (n, k), integer=True).to(torch.int32) + half
        zp = t.get("weight_zero_point")
        zeros = None if zp is None else zp.to(torch.int32) + half  # shaped as the scales
    if not w.get("symmetric", True) and zeros is None:
        t.need("weight_zero_point")
    if zeros is not None and zeros.numel() == 1:
        zeros = zeros.reshape(1, 1).expand(scales.shape)
    elif zeros is not None and tuple(zeros.shape) != tuple(scales.shape):
        t.fail(f"weight_zero_point holds {list(zeros.shape)} zero points for {list(scales.shape)} scales")
    if act and not act.get("dynamic", False):
        t.need("input_scale")  # static activation scales: read and checked (see the module's NOTE)
        if not act.get("symmetric", True):
            t.need("input_zero_point")
    perm = formats.act_order(t.get("weight_g_idx"), k, k // scales.shape[1], f"{t.where}: {t.module}")
    group = k // scales.shape[1]
    name = f"ct-w{bits}a{'8' if act else '16'}" + (f"-g{group}" if group != k else "")
    return formats.linear(q, scales, bits, name, zeros=zeros, perm=perm, bias=t.get("bias"))


def _ascend(t: _Module, n: int, k: int, s: Scheme) -> Optional[dict]:
    """vLLM-Ascend W8A8 (static), W8A8_DYNAMIC and W8A16: int8 weights per channel."""
    kind = s.config.get(f"{t.module}.weight")
    if kind in (None, "FLOAT"):
        return None
    weight = t.need("weight", (n, k), integer=True)
    scale = t.need("weight_scale", (n, 1), integer=False)
    offset = t.get("weight_offset")
    if offset is not None and bool(offset.float().ne(0).any()):
        t.fail("weight_offset is not zero: vLLM-Ascend's int8 products ignore it, so funcspec will not guess "
               "at its meaning")
    q = weight.to(torch.int32) + 128  # [N, K]
    bias = t.get("bias")
    if kind == "W8A8":  # the float bias and the activation offset live in quant_bias (see the module's NOTE)
        t.need("input_scale", integer=False)
        in_offset = t.need("input_offset")
        quant_bias = t.need("quant_bias", (n,), integer=True)
        deq = _deq_scale(t.need("deq_scale", (n,)))
        # a float bias beside quant_bias is already in it: vLLM-Ascend's static product does not add it again
        b = deq * (quant_bias.double() + in_offset.double().flatten()[0] * weight.double().sum(1))
        bias = b.float() if bool(b.ne(0).any()) else None
    return formats.linear(q, scale, 8, f"ascend-{kind.lower()}", bias=bias)


def _deq_scale(t: torch.Tensor) -> torch.Tensor:
    """Ascend's ``deq_scale`` as float64: float32, or (fp16 models) int64 words holding float32 bits."""
    if t.is_floating_point():
        return t.double()
    return (t.to(torch.int64) & 0xFFFFFFFF).to(torch.int32).view(torch.float32).double()


def check_description(scheme: Scheme, keys) -> None:
    """``ValueError`` for an Ascend description that names tensors the weight files (``keys``) do not hold."""
    if scheme.method != "ascend":
        return
    named = [k for k, v in scheme.config.items() if "." in k and isinstance(v, str)]
    missing = [k for k in named if k not in keys]
    if missing:
        raise ValueError(f"{scheme.where}: names tensors the weight files do not hold: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")


_READERS: dict[str, Callable[..., Optional[dict]]] = {
    "gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors, "ascend": _ascend}


# ----------------------------------------------------------------------------- reports


def layer_report(params: dict) -> dict[str, Any]:
    """Which linears of a loaded model's params are quantized, by format name, and which are float:
    ``{"quantized": {name: [modules]}, "float": [modules]}`` (layer indices folded: ``model.layers.*.mlp.up_proj
    (x 2)``)."""
    quantized: dict[str, dict] = {}
    floats: dict[str, int] = {}

    def walk(node, path):
        if isinstance(node, list):
            for i, x in enumerate(node):
                walk(x, f"{path}.{i}")
            return
        if not isinstance(node, dict):
            return
        name = re.sub(r"\.\d+\.", ".*.", path.lstrip("."))
        if "qweight" in node:
            f = node["format"]
            label = f"{f.name} ({f.bits}-bit, group {f.group if f.group != f.in_features else 'per channel'}" \
                    f"{', zero points' if f.asym else ''}{', act-order' if 'perm' in node else ''})"
            by = quantized.setdefault(label, {})
            by[name] = by.get(name, 0) + 1
            return
        w = node.get("weight")
        if isinstance(w, torch.Tensor) and w.dim() == 2 and not name.endswith("embed_tokens"):
            floats[name] = floats.get(name, 0) + 1
            return
        for key, v in node.items():  # a fused group is its members again; stacked experts' gate_up_proj is not
            if not (key in ("qkv_proj", "gate_up_proj") and ("q_proj" in node or "gate_proj" in node)):
                walk(v, f"{path}.{key}")

    walk(params, "")

    def fold(d):
        return [m + (f" (x {c})" if c > 1 else "") for m, c in d.items()]

    return {"quantized": {k: fold(v) for k, v in quantized.items()}, "float": fold(floats)}
