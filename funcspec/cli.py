"""Command line: ``funcspec generate``, ``funcspec serve``, ``funcspec bench capture``, ``funcspec bench spec``,
``funcspec tune-k``, ``funcspec inspect``, ``funcspec precompile``, ``funcspec cache``.

``funcspec run-default`` is what ``make run`` calls: generate with the zoo
target and a zoo drafter, and print tokens/s and acceptance stats.
``funcspec train <role>`` runs the zoo's recipes (:mod:`funcspec.train`).
``funcspec serve MODEL ...`` is vLLM's ``vllm serve`` (:mod:`funcspec.serve`).
"""

from __future__ import annotations

import argparse
import json
import time


DEFAULT_METHOD = "eagle3"


def _generate(args) -> None:
    from funcspec import Engine, SamplingParams

    spec = json.loads(args.speculative_config) if args.speculative_config else None
    t0 = time.perf_counter()
    engine = Engine(args.model, speculative_config=spec, backend=args.backend, max_num_seqs=max(1, len(args.prompt)),
                    max_model_len=args.max_model_len, compilation_config={"capture": args.capture})
    graphs = engine.stats()["graphs"]
    helped = sum(g["helper"] is not None for g in graphs.values())
    loaded = sum(g["loaded"] for g in graphs.values()) - helped
    print(f"engine ready in {time.perf_counter() - t0:.1f}s (backend={engine.backend}; captured {len(graphs)} "
          f"graph(s) at start-up in {engine.startup_seconds:.1f}s, {loaded} loaded from the compiled-step store"
          f"{f', {helped} compiled by helper processes' if helped else ''}: {', '.join(graphs) or 'none'})")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    outs = engine.generate(args.prompt, params)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    for o in outs:
        print(f"Prompt: {o.prompt!r}\nGenerated: {o.outputs[0].text!r}\n")
    st = engine.stats()
    print(f"{n} tokens in {dt:.2f}s = {n / dt:.1f} tokens/s  (backend={st['backend']}, steps={st['steps']}, "
          f"mean acceptance length={st['mean_acceptance_length']:.2f})")
    if spec:
        acc = ", ".join(f"{a:.2f}" for a in st["per_position_acceptance"])
        print(f"speculative_config={json.dumps(spec)}  per-position acceptance: [{acc}]")


def _run_default(args) -> None:
    """The zoo target with the zoo's default speculative method (``make run``)."""
    from funcspec import zoo

    args.model = str(zoo.model_path("target"))
    if args.speculative_config is None:
        args.speculative_config = json.dumps(zoo.speculative_config(args.method, args.k))
    _generate(args)


def _precompile(args) -> None:
    """`funcspec precompile`: capture every graph an engine can need, then save torch's compile cache and the
    compiled steps in one file (built in a private, empty inductor cache, removed afterwards)."""
    import os
    import shutil
    import tempfile

    from funcspec import LLM
    from funcspec.capture import cache, helpers
    from funcspec.serve.args import engine_kwargs

    # NOTE: an empty inductor cache, so that every entry is created (and recorded) in this process; and so no
    # start-up helper process either (torch records only this process's entries), unless the arguments ask.
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR"), os.environ.get(helpers.ENV)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = scratch = tempfile.mkdtemp(prefix="funcspec-precompile-")
    os.environ[helpers.ENV] = "0"
    try:
        llm = LLM(args.model, **engine_kwargs(args, {}))
        graphs = llm.engine.stats()["graphs"]
        steps = [g["stored"] for g in graphs.values() if g["stored"]]
        held = cache.save(args.out, steps)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        for name, value in zip(("TORCHINDUCTOR_CACHE_DIR", helpers.ENV), before):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    print(f"captured {len(graphs)} graph(s) in {llm.engine.startup_seconds:.1f}s: {', '.join(graphs)}")
    print(f"wrote {args.out} ({held})")
    missing = len(graphs) - len(steps)
    if missing:
        print(f"{missing} of {len(graphs)} graph(s) could not be stored as compiled steps (the warning above says "
              f"why): a start from this file still traces {'them' if missing > 1 else 'it'}, and only inductor's "
              f"own cache entries save compiling")
    if steps:
        print(f"start from it with LLM(..., compilation_config={{'compile_cache': {str(args.out)!r}}}) and the "
              f"same engine arguments; it is executable code: load it only where you trust its source")


def _cache(args) -> None:
    """`funcspec cache info|prune`: what the compiled-step store holds; remove what is unused."""
    import time

    from funcspec.capture import store

    where = store.directory()
    if not where.is_dir():
        print(f"{where}: empty (no compiled step filed yet)")
        return
    if args.action == "prune":
        older = None if args.older_than is None else args.older_than * 86400
        removed = store.prune(where, older)
        print(f"removed {len(removed)} file(s) from {where}")
        return
    entries = store.entries(where)
    try:
        store.check_private(where)
        trust = "private to this user"
    except (store.Untrusted, OSError) as e:
        trust = f"NOT trusted, so never read: {e}"
    print(f"{where}: {len(entries)} compiled step(s), {sum(e.bytes for e in entries) / 2**20:.1f} MiB ({trust})")
    if entries:
        age = lambda t: f"{(time.time() - t) / 86400:.1f} days ago"  # noqa: E731
        print(f"last used: oldest {age(entries[0].last_used)}, newest {age(entries[-1].last_used)}")


def _tune_k(args) -> None:
    """`funcspec tune-k`: tune the K table, print it, write the config (see funcspec.tune)."""
    from pathlib import Path

    from funcspec import tune

    keys = {}
    for item in args.spec_key:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--spec-key wants KEY=JSON_VALUE, got {item!r}")
        try:
            keys[name] = json.loads(value)
        except json.JSONDecodeError:
            keys[name] = value  # a bare string, e.g. a path
    if args.model:
        keys["model"] = args.model
    out = args.out or str(Path(args.capture).with_name("tuned-k.json"))
    try:
        tree = args.tree if args.tree in (False, True) else json.loads(args.tree)
        cfg = tune.tune_files(args.capture, args.spec, args.method, out, max_batch=args.max_batch,
                              cost=args.cost, max_k=args.max_k, spec_keys=keys, tree=tree)
    except ValueError as err:  # bad input (a JSONDecodeError too): say which field, without a traceback
        raise SystemExit(f"funcspec tune-k: {err}") from err
    print(tune.format_table(cfg))
    print(f"wrote {out}")


def _inspect(args) -> None:
    """`funcspec inspect PATH [--target TARGET]`: a head's layout, shapes and fit, or a target model's stored
    quantization layer by layer; exit 1 if it does not load."""
    from funcspec.checkpoints.report import inspect

    try:
        report = inspect(args.head, args.target)
    except (ValueError, FileNotFoundError) as err:  # the target itself does not load
        raise SystemExit(f"funcspec inspect: --target: {err}") from err
    print(report)
    if not report.fits:
        raise SystemExit(1)


def build_parser() -> argparse.ArgumentParser:
    from funcspec.zoo import RUN_PROMPTS

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
        p.add_argument("--backend", default="auto",
                       help="eager | inductor | cudagraph | aclgraph | auto (inductor on CPU, as LLM's default)")
        p.add_argument("--capture", default="startup", choices=("startup", "lazy"),
                       help="capture every graph while the engine starts (default), or each on first use")
        p.add_argument("--max-model-len", type=int, default=None)
        p.add_argument("--speculative-config", default=None, help="vLLM speculative_config as JSON")

    gen_args(sub.add_parser("generate", help="generate text and print tokens/s"))
    p = sub.add_parser("run-default", help="what `make run` does: the zoo target with a zoo drafter")
    gen_args(p, model_required=False)
    p.add_argument("--method", default=DEFAULT_METHOD, help="zoo method when --speculative-config is not given")
    p.add_argument("--k", type=int, default=4)
    p.set_defaults(max_tokens=128, prompt=RUN_PROMPTS)
    p = sub.add_parser("tune-k", help="choose K per batch size from bench capture + bench spec results")
    p.add_argument("--capture", required=True, help="a `funcspec bench capture` result JSON")
    p.add_argument("--spec", required=True, help="a `funcspec bench spec` result JSON")
    p.add_argument("--method", required=True, help="the speculative method whose acceptance to use")
    p.add_argument("--max-batch", type=int, default=None, help="default: the largest measured batch")
    p.add_argument("--max-k", type=int, default=None, help="default: the largest measured K")
    p.add_argument("--cost", choices=("replay_ms", "eager_ms"), default=None,
                   help="step cost to use (default: replay_ms when measured)")
    p.add_argument("--model", default=None, help="draft checkpoint, passed into speculative_config")
    p.add_argument("--spec-key", action="append", default=[], metavar="KEY=VALUE",
                   help="another speculative_config key (JSON value), e.g. prompt_lookup_max=4")
    p.add_argument("--tree", nargs="?", const=True, default=False, metavar="JSON",
                   help="tune a token tree's node count N per batch size from the method's tree rows "
                        "(bench spec --tree-sizes) and tree buckets (bench capture --tree); JSON: which tree")
    p.add_argument("--out", default=None, help="default: tuned-k.json beside the capture result")
    p = sub.add_parser("inspect", help="a draft head's published layout, method, shapes, and whether it fits a "
                                       "target; a target model's quantization, layer by layer")
    p.add_argument("head", help="the draft head's directory (as speculative_config['model']), or a target model's "
                                "directory or GGUF file")
    p.add_argument("--target", default=None, help="the target model's directory: load the head for it")
    p = sub.add_parser("precompile", help="capture every graph an engine can need and save torch's compile cache "
                                          "to a file that another machine of the same ISA starts warm from")
    p.add_argument("model", help="the target checkpoint (as LLM's model)")
    from funcspec.serve.args import add_engine_flags

    add_engine_flags(p.add_argument_group("engine (as funcspec serve's: EngineArgs' fields)"))
    p.add_argument("--out", default="funcspec-compile-cache.zip", help="the file to write (default %(default)s)")
    p = sub.add_parser("cache", help="the compiled-step store: where it is, what it holds; prune unused steps")
    p.add_argument("action", choices=("info", "prune"))
    p.add_argument("--older-than", type=float, default=None, metavar="DAYS",
                   help="prune: only steps unused for this many days (default: every stored step)")
    sub.add_parser("train", help="train the model zoo's roles (funcspec train --help)", add_help=False)
    sub.add_parser("serve", help="an OpenAI-compatible server, as `vllm serve` (funcspec serve --help)",
                   add_help=False)
    from funcspec.bench import add_bench_parser

    add_bench_parser(sub)
    return ap


def main(argv=None) -> None:
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # the recipes own their argument parser
        from funcspec.train import main as train_main

        return train_main(argv[1:])
    if argv[:1] == ["serve"]:  # NOTE: its own parser: it passes vLLM flags it does not know on to LLM
        from funcspec.serve.args import main as serve_main

        return serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        _generate(args)
    elif args.command == "run-default":
        _run_default(args)
    elif args.command == "tune-k":
        _tune_k(args)
    elif args.command == "inspect":
        _inspect(args)
    elif args.command == "precompile":
        _precompile(args)
    elif args.command == "cache":
        _cache(args)
    else:
        args.func(args)


if __name__ == "__main__":
    main()
