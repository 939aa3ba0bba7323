"""Benchmarks of lightning_mgpu: each module is one benchmark that prints a table and writes JSON.

Run them as modules, from the repository root (they import each other as ``bench.*``)::

    python -m bench.overhead --quick          # Lightning / ddp_tuned cost per step over raw DDP
    python -m bench.profiler_overhead --quick # CommProfiler's cost per step
    python -m bench.doctor_overhead --quick   # DistributedDoctor's cost per step
    python -m bench.buckets --quick           # bucket_cap_mb="auto" against a sweep of sizes
    python -m bench.pipeline --quick          # pipeline throughput against the unsplit model
    python -m bench.planner --quick           # placement.partition against the optimum and heuristics
    python -m bench.soak --quick              # memory over a long run with both callbacks
    python -m bench.netlab --sweep --quick    # 2 nodes over a shaped link (root): options x models x rates

Shared parts: :mod:`bench.common` (model, data, clock, statistics, report) and
:mod:`bench.launcher` (the one ``torch.distributed.run`` launcher every multi-process
benchmark starts its workers with). Results live in ``bench/results/``.
"""
