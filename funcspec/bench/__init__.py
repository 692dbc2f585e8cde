"""Benchmarks: ``funcspec bench capture`` (per-bucket graph costs), ``bench spec``, ``bench scale`` and ``bench tp``."""


def add_bench_parser(sub) -> None:
    """Register ``bench capture``, ``bench spec``, ``bench scale`` and ``bench tp`` under the CLI's subcommands."""
    from funcspec.bench import capture, scale, spec, tp

    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench", required=True)
    capture.add_parser(kinds)
    spec.add_parser(kinds)
    scale.add_parser(kinds)
    tp.add_parser(kinds)
