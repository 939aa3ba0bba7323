"""Where a 1-rank prediction's error comes from, on a model ``bench/models.py`` does not have (a residual MLP).

``lightning-mgpu whatif`` predicts a 2-node step from a 1-rank profile and a link. On the network
lab (:mod:`bench.labs.network`: both "nodes" on this machine's cores), four inputs are compared
against the measured 2-node step, each adding one effect to the one before:

1. ``nominal``: the configured rate (``--link-gbps R``);
2. ``achieved``: the rate a raw TCP transfer achieved over the link (what TCP delivers of the nominal);
3. ``bench_comm``: ``lightning-mgpu bench-comm`` run across the two nodes (torchrun, one rank each);
4. ``shared_profile``: (3) with the 1-rank profile taken while a second copy of the same run
   computes beside it (the two lab nodes share the cores: compute against compute).

What is left after (4) is what the 1-rank profile cannot see: each lab rank's backward competing
with the gradients' transfer for the same cores (gloo's threads, and the kernel's TCP, veth and
``tbf`` work for *both* ends of the link, all on this machine). On real nodes the other end's work
runs elsewhere and the NIC moves the bytes: that part belongs to the lab, not to the link. The
2-node run's own profile is kept to show it (its forward + backward against the 1-rank profile's).

    python -m bench.whatif_sources               # bench/results/whatif_sources.json (root; about 2 minutes)
    python -m bench.whatif_sources --rates 1     # one rate

On a machine with other work running, single 2-node runs move by tens of percent (the lab's two
"nodes" and everything else share the cores): each rate is measured ``--rounds`` times and the
median kept, with the load average beside each round.

The model: ``Linear(256, 1024)``, two residual blocks ``x + Linear(2048, 1024)(relu(Linear(1024, 2048)(LayerNorm(x))))``,
``Linear(1024, 16)``: 8.7 M parameters, 33 MiB of gradients; batch 64, SGD, ``ddp_tuned`` with default buckets,
one thread per rank. ``--worker`` is one rank's fit (started by the script itself).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from bench import REPO_ROOT, RESULTS, pythonpath_with_repo
from bench.harness import cli, launch
from bench.harness.report import machine_facts, write_json
from bench.labs import network

DEFAULT_OUT = RESULTS / "whatif_sources.json"
RATES = (1.0, 2.5)
STEPS, WARMUP = 28, 8
INPUTS = ("nominal", "achieved", "bench_comm", "shared_profile")
TORCHRUN_1 = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]


# ----------------------------------------------------------------------------- one rank's fit (--worker)


def fit(profile_dir: Path, steps: int, out: Optional[Path]) -> None:
    """Train the residual MLP ``steps`` steps on this launch's ranks; rank 0 writes the median step after the warm-up."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from bench.harness import worker
    from lightning_mgpu import CommProfiler, TunedDDPStrategy

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm, self.up, self.down = (
                nn.LayerNorm(width),
                nn.Linear(width, 2 * width),
                nn.Linear(2 * width, width),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = x + self.down(torch.relu(self.up(self.norm(x))))
            return out

    worker.start(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), Block(1024), Block(1024), nn.Linear(1024, 16))
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(2048, 256, generator=generator), torch.randn(2048, 16, generator=generator))
    timer = worker.StepTimer()
    profiler = CommProfiler(
        warmup_steps=WARMUP,
        profile_steps=steps - WARMUP,
        profile_every=None,
        every_n_steps=10_000,
        timeline_steps=1,
        export_dir=profile_dir,
    )
    trainer = worker.trainer(
        TunedDDPStrategy(), max_steps=steps, callbacks=[worker.time_each_step(timer), profiler], max_epochs=-1
    )
    trainer.fit(worker.regression(model, nn.functional.mse_loss), DataLoader(data, batch_size=64))
    if trainer.global_rank == 0 and out is not None:
        out.write_text(json.dumps({"median_ms": statistics.median(timer.step_ms()[WARMUP:])}))


# ----------------------------------------------------------------------------- the driver


def _worker_argv(profile_dir: Path, out: Optional[Path], steps: int = STEPS) -> list[str]:
    argv = ["-m", "bench.whatif_sources", "--worker", "--profile-dir", str(profile_dir), "--steps", str(steps)]
    return [*argv, *(["--worker-out", str(out)] if out else [])]


def one_rank_profile(scratch: Path, tag: str, *, beside: bool) -> dict[str, Any]:
    """A 1-rank profile on loopback; ``beside``: with a second copy computing at the same time."""
    env = {**os.environ, "PYTHONPATH": pythonpath_with_repo(), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    companion = None
    if beside:  # longer than the profiled run, started first: it computes through all of it
        argv = [sys.executable, *TORCHRUN_1, *_worker_argv(scratch / f"{tag}_companion", None, steps=2 * STEPS)]
        companion = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(5)
    try:
        argv = [sys.executable, *TORCHRUN_1, *_worker_argv(scratch / tag, scratch / f"{tag}.json")]
        subprocess.run(argv, env=env, cwd=REPO_ROOT, check=True, capture_output=True, timeout=600)
    finally:
        if companion is not None:
            try:
                companion.wait(timeout=600)
            except subprocess.TimeoutExpired:
                launch.end_tree(companion)
    profile: dict[str, Any] = json.loads((scratch / tag / "comm_profile.json").read_text())
    return profile


def predict_ms(profile: dict[str, Any], link: Any) -> float:
    from lightning_mgpu.whatif import Scenario, System, load_profile, predict

    return float(predict(load_profile(profile), Scenario(system=System(nodes=2, inter=link))).step_ms)


def compute_ms(profile: dict[str, Any]) -> float:
    """Forward + backward compute of one profiled step (ms)."""
    from lightning_mgpu.whatif import load_profile

    run = load_profile(profile)
    return float(run.forward_ms + run.backward_compute_ms)


def decompose(row: dict[str, Any]) -> dict[str, Any]:
    """Each input's error against the measured step, and how many points each effect took off it (pure)."""
    measured = row["measured_ms"]
    errors = {name: 100.0 * (row["predicted_ms"][name] - measured) / measured for name in INPUTS}
    steps = {
        "tcp_below_nominal": errors["achieved"] - errors["nominal"],
        "link_curve": errors["bench_comm"] - errors["achieved"],
        "compute_beside_compute": errors["shared_profile"] - errors["bench_comm"],
        "left_transfer_beside_backward": -errors["shared_profile"],
    }
    return {"error_pct": errors, "points": steps}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_mgpu.whatif import link_from_bench_comm, link_from_gbps

    from bench.whatif import bench_comm_sweep

    scratch = Path(tempfile.mkdtemp(prefix="whatif_sources_"))
    alone = one_rank_profile(scratch, "alone", beside=False)
    shared = one_rank_profile(scratch, "beside", beside=True)
    rows = []
    network.handle_signals()
    with network.Lab(2, args.rates[0]) as lab:
        for rate in args.rates:
            lab.set_rates(rate)
            achieved = min(lab.measure_both_ways(args.probe_seconds)["measured_gbps"])
            sweep = bench_comm_sweep(lab, max_bytes=32 << 20, scratch=scratch / f"bench_comm_{rate:g}")
            measured, lab_compute, loads = [], [], []
            for index in range(args.rounds):  # a shared machine's other work moves single runs: the median of rounds
                tag = f"lab_{rate:g}_{index}"
                out = scratch / f"{tag}.json"
                runs = launch.run(
                    _worker_argv(scratch / tag, out), nproc_per_node=1, timeout=600, lab=lab, cwd=REPO_ROOT
                )
                launch.check(runs, f"the 2-node fit at {rate:g} Gbit/s")
                measured.append(json.loads(out.read_text())["median_ms"])
                lab_compute.append(compute_ms(json.loads((scratch / tag / "comm_profile.json").read_text())))
                loads.append(os.getloadavg()[0])
            row: dict[str, Any] = {
                "rate_gbps": rate,
                "achieved_gbps": achieved,
                "bench_comm_16mib_gbps": 8 * next(r["busbw_gbps"] for r in sweep["rows"] if r["bytes"] == 16 << 20),
                "measured_ms": statistics.median(measured),
                "measured_per_round_ms": measured,
                "load_average_1min": loads,
                "predicted_ms": {
                    "nominal": predict_ms(alone, link_from_gbps(rate)),
                    "achieved": predict_ms(alone, link_from_gbps(achieved)),
                    "bench_comm": predict_ms(alone, link_from_bench_comm(sweep)),
                    "shared_profile": predict_ms(shared, link_from_bench_comm(sweep)),
                },
                "compute_ms": {
                    "one_rank": compute_ms(alone),
                    "beside": compute_ms(shared),
                    "lab": statistics.median(lab_compute),
                    "lab_per_round": lab_compute,
                },
            }
            row.update(decompose(row))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {
        "benchmark": "whatif_sources",
        "machine": machine_facts(backend="gloo", world_size=2, device_type="cpu", threads_per_rank=1),
        "settings": {
            "rates": list(args.rates),
            "rounds": args.rounds,
            "steps": STEPS,
            "warmup": WARMUP,
            "model": "residual MLP, 8.7M parameters",
        },
        "rows": rows,
    }


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON report (%(default)s)")
    parser.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES), help="Gbit/s (1,2.5)")
    parser.add_argument("--rounds", type=int, default=3, help="2-node runs per rate, their median kept (3)")
    parser.add_argument("--probe-seconds", type=float, default=1.0, help="raw TCP transfer: seconds of traffic (1)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=STEPS, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker:
        args.rates = [network.parse_gbps(part) for part in str(args.rates).split(",") if part.strip()]
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        fit(args.profile_dir, args.steps, args.worker_out)
        return 0
    reason = network.lab_unavailable()
    if reason is not None:
        print(f"whatif_sources: cannot build the network lab: {reason}", file=sys.stderr)
        return 2
    payload = run(args)
    print(f"wrote {write_json(args.out, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
