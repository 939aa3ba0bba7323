"""``lightning-mgpu strategies``: the ``Trainer(strategy=...)`` names this package registers."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("strategies", help="list the strategy names this package registers")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run, subparser=parser)


def run(args: argparse.Namespace) -> int:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_mgpu
    from lightning_mgpu._registration import register_strategies

    register_strategies()  # done already when Lightning loaded; again costs nothing and says so here
    rows = [
        {
            "name": name,
            "description": StrategyRegistry[name]["description"],
            "options": StrategyRegistry[name]["init_params"],
        }
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
