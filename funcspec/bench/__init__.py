"""Benchmarks: ``funcspec bench capture`` (per-bucket graph costs), ``bench spec``, ``bench scale``, ``bench tp`` and
``bench quality`` (quantized formats' held-out loss)."""


def add_bench_parser(sub) -> None:
    """Register ``bench capture``, ``bench spec``, ``bench scale``, ``bench tp`` and ``bench quality``."""
    from funcspec.bench import capture, quant, scale, spec, tp

    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench", required=True)
    capture.add_parser(kinds)
    spec.add_parser(kinds)
    scale.add_parser(kinds)
    tp.add_parser(kinds)
    quant.add_parser(kinds)
