"""``lightning-mgpu tune``: the bucket-size sweep of ``bucket_cap_mb="auto"``, run offline.

Parses the flags, starts the sweep (:mod:`lightning_mgpu.cli.workers.tune`) in ``--nproc``
processes with ``torch.distributed.run``, and prints its table and recommendation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

from lightning_mgpu._target import SYNTAX
from lightning_mgpu.cli import workers
from lightning_mgpu.cli._args import bounded_int, output_dir, positive_seconds, target

DEFAULT_TIMEOUT_S = 1800.0
# Beyond these a value is a mistake: refused before anything starts.
MAX_PROCESSES = 1024
MAX_COUNT = 1_000_000
MAX_TIMEOUT_S = 7 * 24 * 3600.0

DESCRIPTION = """\
Run the bucket-size search of TunedDDPStrategy(bucket_cap_mb="auto") offline.

TARGET names a function, as FILE.py:FUNCTION or MODULE:FUNCTION, that takes no argument
and returns a LightningModule (its train_dataloader is used) or (module, dataloader).
The command starts --nproc processes with torch.distributed.run (127.0.0.1 only), fits
the module with TunedDDPStrategy(bucket_cap_mb="auto") until the search is over (the
training itself is thrown away), prints the table of bucket size -> step time and writes
tune.json and tune.png to --out-dir. Pass the size it recommends to
TunedDDPStrategy(bucket_cap_mb=...), or let "auto" find it during the real run.

examples:
  lightning-mgpu tune my_project/train.py:make_module --nproc 2
  lightning-mgpu tune my_package.models:build --accelerator cuda --nproc 8 --rounds 4
"""


def _sizes(text: str) -> str:
    """Comma-separated MiB, checked like ``tune_candidates``; kept as text for the workers."""
    from lightning_mgpu.tuning.plan import check_candidates

    try:
        values = [float(part) for part in text.split(",") if part.strip()]
        sizes = check_candidates("sizes", values)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated sizes in MiB such as 1,4,16,64 ({exc}), got {text!r}"
        ) from None
    return ",".join(f"{s:g}" for s in sizes)


def register(subparsers: Any) -> None:
    counts, processes = bounded_int(MAX_COUNT), bounded_int(MAX_PROCESSES)
    parser = subparsers.add_parser(
        "tune",
        help="measure DDP step time per gradient-bucket size for your LightningModule (table + plot)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", type=target, metavar="TARGET", help=SYNTAX)
    parser.add_argument("--nproc", type=processes, default=None, help="processes (default: every GPU; 2 on CPU)")
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--rounds", type=counts, default=3, help="visits per layout, alternating order (3)")
    parser.add_argument("--measure", type=counts, default=8, help="timed steps per visit (8)")
    parser.add_argument(
        "--sizes",
        type=_sizes,
        default=None,
        metavar="MIB,...",
        help="candidate bucket sizes in MiB (default 1,2,4,...,256); DDP's default 25 is always added",
    )
    parser.add_argument(
        "--out-dir", type=output_dir, default=Path("tune"), help="where tune.json and tune.png go (./tune)"
    )
    parser.add_argument("--threads", type=processes, default=None, help="torch threads per rank on CPU (cores / nproc)")
    parser.add_argument(
        "--timeout",
        type=positive_seconds(MAX_TIMEOUT_S),
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"stop everything after this long (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.set_defaults(func=run, subparser=parser)


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.splitlines()[-lines:])


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.subparser
    from lightning_mgpu._target import TargetError, load_target

    # Import the target here first: a typo is one line now, not a traceback from every rank.
    try:
        load_target(args.target)
    except TargetError as exc:
        parser.error(f"argument TARGET: {exc}")

    import torch

    accelerator = args.accelerator or ("cuda" if torch.cuda.is_available() else "cpu")
    if accelerator == "cuda" and not torch.cuda.is_available():
        parser.error("argument --accelerator: cuda requested but torch sees no GPU")
    nproc = args.nproc or (torch.cuda.device_count() if accelerator == "cuda" else 2)
    if accelerator == "cuda" and nproc > torch.cuda.device_count():
        parser.error(f"argument --nproc: {nproc} processes but only {torch.cuda.device_count()} GPU(s)")
    threads = args.threads or max(1, (os.cpu_count() or 1) // nproc)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "tune.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "lightning_mgpu.cli.workers.tune",
        "--target",
        args.target,
        "--out",
        str(out.resolve()),
        "--accelerator",
        accelerator,
        "--rounds",
        str(args.rounds),
        "--measure",
        str(args.measure),
    ]
    if args.sizes:
        command += ["--candidates", args.sizes]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    if accelerator == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    if out.exists():
        out.unlink()
    print(
        f"tuning {args.target}: {nproc} process(es) on {accelerator}, {args.rounds} rounds x {args.measure} timed steps"
    )
    # Its own session: at the timeout the launcher and every rank it started go together.
    code, output = workers.run(command, args.timeout, env)
    if code == workers.TIMED_OUT:
        print(_tail(output), file=sys.stderr)
        print(f"{parser.prog}: error: the sweep did not finish within --timeout {args.timeout:g} s", file=sys.stderr)
        return 1
    if code != 0 or not out.exists():
        # A mistake the worker recognised (e.g. the function returned no LightningModule) is
        # one line from each rank: show it alone, without the launcher's traceback.
        known = sorted({line for line in output.splitlines() if line.startswith(f"{parser.prog}: error:")})
        if known:
            print("\n".join(known), file=sys.stderr)
            return 1
        print(_tail(output), file=sys.stderr)
        print(
            f"{parser.prog}: error: the sweep failed (exit code {code}); its last lines are above",
            file=sys.stderr,
        )
        return 1
    result: dict[str, Any] = json.loads(out.read_text())  # plain JSON, never unpickled
    return _report(result, args.out_dir)


def _report(result: dict[str, Any], out_dir: Path) -> int:
    from lightning_mgpu.tuning import report

    record = result["tuning"]
    if not any("step_ms" in c for c in record.get("candidates", [])):
        print(f"Nothing to compare: {record.get('reason') or record.get('status')}.")
        print(f"wrote {out_dir / 'tune.json'}")
        return 0
    report.print_table(result)
    chosen: Optional[float] = record.get("chosen_mb")
    gain = record.get("gain_over_default")
    is_default = any(c["is_default"] and c["cap_mb"] == chosen for c in record["candidates"])
    if is_default:
        print(
            f"recommended: keep DDP's default bucket size (no other layout was at least 2% faster); chosen_mb={chosen:g}"
        )
    else:
        verdict = f"recommended: TunedDDPStrategy(bucket_cap_mb={chosen:g})"
        if gain is not None:
            verdict += f" ({-gain:+.1%} step time vs DDP's default 25 MiB)"
        print(verdict)
    png = report.plot(result, out_dir / "tune.png")
    print(f"wrote {out_dir / 'tune.json'} and {png}")
    return 0
