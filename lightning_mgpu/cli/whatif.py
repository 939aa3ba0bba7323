"""``lightning-mgpu whatif``: predict the step time on another system from one ``comm_profile.json``.

Flags become a :class:`~lightning_mgpu.whatif.model.Scenario`; the replay is
:func:`~lightning_mgpu.whatif.model.predict`, the levers :func:`~lightning_mgpu.whatif.levers.rank_levers`.
Only the standard library at import time: the package's ``whatif`` is pure Python, rich is
imported to print, torch only to measure compression compute, matplotlib only for the sweep's PNG.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from lightning_mgpu._tables import print_table, table, wide_console
from lightning_mgpu.cli._args import bounded_int, existing_parent

if TYPE_CHECKING:
    from lightning_mgpu.whatif import CompressionCosts, Link, Prediction, ProfiledRun, Scenario

MAX_RANKS = 1_000_000

DESCRIPTION = """\
Predict a training step on another system from one profiled run.

PROFILE is a comm_profile.json written by CommProfiler(export_dir=DIR). The step is
replayed: each bucket becomes ready when it did in the profile, its all-reduce costs
alpha*steps + bytes*2(n-1)/n / busbw on the chosen link, buckets take turns on the link in
DDP's order, and what runs past backward is exposed. Prints predicted step time,
communication, exposed communication, speed-up over one device and scaling efficiency,
then the changes that would help, ranked. docs/whatif.md: the model, its link presets
and their sources, and what it ignores.

--world-size N puts each rank on its own node behind --link; --nodes N
--devices-per-node G adds a level inside the node (--intra-link). Without a link the
link is the one the profile measured.

examples:
  lightning-mgpu whatif comm_profile.json --world-size 2 --link-gbps 1
  lightning-mgpu whatif comm_profile.json --world-size 1,2,4,8,16 --link 10gbe
  lightning-mgpu whatif comm_profile.json --nodes 2 --devices-per-node 8 --link ib-hdr --intra-link nvlink3
  lightning-mgpu whatif comm_profile.json --link 1gbe --compression powersgd --powersgd-rank 4 --json
"""


def _number(expected: str, accepted: Callable[[float], bool]) -> Callable[[str], float]:
    """An argparse ``type`` for a number that ``accepted`` allows; ``expected`` says which in the error."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not accepted(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive_float = _number("a number > 0", lambda value: value > 0 and math.isfinite(value))
_fraction = _number("a number from 0 to 1", lambda value: 0.0 <= value <= 1.0)


def _world_sizes(text: str) -> list[int]:
    parse = bounded_int(MAX_RANKS)
    sizes = [parse(part.strip()) for part in text.split(",") if part.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError(f"expected N or N,N,... (e.g. 1,2,4,8), got {text!r}")
    return sizes


def _existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "whatif",
        help="predict step time at another world size, link, bucket size or compression from one profile",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("profile", nargs="?", metavar="PROFILE.json", help="a comm_profile.json from CommProfiler")
    ranks = parser.add_mutually_exclusive_group()
    ranks.add_argument(
        "--world-size",
        type=_world_sizes,
        default=None,
        metavar="N[,N...]",
        help="ranks, one per node (a list: the scaling curve and a PNG); default: as profiled",
    )
    ranks.add_argument("--nodes", type=bounded_int(MAX_RANKS), default=None, help="nodes (with --devices-per-node)")
    parser.add_argument("--devices-per-node", type=bounded_int(MAX_RANKS), default=1, help="ranks per node (default 1)")
    for prefix, helps in (
        (
            "",
            (
                "a link preset between nodes (--list-links)",
                "payload Gbit/s per direction",
                "a bench-comm --json run over the link",
            ),
        ),
        ("intra-", ("link preset inside a node", "Gbit/s inside a node", "bench-comm inside a node")),
    ):
        link = parser.add_mutually_exclusive_group()
        link.add_argument(f"--{prefix}link", default=None, metavar="NAME", help=helps[0])
        link.add_argument(f"--{prefix}link-gbps", type=_positive_float, default=None, metavar="X", help=helps[1])
        link.add_argument(f"--{prefix}link-bench", type=_existing_file, default=None, metavar="FILE", help=helps[2])
    parser.add_argument(
        "--bucket-cap-mb", type=_positive_float, default=None, metavar="B", help="DDP bucket size (MiB)"
    )
    parser.add_argument(
        "--first-bucket-cap-mb", type=_positive_float, default=None, metavar="B", help="first bucket (default 1 MiB)"
    )
    parser.add_argument(
        "--compression",
        choices=("none", "fp16", "bf16", "powersgd"),
        default=None,
        help="default: as profiled (a casting hook shows as the profile's 2x compression ratio); none: without",
    )
    parser.add_argument("--powersgd-rank", type=bounded_int(1024), default=1, help="PowerSGD rank (default 1)")
    parser.add_argument(
        "--compute-scale", type=_positive_float, default=1.0, metavar="S", help="x forward/backward/optimizer time"
    )
    parser.add_argument(
        "--algorithm", choices=("ring", "tree"), default="ring", help="all-reduce algorithm (default ring)"
    )
    parser.add_argument(
        "--params",
        type=_existing_file,
        default=None,
        metavar="FILE",
        help="the gradients' shapes (JSON), if not in the profile",
    )
    parser.add_argument(
        "--costs",
        choices=("auto", "measure", "none"),
        default="auto",
        help="compression compute: measured on this machine (auto: when its device type is the profile's)",
    )
    parser.add_argument(
        "--costs-file",
        type=_existing_file,
        default=None,
        metavar="FILE",
        help="saved costs: a --json run's inputs.compression_costs",
    )
    parser.add_argument("--threads", type=bounded_int(1024), default=None, help="threads while measuring costs")
    parser.add_argument(
        "--host-busbw-gbps",
        type=_positive_float,
        default=None,
        metavar="X",
        help="CPU/gloo: the host's own busbw (GB/s); default: the profile's",
    )
    parser.add_argument("--no-host", action="store_true", help="CPU/gloo: leave out the host's own cost")
    parser.add_argument(
        "--host-overlap",
        type=_fraction,
        default=None,
        metavar="F",
        help="CPU/gloo: how far host work hides behind the wire, 0..1 (default 1: a NIC moves the bytes)",
    )
    parser.add_argument(
        "--no-contention",
        action="store_true",
        help="hook and host work during backward runs beside it for free (default: it takes backward's cores)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--plot", type=existing_parent, default=None, metavar="PNG", help="where the sweep's PNG goes")
    parser.add_argument("--list-links", action="store_true", help="list the link presets and their sources, then exit")
    parser.set_defaults(func=run, subparser=parser)


# ---------------------------------------------------------------------------- flags -> scenario


def _link(name: Optional[str], gbps: Optional[float], bench: Optional[str]) -> Optional[Link]:
    from lightning_mgpu.whatif import link_from_bench_comm, link_from_gbps, resolve_link

    if name is not None:
        return resolve_link(name)
    if gbps is not None:
        return link_from_gbps(gbps)
    if bench is not None:
        return link_from_bench_comm(bench)
    return None


def _costs(args: argparse.Namespace, run: ProfiledRun) -> tuple[CompressionCosts, str]:
    """Compression compute: from --costs-file, measured here, or none (with the reason)."""
    from lightning_mgpu.whatif.compression import NO_COSTS

    if args.costs_file:
        return _read_costs(args.costs_file), f"from {args.costs_file}"
    if args.costs == "none":
        return NO_COSTS, "not measured (--costs none)"
    if run.device_type == "cuda":
        import torch

        if not torch.cuda.is_available():
            if args.costs == "measure":
                raise ValueError("--costs measure: the profile is from CUDA and this machine has no CUDA device")
            return NO_COSTS, "not measured: the profile is from CUDA and this machine has none"
    from lightning_mgpu.whatif.measure import measure_costs

    ranks = sorted({1, 4, args.powersgd_rank}) if run.has_parameters else []
    costs = measure_costs(run.parameters, powersgd_ranks=ranks, device=run.device_type, threads=args.threads)
    return costs, "measured on this machine"


COSTS_EXPECTED = "saved compression costs: the inputs.compression_costs object of a `lightning-mgpu whatif --json` run"


def _read_costs(path: str) -> CompressionCosts:
    """A ``--costs-file``: the costs object, or a whole ``--json`` output holding it; a
    ProfileError naming the file and what was expected otherwise."""
    from lightning_mgpu.whatif.compression import CompressionCosts
    from lightning_mgpu.whatif.records import ProfileError, read_json

    data = read_json(path, expected=COSTS_EXPECTED)
    inputs = data.get("inputs") if isinstance(data, dict) else None
    if isinstance(inputs, dict) and isinstance(inputs.get("compression_costs"), dict):
        data = inputs["compression_costs"]
    try:
        return CompressionCosts.from_dict(data)
    except (ValueError, TypeError) as error:
        raise ProfileError(f"{path}: {error}; expected {COSTS_EXPECTED}") from None


def build(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[ProfiledRun, Scenario, dict[str, Any]]:
    """The profile, the scenario the flags describe, and the inputs echoed in the report."""
    from lightning_mgpu.whatif import PRESETS, Scenario, System, link_from_profile, load_profile, refuse_one_host_sweep
    from lightning_mgpu.whatif import Link
    from lightning_mgpu.whatif.records import load_parameters

    parameters = load_parameters(args.params) if args.params else None
    run = load_profile(args.profile, parameters=parameters, parameters_source=str(args.params))
    costs, costs_source = _costs(args, run)
    overhead = costs.allreduce_overhead_ms
    inter = _link(args.link, args.link_gbps, args.link_bench) or link_from_profile(run, overhead_ms=overhead)
    if inter is None:
        parser.error(
            f"{args.profile} was profiled on one rank, so it measured no link: name one "
            "(--link NAME, --link-gbps X or --link-bench FILE)"
        )
    intra = _link(args.intra_link, args.intra_link_gbps, args.intra_link_bench)
    per_node = args.devices_per_node
    if per_node > 1 and intra is None:
        if run.device_type != "cpu":
            parser.error(f"--devices-per-node {per_node}: name the link inside a node (--intra-link, e.g. nvlink3)")
        intra = PRESETS["loopback"]
    if args.world_size is not None and per_node > 1 and any(n % per_node for n in args.world_size):
        parser.error(f"--world-size {args.world_size} must be multiples of --devices-per-node {per_node}")
    first_world = args.world_size[0] if args.world_size else None
    nodes = args.nodes or (first_world // per_node if first_world else max(1, run.world_size // per_node))
    if args.link_bench is not None:  # a one-host sweep cannot stand for the link between nodes
        refuse_one_host_sweep(inter, max([nodes, *(n // per_node for n in args.world_size or [])]), args.link_bench)
    host: Optional[Link] = None
    if run.device_type == "cpu" and not args.no_host:
        given = args.host_busbw_gbps
        host = (
            Link(name="host", busbw_gbps=given, source="--host-busbw-gbps")
            if given
            else link_from_profile(run, overhead_ms=overhead)
        )
    system = System(
        nodes=nodes,
        devices_per_node=per_node,
        inter=inter,
        intra=intra,
        algorithm=args.algorithm,
        host=host,
        **({"host_overlap": args.host_overlap} if args.host_overlap is not None else {}),
    )
    scenario = Scenario(
        system=system,
        bucket_cap_mb=args.bucket_cap_mb,
        first_bucket_cap_mb=args.first_bucket_cap_mb,
        compression=run.compression if args.compression is None else args.compression,
        powersgd_rank=args.powersgd_rank,
        compute_scale=args.compute_scale,
        costs=costs,
        shared_compute=not args.no_contention,
        host_contention=not args.no_contention,
    )
    inputs = {
        "profile": {
            "path": str(args.profile),
            "world_size": run.world_size,
            "backend": run.backend,
            "device_type": run.device_type,
            "step_ms": run.step_ms,
            "accumulate_grad_batches": run.accumulate_grad_batches,
            "accumulation_ms": run.accumulation_ms,
            "optimizer_step_ms": run.optimizer_step_ms,
            "forward_ms": run.forward_ms,
            "backward_compute_ms": run.backward_compute_ms,
            "optimizer_ms": run.optimizer_ms,
            "other_ms": run.other_ms,
            "exposed_comm_ms": run.exposed_comm_ms,
            "buckets": [b.bytes for b in run.buckets],
            "gradients_listed": run.has_parameters,
            "compression": run.compression,
        },
        "system": system.as_dict(),
        "bucket_cap_mb": args.bucket_cap_mb,
        "first_bucket_cap_mb": args.first_bucket_cap_mb,
        "compression": scenario.compression,
        "powersgd_rank": args.powersgd_rank,
        "compute_scale": args.compute_scale,
        "contention": not args.no_contention,
        "compression_costs": {**costs.as_dict(), "how": costs_source},
    }
    return run, scenario, inputs


# ---------------------------------------------------------------------------- run and print


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.subparser
    if args.list_links:
        return _list_links(args.json)
    if args.profile is None:
        parser.error("the following argument is required: PROFILE.json (or --list-links)")
    if args.devices_per_node > 1 and args.world_size is None and args.nodes is None:
        parser.error("--devices-per-node needs --nodes N (or --world-size N,...)")
    from lightning_mgpu.whatif import ProfileError, rank_levers, sweep_world_sizes

    try:
        profile, scenario, inputs = build(args, parser)
    except (ProfileError, ValueError) as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    sweep = args.world_size is not None and len(args.world_size) > 1
    if sweep:
        curve = sweep_world_sizes(profile, scenario, args.world_size)
        chosen = curve[-1]
    else:
        from lightning_mgpu.whatif import predict

        chosen = predict(profile, scenario)
        curve = [chosen]
    levers = rank_levers(profile, chosen.scenario)
    plot_path: Optional[Path] = None
    if sweep:
        from lightning_mgpu.whatif.plot import plot_scaling

        target = args.plot or str(Path(args.profile).resolve().parent / "whatif_scaling.png")
        plot_path = plot_scaling(curve, target, title=f"{Path(args.profile).name}: {scenario.label(with_system=False)}")
    if args.json:
        document: dict[str, Any] = {
            "predicted": chosen.as_dict(),
            "inputs": inputs,
            "levers": [lever.as_dict() for lever in levers],
            "assumptions": list(chosen.assumptions),
        }
        if sweep:
            document["sweep"] = [p.as_dict() for p in curve]
            document["plot"] = str(plot_path)
        print(json.dumps(document, indent=2))
        return 0
    _print(profile, curve, levers, plot_path)
    return 0


def _print(profile: ProfiledRun, curve: list[Prediction], levers: list[Any], plot_path: Optional[Path]) -> None:
    console = wide_console()
    scenario = curve[-1].scenario
    accumulated = (
        f" per optimizer step of {profile.accumulate_grad_batches} micro-batches"
        if profile.accumulate_grad_batches > 1 and profile.accumulation_ms > 0
        else "/step"
    )
    title = (
        f"predicted from {profile.source} ({profile.world_size} rank(s), {profile.device_type}, "
        f"{profile.optimizer_step_ms:.1f} ms{accumulated} profiled)"
    )
    columns = ("ranks", "system", "step (ms)", "comm (ms)", "exposed (ms)", "speed-up", "efficiency")
    rows = [
        [str(p.world_size), p.scenario.label()]
        + [f"{ms:,.1f}" for ms in (p.step_ms, p.comm_ms, p.exposed_comm_ms)]
        + [f"{p.speedup:.2f}x", f"{100 * p.efficiency:.0f}%"]
        for p in curve
    ]
    console.print(table(title, columns, rows, left=2))
    console.print(f"levers at {scenario.system.world_size} rank(s), best first:", style="bold", highlight=False)
    for lever in levers:
        console.print(f"  {lever.sentence()}", highlight=False)
    for note in curve[-1].assumptions:
        console.print(f"note: {note}", style="dim", highlight=False)
    if plot_path is not None:
        console.print(f"wrote {plot_path}", highlight=False)


def _list_links(as_json: bool) -> int:
    from lightning_mgpu.whatif import PRESETS

    if as_json:
        print(json.dumps([link.as_dict() for link in PRESETS.values()], indent=2))
        return 0
    rows = [
        [link.name, link.nominal, "-" if math.isinf(link.busbw_gbps) else f"{link.busbw_gbps:.3g}"]
        + [f"{link.latency_us:g}", link.source]
        for link in PRESETS.values()
    ]
    print_table(
        "link presets (--link NAME); busbw = what an all-reduce sustains, GB/s = 10^9 B/s",
        ("name", "nominal", "busbw (GB/s)", "latency/step (us)", "source"),
        rows,
        left=5,
    )
    return 0
