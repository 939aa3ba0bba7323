"""Why the job hangs: the classic patterns, told apart from every rank's state, each with its fix (pure).

In order, the first that fits:

``rank-died``
    a rank's process is gone, or its beat stopped (killed on another machine, the GIL held in C
    code, the process stopped).
``uneven-batches``
    one rank ran out of training batches while another still waits in a training step: their
    loaders have different lengths, or one rank is past its run.
``rank-elsewhere``
    a rank is in another part of the run (validation, a checkpoint save, test) while the others
    wait in training (or the other way round).
``stuck-outside-collective``
    a blocked rank is in no collective: data loading, I/O, a sleep, a lock, an endless loop (its
    line is the answer).
``collective-mismatch``
    the ranks wait in *different* collectives, e.g. one in ``barrier()`` the others never call, or
    a ``self.log(..., sync_dist=True)`` reached by one rank only; the source above the user's line
    is searched for the rank condition that sends ranks apart.
``stuck-in-collective``
    every rank waits in the same collective: the communication itself does not complete.
"""

from __future__ import annotations

import linecache
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

from lightning_mgpu.watch.sampling import Frame, shown
from lightning_mgpu.watch.state import RankState
from lightning_mgpu.watch.verdict import Verdict

__all__ = ["CAUSES", "Diagnosis", "diagnose", "known_caller", "rank_condition", "ranks_text"]

CAUSES = (
    "rank-died",
    "uneven-batches",
    "rank-elsewhere",
    "stuck-outside-collective",
    "collective-mismatch",
    "stuck-in-collective",
    "unknown",
)

_RANK_CONDITION = re.compile(
    r"^\s*(el)?if\b.*\b(global_rank|local_rank|node_rank|rank|is_global_zero|is_local_zero|get_rank\(\))\b"
)
_SYNC_DIST = re.compile(r"\blog(_dict)?\(.*sync_dist\s*=\s*True")
_FINISHED_PHASES = ("after_run", "teardown", "train_end", "train_epoch_end", "failed")

# Collectives that the libraries run on their own, by the function that calls them: what they are.
_KNOWN_CALLERS = {
    "_broadcast_sigterm_tensor": "Lightning's SIGTERM check before each training batch",
    "_agree": "the preemption check at the end of each optimizer step",
    "reduce_boolean_decision": "a decision every rank must take together (e.g. ModelCheckpoint's)",
    "_sync_ddp": "a metric reduced across ranks (self.log(..., sync_dist=True))",
    "save_checkpoint": "the barrier after a checkpoint save",
}


@dataclass(frozen=True)
class Diagnosis:
    cause: str
    summary: str
    fix: str
    culprits: list[int] = field(default_factory=list)
    """The ranks the summary is about (the ones out of step)."""

    def as_dict(self) -> dict[str, object]:
        return {"cause": self.cause, "summary": self.summary, "fix": self.fix, "culprits": self.culprits}


def ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    if not ranks:
        return "no rank"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _at(state: RankState) -> str:
    """Where in the user's code: a hook or step Lightning called, or code outside the run (after it)."""
    frame = state.site if state.in_hook or not state.watching or state.waiting_in is None else None
    if frame is None:
        return ""
    code = frame.code
    return f" at {frame.where()} in {frame.function}" + (f": `{code}`" if code else "")


def known_caller(function: str) -> Optional[str]:
    """What a collective the libraries call on their own is for, by the function that calls it (None: not known)."""
    return _KNOWN_CALLERS.get(function)


def _waiting(state: RankState) -> str:
    what = state.waiting_in
    if what is None:
        return state.doing
    known = known_caller(state.caller.function) if state.caller is not None and not state.in_hook else None
    return f"waits in {what}" + (f", {known}" if known and state.collective is not None else "")


def rank_condition(frame: Frame, *, lines_above: int = 12) -> Optional[tuple[int, str]]:
    """The nearest enclosing ``if`` above ``frame``'s line (indented less than it) that tests a rank, if any."""
    line = linecache.getline(frame.file, frame.line)
    if not line:
        return None
    indent = len(line) - len(line.lstrip())
    for number in range(frame.line - 1, max(0, frame.line - 1 - lines_above), -1):
        text = linecache.getline(frame.file, number)
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        own = len(text) - len(text.lstrip())
        if own < indent:
            if _RANK_CONDITION.match(text):
                return number, text.strip()
            if re.match(r"^\s*(def|class)\b", text):
                return None
            indent = own
    return None


def diagnose(states: Sequence[RankState], verdict: Verdict) -> Diagnosis:
    """The first pattern of the module docstring that fits ``states``."""
    by_rank = {s.rank: s for s in states}
    for rule in (_died, _uneven, _elsewhere, _stuck_outside, _mismatch, _same_collective):
        found = rule(states, verdict, by_rank)
        if found is not None:
            return found
    if not verdict.hang:  # a failure report: ranks left (e.g. one that ended its run while the others train)
        left = list(verdict.dead) + list(verdict.unresponsive)
        return Diagnosis(
            "unknown",
            f"{ranks_text(left)} left the job while the others were still in it; no known pattern fits (every "
            "rank's place is listed above).",
            "Read each rank's line above: a rank that ended its run early had fewer batches than the others "
            "(uneven batches) or stopped on its own condition.",
            left,
        )
    return Diagnosis(
        "unknown",
        f"{ranks_text(verdict.blocked)} made no progress for {verdict.timeout:g} s; no known pattern fits "
        "(every rank's place is listed above).",
        "Read each rank's line above and its stack in the JSON report; py-spy dump --pid PID shows native frames too.",
        list(verdict.blocked),
    )


# ----------------------------------------------------------------------------- the rules


def _died(states: Sequence[RankState], verdict: Verdict, by_rank: dict[int, RankState]) -> Optional[Diagnosis]:
    # A rank that died past the end of its run (e.g. its collective after fit failed) is uneven batches' doing.
    lost = [rank for rank in verdict.dead + verdict.unresponsive if by_rank[rank].watching or by_rank[rank].missing]
    if not lost:
        return None
    parts = []
    for rank in lost:
        state = by_rank[rank]
        if state.missing:
            parts.append(f"rank {rank} never published a heartbeat (its run never reached the watch)")
            continue
        host = state.host.split(" ", 1)[0]
        if state.gone:
            how = f"its process (pid {state.pid} on {host}) has ended"
        elif state.failure:
            how = f"its run failed with {state.failure}"
        else:
            how = (
                f"it has said nothing for {state.silent_s:.0f} s (killed on another machine, its node unreachable, "
                "or its process stopped or holding the GIL in C code)"
            )
        parts.append(f"rank {rank}: {how}; last seen {state.doing}{_at(state)}")
    waiting = [s for s in states if s.rank not in lost and s.waiting_in]
    verb = "waits" if len(waiting) == 1 else "wait"
    then = f"; {ranks_text([s.rank for s in waiting])} {verb} for it in vain" if waiting else ""
    return Diagnosis(
        "rank-died",
        "; ".join(parts) + then + ".",
        "Look at that rank's own output: an error, or nothing if it was killed (the OOM killer: `dmesg`; the "
        "scheduler's log for a node lost). A collective cannot complete without every rank of its group.",
        lost,
    )


def _uneven(states: Sequence[RankState], verdict: Verdict, by_rank: dict[int, RankState]) -> Optional[Diagnosis]:
    training = [s for s in states if s.family == "train" and s.phase not in _FINISHED_PHASES and s.stage == "fit"]
    finished = [s for s in states if s.phase in _FINISHED_PHASES or not s.watching]
    lengths = {s.batches for s in training if s.batches is not None}
    waiting = [s for s in training if s.rank in verdict.blocked or s.in_collective]
    if not waiting or not (finished or len(lengths) > 1):
        return None
    short = finished or [s for s in training if s.batches == min(lengths)]
    waiting = [s for s in waiting if s not in short]
    if not short or not waiting:
        return None
    ends = ", ".join(
        f"rank {s.rank} ran {s.batches_done} training batches"
        + (f" ({s.batches} per epoch)" if s.batches is not None else "")
        + (f", then {s.doing}{_at(s)}" if s.phase != "train_epoch_end" else "")
        + (" (its process has ended since)" if s.gone else "")
        for s in short
    )
    behind = "; ".join(
        f"rank {s.rank} {_waiting(s)}, with {s.batches_done}"
        + (f" of its {s.batches}" if s.batches is not None else "")
        + " batches done"
        for s in waiting
    )
    return Diagnosis(
        "uneven-batches",
        f"the ranks have different numbers of training batches: {ends}; {behind}.",
        "Give every rank the same number of batches: keep Trainer(use_distributed_sampler=True) (its "
        "DistributedSampler pads every rank to the same length), or, with your own sampler or an IterableDataset, "
        "the same length on every rank (drop_last=True, or cut to the shortest rank's length). Inputs that cannot "
        "be evened out need every rank to stop when the first runs out (torch.distributed.algorithms.Join).",
        [s.rank for s in short],
    )


_ELSEWHERE_FIX = {
    "validation": "Every rank must run the same validation: the same number of validation batches (keep "
    "use_distributed_sampler=True for the validation loader, or give every rank the same limit_val_batches), "
    "and no validation run by one rank only. For an evaluation only rank 0 does, run it after fit, or make the "
    "other ranks wait for it at a barrier (and give hang_timeout more than it takes).",
    "checkpoint": "Every rank must call trainer.save_checkpoint(...) (rank 0 writes, the others wait for it at a "
    "barrier): a save under `if trainer.is_global_zero:` leaves the other ranks in the next collective. To write "
    "a file from rank 0 alone, call no collective in between (torch.save, not trainer.save_checkpoint).",
}


def _elsewhere(states: Sequence[RankState], verdict: Verdict, by_rank: dict[int, RankState]) -> Optional[Diagnosis]:
    stuck = [by_rank[r] for r in verdict.blocked if by_rank[r].watching]
    if not stuck:
        return None
    families = {s.family for s in stuck}
    others = [s for s in states if s.watching and s.family not in families and s.family not in ("setup", "end")]
    if not others:
        return None
    where = "; ".join(
        f"rank {s.rank} is {'still ' if s.idle_s < verdict.timeout else ''}{s.doing}{_at(s)}" for s in others
    )
    blocked = "; ".join(f"rank {s.rank} {_waiting(s)} ({s.doing})" for s in stuck)
    fix = _ELSEWHERE_FIX.get(
        others[0].family,
        "Every rank must run the same loops in the same order: a loop one rank runs alone (or runs longer) "
        "leaves the others waiting in the next collective.",
    )
    return Diagnosis(
        "rank-elsewhere",
        f"the ranks are in different parts of the run: {where}; {blocked}.",
        fix,
        [s.rank for s in others],
    )


def _stuck_outside(states: Sequence[RankState], verdict: Verdict, by_rank: dict[int, RankState]) -> Optional[Diagnosis]:
    outside = [by_rank[r] for r in verdict.blocked if by_rank[r].waiting_in is None]
    if not outside:
        return None
    waiting = [s for s in states if s.rank not in {o.rank for o in outside} and s.waiting_in]
    where = "; ".join(
        f"rank {s.rank} has made no progress for {s.idle_s:.0f} s {s.doing}{_at(s)}, in no collective" for s in outside
    )
    then = "; " + "; ".join(f"rank {s.rank} {_waiting(s)}" for s in waiting) if waiting else ""
    loading = any(s.phase == "data_fetch" for s in outside)
    fix = (
        "The data loader does not return: look at that line (a read that never ends, a lock, a remote file "
        "system); with num_workers > 0 a worker may be stuck (py-spy dump --pid on the worker processes)."
        if loading
        else "That line does not return: a sleep, an endless loop, a wait on I/O, a lock or another process. "
        "If it is legitimate work that takes this long without any progress, raise hang_timeout above it."
    )
    return Diagnosis(
        "stuck-outside-collective",
        f"{where}{then}." + (" It is loading data." if loading else ""),
        fix,
        [s.rank for s in outside],
    )


def _mismatch(states: Sequence[RankState], verdict: Verdict, by_rank: dict[int, RankState]) -> Optional[Diagnosis]:
    waiting = [s for s in states if s.waiting_in is not None]
    kinds = {_collective_key(s) for s in waiting}
    if len(kinds) < 2:
        return None
    # The ranks whose collective the user's own code called are the likely odd ones out.
    culprits = [s for s in waiting if s.in_hook]
    if not culprits or len(culprits) == len(waiting):
        counts: dict[tuple[str, int], list[RankState]] = {}
        for s in waiting:
            counts.setdefault(_collective_key(s), []).append(s)
        culprits = min(counts.values(), key=len)
    others = [s for s in waiting if s not in culprits]
    first = culprits[0]
    site = first.site if first.in_hook else None
    condition = rank_condition(site) if site is not None else None
    sync_dist = site is not None and bool(_SYNC_DIST.search(site.code))
    entered = "; ".join(
        f"{ranks_text([s.rank])} entered {s.waiting_in}"
        + (f" at {s.site.where()}" if s.in_hook and s.site is not None else "")
        for s in culprits
    )
    if condition is not None and site is not None:
        entered += f", under a rank condition ({shown(site.file)}:{condition[0]}: `{condition[1]}`)"
    rest = "; ".join(f"rank {s.rank} {_waiting(s)}" for s in others)
    summary = f"the ranks wait in different collectives: {entered}; {rest}" if rest else entered
    if sync_dist:
        fix = (
            "self.log(..., sync_dist=True) reduces the value across ranks where it is called: log it on every "
            "rank (the same names, in the same order), or, for a value only one rank has, log it with "
            "rank_zero_only=True and without sync_dist."
        )
    else:
        fix = (
            "A collective must be called by every rank of its group, in the same order: call it on every rank "
            "(take it out of the rank condition), or leave rank-only work free of collectives "
            "(trainer.strategy.barrier(), broadcast, all_gather, sync_dist logging, trainer.save_checkpoint)."
        )
    return Diagnosis("collective-mismatch", summary + ".", fix, [s.rank for s in culprits])


def _collective_key(state: RankState) -> tuple[str, int]:
    if state.collective is not None:
        return (str(state.collective["kind"]), int(state.collective["seq"]))
    return (state.waiting_in or "", -1)


def _same_collective(
    states: Sequence[RankState], verdict: Verdict, by_rank: dict[int, RankState]
) -> Optional[Diagnosis]:
    waiting = [s for s in states if s.waiting_in is not None]
    if not waiting or len(waiting) < len(states):
        return None
    first = waiting[0]
    return Diagnosis(
        "stuck-in-collective",
        f"every rank waits in the same collective: {first.waiting_in}{_at(first)}.",
        "The communication itself does not complete: a network or NCCL problem (run with NCCL_DEBUG=INFO, try "
        "`lightning-mgpu doctor`), or a rank of the group that is not part of this job's ranks.",
        [],
    )
