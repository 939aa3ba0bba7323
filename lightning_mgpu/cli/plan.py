"""``lightning-mgpu plan``: how a model would be split over K devices, under each balance mode.

Parses the flags, builds the model from the target, measures each layer on one micro-batch
with the package's one profiler (:mod:`lightning_mgpu.placement.planning.profile`), plans it with
every balance mode (:func:`lightning_mgpu.placement.planning.plan.plan_stages`) and prints the
plans side by side. With ``--split-points`` (any model), each stage between them is measured
instead, the model running its own forward on one micro-batch of ``--shape``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING, Any

from lightning_mgpu._target import SYNTAX
from lightning_mgpu.cli._args import bounded_int, existing_parent, positive_size, target

if TYPE_CHECKING:  # torch underneath: imported when the command runs, not for --help
    from lightning_mgpu.placement.planning.plan import PlacementPlan

_DTYPES = ("float32", "float16", "bfloat16", "float64", "long", "int")
# Beyond these a value is a mistake: refused before anything is built or measured.
_LIMITS = {"devices": 1024, "microbatches": 1_000_000, "repeats": 10_000, "high": 2**63 - 1}
MAX_SAMPLE_ELEMENTS = 2**31

DESCRIPTION = """\
Show how a model would be split over K devices, under each balance mode.

TARGET names a function, as FILE.py:FUNCTION or MODULE:FUNCTION (imported with the
current directory on the path), that takes no argument and returns an nn.Sequential, or a
module whose only nn.Sequential child (or --split-module) is what gets split. --shape is
the shape of one batch of that sequential's input; each layer is measured on one
micro-batch of it, then planned with balance "time", "memory" and "params" and printed
side by side, each plan judged by the measured time of its slowest stage.

examples:
  lightning-mgpu plan mypkg.models:build --shape 64,16 --devices 2
  lightning-mgpu plan models.py:build --shape 8,512 --dtype long --high 32000 --devices 4 --microbatches 8
  lightning-mgpu plan models.py:gpt2 --shape 8,128 --dtype long --high 50257 --split-points transformer.h.6
"""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="show how a model would be split over K devices (time / memory / params balance)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("factory", type=target, metavar="TARGET", help=f"a function returning the model: {SYNTAX}")
    parser.add_argument("--shape", required=True, help="shape of one batch of the split module's input, e.g. 64,512")
    parser.add_argument("--dtype", default="float32", choices=_DTYPES, help="input dtype (long/int for token ids)")
    parser.add_argument(
        "--high",
        type=bounded_int(_LIMITS["high"]),
        default=2,
        help="token ids are drawn from [0, HIGH) for integer dtypes",
    )
    parser.add_argument(
        "--devices", type=bounded_int(_LIMITS["devices"]), default=2, help="K, devices per replica (default 2)"
    )
    parser.add_argument(
        "--microbatches",
        type=bounded_int(_LIMITS["microbatches"]),
        default=1,
        help="M, micro-batches per step (default 1)",
    )
    parser.add_argument("--split-module", default=None, help="attribute holding the nn.Sequential, if not the only one")
    parser.add_argument(
        "--split-points",
        default=None,
        metavar="NAMES",
        help="comma-separated qualified submodule names where stages 1.. begin (any model, as "
        "HybridParallelStrategy(split_points=...)); --devices becomes their count + 1 and --shape is the model's input",
    )
    parser.add_argument(
        "--threads",
        type=bounded_int(4096),
        default=None,
        help="intra-op threads while measuring (default: this machine's threads / --devices, as a stage gets in a fit)",
    )
    parser.add_argument("--device", default="cpu", help="where to measure (cpu, cuda, cuda:1 ...)")
    parser.add_argument(
        "--capacity",
        type=positive_size,
        default=None,
        metavar="SIZE",
        help="memory per device, e.g. 80GiB (default: no limit)",
    )
    parser.add_argument(
        "--repeats", type=bounded_int(_LIMITS["repeats"]), default=5, help="timed runs per layer (median; default 5)"
    )
    parser.add_argument(
        "--json", type=existing_parent, default=None, metavar="PATH", help="also write the plans as JSON"
    )
    parser.set_defaults(func=run, subparser=parser)


def _shape(parser: argparse.ArgumentParser, text: str, microbatches: int) -> list[int]:
    try:
        shape = [int(part) for part in text.lower().replace("x", ",").split(",")]
    except ValueError:
        parser.error(f"argument --shape: expected sizes like 64,512, got {text!r}")
    if not shape or any(size < 1 for size in shape):
        parser.error(f"argument --shape: every size must be >= 1, got {text!r}")
    elements = -(-shape[0] // microbatches) * math.prod(shape[1:])  # one micro-batch is measured
    if elements > MAX_SAMPLE_ELEMENTS:
        parser.error(
            f"argument --shape: a micro-batch of {text!r} has {elements} elements, more than "
            f"{MAX_SAMPLE_ELEMENTS}; measure on a smaller batch (costs scale with it)"
        )
    return shape


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.subparser
    shape = _shape(parser, args.shape, args.microbatches)
    if args.split_module is not None and not args.split_module.strip():
        parser.error("argument --split-module: expected an attribute name, got ''")
    capacity = None if args.capacity is None else float(args.capacity)

    import torch

    from lightning_mgpu._target import TargetError, load_target
    from lightning_mgpu.placement.planning.plan import BALANCE_MODES, plan_stages
    from lightning_mgpu.placement.planning.profile import profile_batch_size, profile_blocks, profile_layers
    from lightning_mgpu.placement.planning.split_points import check_split_points

    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        parser.error(f"argument --device: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        parser.error(
            f"argument --device: {device} is not on this machine ({count} GPU(s) visible: cuda:0 to cuda:{count - 1})"
        )
    try:
        factory = load_target(args.factory)
    except TargetError as exc:
        parser.error(f"argument TARGET: {exc}")
    try:
        model = factory()
    except Exception as exc:  # the user's own code: one line, as for an import that fails
        parser.error(f"calling {args.factory}() failed: {type(exc).__name__}: {exc}")
    threads = args.threads or max(1, torch.get_num_threads() // args.devices)
    points = None if args.split_points is None else [p.strip() for p in args.split_points.split(",") if p.strip()]
    if points is not None:
        try:
            check_split_points(model, points, len(points) + 1)
        except ValueError as exc:
            parser.error(f"argument --split-points: {exc}")
        seq = model
    else:
        seq = _find_sequential(parser, model, args.split_module)
        if len(seq) < args.devices:
            parser.error(f"the nn.Sequential has {len(seq)} layers, fewer than --devices {args.devices}")
    micro_batch = profile_batch_size(shape[0], args.microbatches, seq)
    dtype = {"long": torch.long, "int": torch.int}.get(args.dtype) or getattr(torch, args.dtype)
    sample_shape = (micro_batch, *shape[1:])
    try:
        if dtype in (torch.long, torch.int):
            sample = torch.randint(0, args.high, sample_shape, dtype=dtype)
        else:
            sample = torch.randn(sample_shape, dtype=dtype)
    except (RuntimeError, MemoryError, OverflowError) as exc:
        parser.error(f"argument --shape: cannot make a sample of shape {list(sample_shape)} ({args.dtype}): {exc}")
    try:
        if points is None:
            layers = profile_layers(seq, sample, device=device, repeats=args.repeats, threads=threads)
        else:  # the stages themselves: the model's start, then each split point to the next
            model.to(device).train()
            given = sample.to(device)
            layers = profile_blocks(
                model, points, lambda: model(given), repeats=args.repeats, threads=threads, lead=True
            )
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        parser.error(f"running the model on a sample of shape {list(sample_shape)} ({args.dtype}) failed: {exc}")
    if points is not None:
        return _print_stages(args, points, layers, sample_shape, threads)

    from rich.console import Console
    from rich.table import Table

    console = Console()
    devices = [f"{device.type}:{i}" if device.type != "cpu" else f"cpu{i}" for i in range(args.devices)]
    plans = {}
    for balance in BALANCE_MODES:
        try:
            plan = plan_stages(
                layers, devices, balance, microbatches=args.microbatches, capacity=[capacity] * args.devices
            )
        except ValueError as exc:
            console.print(f"[bold]balance={balance!r}[/]: [red]{exc}[/]")
            continue
        plans[balance] = plan
        console.print(plan.table(title=f"balance={balance!r}: {len(layers)} layers over {args.devices} devices"))
    if not plans:
        print(f"{parser.prog}: error: no balance mode found a placement that fits", file=sys.stderr)
        return 1
    best = min(plans.values(), key=_slowest_stage_ms)
    summary = Table(title=f"{args.factory}: micro-batch {list(sample_shape)}, M={args.microbatches}")
    for column in ("balance", "sizes", "slowest stage ms", "largest stage memory", "ideal speed-up"):
        summary.add_column(column, justify="left" if column in ("balance", "sizes") else "right")
    for name, plan in plans.items():
        mark = " (fastest)" if plan is best else ""
        summary.add_row(
            name + mark,
            str(plan.sizes),
            f"{_slowest_stage_ms(plan):.3f}",
            f"{max(plan.stage_memory_bytes or [0]) / 2**20:.1f} MiB",
            f"{plan.ideal_speedup:.2f}x",
        )
    console.print(summary)
    if args.json:
        payload = {
            "factory": args.factory,
            "sample_shape": list(sample_shape),
            "plans": {k: p.as_dict() for k, p in plans.items()},
        }
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=2)
        print(f"wrote {args.json}")
    return 0


def _print_stages(
    args: argparse.Namespace, points: list[str], stages: list[Any], sample_shape: Any, threads: int
) -> int:
    """``--split-points``: one row per stage as the split points make them (measured, no planning)."""
    from rich.console import Console

    from lightning_mgpu.placement.planning.plan import PlacementPlan

    k = len(points) + 1
    plan = PlacementPlan([f"from {stage.name}" for stage in stages], [1] * k, "split_points", args.microbatches, stages)
    title = f"{args.factory}: split points {points}, micro-batch {list(sample_shape)}, {threads} thread(s)"
    Console().print(plan.table(title=title))
    if args.json:
        payload = {
            "factory": args.factory,
            "split_points": points,
            "stage_time_ms": plan.stage_time_ms,
            "stage_param_bytes": [stage.param_bytes for stage in stages],
            "sample_shape": list(sample_shape),
            "plan": plan.as_dict(),
        }
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=2)
        print(f"wrote {args.json}")
    return 0


def _slowest_stage_ms(plan: PlacementPlan) -> float:
    # Plans made here come from measured layers: every stage has a time.
    return max(plan.stage_time_ms or [0.0])


def _find_sequential(parser: argparse.ArgumentParser, model: Any, split_module: Any) -> Any:
    """The nn.Sequential to split: ``model`` itself, its ``--split-module``, or its only nn.Sequential child."""
    from torch import nn

    if split_module:
        try:
            found = model.get_submodule(split_module)
        except AttributeError:
            found = None
        if not isinstance(found, nn.Sequential):
            parser.error(f"--split-module {split_module!r} is not an nn.Sequential of {type(model).__name__}")
        return found
    if isinstance(model, nn.Sequential):
        return model
    if not isinstance(model, nn.Module):
        parser.error(f"the factory returned {type(model).__name__}, not an nn.Module")
    candidates = [child for child in model.children() if isinstance(child, nn.Sequential)]
    if len(candidates) != 1:
        parser.error(
            f"{type(model).__name__} has {len(candidates)} nn.Sequential children; name one with --split-module"
        )
    return candidates[0]
