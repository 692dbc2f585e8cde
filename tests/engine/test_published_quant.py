"""Quantized checkpoints as published load as they are stored: GPTQ, AWQ, compressed-tensors, vLLM-Ascend.

Each case writes a tiny random Llama (or Qwen2, for biases) in the published
layout (``funcspec.checkpoints.quantized_write``: round-to-nearest values, the
format's own tensors, names, packing and config), loads it, and checks
(a) every quantized linear dequantizes to what the format's definition gives
from the file's tensors, computed here independently with plain integer ops;
(b) the logits match an HF model built from those dequantized weights, within
what int8 activations cost; (c) greedy speculation equals greedy AR on the
quantized weights. Layouts as read from:

- GPTQ: AutoGPTQ ``nn_modules/qlinear/qlinear_cuda_old.py`` (``pack``: qweight
  packed along K, qzeros along N, zeros stored minus one) and vLLM
  ``model_executor/layers/quantization/gptq.py`` (``checkpoint_format``
  ``gptq_v2`` keeps the zeros as they are; ``g_idx`` for desc_act).
- AWQ: AutoAWQ ``modules/linear/gemm.py`` (``WQLinear_GEMM.from_linear``: the
  [0, 2, 4, 6, 1, 3, 5, 7] interleave) and vLLM ``awq.py`` / ``awq_triton.py``
  (``AWQ_REVERSE_ORDER``).
- compressed-tensors: ``compressors/quantized_compressors/pack_quantized.py``
  (``pack_to_int32``: values + 2^(b-1) along K, zero points along N) and vLLM
  ``compressed_tensors/schemes/compressed_tensors_wNa16.py`` /
  ``compressed_tensors_w8a8_int8.py``.
- vLLM-Ascend: ``quantization/methods/w8a8_static.py`` (``input_scale``,
  ``input_offset``, ``deq_scale``, ``quant_bias``), ``w8a8_dynamic.py`` and
  ``configs/modelslim_config.py`` (``quant_model_description.json``).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_hf_model
from funcspec import LLM, Engine, SamplingParams, load_model
from funcspec.checkpoints import quantized_write as qw
from funcspec.checkpoints.report import inspect
from funcspec.nn.llama import forward, init_kv_cache
from funcspec.quant import formats

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 5, 9, 1, 5, 9, 3], [4, 7, 4, 7, 2]]
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)

CASES = {  # name -> (arch, writer, its options)
    "gptq-int4-g128": ("llama", qw.write_gptq, {}),
    "gptq-int4-g32-asym": ("llama", qw.write_gptq, {"group": 32, "sym": False}),
    "gptq-int4-g64-act-order": ("qwen2", qw.write_gptq, {"group": 64, "desc_act": True}),
    "gptq-int8-g128-asym-act-order": ("llama", qw.write_gptq, {"bits": 8, "sym": False, "desc_act": True}),
    "gptq-int4-channel-v2": ("llama", qw.write_gptq, {"group": -1, "sym": False, "checkpoint_format": "gptq_v2"}),
    "awq-int4-g128": ("llama", qw.write_awq, {}),
    "awq-int4-g64": ("qwen2", qw.write_awq, {"group": 64}),
    "ct-w4a16-g128": ("llama", qw.write_compressed_tensors, {}),
    "ct-w4a16-g32-asym-actorder": ("llama", qw.write_compressed_tensors, {"group": 32, "sym": False,
                                                                         "actorder": True}),
    "ct-w8a16-channel": ("llama", qw.write_compressed_tensors, {"scheme": "w8a16", "group": 0}),
    "ct-w8a8-dynamic": ("llama", qw.write_compressed_tensors, {"scheme": "w8a8"}),
    "ct-w8a8-static": ("qwen2", qw.write_compressed_tensors, {"scheme": "w8a8", "activations": "static"}),
    "ascend-w8a8": ("qwen2", qw.write_ascend, {}),
    "ascend-w8a8-dynamic": ("llama", qw.write_ascend, {"kind": "W8A8_DYNAMIC"}),
}
LINEARS = [f"model.layers.{i}.{m}" for i in range(2) for m in qw.LINEARS]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("published_quant")
    for arch in ("llama", "qwen2"):
        model = make_hf_model(root / arch, arch=arch, **SHAPE)
        with torch.no_grad():  # Qwen2's q/k/v biases start at zero: make them count
            for name, p in model.named_parameters():
                p.normal_(0, 0.5) if name.endswith(".bias") else None
        model.save_pretrained(str(root / arch))
    return root


@pytest.fixture(scope="module")
def written(sources):
    cache = {}

    def get(name):
        if name not in cache:
            arch, writer, options = CASES[name]
            cache[name] = writer(sources / arch, sources / name, **options)
        return cache[name]
    return get


# ----------------------------------------------------------------------------- the formats' definitions


def _bits_at(words: torch.Tensor, index: torch.Tensor, bits: int) -> torch.Tensor:
    """Value ``index`` (its position inside its word) of int32 ``words``, as an unsigned integer."""
    return (words.to(torch.int64) & 0xFFFFFFFF) >> (bits * index) & ((1 << bits) - 1)


def reference_weight(t: dict, hf: dict, module: str, desc=None) -> tuple:
    """(W [N, K] float64, bias or None) of ``module`` from the file's tensors, as each format defines them."""
    qc = hf.get("quantization_config") or {}
    method = "ascend" if desc is not None else qc["quant_method"]
    get = lambda name: t.get(f"{module}.{name}")  # noqa: E731
    if method in ("gptq", "awq"):
        qweight, scales, qzeros = get("qweight"), get("scales").double(), get("qzeros")
        kg, n = scales.shape
        bits = qc["bits"]
        per = 32 // bits
        if method == "gptq":
            k = qweight.shape[0] * per
            kk, nn_ = torch.meshgrid(torch.arange(k), torch.arange(n), indexing="ij")
            q = _bits_at(qweight[kk // per, nn_], kk % per, bits)  # [K, N]
            g = get("g_idx").long()[kk]  # each input's group
            z = _bits_at(qzeros[g, nn_ // per], nn_ % per, bits)
            z = z + (1 if qc.get("checkpoint_format", "gptq") == "gptq" else 0)
        else:
            k = qweight.shape[0]
            kk, nn_ = torch.meshgrid(torch.arange(k), torch.arange(n), indexing="ij")
            position = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])[nn_ % 8]  # AWQ_REVERSE_ORDER
            q = _bits_at(qweight[kk, nn_ // 8], position, 4)
            g = kk // (k // kg)
            z = _bits_at(qzeros[g, nn_ // 8], position, 4)
        return (scales[g, nn_] * (q - z)).t(), get("bias")
    if method == "compressed-tensors":
        group = qc["config_groups"]["group_0"]
        bits = group["weights"]["num_bits"]
        scale = get("weight_scale").double()
        if get("weight_packed") is not None:
            n, k = (int(x) for x in get("weight_shape"))
            per = 32 // bits
            nn_, kk = torch.meshgrid(torch.arange(n), torch.arange(k), indexing="ij")
            q = _bits_at(get("weight_packed")[nn_, kk // per], kk % per, bits) - (1 << (bits - 1))  # signed
            g_idx = get("weight_g_idx")
            g = (kk // (k // scale.shape[1])) if g_idx is None else g_idx.long()[kk]
            zp = get("weight_zero_point")
            z = 0 if zp is None else _bits_at(zp[nn_ // per, g], nn_ % per, bits) - (1 << (bits - 1))
            return scale[nn_, g] * (q - z), get("bias")
        return scale * get("weight").double(), get("bias")
    kind = desc[f"{module}.weight"]
    w = get("weight_scale").double() * get("weight").double()
    if kind != "W8A8":
        return w, get("bias")
    deq = get("deq_scale").double()
    bias = deq * (get("quant_bias").double() + get("input_offset").double() * get("weight").double().sum(1))
    return w, bias


def _file(path):
    tensors = load_file(str(path / "model.safetensors"))
    hf = json.loads((path / "config.json").read_text())
    desc = path / "quant_model_description.json"
    return tensors, hf, json.loads(desc.read_text()) if desc.exists() else None


def _linear(params, module):
    node = params
    for part in module.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


@pytest.mark.parametrize("name", list(CASES))
def test_every_quantized_linear_dequantizes_as_its_format_defines(written, name):
    """(a) Bit for bit where the format is symmetric; with zero points, W = s q - o with the offset o = s z
    rounded to fp16 as every scale is (within 2^-11 of s z)."""
    path = written(name)
    tensors, hf, desc = _file(path)
    model = load_model(path)
    assert model.quantization is not None and model.quantization.method == name.split("-")[0].replace(
        "ct", "compressed-tensors")
    assert "weight" in model.params["lm_head"]  # lm_head stays float, as published files keep it
    for module in LINEARS:
        p = _linear(model.params, module)
        want, bias = reference_weight(tensors, hf, module, desc)
        got = formats.dequantize(p, torch.float64)
        tol = 0.0
        if p["format"].asym:
            tol = (p["offsets"].double().abs().max() * 2 ** -11).item()
        assert (got - want).abs().max().item() <= tol, module
        f = p["format"]  # act-order over one group is no order at all
        assert ("perm" in p) == ("act" in name and f.group < f.in_features), module
        if bias is not None and bool(bias.ne(0).any()):
            torch.testing.assert_close(p["bias"].double(), bias.double().to(torch.float32).double(), rtol=0,
                                       atol=0)


def _hf_logits(path, tokens):
    """HF transformers' logits of the float model made of the format's dequantized weights (reference_weight)."""
    import transformers

    tensors, hf, desc = _file(path)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items()
                                                  if k not in ("quantization_config", "torch_dtype")})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    keys = model.state_dict().keys()
    state = {k: v.float() for k, v in tensors.items() if k in keys and k.rsplit(".", 1)[0] not in LINEARS}
    for module in LINEARS:
        w, b = reference_weight(tensors, hf, module, desc)
        state[module + ".weight"] = w.float()
        if module + ".bias" in keys:
            state[module + ".bias"] = b.float()
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_hf_on_the_dequantized_weights_and_speculation_equals_ar(written, name):
    """(b) funcspec's quantized product (int8 activations per 32 k) against HF's float product of the same
    weights: within 3% of the logits' range; (c) ngram speculation equals greedy AR on the quantized weights."""
    path = written(name)
    tokens = [1, 5, 9, 13, 2, 7, 11, 3]
    model = load_model(path)
    z = torch.zeros(1, dtype=torch.int64)
    ours = forward(model.cfg, model.params, init_kv_cache(model.cfg, 1, len(tokens)), torch.tensor([tokens]), z, z)[0]
    theirs = _hf_logits(path, tokens)
    assert (ours - theirs).abs().max().item() < 0.03 * theirs.abs().max().item()
    ar = [o.outputs[0].token_ids for o in Engine(str(path), max_num_seqs=2,
                                                 enforce_eager=True).generate(PROMPTS, GREEDY)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    assert [o.outputs[0].token_ids for o in Engine(str(path), spec, max_num_seqs=2,
                                                   enforce_eager=True).generate(PROMPTS, GREEDY)] == ar


@pytest.mark.parametrize("name", ["gptq-int4-g64-act-order", "awq-int4-g128", "ascend-w8a8"])
def test_a_quantized_draft_model_on_inductor_compiles_once_and_equals_ar(written, name, request):
    """A published quantized checkpoint as both target and draft model, on inductor (act-order's gather
    inside the graph): greedy equals eager AR and nothing recompiles after warm-up. NOTE: one batch bucket (2),
    so that a row left alone runs padded in the one graph, compiled once. AWQ's 4-bit product is the custom op
    GPTQ's is, so its step runs Dynamo's graph in place of inductor's codegen (``traced_codegen``); GPTQ
    (act-order's gather) and W8A8 (activations quantized in the graph) compile by real inductor."""
    if name == "awq-int4-g128":
        request.getfixturevalue("traced_codegen")
    path = str(written(name))
    ar = [o.outputs[0].token_ids for o in Engine(path, max_num_seqs=2, enforce_eager=True).generate(PROMPTS, GREEDY)]
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    eng = Engine(path, spec, max_num_seqs=2, backend="inductor",
                 compilation_config={"batch_sizes": [2], "capture": "lazy"})
    assert [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)] == ar
    with torch.compiler.set_stance("fail_on_recompile"):
        assert [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)] == ar
    assert all(g.stats.compiles + g.stats.loaded == 1 and g.stats.graph_breaks == 0 for g in eng.graphs.values())
    assert len(eng.runner.compiled) == 1


def test_llm_reads_the_format_and_checks_a_named_one(written):
    """``LLM(model)`` detects the format; naming it (vLLM's name, or its marlin kernel's) is accepted, naming
    another is the error vLLM gives."""
    path = str(written("gptq-int4-g128"))
    want = [o.outputs[0].token_ids for o in LLM(path, enforce_eager=True).generate(PROMPTS, GREEDY)]
    for name in ("gptq", "gptq_marlin"):  # the name check, not capture (test_runtime.py covers capture)
        llm = LLM(path, quantization=name, enforce_eager=True)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    with pytest.raises(ValueError, match=r"quantization='awq', but .* is stored as 'gptq'"):
        LLM(path, quantization="awq")


def test_inspect_reports_the_format_and_which_layers_are_quantized(written):
    report = inspect(written("ct-w4a16-g32-asym-actorder"))
    text = str(report)
    assert report.fits and report.layout is None
    assert "compressed-tensors pack-quantized W4A16, group 32, asymmetric" in text
    assert "ct-w4a16-g32 (4-bit, group 32, zero points, act-order): " in text
    assert "model.layers.*.self_attn.q_proj (x 2)" in text and "float: lm_head" in text


# ----------------------------------------------------------------------------- bad files


def _edit(src, dst, config=None, drop=(), tensors=None, description=None):
    """A copy of checkpoint ``src`` with its quantization_config updated, keys dropped or replaced."""
    import shutil

    shutil.copytree(src, dst)
    if config is not None:
        hf = json.loads((dst / "config.json").read_text())
        hf["quantization_config"].update(config)
        (dst / "config.json").write_text(json.dumps(hf))
    if drop or tensors:
        t = load_file(str(dst / "model.safetensors"))
        t = {k: v for k, v in t.items() if k not in drop}
        t.update(tensors or {})
        save_file(t, str(dst / "model.safetensors"))
    if description is not None:
        d = json.loads((dst / "quant_model_description.json").read_text())
        d.update(description)
        (dst / "quant_model_description.json").write_text(json.dumps(d))
    return dst


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("case, edit, message", [
    ("gptq-int4-g128", {"config": {"quant_method": "fp8"}},
     r"quantization_config.quant_method 'fp8' is not a format funcspec reads"),
    ("gptq-int4-g128", {"config": {"bits": 3}}, r"quantization_config.bits: 3-bit weights are not run by funcspec"),
    ("gptq-int4-g128", {"config": {"group_size": 16}},
     rf"{Q}.scales: expected \[8, 128\], got \[1, 128\]"),
    ("gptq-int4-g128", {"drop": (f"{Q}.scales",)}, rf"missing {Q}.scales \(a quantized linear's scales\)"),
    ("gptq-int4-g128", {"config": {"checkpoint_format": "marlin"}}, r"checkpoint_format 'marlin' is not read"),
    ("awq-int4-g128", {"config": {"version": "gemv"}}, r"version 'gemv' is not read \(funcspec reads AWQ's GEMM"),
    ("ct-w4a16-g32-asym-actorder", {"drop": (f"{Q}.weight_zero_point",)}, rf"missing {Q}.weight_zero_point"),
    ("ct-w4a16-g128", {"config": {"format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}},
     r"format 'float-quantized' is not read"),
    ("ct-w8a8-static", {"drop": (f"{Q}.input_scale",)}, rf"missing {Q}.input_scale"),
    ("gptq-int4-g64-act-order", {"tensors": {f"{Q}.g_idx": torch.zeros(128, dtype=torch.int32)}},
     r"g_idx does not hold 64 inputs in each of its 2 groups"),
    ("ascend-w8a8", {"description": {"model.layers.0.mlp.up_proj.smooth_factor": "W8A8"}},
     r"quant_model_description.json: names tensors the weight files do not hold: "
     r"\['model.layers.0.mlp.up_proj.smooth_factor'\]"),
    ("ascend-w8a8", {"description": {f"{Q}.weight": "W4A8_DYNAMIC"}}, r"quant types \['W4A8_DYNAMIC'\] are not read"),
    ("ascend-w8a8-dynamic", {"tensors": {f"{Q}.weight_offset": torch.ones(128, 1, dtype=torch.bfloat16)}},
     r"weight_offset is not zero"),
])
def test_bad_files_name_what_is_wrong(written, tmp_path, case, edit, message):
    path = _edit(written(case), tmp_path / "bad", **edit)
    with pytest.raises(ValueError, match=message):
        load_model(path)


def test_msmodelslim_file_names_are_found(written, tmp_path):
    """msmodelslim's older output names its files ``quant_model_weight_w8a8.safetensors`` and
    ``quant_model_description_w8a8.json``: read as the same model as under funcspec's names; two descriptions are
    refused, naming both."""
    import shutil

    src, dst = written("ascend-w8a8"), tmp_path / "modelslim"
    dst.mkdir()
    for f in src.iterdir():
        renamed = {"model.safetensors": "quant_model_weight_w8a8.safetensors",
                   "quant_model_description.json": "quant_model_description_w8a8.json"}.get(f.name, f.name)
        shutil.copy(f, dst / renamed)
    want, got = load_model(src), load_model(dst)
    assert got.quantization.where.endswith("quant_model_description_w8a8.json")
    for module in LINEARS:
        a, b = _linear(want.params, module), _linear(got.params, module)
        assert torch.equal(formats.dequantize(a, torch.float64), formats.dequantize(b, torch.float64)), module
    shutil.copy(dst / "quant_model_description_w8a8.json", dst / "quant_model_description.json")
    with pytest.raises(ValueError, match=r"modelslim: several vLLM-Ascend descriptions \(\['quant_model_description"
                                         r"\.json', 'quant_model_description_w8a8\.json'\]\)"):
        load_model(dst)


def test_a_group_size_the_kernel_does_not_run_is_named(sources, tmp_path):
    path = qw.write_gptq(sources / "llama", tmp_path / "g16", group=16)
    with pytest.raises(ValueError, match=rf"{Q}: quantized weight \[128, 128\]: .*group size a multiple of 32 "
                                         r"dividing it \(or 16 at 8 and 6 bits\); got group 16"):
        load_model(path)
