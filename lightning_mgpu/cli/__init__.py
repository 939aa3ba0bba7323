"""The ``lightning-mgpu`` console script: one module per command.

Each command module has ``register(subparsers)``, which adds its parser using the standard
library only, and a ``run(args)`` that imports what the command needs (torch, Lightning, the
package's features) when it runs. So ``lightning-mgpu --help`` and ``lightning-mgpu COMMAND
--help`` import neither torch nor Lightning. A new command is a new module listed in
``COMMANDS``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from lightning_mgpu.cli import bench_comm, doctor, plan, strategies, tune, whatif

# In the order ``--help`` lists them.
COMMANDS = (strategies, doctor, bench_comm, tune, plan, whatif)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-mgpu",
        description="Multi-GPU training for PyTorch Lightning: strategies, profiling and checks.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``lightning-mgpu ARGV``; returns the exit code (argument errors exit 2 through argparse)."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


__all__ = ["COMMANDS", "build_parser", "main"]

if __name__ == "__main__":  # pragma: no cover - `python -m lightning_mgpu.cli` runs __main__.py
    sys.exit(main())
