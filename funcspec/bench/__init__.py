"""Benchmarks: ``funcspec bench capture`` (per-bucket graph costs), ``bench spec``, ``bench scale``, ``bench tp``,
``bench quality`` (quantized formats' held-out loss) and ``bench runtime`` (start-up, compile stalls, host cost)."""


def add_bench_parser(sub) -> None:
    """Register ``bench capture``, ``bench spec``, ``bench scale``, ``bench tp``, ``bench quality`` and
    ``bench runtime``."""
    from funcspec.bench import capture, quant, runtime, scale, spec, tp

    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench", required=True)
    capture.add_parser(kinds)
    spec.add_parser(kinds)
    scale.add_parser(kinds)
    tp.add_parser(kinds)
    quant.add_parser(kinds)
    runtime.add_parser(kinds)
