"""``funcspec bench routing``: how many experts a verify step of K+1 tokens streams, per MoE layer.

An autoregressive step of one token reads ``top_k`` experts per sparse layer; a
verify step reads the union of its K+1 tokens' experts, so its weight bytes
grow with how little consecutive tokens' routing overlaps. This runs the target
over a token stream once (eager, prefill), records every sparse layer's
``[T, top_k]`` expert ids, and reports for each K the mean union over every
window of K+1 consecutive tokens, per layer and over all layers, beside
``top_k`` (perfectly correlated routing) and ``min(E, (K+1)·top_k)``
(independent routing that never repeats). With ``--time`` it also times one
eager verify step of each K+1 after a prefix, on the kernels the engine would
take, beside the bytes that step must stream (the dense weights once, plus per
layer the union of that block's experts), so a step's cost can be set against
its union. Results go to
``graphs/results/cpu/routing-<time>.json`` and ``.md``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from funcspec.bench.capture import write_result
from funcspec.bench.scale.machine import machine_info


class RecordingOps:
    """An ``Ops`` that keeps every routed-expert call's ids [T, k] (in call order: the sparse layers, in order)."""

    def __init__(self, ops):
        self.ops, self.ids = ops, []

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def experts(self, x, ids, weights, p):
        self.ids.append(ids.clone())
        return self.ops.experts(x, ids, weights, p)


def layer_routing(model, tokens: list[int]) -> list[torch.Tensor]:
    """Each sparse layer's expert ids [T, k] for ``tokens`` run as one prefill of ``model`` (a loaded MoE)."""
    import dataclasses

    from funcspec.nn.llama import forward, init_kv_cache

    if not model.cfg.moe.num_experts:
        raise ValueError(f"model: {model.path} is not a mixture-of-experts model (it has no routed experts)")
    rec = RecordingOps(model.cfg.ops)
    cfg = dataclasses.replace(model.cfg, ops=rec)
    t = torch.tensor([tokens])  # [1, T]
    kv = init_kv_cache(cfg, 1, len(tokens))
    with torch.no_grad():
        forward(cfg, model.params, kv, t, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    return rec.ids


def mean_union(ids: torch.Tensor, num_experts: int, window: int) -> float:
    """The mean number of distinct experts among ``window`` consecutive tokens' ids [T, k]."""
    hits = torch.zeros(ids.shape[0], num_experts).scatter_(1, ids, 1.0)  # [T, E]
    counts = hits.cumsum(0)  # [T, E]
    counts = torch.cat([torch.zeros(1, num_experts), counts])  # [T+1, E]
    in_window = counts[window:] - counts[:-window]  # [T-window+1, E]
    return (in_window > 0).sum(-1).float().mean().item()


def step_costs(model, tokens: list[int], ks, reps: int, prefix: int = 64) -> list[dict]:
    """Per K: the median ms of one eager step of K+1 tokens after ``prefix`` tokens, on the engine's kernels
    (params prepared as it prepares them), and the bytes it streams given that block's expert union."""
    import dataclasses
    import math
    import statistics

    from funcspec.checkpoints import expected_shapes
    from funcspec.kernels import resolve
    from funcspec.nn.llama import forward, init_kv_cache
    from funcspec.quant import prepare_params

    rec = RecordingOps(resolve("cpu"))
    cfg = dataclasses.replace(model.cfg, ops=rec)
    params = prepare_params(model.params, rec.ops)
    item = model.params["model"]["norm"]["weight"].element_size()
    shapes = expected_shapes(model.cfg)
    dense = sum(math.prod(s) for k, s in shapes.items() if ".experts." not in k and "embed_tokens" not in k) * item
    m = model.cfg.moe
    expert = 3 * model.cfg.hidden_size * m.intermediate_size * item  # one expert's gate, up and down
    kv = init_kv_cache(cfg, 1, prefix + max(ks) + 1)
    zero = torch.zeros(1, dtype=torch.long)
    rows = []
    with torch.no_grad():
        forward(cfg, params, kv, torch.tensor([tokens[:prefix]]), zero, zero)  # the prefix's KV
        for k in ks:
            block, start = torch.tensor([tokens[prefix:prefix + k + 1]]), torch.full((1,), prefix)
            rec.ids.clear()
            forward(cfg, params, kv, block, zero, start)  # warm-up, and the block's routing
            union = sum(len(torch.unique(x)) for x in rec.ids)  # experts read over all sparse layers
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                forward(cfg, params, kv, block, zero, start)
                times.append((time.perf_counter() - t0) * 1e3)
            rows.append({"k": k, "step_ms": statistics.median(times), "experts_read": union,
                         "bytes": dense + union * expert})
    for r in rows:
        r["gb_per_s"] = r["bytes"] / r["step_ms"] / 1e6
        r["cost_over_ar"] = r["step_ms"] / rows[0]["step_ms"]
        r["bytes_over_ar"] = r["bytes"] / rows[0]["bytes"]
    return rows


def measure(model, tokens: list[int], ks) -> dict:
    """Per K, the mean union per layer and over layers, with the two bounds."""
    ids = layer_routing(model, tokens)
    m = model.cfg.moe
    rows = []
    for k in ks:
        per_layer = [mean_union(x, m.num_experts, k + 1) for x in ids]
        rows.append({"k": k, "mean_union": sum(per_layer) / len(per_layer), "per_layer": per_layer,
                     "correlated": m.top_k, "independent": min(m.num_experts, (k + 1) * m.top_k)})
    return {"num_experts": m.num_experts, "top_k": m.top_k, "sparse_layers": list(m.sparse_layers),
            "tokens": len(tokens), "rows": rows}


def stream_tokens(model, n: int, seed: int) -> tuple[list[int], str]:
    """``n`` tokens to route: the held-out stdlib text through the model's tokenizer, else random ids."""
    tok = model.tokenizer
    if tok is not None:
        from funcspec.train import data

        ids = []
        for p in data.split_files("heldout"):
            ids += tok.encode(data.read_text(p), add_special_tokens=False)
            if len(ids) >= n:
                return ids[:n], "held-out stdlib text"
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.cfg.vocab_size, (n,), generator=g).tolist(), "random ids"


def run(args) -> Path:
    """``funcspec bench routing``: the expert union of a verify step, per K and layer; JSON and markdown."""
    from funcspec.checkpoints import load_model

    ks = [int(k) for k in args.ks.split(",")]
    model = load_model(args.model, dtype=getattr(torch, args.dtype))
    tokens, source = stream_tokens(model, args.tokens, args.seed)
    result = {"bench": "routing", "time": time.strftime("%Y%m%d-%H%M%S"), "model": str(args.model),
              "source": source, "dtype": args.dtype, "machine": machine_info(), **measure(model, tokens, ks)}
    if args.time:
        result["steps"] = step_costs(model, tokens, sorted({0, *ks}), args.reps)
    path = write_result(result, args.out, markdown)
    print(markdown(result))
    print(f"wrote {path} and its .md")
    return path


def markdown(r: dict) -> str:
    """The result as markdown: one row per K, then the per-layer unions."""
    lines = [f"# funcspec bench routing: {Path(r['model']).name}\n",
             f"{r['tokens']} tokens ({r['source']}), {r['num_experts']} experts, top-{r['top_k']}, sparse layers "
             f"{r['sparse_layers']}. A verify step of K+1 tokens streams the union of their experts per layer.\n",
             "| K | mean union (all layers) | correlated (top_k) | independent (min(E, (K+1)·top_k)) | "
             "union / top_k |", "|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['k']} | {x['mean_union']:.2f} | {x['correlated']} | {x['independent']} | "
                     f"{x['mean_union'] / x['correlated']:.2f} |")
    lines += ["", "Per layer (mean union, in layer order):", ""]
    lines += [f"- K={x['k']}: " + ", ".join(f"{u:.2f}" for u in x["per_layer"]) for x in r["rows"]]
    if r.get("steps"):
        lines += ["", f"## One eager step of K+1 tokens after a 64-token prefix ({r['dtype']}, the engine's "
                  "kernels, median)\n",
                  "| K | experts read (all layers) | MB streamed | step ms | GB/s | cost / AR | bytes / AR |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {x['k']} | {x['experts_read']} | {x['bytes'] / 1e6:.0f} | {x['step_ms']:.2f} | "
                  f"{x['gb_per_s']:.1f} | {x['cost_over_ar']:.2f} | {x['bytes_over_ar']:.2f} |" for x in r["steps"]]
        m = r["machine"]
        lines += ["", f"CPU: {m['cpu']} ({m['cores']} logical cores), threads {m['threads']}, ISA: "
                  + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in m["flags"].items())]
    return "\n".join(lines) + "\n"


def add_parser(kinds) -> None:
    """Register ``funcspec bench routing`` and its options."""
    p = kinds.add_parser("routing", help="MoE: the expert union a verify step of K+1 tokens streams, per layer")
    p.add_argument("model", help="a mixture-of-experts checkpoint directory")
    p.add_argument("--ks", default="1,2,4,8", help="K values, comma-separated (default %(default)s)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens routed (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of random ids (no tokenizer)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="weights' dtype")
    p.add_argument("--time", action="store_true", help="also time one verify step per K (eager, engine kernels)")
    p.add_argument("--reps", type=int, default=10, help="timed steps per K (default %(default)s)")
    p.add_argument("--out", default=None, help="results directory (default graphs/results/cpu)")
    p.set_defaults(func=run)
