"""Benchmarks: ``funcspec bench capture`` (per-bucket graph costs) and ``funcspec bench spec``."""


def add_bench_parser(sub) -> None:
    """Register ``bench capture`` and ``bench spec`` under the CLI's subcommands."""
    from funcspec.bench import capture, scale, spec

    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench", required=True)
    capture.add_parser(kinds)
    spec.add_parser(kinds)
    scale.add_parser(kinds)
