"""``funcspec bench spec``: tokens/s and acceptance of speculative decoding vs autoregressive vs HF.

One run measures, on the same checkpoint and prompts:

- funcspec autoregressive decoding (K = 0),
- funcspec with each speculative method,
- HF ``transformers`` ``generate``: plain greedy, ``prompt_lookup_num_tokens=K``
  and, given ``--draft``, ``assistant_model``.

HF runs one prompt at a time (its assisted generation is batch-1 only), and
plain greedy also in left-padded batches of ``--batch``; funcspec runs the
prompts through ``--batch`` slots. Results go to
``graphs/results/<device>/spec-<time>.json`` and ``.md``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from funcspec.bench.capture import RESULTS, device_name


def repetitive_prompts(n: int, tokenizer=None) -> list:
    """Code-editing-like prompts: a function, then the start of an edited copy of it."""
    body = ("def {f}(items):\n    total = 0\n    for item in items:\n        if item > {c}:\n"
            "            total += item * {c}\n    return total\n\n")
    out = []
    for i in range(n):
        text = body.format(f=f"score_{i}", c=i + 2) + body.format(f=f"score_{i}_v2", c=i + 3)[:40]
        out.append(text if tokenizer is not None else list(range(3, 40)))
    return out


def _funcspec_run(model, prompts, method, k, backend, batch, max_tokens, draft):
    from funcspec import Engine, SamplingParams

    spec = None
    if method != "ar":
        spec = {"method": method, "num_speculative_tokens": k}
        if method == "ngram":
            spec.update(prompt_lookup_min=1, prompt_lookup_max=4)
        if method == "draft_model":
            spec["model"] = draft
    eng = Engine(model, speculative_config=spec, backend=backend, max_batch_size=batch,
                 max_model_len=max(len(p) for p in prompts) + max_tokens + 8)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    eng.generate(prompts[:batch], sp)  # warm-up: captures every bucket this run uses
    t0 = time.perf_counter()
    outs = eng.generate(prompts, sp)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    st = eng.stats
    return {"engine": "funcspec", "method": method, "k": k if spec else 0, "backend": eng.backend,
            "tokens": n, "seconds": dt, "tokens_per_s": n / dt, "tau": st["mean_acceptance_length"],
            "per_position_acceptance": st["per_position_acceptance"],
            "step_ms_median": statistics.median(
                [m for g in eng.graphs.values() for m in g.stats.replay_ms]) if eng.graphs else None,
            "outputs": [o.outputs[0].token_ids for o in outs]}


def _hf_batched(model, prompts, batch, pad_id, kwargs):
    """HF greedy on left-padded batches of ``batch`` prompts; returns the new tokens per prompt."""
    outs = []
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        out = model.generate(ids, attention_mask=mask, pad_token_id=pad_id, **kwargs)
        outs.extend(out[:, width:].tolist())
    return outs


def _hf_run(model_path, prompts, max_tokens, mode, k, draft, batch=1):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    kwargs = {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "do_sample": False}
    if mode == "greedy_batched":
        pad = model.generation_config.pad_token_id or 0
        with torch.no_grad():
            _hf_batched(model, prompts[:batch], batch, pad, kwargs)  # warm-up
            t0 = time.perf_counter()
            outs = _hf_batched(model, prompts, batch, pad, kwargs)
            dt = time.perf_counter() - t0
        n = sum(len(o) for o in outs)
        return {"engine": "hf", "method": f"greedy, batch {batch}", "k": 0, "backend": "eager", "tokens": n,
                "seconds": dt, "tokens_per_s": n / dt, "outputs": outs}
    if mode == "prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = k
    if mode == "assistant":
        kwargs["assistant_model"] = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    outs, n = [], 0
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0]]), **kwargs)  # warm-up
        t0 = time.perf_counter()
        for p in prompts:
            ids = model.generate(torch.tensor([p]), **kwargs)[0, len(p):].tolist()
            outs.append(ids)
            n += len(ids)
        dt = time.perf_counter() - t0
    return {"engine": "hf", "method": mode, "k": k if mode != "greedy" else 0, "backend": "eager",
            "tokens": n, "seconds": dt, "tokens_per_s": n / dt, "outputs": outs}


def run(model: str, methods=("ngram", "suffix"), k: int = 4, batch: int = 4, backend: str = "eager",
        num_prompts: int = 8, max_tokens: int = 64, draft: str | None = None, hf: bool = True,
        out_dir=None) -> dict:
    """Benchmark AR, each method and HF on the same prompts; returns (and writes) the result."""
    from funcspec.checkpoints import load_model

    tok = load_model(model).tokenizer
    texts = repetitive_prompts(num_prompts, tok)
    prompts = [tok(t)["input_ids"] if tok is not None else t for t in texts]
    rows = [_funcspec_run(model, prompts, "ar", 0, backend, batch, max_tokens, draft)]
    for m in methods:
        rows.append(_funcspec_run(model, prompts, m, k, backend, batch, max_tokens, draft))
    if hf:
        for mode in ["greedy", "greedy_batched", "prompt_lookup"] + (["assistant"] if draft else []):
            rows.append(_hf_run(model, prompts, max_tokens, mode, k, draft, batch))
    ar, hf_greedy = rows[0], next((r for r in rows if r["engine"] == "hf" and r["method"] == "greedy"), None)
    for r in rows:
        r["speedup_vs_funcspec_ar"] = r["tokens_per_s"] / ar["tokens_per_s"]
        if hf_greedy:
            r["speedup_vs_hf_greedy"] = r["tokens_per_s"] / hf_greedy["tokens_per_s"]
        r["matches_ar_greedy"] = r["outputs"] == ar["outputs"]
        if r.get("tau"):
            r["speedup_over_tau"] = r["speedup_vs_funcspec_ar"] / r["tau"]
    for r in rows:
        del r["outputs"]
    result = {"model": model, "backend": backend, "batch": batch, "k": k, "num_prompts": num_prompts,
              "max_tokens": max_tokens, "device": device_name("cpu"), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "rows": rows}
    _write(result, Path(out_dir) if out_dir else RESULTS / device_name("cpu"))
    return result


def markdown(result: dict) -> str:
    """The result as a markdown table."""
    head = "| engine | method | K | backend | tokens/s | vs funcspec AR | vs HF greedy | τ | speedup/τ | = AR greedy |\n"
    head += "|---|---|---|---|---|---|---|---|---|---|\n"
    lines = []
    for r in result["rows"]:
        tau = f"{r['tau']:.2f}" if r.get("tau") else "-"
        sot = f"{r['speedup_over_tau']:.2f}" if r.get("speedup_over_tau") else "-"
        vs_hf = f"{r['speedup_vs_hf_greedy']:.2f}x" if "speedup_vs_hf_greedy" in r else "-"
        lines.append(f"| {r['engine']} | {r['method']} | {r['k']} | {r['backend']} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup_vs_funcspec_ar']:.2f}x | {vs_hf} | {tau} | {sot} | {r['matches_ar_greedy']} |")
    return head + "\n".join(lines) + "\n"


def _write(result: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"spec-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {stem}.json and {stem}.md")


def add_parser(kinds) -> None:
    p = kinds.add_parser("spec", help="speculative vs autoregressive vs HF generate, in one run")
    p.add_argument("--model", required=True)
    p.add_argument("--methods", default="ngram,suffix")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--backend", default="eager")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--draft", default=None, help="draft checkpoint for draft_model and HF assistant_model")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")

    def go(a):
        if a.threads:
            torch.set_num_threads(a.threads)
        run(a.model, [m for m in a.methods.split(",") if m], a.k, a.batch, a.backend, a.num_prompts,
            a.max_tokens, a.draft, not a.no_hf, a.out_dir)

    p.set_defaults(func=go)
