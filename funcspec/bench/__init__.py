"""Benchmarks: ``funcspec bench capture`` (per-bucket graph costs) and ``funcspec bench spec``."""


def add_bench_parser(sub) -> None:
    """Register ``bench capture`` under the CLI's subcommands."""
    from funcspec.bench.capture import add_parser

    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench", required=True)
    add_parser(kinds)
