"""Command line: ``funcspec generate``, ``funcspec bench capture``, ``funcspec bench spec``.

``funcspec run-default`` is what ``make run`` calls: build the default zoo
model if needed, then generate with it.
"""

from __future__ import annotations

import argparse
import json
import time


def _generate(args) -> None:
    from funcspec import Engine, SamplingParams

    spec = json.loads(args.speculative_config) if args.speculative_config else None
    engine = Engine(args.model, speculative_config=spec, backend=args.backend,
                    max_batch_size=max(1, len(args.prompt)), max_model_len=args.max_model_len)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    outs = engine.generate(args.prompt, params)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    for o in outs:
        print(f"Prompt: {o.prompt!r}\nGenerated: {o.outputs[0].text!r}\n")
    st = engine.stats
    print(f"{n} tokens in {dt:.2f}s = {n / dt:.1f} tokens/s  (backend={st['backend']}, steps={st['steps']}, "
          f"mean acceptance length={st['mean_acceptance_length']:.2f})")
    if spec:
        acc = ", ".join(f"{a:.2f}" for a in st["per_position_acceptance"])
        print(f"speculative_config={json.dumps(spec)}  per-position acceptance: [{acc}]")


def _run_default(args) -> None:
    from funcspec import zoo

    path = zoo.build_default()
    args.model = str(path)
    _generate(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="funcspec", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    def gen_args(p, model_required=True):
        if model_required:
            p.add_argument("--model", required=True, help="HF-format checkpoint directory")
        p.add_argument("prompt", nargs="*", default=["def fibonacci(n):", "import os\nimport sys\n"])
        p.add_argument("--max-tokens", type=int, default=64)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--seed", type=int, default=None)
        p.add_argument("--ignore-eos", action="store_true")
        p.add_argument("--backend", default="eager", help="eager | inductor | cudagraph | aclgraph | auto")
        p.add_argument("--max-model-len", type=int, default=None)
        p.add_argument("--speculative-config", default=None, help="vLLM speculative_config as JSON")

    gen_args(sub.add_parser("generate", help="generate text and print tokens/s"))
    p = sub.add_parser("run-default", help="what `make run` does")
    gen_args(p, model_required=False)
    p.set_defaults(ignore_eos=True, speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}))
    from funcspec.bench import add_bench_parser

    add_bench_parser(sub)
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        _generate(args)
    elif args.command == "run-default":
        _run_default(args)
    else:
        args.func(args)


if __name__ == "__main__":
    main()
