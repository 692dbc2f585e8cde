"""Benchmarks: ``funcspec bench capture`` (per-bucket graph costs), ``bench spec``, ``bench scale``, ``bench tp``,
``bench ep-comm`` (expert parallelism's collective), ``bench routing`` (a MoE's expert union per verify
step), ``bench moe`` (the routed-expert kernel), ``bench quality`` (quantized formats' held-out loss),
``bench runtime`` (start-up, compile stalls, host cost) and ``bench serve`` (a load and fault run of
``funcspec serve``)."""


def add_bench_parser(sub) -> None:
    """Register ``bench capture``, ``bench spec``, ``bench scale``, ``bench tp``, ``bench ep-comm``,
    ``bench routing``, ``bench moe``, ``bench quality``, ``bench runtime`` and ``bench serve``."""
    from funcspec.bench import capture, ep, moe, quant, routing, runtime, scale, serve, spec, tp

    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench", required=True)
    capture.add_parser(kinds)
    spec.add_parser(kinds)
    scale.add_parser(kinds)
    tp.add_parser(kinds)
    ep.add_parser(kinds)
    routing.add_parser(kinds)
    moe.add_parser(kinds)
    quant.add_parser(kinds)
    runtime.add_parser(kinds)
    serve.add_parser(kinds)
