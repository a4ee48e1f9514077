"""The ``kvrelay`` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys

from kvrelay import __version__
from kvrelay import config as kcfg


def _cmd_config(args: argparse.Namespace) -> int:
    import yaml

    cfg = kcfg.config_from_args(args)
    print(yaml.safe_dump(kcfg.to_dict(cfg), sort_keys=False), end="")
    return 0


def _cmd_bench_transfer(args: argparse.Namespace) -> int:
    from bench import transfer

    return transfer.main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvrelay", description="Disaggregated prefill/decode serving for vLLM: "
                                "KV chunks pushed from prefill to decode nodes over NIXL, UCX, TCP or shm.")
    p.add_argument("--version", action="version", version=f"kvrelay {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    c = sub.add_parser("config", help="print the effective configuration (defaults < YAML < flags)")
    kcfg.add_config_args(c)
    c.set_defaults(func=_cmd_config)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", metavar="BENCH", required=True)
    from bench.transfer import add_args

    t = bsub.add_parser("transfer", help="chunk transfer latency/bandwidth per backend vs same-run ceilings",
                        description="Sweeps backends x chunk sizes x windows between two processes and "
                        "prints a table, writes JSON and a PNG plot.")
    add_args(t)
    t.set_defaults(func=_cmd_bench_transfer)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except kcfg.ConfigError as exc:
        print(f"kvrelay: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
