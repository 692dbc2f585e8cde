"""``funcspec bench spec``: tokens/s and acceptance of speculative decoding vs autoregressive vs HF.

One run measures, on the same checkpoint and prompts:

- funcspec autoregressive decoding (K = 0),
- funcspec with each speculative method at each K and batch size,
- HF ``transformers`` ``generate``: plain greedy, ``prompt_lookup_num_tokens=K``
  and ``assistant_model`` = the draft_model checkpoint (a constant K per round),
- token trees (``trees``: a method and its tree keys), each beside its method's
  chain at equal verify width (K = N, so K + 1 = N + 1 tokens per row): the rows
  report the tree's speedup and τ over that chain, measured in the same run;
- each tree also cut to every node count of ``tree_sizes`` (the engine's
  ``num_speculative_tokens_per_batch_size`` at N, so every step drafts N nodes):
  rows with ``k`` = N, the whole tree's keys in ``tree``, and the per-depth
  acceptance and τ that ``funcspec tune-k --tree`` reads (a smaller tree's
  acceptance is not a prefix of a bigger one's, so each N is measured).

By default the model is the zoo target, the neural methods use the zoo's heads
and the prompts are the first 128 tokens of the zoo's held-out stdlib files
(128 new tokens, greedy, EOS ignored). HF runs one prompt at a time (its
assisted generation is batch-1 only), and plain greedy also in left-padded
batches; funcspec runs the prompts through ``batch`` slots. Results go to
``graphs/results/<device>/spec-<time>.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from funcspec.bench.capture import RESULTS, device_name, tree_size


def repetitive_prompts(n: int, tokenizer=None) -> list:
    """Code-editing-like prompts: a function, then the start of an edited copy of it."""
    body = ("def {f}(items):\n    total = 0\n    for item in items:\n        if item > {c}:\n"
            "            total += item * {c}\n    return total\n\n")
    out = []
    for i in range(n):
        text = body.format(f=f"score_{i}", c=i + 2) + body.format(f=f"score_{i}_v2", c=i + 3)[:40]
        out.append(text if tokenizer is not None else list(range(3, 40)))
    return out


def load_prompts(source: str, tokenizer, num: int, prompt_tokens: int) -> list[list[int]]:
    """Prompt token ids from ``source``: ``heldout`` (the zoo's held-out stdlib files, first
    ``prompt_tokens`` tokens each), ``package:NAME`` (the same from an installed package's
    files: code outside the stdlib, the zoo's second corpus), ``repetitive`` (code-editing
    prompts), or a path to a ``.json`` list of strings or a text file with one prompt per line."""
    from funcspec.train import data

    if source == "heldout":
        return data.heldout_prompts(tokenizer, num, prompt_tokens)
    if source.startswith("package:"):
        return data.file_prompts(tokenizer, data.package_files(source.split(":", 1)[1]), num, prompt_tokens)
    if source == "repetitive":
        texts = repetitive_prompts(num, tokenizer)
        return [tokenizer(t)["input_ids"] for t in texts] if tokenizer is not None else texts
    path = Path(source)
    if not path.exists():
        raise ValueError(f"prompts: {source!r} is neither 'heldout', 'package:NAME', 'repetitive' nor an existing file")
    texts = json.loads(path.read_text()) if path.suffix == ".json" else path.read_text().splitlines()
    return [tokenizer(t)["input_ids"] for t in texts if t][:num]


def _corpus(source: str) -> str:
    """What the prompts came from, with the installed version for ``package:NAME`` (its files change with it)."""
    if source.startswith("package:"):
        from importlib.metadata import version

        name = source.split(":", 1)[1]
        return f"{name} {version(name)} (installed package, outside the stdlib)"
    return {"heldout": "held-out stdlib files"}.get(source, source)


def _funcspec_run(model, prompts, method, k, backend, batch, max_tokens, head, tree=None, nodes=None,
                  quantization=None, draft_quantization=None):
    """One funcspec row: ``method`` at K = ``k`` (a tree: its node count), or the tree cut to ``nodes``; the target
    quantized on load as ``quantization``, the drafter's own weights as ``draft_quantization``."""
    from funcspec import Engine, SamplingParams
    from funcspec.zoo import speculative_config

    extra = dict(tree or {})
    if nodes is not None:  # every batch size of this engine drafts the tree's first / best N nodes
        extra["num_speculative_tokens_per_batch_size"] = [[1, batch, nodes]]
    if draft_quantization:
        extra["quantization"] = draft_quantization
    spec = None if method == "ar" else speculative_config(method, k, head, **extra)
    eng = Engine(model, speculative_config=spec, backend=backend, max_num_seqs=batch,
                 max_model_len=max(len(p) for p in prompts) + max_tokens + 8, quantization=quantization,
                 compilation_config={"capture": "lazy"})  # greedy only: the warm-up captures what it uses
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    eng.generate(prompts[:batch], sp)  # warm-up: captures every bucket this run uses
    eng.reset_stats()
    t0 = time.perf_counter()
    outs = eng.generate(prompts, sp)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    st = eng.stats()
    step_ms = [m for bucket in st["bucket_timings"].values() for m in bucket["replay_ms"]]
    k = k if nodes is None else nodes
    return {"engine": "funcspec", "method": method, "k": k if spec else 0, "batch": batch, "backend": eng.backend,
            "tree": tree, "quantization": quantization, "draft_quantization": draft_quantization,
            "tokens": n, "seconds": dt, "tokens_per_s": n / dt, "tau": st["mean_acceptance_length"],
            "per_position_acceptance": st["per_position_acceptance"],
            "step_ms_median": statistics.median(step_ms) if step_ms else None,
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
    row = {"engine": "hf", "method": mode, "k": k if mode in ("prompt_lookup", "assistant") else 0, "batch": batch,
           "backend": "eager"}
    if mode == "greedy_batched":
        pad = model.generation_config.pad_token_id or 0
        with torch.no_grad():
            _hf_batched(model, prompts[:batch], batch, pad, kwargs)  # warm-up
            t0 = time.perf_counter()
            outs = _hf_batched(model, prompts, batch, pad, kwargs)
            dt = time.perf_counter() - t0
        n = sum(len(o) for o in outs)
        return {**row, "method": f"greedy, batch {batch}", "tokens": n, "seconds": dt, "tokens_per_s": n / dt,
                "outputs": outs}
    if mode == "prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = k
    if mode == "assistant":
        assistant = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
        # NOTE: a constant K drafts per round, as funcspec does (HF's default schedule adapts K).
        assistant.generation_config.num_assistant_tokens = k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = assistant
    outs, n = [], 0
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0]]), **kwargs)  # warm-up
        t0 = time.perf_counter()
        for p in prompts:
            ids = model.generate(torch.tensor([p]), **kwargs)[0, len(p):].tolist()
            outs.append(ids)
            n += len(ids)
        dt = time.perf_counter() - t0
    return {**row, "batch": 1, "tokens": n, "seconds": dt, "tokens_per_s": n / dt, "outputs": outs}


def _head_paths(model: str, methods, heads: dict | None) -> dict:
    """Checkpoint per neural method: ``heads`` first, then the zoo's when ``model`` is the zoo target."""
    from funcspec import zoo

    out = dict(heads or {})
    is_zoo = Path(model).resolve() == zoo.model_path("target").resolve()
    for m in list(methods) + ["draft_model"]:
        if m in zoo.HEAD_METHODS and m not in out and is_zoo and zoo.model_path(m).exists():
            out[m] = str(zoo.model_path(m))
    missing = [m for m in methods if m in zoo.HEAD_METHODS and m not in out]
    if missing:
        raise ValueError(f"methods {missing} need a checkpoint: pass heads={{method: path}} (--head METHOD=PATH)")
    return out


def check_tree_sizes(trees, sizes) -> None:
    """Every node count of ``sizes`` is in 1..N of every tree (checked before anything runs)."""
    for method, tree in trees:
        n = tree_size(method, tree)
        if any(isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= n for size in sizes):
            raise ValueError(f"tree_sizes {list(sizes)} must be node counts in 1..{n}, the size of {method} "
                             f"tree {tree}")


def _tree_rows(model, ids, trees, backend, b, max_tokens, heads, chains: dict, sizes=()) -> list[dict]:
    """Each tree's row, with its speedup and τ over its method's chain at K = N (run here unless in ``chains``),
    then a row per node count of ``sizes`` below N: the tree cut to it."""
    rows = []
    for method, tree in trees:
        n = tree_size(method, tree)
        if (method, n) not in chains:
            chains[method, n] = _funcspec_run(model, ids, method, n, backend, b, max_tokens, heads.get(method))
            rows.append(chains[method, n])
        row = _funcspec_run(model, ids, method, n, backend, b, max_tokens, heads.get(method), dict(tree))
        chain = chains[method, n]
        row["speedup_vs_chain"] = row["tokens_per_s"] / chain["tokens_per_s"]
        row["tau_vs_chain"] = row["tau"] / chain["tau"]
        rows.append(row)
        rows += [_funcspec_run(model, ids, method, n, backend, b, max_tokens, heads.get(method), dict(tree), size)
                 for size in sorted(set(sizes)) if size < n]
    return rows


def run(model: str | None = None, methods=("ngram", "suffix"), ks=(4,), batches=(4,), backend: str = "eager",
        prompts: str = "heldout", num_prompts: int = 8, prompt_tokens: int = 128, max_tokens: int = 128,
        heads: dict | None = None, hf: bool = True, out_dir=None, trees=(), tree_sizes=(), quantization=None,
        draft_quantizations=(None,)) -> dict:
    """Benchmark AR, each method at each K and batch, and HF, on the same prompts; writes and returns the result.

    ``model`` defaults to the zoo target; ``heads`` maps neural methods to their
    checkpoints (the zoo's by default on the zoo target), ``heads["draft_model"]``
    is also HF's ``assistant_model``. ``trees``: ``(method, tree keys)`` pairs,
    e.g. ``("eagle3", {"speculative_token_tree": "[(0,), (1,)]"})``, each run
    beside its chain at K = N, and cut to each node count of ``tree_sizes``
    (e.g. ``(4, 8)``). Every row records whether its outputs equal funcspec AR
    greedy's, token for token. ``quantization`` quantizes the target on load (every funcspec row, AR too: the
    lossless check is against AR on the same weights; HF rows stay unquantized); each neural method runs once per
    entry of ``draft_quantizations`` (``None``: the head as stored, else its own weights quantized on load).
    """
    from funcspec.quant.formats import on_load

    on_load(quantization)
    for q in draft_quantizations:
        on_load(q, "draft_quantizations")
    from funcspec import zoo
    from funcspec.checkpoints import load_model

    model = str(model or zoo.model_path("target"))
    heads = _head_paths(model, list(methods) + [m for m, _ in trees], heads)
    check_tree_sizes(trees, tree_sizes)
    ids = load_prompts(prompts, load_model(model).tokenizer, num_prompts, prompt_tokens)
    rows, ar = [], {}
    for b in batches:
        ar[b] = _funcspec_run(model, ids, "ar", 0, backend, b, max_tokens, None, quantization=quantization)
        rows.append(ar[b])
        chains: dict = {}
        for m in methods:
            for k in ks:
                for dq in draft_quantizations if m in heads else (None,):
                    row = _funcspec_run(model, ids, m, k, backend, b, max_tokens, heads.get(m),
                                        quantization=quantization, draft_quantization=dq)
                    chains.setdefault((m, k), row)  # trees compare against the head as stored
                    rows.append(row)
        rows += _tree_rows(model, ids, trees, backend, b, max_tokens, heads, chains, tree_sizes)
    if hf:
        rows.append(_hf_run(model, ids, max_tokens, "greedy", 0, None))
        rows += [_hf_run(model, ids, max_tokens, "greedy_batched", 0, None, b) for b in batches if b > 1]
        for k in ks:
            rows.append(_hf_run(model, ids, max_tokens, "prompt_lookup", k, None))
            if "draft_model" in heads:
                rows.append(_hf_run(model, ids, max_tokens, "assistant", k, heads["draft_model"]))
    reference = ar[batches[0]]["outputs"]
    hf_greedy = next((r for r in rows if r["engine"] == "hf" and r["method"] == "greedy"), None)
    for r in rows:
        base = ar.get(r["batch"], ar[batches[0]])
        r["speedup_vs_funcspec_ar"] = r["tokens_per_s"] / base["tokens_per_s"]
        if hf_greedy:
            r["speedup_vs_hf_greedy"] = r["tokens_per_s"] / hf_greedy["tokens_per_s"]
        r["matches_ar_greedy"] = r["outputs"] == reference
        if r.get("tau"):
            r["speedup_over_tau"] = r["speedup_vs_funcspec_ar"] / r["tau"]
    for r in rows:
        del r["outputs"]
    result = {"model": model, "heads": heads, "backend": backend, "quantization": quantization,
              "batches": list(batches), "ks": list(ks),
              "prompts": prompts, "num_prompts": len(ids), "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
              "corpus": _corpus(prompts), "trees": [[m, dict(t)] for m, t in trees],
              "tree_sizes": sorted(set(tree_sizes)),
              "device": device_name("cpu"), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "rows": rows}
    _write(result, Path(out_dir) if out_dir else RESULTS / device_name("cpu"))
    return result


def label(r: dict) -> str:
    """A row's short name, e.g. ``funcspec eagle3 K4 B4``, ``funcspec eagle3 tree N16 B4`` or ``hf assistant K4``."""
    k = (f" tree N{r['k']}" if r.get("tree") else f" K{r['k']}") if r["k"] else ""
    b = f" B{r['batch']}" if r["engine"] == "funcspec" else ""
    q = f" ({r['draft_quantization']} head)" if r.get("draft_quantization") else ""
    return f"{r['engine']} {r['method']}{q}{k}{b}"


def markdown(result: dict) -> str:
    """The result as a markdown table."""
    head = ("| engine | method | K | batch | backend | tokens/s | vs funcspec AR | vs HF greedy | τ | speedup/τ "
            "| per-position acceptance | = AR greedy | tree | tree vs chain (speed, τ) |\n")
    head += "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    if result.get("quantization"):  # every funcspec row, AR included, runs the target quantized on load
        head = f"Target quantized on load: {result['quantization']} (HF rows: unquantized).\n\n" + head
    lines = []
    for r in result["rows"]:
        tau = f"{r['tau']:.2f}" if r.get("tau") else "-"
        sot = f"{r['speedup_over_tau']:.2f}" if r.get("speedup_over_tau") else "-"
        vs_hf = f"{r['speedup_vs_hf_greedy']:.2f}x" if "speedup_vs_hf_greedy" in r else "-"
        acc = ", ".join(f"{a:.2f}" for a in r.get("per_position_acceptance") or []) or "-"
        tree = json.dumps(r["tree"]).replace("|", "/") if r.get("tree") else "-"
        vs_chain = f"{r['speedup_vs_chain']:.2f}x, {r['tau_vs_chain']:.2f}x" if "speedup_vs_chain" in r else "-"
        method = r["method"] + (f" ({r['draft_quantization']} head)" if r.get("draft_quantization") else "")
        lines.append(f"| {r['engine']} | {method} | {r['k']} | {r['batch']} | {r['backend']} | "
                     f"{r['tokens_per_s']:.1f} | {r['speedup_vs_funcspec_ar']:.2f}x | {vs_hf} | {tau} | {sot} | "
                     f"{acc} | {r['matches_ar_greedy']} | {tree} | {vs_chain} |")
    return head + "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Four panels: tokens/s; speedup over funcspec AR and HF greedy; τ and speedup/τ; per-position acceptance."""
    from matplotlib.figure import Figure  # NOTE: not pyplot: leaves a notebook's backend alone

    rows = result["rows"]
    names = [label(r) for r in rows]
    spec = [r for r in rows if r.get("tau") and r["k"]]
    fig = Figure(figsize=(15, 10))
    ax = fig.subplots(2, 2)
    colors = ["tab:blue" if r["engine"] == "funcspec" else "tab:orange" for r in rows]
    ax[0, 0].barh(names, [r["tokens_per_s"] for r in rows], color=colors)
    ax[0, 0].set_xlabel("tokens/s (blue funcspec, orange HF)")
    y = range(len(rows))
    ax[0, 1].barh([i - 0.2 for i in y], [r["speedup_vs_funcspec_ar"] for r in rows], 0.4, label="vs funcspec AR")
    ax[0, 1].barh([i + 0.2 for i in y], [r.get("speedup_vs_hf_greedy", 0) for r in rows], 0.4,
                  label="vs HF greedy (batch 1)")
    ax[0, 1].set_yticks(list(y), names)
    ax[0, 1].axvline(1.0, color="k", lw=0.5)
    ax[0, 1].legend()
    ax[0, 1].set_xlabel("speedup")
    sy = range(len(spec))
    ax[1, 0].barh([i - 0.2 for i in sy], [r["tau"] for r in spec], 0.4, label="τ (mean tokens per step)")
    ax[1, 0].barh([i + 0.2 for i in sy], [r["speedup_over_tau"] for r in spec], 0.4, label="speedup / τ")
    ax[1, 0].set_yticks(list(sy), [label(r) for r in spec])
    ax[1, 0].legend()
    for r in spec:
        acc = r["per_position_acceptance"]
        ax[1, 1].plot(range(1, len(acc) + 1), acc, marker="o", label=label(r))
    ax[1, 1].set_xlabel("draft position")
    ax[1, 1].set_ylabel("acceptance rate")
    ax[1, 1].set_ylim(0, 1.02)
    if spec:
        ax[1, 1].legend(fontsize=7)
    fig.suptitle(f"{Path(result['model']).name}: {result['num_prompts']} prompts ({result['prompts']}), "
                 f"{result['max_tokens']} new tokens, backend {result['backend']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _write(result: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"spec-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    stem.with_suffix(".md").write_text(markdown(result))
    plot(result, stem.with_suffix(".png"))
    print(markdown(result))
    print(f"wrote {stem}.json, .md and .png")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def add_parser(kinds) -> None:
    """Register ``funcspec bench spec`` and its options."""
    p = kinds.add_parser("spec", help="speculative vs autoregressive vs HF generate, in one run")
    p.add_argument("--model", default=None, help="checkpoint (default: the zoo target)")
    p.add_argument("--methods", default="ngram,suffix,draft_model,medusa,mtp,eagle3,dflash,dspark")
    p.add_argument("--k", default="4", help="comma-separated K values")
    p.add_argument("--batch", default="4", help="comma-separated batch sizes (engine slots)")
    p.add_argument("--backend", default="eager")
    p.add_argument("--prompts", default="heldout", help="heldout | package:NAME (an installed package's files, "
                   "e.g. package:numpy) | repetitive | a .json list or a text file")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length for --prompts heldout")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--head", action="append", default=[], metavar="METHOD=PATH",
                   help="checkpoint of a neural method (draft_model's is also HF's assistant_model)")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--quantization", default=None, help="quantize the target on load (int8, int4, int4-g128, ...)")
    p.add_argument("--draft-quantization", default="",
                   help="comma list of the drafters' on-load quantizations, 'none' for the head as stored; each "
                        "neural method runs once per entry (e.g. none,int4)")
    p.add_argument("--tree", action="append", default=[], metavar="METHOD=JSON",
                   help='a token tree run beside its chain at K = N, e.g. eagle3=\'{"speculative_eagle_topk": 3, '
                        '"speculative_num_steps": 5, "speculative_num_draft_tokens": 17}\'')
    p.add_argument("--tree-sizes", default="", help="comma-separated node counts N: each --tree also cut to N "
                                                   "(rows for funcspec tune-k --tree)")

    def go(a):
        if a.threads:
            torch.set_num_threads(a.threads)
        heads = dict(h.split("=", 1) for h in a.head)
        run(a.model, [m for m in a.methods.split(",") if m], _ints(a.k), _ints(a.batch), a.backend, a.prompts,
            a.num_prompts, a.prompt_tokens, a.max_tokens, heads, not a.no_hf, a.out_dir,
            [(m, json.loads(t)) for m, t in (x.split("=", 1) for x in a.tree)], _ints(a.tree_sizes), a.quantization,
            tuple(None if q == "none" else q for q in a.draft_quantization.split(",") if q) or (None,))

    p.set_defaults(func=go)
