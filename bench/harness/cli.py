"""The command line every benchmark shares: ``--quick``, ``--out`` and the options of its launches.

* :func:`parser`: a parser whose description is the module docstring's first paragraph;
* :func:`add_launch_options`: ``--quick``, ``--out``, ``--accelerator``, ``--nproc``, ``--threads``,
  ``--launch-timeout`` and the internal ``--worker-out`` (set by :func:`bench.harness.launch.launch`
  for the ranks it starts);
* :func:`finish`: ``--quick``'s values applied (flags given explicitly win), ``--threads``
  defaulted to the cores per rank, and counts that must be >= 1 checked.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence


def parser(doc: Optional[str]) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        description=(doc or "").split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )


def add_launch_options(
    parser: argparse.ArgumentParser, *, out: Path, quick: dict[str, Any], timeout: float, launches: str = "launch"
) -> None:
    """The options of a benchmark that launches its ranks (:mod:`bench.harness.launch`)."""
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {quick} unless given explicitly")
    parser.add_argument("--out", type=Path, default=out, help="JSON report (%(default)s)")
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo; cuda: nccl")
    parser.add_argument("--nproc", type=int, default=2, help=f"processes (ranks) per {launches} (2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (cores // nproc)")
    parser.add_argument("--launch-timeout", type=float, default=timeout, help=f"seconds per {launches} (%(default)s)")
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)


def apply_quick(args: argparse.Namespace, argv: Optional[Sequence[str]], quick: dict[str, Any]) -> None:
    """``--quick``: set the smoke-run values of ``quick`` on ``args``, except flags given explicitly."""
    if not getattr(args, "quick", False):
        return
    given = {
        a.split("=")[0].lstrip("-").replace("-", "_")
        for a in (argv if argv is not None else sys.argv[1:])
        if a.startswith("--")
    }
    for name, value in quick.items():
        if name not in given:
            setattr(args, name, value)


def finish(
    parser: argparse.ArgumentParser,
    argv: Optional[Sequence[str]],
    quick: dict[str, Any],
    *,
    positive: Sequence[str] = (),
) -> argparse.Namespace:
    """Parse ``argv``, apply ``--quick``, default ``--threads`` and check that each of ``positive`` is >= 1."""
    args = parser.parse_args(argv)
    apply_quick(args, argv, quick)
    for name in positive:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"argument --{name.replace('_', '-')}: must be >= 1, got {value}")
    if getattr(args, "threads", 0) is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.nproc)
    return args


def names(text: str, allowed: Sequence[str], flag: str, parser: argparse.ArgumentParser) -> list[str]:
    """A comma-separated list of names from ``allowed`` (``--models mlp,cnn``); a parser error otherwise."""
    chosen = [name.strip() for name in str(text).split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(allowed))
    if unknown or not chosen:
        parser.error(f"argument {flag}: unknown {unknown or 'empty list'}; choose from {', '.join(allowed)}")
    return chosen
