"""Soak: is memory flat over a long run with ``CommProfiler`` and ``DistributedDoctor`` attached? Does the hang watch stay quiet?

A tiny model (an MLP of 4 hidden 64-wide layers, 17k parameters: the package's per-step work
dominates, so a leak of a few bytes per step shows) trains for 20,000 steps on 2 CPU ranks
(gloo, ``strategy="ddp_tuned"``, Lightning's own launcher) with ``CommProfiler`` (default
settings: a timed communication hook on every bucket, a gather every 50 steps) and
``DistributedDoctor`` (default: a check every 100 steps, at every epoch start and end; an epoch
is 1,000 steps here, so 20 epochs). Batches are drawn in ``training_step`` from a generator
seeded by the step (no data set in memory; the loader yields indices only).

The strategy's hang watch runs at its default (``hang_timeout=300``), through checkpoint saves
(``ModelCheckpoint`` every ``steps / 8`` steps, into a temporary directory) and validation (20
batches every ``min(1,000, steps / 4)`` steps): none of that is a hang, and the watch must never
fire (it would end the run with status 124). The report records, per rank, the timeout in force
at the end of training and how many times the watch published its state (it was on all along),
and whether a hang report was written.

Every rank samples its resident set size (``/proc/self/statm``) and the number of objects the
garbage collector tracks (after a collection) at the first step, at 1%, 5%, 10%, 25%, 50%, 60%,
75%, 90% of the run and at the end; the table and ``bench/results/soak.json`` report them for
both ranks.

    python -m bench.soak                  # 20,000 steps, a few minutes on 2 cores
    python -m bench.soak --quick          # 400 steps, a smoke run (tests/bench/test_soak.py: the watch quiet)
    python -m bench.soak --steps 100000 --out /tmp/soak.json

(from the repository root: see ``bench/__init__.py``; Lightning's launcher starts the other
rank with the same ``python -m bench.soak`` command.)

What grows by design: CommProfiler keeps the figures of its last ``history`` = 10,000 profiled
steps (for its medians), so during the first half of the run every rank gains one small object
per step, up to that bound. "Flat" is judged on the second half (from step 10,000, once that
buffer is full, to the end): each rank must grow by less than ``FLAT_MIB`` MiB and
``FLAT_OBJECTS`` tracked objects there, which a leak of one object, or ~400 bytes, per step
would exceed. Runs shorter than twice the history get no verdict.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from bench import RESULTS
from bench.harness.report import machine_facts, print_table, write_json
from lightning_mgpu import CommProfiler, DistributedDoctor
from lightning_mgpu.watch.watcher import the_watch

STEPS, QUICK_STEPS = 20_000, 400
EPOCH_STEPS = 1_000
VALIDATION_BATCHES = 20


def checkpoint_every(steps: int) -> int:
    return max(1, steps // 8)


def validation_every(steps: int) -> int:
    return max(1, min(EPOCH_STEPS, steps // 4))


FRACTIONS = (0.01, 0.05, 0.10, 0.25, 0.50, 0.60, 0.75, 0.90)
HISTORY = 10_000  # CommProfiler's default: figures of the last 10,000 steps are kept
FLAT_MIB = 4.0
FLAT_OBJECTS = 2_000
DEFAULT_OUT = RESULTS / "soak.json"


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(8, 64), nn.Tanh()]
        for _ in range(4):
            layers += [nn.Linear(64, 64), nn.Tanh()]
        self.net = nn.Sequential(*layers, nn.Linear(64, 1))
        self.last_loss = 0.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.global_step * 2 + self.global_rank)
        x = torch.randn(16, 8, generator=generator)
        loss = nn.functional.mse_loss(self.net(x), torch.sin(x[:, :1]))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        generator = torch.Generator().manual_seed(10**6 + batch_idx * 2 + self.global_rank)
        x = torch.randn(16, 8, generator=generator)
        self.log("val_loss", nn.functional.mse_loss(self.net(x), torch.sin(x[:, :1])), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        resident_pages = int(handle.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class MemoryProbe(L.Callback):
    """Samples this rank's RSS and tracked objects at chosen steps; gathers every rank's at the end."""

    def __init__(self, steps: int, out: Path) -> None:
        self.at = sorted({1, *(max(1, int(steps * f)) for f in FRACTIONS), steps})
        self.out = out
        self.samples: list[dict[str, Any]] = []
        self.started = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step in self.at and (not self.samples or self.samples[-1]["step"] != step):
            gc.collect()  # what is still referenced, not what the collector has not reached yet
            self.samples.append(
                {
                    "step": step,
                    "rss_mib": rss_mib(),
                    "gc_objects": len(gc.get_objects()),
                    "elapsed_s": time.perf_counter() - self.started,
                }
            )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        watch = the_watch()
        mine = {
            "rank": trainer.global_rank,
            "pid": os.getpid(),
            "samples": self.samples,
            "peak_rss_mib": peak_rss_mib(),
            "watch": {"hang_timeout_s": watch.timeout, "beats": watch.beats},
        }
        gathered: list[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(gathered, mine)  # every rank enters
        if trainer.global_rank == 0:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            (self.out.with_suffix(".ranks.tmp")).write_text(json.dumps(gathered))


def report(
    ranks: list[dict[str, Any]], steps: int, elapsed_s: float, out: Path, *, hang_reports: int = 0
) -> dict[str, Any]:
    judged = steps >= 2 * HISTORY
    from_step = HISTORY if judged else steps // 2
    per_rank = []
    for rank in ranks:
        samples = rank["samples"]
        first, last = samples[0], samples[-1]
        middle = next(s for s in samples if s["step"] >= from_step)
        window = max(1, last["step"] - middle["step"])
        per_rank.append(
            {
                **rank,
                "start_rss_mib": first["rss_mib"],
                "end_rss_mib": last["rss_mib"],
                "growth_mib": last["rss_mib"] - first["rss_mib"],
                "gc_objects_growth": last["gc_objects"] - first["gc_objects"],
                "window": {"from_step": middle["step"], "to_step": last["step"]},
                "window_growth_mib": last["rss_mib"] - middle["rss_mib"],
                "window_growth_kib_per_1000_steps": (last["rss_mib"] - middle["rss_mib"]) * 1024 * 1000 / window,
                "window_gc_objects_growth": last["gc_objects"] - middle["gc_objects"],
            }
        )
    flat = all(r["window_growth_mib"] < FLAT_MIB and r["window_gc_objects_growth"] < FLAT_OBJECTS for r in per_rank)
    verdict = ("flat" if flat else "growing") if judged else f"no verdict (fewer than {2 * HISTORY:,} steps)"
    result = {
        "benchmark": "soak",
        "command": "python -m bench.soak" + ("" if steps == STEPS else f" --steps {steps}"),
        "steps": steps,
        "epoch_steps": EPOCH_STEPS,
        "elapsed_s": elapsed_s,
        "steps_per_s": steps / elapsed_s if elapsed_s else None,
        "callbacks": {
            "CommProfiler": f"defaults (every_n_steps=50, history={HISTORY})",
            "DistributedDoctor": "defaults (check_every_n_batches=100)",
        },
        "watch": {
            "hang_timeout_s": [rank["watch"]["hang_timeout_s"] for rank in ranks],
            "beats": [rank["watch"]["beats"] for rank in ranks],
            "hang_reports": hang_reports,
            "checkpoint_every_steps": checkpoint_every(steps),
            "validation_every_steps": validation_every(steps),
        },
        "limits": {"window_mib": FLAT_MIB, "window_gc_objects": FLAT_OBJECTS},
        "verdict": verdict,
        "ranks": per_rank,
        "machine": machine_facts(backend="gloo", world_size=len(ranks), device_type="cpu", threads_per_rank=1),
    }
    rows = []
    for index, sample in enumerate(per_rank[0]["samples"]):
        row = [f"{sample['step']:,}"]
        for rank in per_rank:
            other = rank["samples"][index]
            row += [f"{other['rss_mib']:.1f}", f"{other['gc_objects']:,}"]
        rows.append(row)
    columns = ["step"] + [f"{name} r{r['rank']}" for r in per_rank for name in ("RSS MiB", "objects")]
    growth = "; ".join(
        f"rank {r['rank']}: {r['growth_mib']:+.1f} MiB over the run, {r['window_growth_mib']:+.1f} MiB and "
        f"{r['window_gc_objects_growth']:+,} objects from step {r['window']['from_step']:,}"
        for r in per_rank
    )
    print_table(
        f"soak: {steps:,} steps, 2 ranks, CommProfiler + DistributedDoctor ({elapsed_s:.0f} s)",
        columns,
        rows,
        caption=f"{growth} -> {verdict}",
    )
    watch = result["watch"]
    print(
        "hang watch: "
        + ", ".join(
            f"rank {rank['rank']} hang_timeout={rank['watch']['hang_timeout_s']} s, {rank['watch']['beats']} beats"
            for rank in ranks
        )
        + f"; {hang_reports} hang report(s); a checkpoint every {watch['checkpoint_every_steps']:,} steps, "
        f"validation every {watch['validation_every_steps']:,}"
    )
    write_json(out, result)
    print(f"wrote {out}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps", type=int, default=None, help=f"optimizer steps (default {STEPS:,}; --quick {QUICK_STEPS})"
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps: a smoke run")
    parser.add_argument("--out", type=Path, default=None, help="JSON result (default bench/results/soak.json)")
    args = parser.parse_args()
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    if steps < 20:
        parser.error(f"argument --steps: at least 20 steps, got {steps}")
    out = args.out or DEFAULT_OUT
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)

    probe = MemoryProbe(steps, out)
    # One directory for both ranks: Lightning's launcher starts rank 1 with rank 0's environment.
    root = Path(os.environ.get("MGPU_SOAK_DIR") or tempfile.mkdtemp(prefix="soak_"))
    os.environ["MGPU_SOAK_DIR"] = str(root)
    saves = ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=checkpoint_every(steps), save_top_k=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_tuned",  # the hang watch on, at its default
        max_steps=steps,
        limit_train_batches=EPOCH_STEPS,
        val_check_interval=validation_every(steps),
        limit_val_batches=VALIDATION_BATCHES,
        num_sanity_val_steps=0,
        callbacks=[CommProfiler(), DistributedDoctor(), probe, saves],
        default_root_dir=str(root),  # where a hang report would go
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(range(2 * EPOCH_STEPS), batch_size=1)
    validation = DataLoader(range(2 * VALIDATION_BATCHES), batch_size=1)
    started = time.perf_counter()
    trainer.fit(Tiny(), loader, validation)
    elapsed = time.perf_counter() - started
    if trainer.global_rank == 0:
        partial = out.with_suffix(".ranks.tmp")
        ranks = json.loads(partial.read_text())
        partial.unlink()
        report(ranks, steps, elapsed, out, hang_reports=len(list(root.glob("**/hang_report.json"))))
        shutil.rmtree(root, ignore_errors=True)
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
