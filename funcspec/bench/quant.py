"""Quantized weights at real size: each format's decode against llama.cpp on the same file, speculation on top,
batch, and quality (``funcspec bench scale --phases quant`` and ``funcspec bench quality``).

Formats (:data:`FORMATS`): the checkpoint's own dtype, funcspec's quantize-on-load ``int8`` / ``int4`` /
``int4-g128``, and GGUF files made from the same weights, ``q8_0``, ``q4_0`` and ``q4_k_m``, by llama.cpp's own
quantizer (``llama_model_quantize``, from the bf16 GGUF) and loaded by both funcspec and llama.cpp, and
checkpoints written in published layouts (``gptq-int4``, ``gptq-int8``, ``awq-int4``, ``ct-w4a16``, ``ct-w8a8``,
``ascend-w8a8``: :data:`PUBLISHED`, group 128 where grouped). Per format:

- funcspec AR (inductor, batch 1) ms/token, the bytes a step streams and the bound they set at the copy
  bandwidth (the ``bandwidth`` phase's), and llama.cpp paired in alternating runs (the median of the pair
  ratios): on a GGUF format the same file, on a published format llama.cpp's file of its bits (Q4_0, Q8_0);
- speculation with synthetic acceptance alpha^(i+1) at K: the free ``echo`` drafter, and random EAGLE-3 and
  DFlash heads of the target's own shape (bf16, and the EAGLE-3 head quantized like the target:
  :func:`head_scheme`), so the drafter's cost is real; each against funcspec AR, and against llama.cpp's AR
  paired as funcspec AR is;
- batch ``B`` over batch 1 tokens/s, paired.

Quality (:func:`quality`): held-out cross-entropy (nats/token, teacher-forced) and greedy agreement with the
unquantized model, per format.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path
from typing import Any

import torch

FORMATS = {"int8": ("load", "int8"), "int4": ("load", "int4"), "int4-g128": ("load", "int4-g128"),
           "q8_0": ("gguf", "Q8_0"), "q4_0": ("gguf", "Q4_0"), "q4_k_m": ("gguf", "Q4_K_M"),
           "gptq-int4": ("published", "gptq"), "gptq-int8": ("published", "gptq"), "awq-int4": ("published", "awq"),
           "ct-w4a16": ("published", "compressed-tensors"), "ct-w8a8": ("published", "compressed-tensors"),
           "ascend-w8a8": ("published", "ascend")}
"""Format name -> (where it comes from, its quantization: funcspec's scheme, llama.cpp's file type, or the
published format a checkpoint is written in)."""

PUBLISHED: dict[str, tuple[str, dict[str, Any]]] = {
    "gptq-int4": ("write_gptq", {}), "gptq-int8": ("write_gptq", {"bits": 8}), "awq-int4": ("write_awq", {}),
    "ct-w4a16": ("write_compressed_tensors", {}), "ct-w8a8": ("write_compressed_tensors", {"scheme": "w8a8"}),
    "ascend-w8a8": ("write_ascend", {})}
"""Published formats: the writer (:mod:`funcspec.checkpoints.quantized_write`) and its options (group 128)."""


def llamacpp_ftype(kind: str) -> int:
    """llama.cpp's ``LLAMA_FTYPE_MOSTLY_*`` of a file type name."""
    import llama_cpp

    return getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")


def quantized_gguf(ckpt: Path, kind: str, threads: int, where: Path) -> Path:
    """``ckpt`` as a GGUF of llama.cpp file type ``kind`` (Q8_0, Q4_0, Q4_K_M), quantized by llama.cpp itself from
    the bf16 GGUF (:func:`funcspec.checkpoints.gguf_write.write`), built once in directory ``where``."""
    import llama_cpp

    from funcspec.checkpoints import gguf_write

    out = where / f"model-{kind.lower()}.gguf"
    if out.exists():
        return out
    src = gguf_write.write(ckpt, where / "model-bfloat16.gguf", "bfloat16")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llamacpp_ftype(kind)
    params.nthread = threads
    tmp = out.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {kind}")
    tmp.replace(out)
    return out


def streamed_bytes(params, top_k: int = 0) -> int:
    """Bytes a decode step of one token reads from ``params``: every linear once (quantized: values, scales,
    offsets; float: its packed copy, or its weight), the norms, and of a MoE layer's stacked experts the ``top_k``
    a token is routed to; not the embeddings, read by row."""
    if isinstance(params, (list, tuple)):
        return sum(streamed_bytes(p, top_k) for p in params)
    if not isinstance(params, dict):
        return 0
    if _stacked_experts(params):
        from funcspec.kernels.moe import expert_bytes

        return top_k * expert_bytes(params)
    if "qweight" in params:
        return params["format"].bytes
    if "packed" in params and isinstance(params.get("weight"), torch.Tensor):
        return params["weight"].numel() * params["weight"].element_size()
    fused = {m for group in ("qkv_proj", "gate_up_proj") if group in params
             for m in {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}[group]}
    return sum(streamed_bytes(v, top_k) if isinstance(v, (dict, list)) else v.numel() * v.element_size()
               for k, v in params.items() if k not in fused and k != "embed_tokens")


def _stacked_experts(params: dict) -> bool:
    """A MoE layer's routed experts: ``gate_up_proj`` and ``down_proj`` stacked over experts, float or quantized."""
    parts = [params.get(m) for m in ("gate_up_proj", "down_proj")]
    return all(isinstance(p, dict) and (p.get("weight") is not None and p["weight"].dim() == 3
                                        or p.get("qweight") is not None and p["qweight"].dim() == 5) for p in parts)


def gguf_file(model_dir, fmt: str, threads: int, where=None) -> Path:
    """The GGUF file of GGUF format ``fmt`` made from ``model_dir`` into directory ``where`` (default: beside it):
    llama.cpp's quantizer (:func:`quantized_gguf`) where llama-cpp-python is installed, else gguf's own Q8_0 / Q4_0
    (:func:`funcspec.checkpoints.gguf_write.write`; Q4_K_M needs llama.cpp)."""
    from funcspec.checkpoints import gguf_write

    where = Path(where or model_dir)
    where.mkdir(parents=True, exist_ok=True)
    if _has_llamacpp():
        return quantized_gguf(Path(model_dir), FORMATS[fmt][1], threads, where)
    if fmt not in gguf_write.WRITE_KINDS:
        raise ValueError(f"format {fmt!r} is made by llama.cpp's quantizer: pip install 'funcspec[llamacpp]'")
    return gguf_write.write(Path(model_dir), where / f"model-{fmt}.gguf", fmt)


def published_checkpoint(model_dir, fmt: str, where: Path) -> Path:
    """``model_dir`` written in published format ``fmt`` (:data:`PUBLISHED`; round-to-nearest values, not
    GPTQ's or AWQ's calibration) into ``where/published-<fmt>``, once."""
    from funcspec.checkpoints import quantized_write

    path = Path(where) / f"published-{fmt}"
    if not (path / "config.json").exists():
        writer, options = PUBLISHED[fmt]
        getattr(quantized_write, writer)(model_dir, path, **options)
    return path


def target_of(ctx: dict, fmt: str):
    """(what the engine loads, its ``quantization``, the GGUF file llama.cpp loads or ``None``) for ``fmt``; a
    published format pairs with llama.cpp's file of its bits (Q4_0 or Q8_0), made from the same weights."""
    where, q = FORMATS[fmt]
    if where == "load":
        return ctx["model"], q, None
    if where == "published":
        same_bits = "q4_0" if "4" in fmt.split("-")[1] else "q8_0"
        return (str(published_checkpoint(ctx["path"], fmt, Path(ctx["path"]))), q,
                gguf_file(ctx["path"], same_bits, torch.get_num_threads()))
    path = gguf_file(ctx["path"], fmt, torch.get_num_threads())
    return str(path), None, path


def head_scheme(fmt: str) -> str:
    """The on-load scheme a draft head takes beside a target of format ``fmt``: the target's own where it is
    quantized on load, else funcspec's of the same bits (8: ``int8``; 4: ``int4-g128``, grouped as the 4-bit
    files are)."""
    where, q = FORMATS[fmt]
    if where == "load":
        return q
    return "int8" if "8" in fmt else "int4-g128"


def _engine(model, quantization, backend: str, batch: int, max_len: int, spec=None):
    from funcspec import Engine

    return Engine(model, speculative_config=spec, backend=backend, max_num_seqs=batch, max_model_len=max_len,
                  dtype=torch.bfloat16, quantization=quantization,
                  compilation_config={"capture": "lazy"})  # greedy only


def _rates(alpha: float, k: int) -> list[float]:
    return [alpha ** (i + 1) for i in range(k)]


def format_row(ctx: dict, fmt: str, o: dict, bound_gbps) -> dict:
    """One format's AR, llama.cpp pairing, speculation and batch rows (see the module docstring)."""
    from funcspec.bench import timing

    model, q, gguf_path = target_of(ctx, fmt)
    backend, n, reps, k, alpha = o["sweep_backend"], ctx["n"], ctx["reps"], o["quant_k"], o["quant_alpha"]
    ar_eng = _engine(model, q, backend, 1, ctx["max_len"])
    ar = timing.timed_generate(ar_eng, [ctx["prompt"]], n, reps)
    nbytes = streamed_bytes(ar_eng.params["target"], ar_eng.model.cfg.moe.top_k)
    row: dict[str, Any] = {
        "format": fmt, "source": FORMATS[fmt][0], "quantization": FORMATS[fmt][1], "streamed_bytes": nbytes,
        "llamacpp_file": None if gguf_path is None else gguf_path.name,
        "ms_per_token": ar["ms_per_token"], "step_ms": timing.step_ms(ar, 1, 0), "recompiles": ar["recompiles"],
        "bound_ms": nbytes / (bound_gbps * 1e9) * 1e3 if bound_gbps else None}
    row["pct_of_bound"] = 100 * row["bound_ms"] / row["ms_per_token"] if row["bound_ms"] else None
    lc = _llamacpp(gguf_path, ctx)
    if lc is not None:
        theirs = timing.llamacpp_greedy(lc, reps)
        row["llamacpp_ms_per_token"], row["llamacpp_repacked"] = theirs["ms_per_token"], lc.repacked
        row["paired"] = timing.paired_ratios(timing.decode_ms(ar_eng, [ctx["prompt"]], n), lambda: lc()[2],
                                            max(reps, 3))
    heads: dict[str, dict[str, Any]] = {"echo": {"method": "echo"}}
    if "heads" in o["quant_parts"]:
        from funcspec.checkpoints import init_draft_head

        for method in ("eagle3", "dflash"):
            path = Path(ctx["path"]) / f"random-{method}"
            if not (path / "config.json").exists():
                init_draft_head(method, ctx["model"], path, **({"num_layers": 1} if method == "dflash" else {}))
            heads[method] = {"method": method, "model": str(path)}
            if method == "eagle3":  # the head quantized like the target: its scheme, or one of its bits
                heads["eagle3-quantized"] = {**heads[method], "quantization": head_scheme(fmt)}
    row["speculation"] = {}
    for name, spec in heads.items():
        spec = {**spec, "num_speculative_tokens": k, "rejection_sample_method": "synthetic",
                "synthetic_acceptance_rates": _rates(alpha, k)}
        eng = _engine(model, q, backend, 1, ctx["max_len"], spec)
        r = timing.timed_generate(eng, [ctx["prompt"]], n, reps)
        step = timing.step_ms(r, 1, k)
        # NOTE: llama.cpp's AR time drifts from run to run on a shared VM: a figure taken minutes apart is no ratio
        vs_lc = timing.paired_ratios(timing.decode_ms(eng, [ctx["prompt"]], n), lambda: lc()[2],
                                     max(reps, 3)) if lc else None
        row["speculation"][name] = {
            "alpha": alpha, "k": k, "head_quantization": spec.get("quantization"), "tau": r["tau"],
            "ms_per_token": r["ms_per_token_pooled"],
            "speedup_vs_ar": ar["ms_per_token"] / r["ms_per_token_pooled"], "step_ms": step,
            "step_cost_vs_ar": step / row["step_ms"] if step and row["step_ms"] else None,
            "vs_llamacpp_ar": 1 / vs_lc["ratio"] if vs_lc else None, "llamacpp_paired": vs_lc,
            "recompiles": r["recompiles"]}
        del eng
    if "batch" in o["quant_parts"]:
        top = max(o["batches"])
        eng = _engine(model, q, backend, top, ctx["max_len"])
        prompts = {b: timing.random_prompts(ctx["prompt_ids"], b, ctx["p"], ctx["seed"] + 1000 + b) for b in (1, top)}
        for b in (1, top):
            timing.timed_generate(eng, prompts[b], n, 1)  # warm-up captures
        p = timing.paired_ratios(timing.decode_ms(eng, prompts[1], n), timing.decode_ms(eng, prompts[top], n),
                                max(reps, 3))
        row["batch"] = {"batch": top, "tokens_per_s_ratio": top * p["ratio"], **p}
    return row


def _llamacpp(gguf_path: Path | None, ctx: dict):
    """llama.cpp's greedy session (``timing.llamacpp_session``) on a format's file, or ``None`` where the format
    has none or llama.cpp is not installed."""
    from funcspec.bench import timing

    if gguf_path is None or not _has_llamacpp():
        return None
    return timing.llamacpp_session(gguf_path, ctx["prompt"], ctx["n"], torch.get_num_threads(), f32_kv=False)


def _has_llamacpp() -> bool:
    try:
        import llama_cpp  # noqa: F401 (imported only to see it is installed)
    except ImportError:
        return False
    return True


def phase(ctx: dict, o: dict, result: dict) -> None:
    """``bench scale``'s ``quant`` phase: :func:`format_row` per format of ``--quantization``."""
    from tqdm import tqdm

    bw = result.get("bandwidth", {}).get("gb_per_s")
    rows = [format_row(ctx, fmt, o, bw) for fmt in tqdm(o["quantization"], desc="quant", leave=False)]
    base = result.get("ar") or []
    result["quant"] = {"backend": o["sweep_backend"], "k": o["quant_k"], "alpha": o["quant_alpha"], "rows": rows,
                       "unquantized_ms_per_token": min((a["ms_per_token"] for a in base), default=None)}


def markdown(r: dict) -> list[str]:
    """The ``quant`` phase's tables."""
    q = r.get("quant")
    if not q:
        return []
    lines = [f"## Quantized formats ({q['backend']}, batch 1)\n",
             "| format | MiB streamed | ms/token | % of bound | llama.cpp ms/token (its file) | funcspec / llama.cpp "
             "(paired) | echo K={k} | EAGLE-3 K={k} | EAGLE-3 (quantized) K={k} | DFlash K={k} | K={k} step / AR step "
             "| batch {b} / 1 |".format(k=q["k"], b=next((x["batch"]["batch"] for x in q["rows"] if "batch" in x),
                                                          "-")),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def spec(row, name):
        s = row["speculation"].get(name)
        if not s:
            return "-"
        vs = f", {s['vs_llamacpp_ar']:.2f}x llama.cpp AR" if s.get("vs_llamacpp_ar") else ""
        return f"{s['ms_per_token']:.2f} ms ({s['speedup_vs_ar']:.2f}x AR{vs})"

    for row in q["rows"]:
        paired = row.get("paired")
        lines.append(
            f"| {row['format']} | {row['streamed_bytes'] / 2**20:.0f} | {row['ms_per_token']:.2f} | "
            f"{_f(row['pct_of_bound'], '.0f')}% | {_llamacpp_cell(row)} | "
            f"{_f(paired['ratio']) + 'x' if paired else '-'} | {spec(row, 'echo')} | {spec(row, 'eagle3')} | "
            f"{spec(row, 'eagle3-quantized')} | {spec(row, 'dflash')} | "
            f"{_f(row['speculation']['echo'].get('step_cost_vs_ar'))} | "
            f"{_f(row['batch']['tokens_per_s_ratio']) + 'x' if 'batch' in row else '-'} |")
    plain = [row["format"] for row in q["rows"] if row.get("llamacpp_repacked") is False]
    if plain:
        lines.append(f"\nllama.cpp ran {', '.join(plain)} on its plain weight buffers: its repacked ones crashed "
                     "the process on this machine (timing.llamacpp_repacks).")
    lines.append(f"\nSpeculation: synthetic acceptance alpha^(i+1), alpha = {q['alpha']}; heads of the target's "
                 "shape with random weights (their cost is real, their acceptance synthetic). funcspec / llama.cpp "
                 "< 1: funcspec faster.\n")
    return lines


def _llamacpp_cell(row: dict) -> str:
    """llama.cpp's ms/token, naming its file where it is not the format's own (a published format's row)."""
    ms = _f(row.get("llamacpp_ms_per_token"))
    return f"{ms} ({row['llamacpp_file']})" if row.get("source") == "published" and ms != "-" else ms


def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


# ----------------------------------------------------------------------------- quality


def quality(model_dir, sequences: list[list[int]], formats: list[str], threads: int = 2,
            cache_dir=None) -> list[dict]:
    """Held-out cross-entropy (nats/token, teacher-forced) and greedy agreement (the argmax at each position
    equals the unquantized model's) of each format, on ``sequences``; the unquantized row first. Each format also
    gives ``cross_entropy_weights_only``: its weights dequantized, activations left as they are (the kernel
    quantizes activations to int8 per 32 k: W8A8 / W4A8; this is W8A16 / W4A16 on the same weights).

    GGUF formats are made from the checkpoint by :func:`gguf_file`, published ones by
    :func:`published_checkpoint`, into ``cache_dir`` (default
    ``~/.cache/funcspec/quality/<checkpoint name>``: never into the checkpoint itself).
    """
    from funcspec import Engine
    from funcspec.nn.llama import forward, init_kv_cache

    def logits_of(eng, dequantize: bool = False):
        cfg, params = eng.model.cfg, eng.params["target"]
        params = dequantized(params) if dequantize else params
        out = []
        for seq in sequences:
            z = torch.zeros(1, dtype=torch.int64)
            with torch.no_grad():
                out.append(forward(cfg, params, init_kv_cache(cfg, 1, len(seq)), torch.tensor([seq]), z, z)[0][0])
        return out  # [T, V] each

    base = logits_of(Engine(str(model_dir), max_num_seqs=1, enforce_eager=True))
    rows = [_quality_row("unquantized", base, base, sequences)]
    for fmt in formats:
        where, q = FORMATS[fmt]
        cache = cache_dir or Path.home() / ".cache" / "funcspec" / "quality" / Path(model_dir).resolve().name
        if where == "load":
            eng = Engine(str(model_dir), max_num_seqs=1, quantization=q, enforce_eager=True)
        elif where == "published":
            eng = Engine(str(published_checkpoint(model_dir, fmt, cache)), max_num_seqs=1, enforce_eager=True)
        else:
            eng = Engine(str(gguf_file(model_dir, fmt, threads, cache)), max_num_seqs=1, enforce_eager=True)
        row = _quality_row(fmt, logits_of(eng), base, sequences)
        row["cross_entropy_weights_only"] = _quality_row(fmt, logits_of(eng, True), base, sequences)["cross_entropy"]
        rows.append(row)
    return rows


def dequantized(params):
    """``params`` with every quantized linear as its float weight (the fused groups dropped: their members are
    there): the same weights with unquantized activations, i.e. W8A16 / W4A16 arithmetic."""
    from funcspec.quant.formats import dequantize

    if isinstance(params, list):
        return [dequantized(p) for p in params]
    if not isinstance(params, dict):
        return params
    if "qweight" in params:
        w = dequantize(params)
        return {"weight": w, **({"bias": params["bias"]} if params.get("bias") is not None else {})}
    return {k: dequantized(v) for k, v in params.items() if k not in ("qkv_proj", "gate_up_proj")}


def _quality_row(fmt: str, logits, base, sequences) -> dict:
    nll, agree, n = 0.0, 0, 0
    for lg, bl, seq in zip(logits, base, sequences):
        target = torch.tensor(seq[1:])
        nll += torch.nn.functional.cross_entropy(lg[:-1].float(), target, reduction="sum").item()
        agree += (lg[:-1].argmax(-1) == bl[:-1].argmax(-1)).sum().item()
        n += len(seq) - 1
    return {"format": fmt, "cross_entropy": nll / n, "greedy_agreement": agree / n, "tokens": n,
            "perplexity": math.exp(nll / n)}


def quality_markdown(rows: list[dict], title: str) -> list[str]:
    base = rows[0]["cross_entropy"]
    lines = [f"## Quality: {title}\n", "| format | cross-entropy (nats/token) | vs unquantized | greedy agreement "
             "| weights only (A16): vs unquantized |", "|---|---|---|---|---|"]
    for r in rows:
        a16 = r.get("cross_entropy_weights_only")
        lines.append(f"| {r['format']} | {r['cross_entropy']:.4f} | {r['cross_entropy'] - base:+.4f} | "
                     f"{100 * r['greedy_agreement']:.1f}% | {'-' if a16 is None else format(a16 - base, '+.4f')} |")
    return lines + [f"\n{rows[0]['tokens']} held-out tokens.\n"]


def run_quality(args) -> dict:
    """``funcspec bench quality``: :func:`quality` of each format on each prompt source; writes JSON and markdown."""
    import json
    import time

    from funcspec import zoo
    from funcspec.bench.capture import RESULTS, device_name
    from funcspec.bench.spec import load_prompts
    from funcspec.checkpoints import load_model

    model = args.model or str(zoo.model_path("target"))
    formats = [f for f in args.formats.split(",") if f]
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise SystemExit(f"funcspec bench quality: formats {bad} unknown; choose from {list(FORMATS)}")
    tok = load_model(model).tokenizer
    result: dict[str, Any] = {"model": model, "formats": formats, "sources": {}}
    lines = [f"# funcspec bench quality: `{model}`\n"]
    for source in args.prompts.split(","):
        seqs = load_prompts(source, tok, args.num, args.tokens)
        rows = quality(model, seqs, formats, args.threads or torch.get_num_threads(), args.cache_dir)
        result["sources"][source] = rows
        lines += quality_markdown(rows, f"{source} ({len(seqs)} sequences of {args.tokens} tokens)")
    out = Path(args.out) if args.out else RESULTS / device_name("cpu")
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"quality-{time.strftime('%Y%m%d-%H%M%S')}"
    Path(f"{stem}.json").write_text(json.dumps(result, indent=2))
    Path(f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {stem}.json and .md")
    return result


def add_parser(kinds) -> None:
    """Register ``funcspec bench quality``."""
    p = kinds.add_parser("quality", help="held-out cross-entropy and greedy agreement of each quantized format")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the zoo target)")
    p.add_argument("--formats", default="int8,int4,int4-g128,q8_0,q4_0,q4_k_m", help="formats (default %(default)s)")
    p.add_argument("--prompts", default="heldout,package:numpy", help="prompt sources, comma list (bench spec's)")
    p.add_argument("--num", type=int, default=32, help="sequences per source")
    p.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    p.add_argument("--out", default=None, help="results directory (default graphs/results/<device>)")
    p.add_argument("--cache-dir", default=None,
                   help="where the GGUF files are made (default ~/.cache/funcspec/quality/<checkpoint name>)")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp quantizer threads (default: torch's)")
    p.set_defaults(func=run_quality)
