"""``lightning-mgpu doctor``, the machine check: is this machine (and this shell) ready for multi-process training?

The checks and the JSON report are :mod:`lightning_mgpu.envcheck`; those that start processes are
:mod:`lightning_mgpu.cli._allreduce` and (``--selftest``) :mod:`lightning_mgpu.cli._selftest`, their
programs in :mod:`lightning_mgpu.cli.workers`. This module parses the flags and prints the report as
a table (or JSON). ``--rules`` lists the rules of the ``DistributedDoctor`` callback
(:mod:`lightning_mgpu.callbacks.doctor`), which watches a run as it trains.

Started by a launcher on several ranks (``srun``, ``torchrun --nnodes=N``: its variables set), the
command checks every node and prints one report from rank 0 (:mod:`lightning_mgpu.cli._across_nodes`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from lightning_mgpu import envcheck  # standard library only at import: fine for --help
from lightning_mgpu.cli._allreduce import SMOKE_TIMEOUT_S, check_smoke
from lightning_mgpu.cli._args import bounded_int, positive_seconds

MAX_TIMEOUT_S = 3600.0  # a health check that may wait longer is a mistake


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check this machine for multi-process training (versions, devices, backends, a real all_reduce, "
        "launcher environment, limits)",
        description="Check this machine and shell for multi-process training. Every line is ok, warn or fail, "
        "with how to fix each warn and fail; the exit code is 1 when anything fails.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--skip-allreduce", action="store_true", help="skip the multi-process all_reduce tests")
    parser.add_argument(
        "--timeout",
        type=positive_seconds(MAX_TIMEOUT_S),
        default=SMOKE_TIMEOUT_S,
        metavar="SECONDS",
        help=f"limit for each all_reduce test, start-up included (default {SMOKE_TIMEOUT_S:g}); with --selftest, "
        "for each path (default 300)",
    )
    parser.add_argument("--rules", action="store_true", help="list the DistributedDoctor callback's rules and exit")
    parser.add_argument(
        "--selftest",
        action="store_true",
        help="run every CUDA path of the package on the GPUs there are (NCCL DDP, CUDA-event profiling, AMP with "
        "each compression, hybrid across cuda:0 and the CPU and across GPUs, the pipeline's copy streams), each in "
        "its own process, and report pass/fail with timings; without a GPU it says so and exits 0",
    )
    parser.add_argument(
        "--selftest-jobs",
        type=bounded_int(16),
        default=1,
        metavar="N",
        help="with --selftest: run up to N paths at once, each its own process (default 1: one after another; "
        "the paths' own timings then include the others' load)",
    )
    parser.add_argument(
        "--selftest-device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: run the self-test's code on CPU stand-ins (gloo, bf16-mixed, CPU stages), to check the "
        "self-test itself (default cuda)",
    )
    parser.set_defaults(func=run, subparser=parser)


def run(args: argparse.Namespace) -> int:
    if args.rules:
        print_rules()
        return 0
    started = time.perf_counter()
    world = None if args.selftest else _launched_world()
    if world is not None:
        from lightning_mgpu.cli import _across_nodes

        result, prints = _across_nodes.run(os.environ, world, timeout=args.timeout, allreduce=not args.skip_allreduce)
    else:
        if args.selftest:
            from lightning_mgpu.cli._selftest import PATH_TIMEOUT_S, run_selftest

            timeout = args.timeout if args.timeout != SMOKE_TIMEOUT_S else PATH_TIMEOUT_S
            checks = run_selftest(device=args.selftest_device, timeout=timeout, jobs=args.selftest_jobs)
        else:
            smoke = None if args.skip_allreduce else lambda backend, world: check_smoke(backend, world, args.timeout)
            checks = envcheck.collect(os.environ, smoke=smoke)
        result, prints = envcheck.report(checks, time.perf_counter() - started), True
    if prints and args.json:
        print(json.dumps(result, indent=2))
    elif prints:
        print_report(result)
    return 1 if result["status"] == "fail" else 0


def _launched_world() -> Any:
    """The launcher's world of several ranks this command was started in (None: run as on one machine)."""
    from lightning_mgpu.comm.launched import launched_world

    try:
        return launched_world(os.environ)
    except ValueError:  # a malformed launcher variable: the "launcher" check of the one-machine report names it
        return None


def print_report(result: dict[str, Any]) -> None:
    """The report as a table, then one line per warn and fail with its fix."""
    from rich.console import Console
    from rich.table import Table

    colours = {"ok": "green", "warn": "yellow", "fail": "bold red"}
    counts = result["counts"]
    console = Console()
    console.print(
        f"lightning-mgpu doctor: {counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail "
        f"({result['elapsed_s']:.1f} s)",
        soft_wrap=True,
    )
    table = Table()
    table.add_column("check", style="bold")
    table.add_column("status")
    table.add_column("value", overflow="fold")
    for check in result["checks"]:
        table.add_row(check["name"], f"[{colours[check['status']]}]{check['status']}[/]", check["value"])
    console.print(table)
    for check in result["checks"]:
        if check["fix"]:
            console.print(f"[{colours[check['status']]}]{check['status']}[/] {check['name']}: {check['fix']}")


def print_rules() -> None:
    """One block per rule: readable at any terminal width."""
    from lightning_mgpu.callbacks.doctor.rules import table_rows

    print("DistributedDoctor rules (DistributedDoctor(disable=['<id>', ...]) turns one off)\n")
    for rule_id, catches, detection, cost, fix in table_rows():
        print(f"{rule_id}\n  catches:  {catches}\n  detected: {detection}\n  cost:     {cost}\n  fix:      {fix}\n")
