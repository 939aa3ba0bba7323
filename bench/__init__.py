"""Benchmarks of lightning_mgpu: each module is one benchmark that prints a table and writes JSON.

Run them as modules, from the repository root (they import each other as ``bench.*``)::

    python -m bench.overhead --quick          # Lightning / ddp_tuned cost per step over raw DDP
    python -m bench.profiler_overhead --quick # CommProfiler's cost per step
    python -m bench.doctor_overhead --quick   # DistributedDoctor's cost per step
    python -m bench.fp16_safety --quick       # what making fp16 compression safe costs
    python -m bench.buckets --quick           # bucket_cap_mb="auto" against a sweep of sizes
    python -m bench.pipeline --quick          # pipeline throughput against the unsplit model
    python -m bench.planner --quick           # placement.partition against the optimum and heuristics
    python -m bench.soak --quick              # memory over a long run with both callbacks
    python -m bench.netlab --sweep --quick    # 2 nodes over a shaped link (root): options x models x rates
    python -m bench.whatif --quick            # whatif's predictions against the network lab (root)
    python -m bench.cluster_preemption --quick # preemption under SLURM: ddp_tuned against ddp (root)

Every benchmark stands on :mod:`bench.harness` (launching ranks, the rounds that interleave
configurations against drift, statistics, the report) and, for more than one "node", on
:mod:`bench.labs` (the network lab; the tests use it too). Results live in ``bench/results/``.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "bench" / "results"
"""Where every benchmark writes its JSON (and PNG) by default: the files the docs read."""


def pythonpath_with_repo() -> str:
    """This process's ``PYTHONPATH`` with the repository first: what a child needs to import ``bench`` and ``tests``."""
    return os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
