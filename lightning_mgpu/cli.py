"""The ``lightning-mgpu`` console script.

Subcommands land with the features behind them; this version has ``strategies``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence


def _cmd_strategies(args: argparse.Namespace) -> int:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_mgpu

    rows = [
        {"name": name, "description": StrategyRegistry[name]["description"], "options": StrategyRegistry[name]["init_params"]}
        for name in lightning_mgpu.STRATEGY_NAMES
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"lightning_mgpu {lightning_mgpu.__version__}: Trainer(strategy=...) names")
    table.add_column("name", style="bold")
    table.add_column("what it is")
    table.add_column("preset options")
    for row in rows:
        options = ", ".join(f"{k}={v!r}" for k, v in row["options"].items()) or "-"
        table.add_row(row["name"], row["description"], options)
    Console().print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-mgpu",
        description="Multi-GPU training for PyTorch Lightning: strategies, profiling and checks.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    strategies = sub.add_parser("strategies", help="list the strategy names this package registers")
    strategies.add_argument("--json", action="store_true", help="print JSON instead of a table")
    strategies.set_defaults(func=_cmd_strategies)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
