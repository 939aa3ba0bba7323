"""Is the job hung? A pure function of every rank's state and the timeout.

A rank is **blocked** when its main thread has made no progress for ``timeout`` seconds (its own
watch measures that: :class:`~lightning_mgpu.watch.sampling.Progress`). A blocked rank is
**excused** while another rank is still working *in the same phase family*: outside any collective
and itself not blocked. That is what legitimate pauses look like: rank 0 writes a checkpoint while
the others wait at the barrier after it; rank 0 runs a slow step, or rank-0-only work between two
collectives, while the others wait in the next one. A rank working in another family does not
excuse it: rank 0 still validating while the others wait in training is out of step, however
busy. The job is **hung** when some blocked rank is excused by no one.

Ranks that cannot speak for themselves: a rank whose process is **gone** (seen on this machine) is
dead, and then the others need wait only ``dead_timeout`` (their collective will never complete on
NCCL; gloo says so itself when the connection closes); a rank whose beat has stopped
(**unresponsive**: killed on another machine, the GIL held in C code, stopped) excuses no one. A
rank past the end of its run (its watch only listens) is never blocked and excuses no one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from lightning_mgpu.watch.state import RankState

__all__ = ["Verdict", "judge"]


@dataclass(frozen=True)
class Verdict:
    hang: bool
    blocked: list[int] = field(default_factory=list)
    """Ranks without progress for the timeout (dead ones excluded)."""
    dead: list[int] = field(default_factory=list)
    unresponsive: list[int] = field(default_factory=list)
    timeout: float = 0.0
    """The timeout the verdict applied (``dead_timeout`` when a rank was dead)."""

    def as_dict(self) -> dict[str, object]:
        return {
            "hang": self.hang,
            "blocked": self.blocked,
            "dead": self.dead,
            "unresponsive": self.unresponsive,
            "timeout_s": self.timeout,
        }


def judge(states: Sequence[RankState], *, timeout: float, silent_limit: float, dead_timeout: float = 10.0) -> Verdict:
    """The verdict on ``states`` (one per rank, as read now); see the module docstring."""
    dead = [s.rank for s in states if s.gone]
    unresponsive = [s.rank for s in states if not s.gone and (s.missing or s.silent_s >= silent_limit)]
    live = [s for s in states if s.rank not in dead and s.rank not in unresponsive]
    limit = min(timeout, dead_timeout) if dead else timeout
    blocked = [s for s in live if s.watching and s.idle_s >= limit]

    def excused(rank: RankState) -> bool:
        return any(
            other.rank != rank.rank
            and other.watching
            and other.family == rank.family
            and other.idle_s < limit
            and not other.in_collective
            for other in live
        )

    hang = any(not excused(rank) for rank in blocked)
    return Verdict(hang, [s.rank for s in blocked], dead, unresponsive, limit)
