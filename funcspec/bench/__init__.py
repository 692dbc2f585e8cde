"""Benchmarks: ``funcspec bench capture`` (per-bucket graph costs), ``bench spec``, ``bench scale``, ``bench tp``,
``bench quality`` (quantized formats' held-out loss), ``bench runtime`` (start-up, compile stalls, host cost),
``bench serve`` (a load and fault run of ``funcspec serve``) and ``bench moe`` (the routed-expert kernel)."""


def add_bench_parser(sub) -> None:
    """Register ``bench capture``, ``bench spec``, ``bench scale``, ``bench tp``, ``bench quality``,
    ``bench runtime``, ``bench serve`` and ``bench moe``."""
    from funcspec.bench import capture, moe, quant, runtime, scale, serve, spec, tp

    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench", required=True)
    capture.add_parser(kinds)
    spec.add_parser(kinds)
    scale.add_parser(kinds)
    tp.add_parser(kinds)
    quant.add_parser(kinds)
    runtime.add_parser(kinds)
    serve.add_parser(kinds)
    moe.add_parser(kinds)
