"""Preemption under a real scheduler: ``ddp_tuned`` against Lightning's own ``ddp``, three ways SLURM preempts a job.

A 2-node job (the SLURM lab, :mod:`bench.labs.slurm`: one rank per node, gloo across the link)
fits ``tests/scripts/cluster_fit.py`` (``--requeue``, Lightning's ``auto_requeue``), and is preempted:

* ``time_limit``: by its time limit, with SLURM's warning ``--time=1 --signal=USR1@5``, twice in a
  row (the first two runs are paced so that they cannot finish inside one minute; then the limit is
  raised, as an operator would, and the third runs free): the job must get through every cycle and
  complete. slurmctld looks at time limits every
  30 s and sends the warning at the first look that finds less than T + 30 s left, so ``@5`` comes
  25-55 s into a one-minute job, and the limit itself one look (30 s) later at the earliest;
* ``scancel_usr1``: ``scancel --signal=USR1`` (the same signal, sent by hand) once the fit passed a step;
* ``requeue``: ``scontrol requeue`` once the fit passed a step: SLURM's SIGTERM to every task (then
  SIGKILL ``KillWait`` seconds later) and the job queued again, as when a higher-priority job preempts it.

For every case, from every attempt's record (each rank writes the step it started and ended at and
its loss at every step) and the checkpoints left: whether every rank stopped at the same step, which
step was saved, where the next attempt resumed, how many steps were redone, whether every loss
equals the uninterrupted run's at the same step, and whether the job completed.

    python -m bench.cluster_preemption           # bench/results/cluster_preemption.json (root; ~10 min)
    python -m bench.cluster_preemption --quick   # smoke run: one repeat, stock ddp without the time-limit case

Run from the repository root as root (the lab needs it); ``docs/cluster.md``'s table is generated from the
JSON (``python -m docs.generate``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from bench import RESULTS
from bench.harness import cli
from bench.harness.report import machine_facts, print_table, write_json
from bench.labs.network import LabError, handle_signals
from bench.labs.slurm import Cluster, Job, lab_unavailable

DEFAULT_OUT = RESULTS / "cluster_preemption.json"
STRATEGIES = ("ddp_tuned", "ddp")
WAYS = ("time_limit", "scancel_usr1", "requeue")
SCRIPT = "tests.scripts.cluster_fit"
STEPS = 300
MARKER_STEP = 10
TIME_LIMIT = ["--time=1", "--signal=USR1@5"]
TIME_LIMIT_PREEMPTIONS = 2
"""The time-limit case's first attempts run paced (``TIME_LIMIT_STEP_S`` a step), so the job is preempted
exactly this many times before an attempt runs free and completes."""
TIME_LIMIT_STEP_S = 2.0
"""A paced attempt cannot finish (the warning comes 25-55 s into an attempt; 2 s a step leaves any attempt more
than that to do): each of the first ``TIME_LIMIT_PREEMPTIONS`` attempts is preempted. At 0.2 s a step a second
attempt once finished its remaining 182 steps before its warning (one preemption, not two)."""
LIFTED_LIMIT_MIN = 10
"""Once a time-limit job was requeued ``TIME_LIMIT_PREEMPTIONS`` times, its limit is raised to this many minutes
(``scontrol update``, as an operator would): the free attempt then completes whatever the machine's load (with
one minute, a slow free attempt was preempted again, or got its warning while exiting after its last step and
was counted failed)."""
QUICK = {"repeats": 1, "ddp_ways": "scancel_usr1,requeue", "timeout": 400.0}
TIMEOUT_S = 1200.0
HANG_S = 60.0
"""How long after its signal a job may take to be requeued before it counts as hung and is cancelled: stock
``ddp`` saves its checkpoint from inside Lightning's signal handler, whose collective can meet another
collective on the other rank and wait forever."""


@dataclass
class Case:
    """One job: what it runs and how it is preempted; the job and the moment it was signalled, once known."""

    strategy: str
    way: str
    repeat: int
    out: Path
    job: Optional[Job] = None
    signalled_at: Optional[float] = None
    hung: bool = False
    """Not requeued within :data:`HANG_S` of the signal: cancelled (stock ``ddp``'s handler can deadlock)."""

    @property
    def label(self) -> str:
        return f"{self.strategy}-{self.way}-{self.repeat}"


def fit_argv(case_out: Path, strategy: str, way: str) -> list[str]:
    argv = [sys.executable, "-m", SCRIPT, "--out-dir", str(case_out), "--strategy", strategy, "--steps", str(STEPS)]
    if way == "time_limit":
        attempts = ",".join(str(a) for a in range(TIME_LIMIT_PREEMPTIONS))
        return [*argv, "--slow-after", "0", "--step-sleep", str(TIME_LIMIT_STEP_S), "--slow-attempts", attempts]
    if way == "reference":
        return [*argv, "--slow-after", "0"]  # the marker after step 0: the job is running
    return [*argv, "--slow-after", str(MARKER_STEP), "--step-sleep", "0.1"]


def submit(cluster: Cluster, case: Case) -> None:
    options = ["--requeue", *(TIME_LIMIT if case.way == "time_limit" else [])]
    argv = fit_argv(case.out, case.strategy, case.way)
    case.job = cluster.srun_job(argv, nodes=2, options=options, workdir=case.out, name=case.label)


def _marker(case: Case, attempt: int = 0) -> bool:
    return (case.out / f"reached-{attempt}").exists()


def drive(cluster: Cluster, cases: Sequence[Case], *, timeout: float) -> None:
    """Submit every case, preempt the hand-signalled ones once past the marker step, wait for every job.

    The time-limit jobs go first, and the others only once those are training: a job starting beside
    many others on a small machine could still be starting when its time limit's warning comes.
    """
    deadline = time.monotonic() + timeout
    first = [c for c in cases if c.way == "time_limit"]
    rest = [c for c in cases if c.way != "time_limit"]
    for case in first:
        submit(cluster, case)
    for case in first:  # training (any attempt past its first step), requeued, or ended: the rest may start
        assert case.job is not None
        while not any(case.out.glob("reached-*")) and time.monotonic() < deadline:
            state = case.job.state()
            if state.done or state.restarts:
                break
            time.sleep(0.2)
    for case in rest:
        submit(cluster, case)
    pending = [c for c in rest if c.way in ("scancel_usr1", "requeue")]
    signalled: list[Case] = []
    limited = list(first)
    while pending or signalled or limited:
        for case in list(limited):
            assert case.job is not None
            state = case.job.state()
            if state.restarts >= TIME_LIMIT_PREEMPTIONS:
                cluster.client(["scontrol", "update", f"JobId={case.job.id}", f"TimeLimit={LIFTED_LIMIT_MIN}"])
                limited.remove(case)
            elif state.done or time.monotonic() > deadline:
                limited.remove(case)
        for case in list(pending):
            assert case.job is not None
            if _marker(case):
                if case.way == "scancel_usr1":
                    case.job.signal("USR1")
                else:
                    case.job.requeue()
                case.signalled_at = time.time()
                pending.remove(case)
                signalled.append(case)
            elif case.job.state().done or time.monotonic() > deadline:
                pending.remove(case)  # ended before it could be preempted: the analysis says so
        for case in list(signalled):
            assert case.job is not None and case.signalled_at is not None
            state = case.job.state()
            if state.restarts or state.done:
                signalled.remove(case)
            elif time.time() - case.signalled_at > HANG_S:
                case.hung = True
                case.job.cancel()
                signalled.remove(case)
        time.sleep(0.2)
    for case in cases:
        assert case.job is not None
        try:
            case.job.wait(max(1.0, deadline - time.monotonic()))
        except LabError as error:
            print(f"cluster_preemption: {case.label}: {error}", file=sys.stderr)


# ----------------------------------------------------------------------------- analysis


def _records(out: Path) -> dict[int, dict[int, dict[str, Any]]]:
    """attempt -> rank -> record."""
    found: dict[int, dict[int, dict[str, Any]]] = {}
    for path in out.glob("attempt*-rank*.json"):
        record = json.loads(path.read_text())
        found.setdefault(int(record["attempt"]), {})[int(record["rank"])] = record
    return found


def _saved_steps(out: Path) -> dict[str, int]:
    import torch

    saved = {}
    for path in sorted((out / "root").glob("hpc_ckpt_*.ckpt")):
        saved[path.name] = int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])
    return saved


def analyse(case: Case, reference: dict[int, dict[str, float]], ranks: int = 2) -> dict[str, Any]:
    """What happened to one job (see the module docstring), from its records, checkpoints and state."""
    assert case.job is not None
    state = case.job.state()
    records = _records(case.out)
    saved = _saved_steps(case.out)
    attempts = []
    for attempt in range(max([state.restarts, *records]) + 1):  # an attempt whose ranks were all killed left nothing
        ranks_seen = records.get(attempt, {})
        attempts.append(
            {
                "attempt": attempt,
                "start_step": [ranks_seen.get(r, {}).get("start_step") for r in range(ranks)],
                "end_step": [ranks_seen.get(r, {}).get("end_step") for r in range(ranks)],
                "outcome": [ranks_seen.get(r, {}).get("outcome", "killed (no record)") for r in range(ranks)],
                "resumed_from": ranks_seen.get(0, {}).get("resumed_from"),
                "early_signal": any(ranks_seen.get(r, {}).get("early_signal") for r in range(ranks)),
                "started": min((rec["started"] for rec in ranks_seen.values()), default=None),
                "ended": max((rec["ended"] for rec in ranks_seen.values()), default=None),
            }
        )
    preemptions = []
    for before, after in zip(attempts, attempts[1:]):
        stopped = before["end_step"]
        resumed = after["start_step"][0]
        saved_step = saved.get(after["resumed_from"] or "", None)
        preemptions.append(
            {
                "stopped_at": stopped,
                "same_step": len(set(stopped)) == 1 and None not in stopped,
                "saved_step": saved_step,
                "resumed_at": resumed,
                "redone_steps": None if None in stopped or resumed is None else max(stopped) - resumed,
                "outcome": before["outcome"],
                "requeue_gap_s": None
                if None in (after["started"], before["ended"])
                else after["started"] - before["ended"],
            }
        )
    if case.hung:  # signalled, never requeued: a preemption that saved nothing usable and resumed nowhere
        preemptions.append(
            {
                "stopped_at": attempts[-1]["end_step"],
                "same_step": False,
                "saved_step": max(saved.values(), default=None),
                "resumed_at": None,
                "redone_steps": None,
                "outcome": [f"hung: cancelled {HANG_S:g} s after the signal"] * ranks,
                "requeue_gap_s": None,
            }
        )
    exact = bool(records) and all(
        all(reference[rank].get(step) == loss for step, loss in record["losses"].items())
        for by_rank in records.values()
        for rank, record in by_rank.items()
    )
    last = attempts[-1] if attempts else None
    completed = state.state == "COMPLETED" and last is not None and last["end_step"] == [STEPS] * ranks
    signal_to_stopped = None
    if case.signalled_at is not None and attempts and None not in attempts[0]["end_step"]:
        signal_to_stopped = attempts[0]["ended"] - case.signalled_at
    return {
        "strategy": case.strategy,
        "preempted_by": case.way,
        "repeat": case.repeat,
        "job_state": state.state,
        "exit_code": state.exit_code,
        "restarts": state.restarts,
        "attempts": attempts,
        "preemptions": preemptions,
        "checkpoints": saved,
        "exact": exact,
        "completed": completed,
        "signal_to_stopped_s": signal_to_stopped,
        "hung": case.hung,
    }


def _last_step(preemption: dict[str, Any]) -> Optional[int]:
    """The last step any rank of a preempted run finished (None: no rank left a record)."""
    steps = [step for step in preemption["stopped_at"] if step is not None]
    return max(steps) if steps else None


def _most_redone(redone: list[Optional[int]]) -> Optional[int]:
    """The most steps a resumed run redid; None when some preemption left that unknown (no record, or hung)."""
    return None if None in redone else max(redone, default=0)  # type: ignore[type-var]


def summarise(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per strategy and way of preempting, over the repeats (the table in docs/cluster.md)."""
    lines = []
    for strategy in STRATEGIES:
        for way in WAYS:
            runs = [r for r in rows if r["strategy"] == strategy and r["preempted_by"] == way]
            if not runs:
                continue
            preemptions = [p for r in runs for p in r["preemptions"]]
            lines.append(
                {
                    "strategy": strategy,
                    "preempted_by": way,
                    "runs": len(runs),
                    "preemptions": len(preemptions),
                    "same_step": sum(bool(p["same_step"]) for p in preemptions),
                    "saved_stopped_step": sum(
                        p["saved_step"] is not None and p["saved_step"] == _last_step(p) for p in preemptions
                    ),
                    "resumed_where_stopped": sum(p["redone_steps"] == 0 for p in preemptions),
                    "max_redone_steps": _most_redone([p["redone_steps"] for p in preemptions]),
                    "exact": sum(bool(r["exact"]) for r in runs),
                    "completed": sum(bool(r["completed"]) for r in runs),
                    "outcomes": sorted({o for p in preemptions for o in p["outcome"]}),
                    "hung": sum(bool(r["hung"]) for r in runs),
                }
            )
    return lines


def reference_losses(out: Path, ranks: int = 2) -> dict[int, dict[str, float]]:
    records = _records(out).get(0, {})
    return {rank: records.get(rank, {}).get("losses", {}) for rank in range(ranks)}


def run(cluster: Cluster, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    started = time.perf_counter()
    cases = [Case("ddp_tuned", "reference", 0, root / "reference")]
    for repeat in range(args.repeats):
        for strategy in STRATEGIES:
            ways = args.ddp_ways.split(",") if strategy == "ddp" else WAYS
            cases += [Case(strategy, way, repeat, root / f"{strategy}-{way}-{repeat}") for way in WAYS if way in ways]
    drive(cluster, cases, timeout=args.timeout)
    reference = reference_losses(cases[0].out)
    if not all(reference.values()):
        raise LabError(
            f"the uninterrupted reference run left no losses:\n{cases[0].job.output() if cases[0].job else ''}"
        )
    rows = [analyse(case, reference) for case in cases[1:]]
    return {
        "benchmark": "cluster_preemption",
        "machine": machine_facts(backend="gloo", world_size=2, device_type="cpu", threads_per_rank=1),
        "settings": {
            "nodes": 2,
            "ranks_per_node": 1,
            "steps": STEPS,
            "marker_step": MARKER_STEP,
            "time_limit": TIME_LIMIT,
            "time_limit_preemptions": TIME_LIMIT_PREEMPTIONS,
            "repeats": args.repeats,
            "ddp_ways": args.ddp_ways.split(","),
            "quick": args.quick,
            "scheduler": "slurm-wlm (bench/labs/slurm.py): --requeue, KillWait=30, cred_expire=5",
        },
        "summary": summarise(rows),
        "rows": rows,
        "wall_s": time.perf_counter() - started,
    }


def print_summary(payload: dict[str, Any]) -> None:
    columns = ["strategy", "preempted by", "runs", "same step", "saved", "resumed there", "exact", "completed"]
    lines = []
    for line in payload["summary"]:
        count = line["preemptions"]
        lines.append(
            [
                line["strategy"],
                line["preempted_by"],
                str(line["runs"]),
                f"{line['same_step']}/{count}",
                f"{line['saved_stopped_step']}/{count}",
                f"{line['resumed_where_stopped']}/{count}",
                f"{line['exact']}/{line['runs']}",
                f"{line['completed']}/{line['runs']}",
            ]
        )
    print_table("preemption under SLURM (2 nodes x 1 rank)", columns, lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK} unless given explicitly")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON report (%(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="jobs per strategy and way (3)")
    parser.add_argument(
        "--ddp-ways", default=",".join(WAYS), help=f"ways stock ddp is preempted ({','.join(WAYS)}; quick: two)"
    )
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds for everything (%(default)s)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the jobs run (a temporary directory)")
    args = cli.finish(parser, argv, QUICK, positive=("repeats",))
    unknown = set(args.ddp_ways.split(",")) - set(WAYS)
    if unknown:
        parser.error(f"argument --ddp-ways: unknown {sorted(unknown)}; choose from {','.join(WAYS)}")
    return args


def main(argv: Optional[Sequence[str]] = None, *, cluster: Optional[Cluster] = None) -> int:
    """The command; ``cluster``: a cluster already built (the tests'), else one is built and torn down here."""
    import tempfile

    args = parse_args(argv)
    root = args.work_dir or Path(tempfile.mkdtemp(prefix="cluster_preemption_"))
    if cluster is None:
        reason = lab_unavailable()
        if reason is not None:
            print(f"cluster_preemption: cannot build the SLURM lab: {reason}", file=sys.stderr)
            return 2
        handle_signals()
        try:
            with Cluster(2) as built:
                payload = run(built, args, root)
        except LabError as error:
            print(f"cluster_preemption: {error}", file=sys.stderr)
            return 1
    else:
        payload = run(cluster, args, root)
    out = write_json(args.out, payload)
    print_summary(payload)
    print(f"wrote {out} ({payload['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
