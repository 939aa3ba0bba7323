"""The hang watch: when a job stops progressing, say which rank is where and why, then end it, in seconds.

Every rank runs a watch thread (:mod:`.watcher`) beside its main thread. The main thread keeps a
:class:`~.heartbeat.Heartbeat` (phase, batch, the collective it is in: cheap attribute writes from
Lightning's hooks, :mod:`.hooks`, and from wrappers of ``torch.distributed``'s collectives,
:mod:`.collectives`); the watch thread samples it, and the main thread's stack, CPU time and I/O
(:mod:`.sampling`), publishes the rank's :class:`~.state.RankState` to the rendezvous store
(:mod:`.channel`, never the process group, which may be what is stuck), judges every rank's state
(:mod:`.verdict`), and on a hang elects one rank that prints one report (:mod:`.diagnosis`,
:mod:`.report`) before every rank exits non-zero. It also sees preemption signals while the main
thread is blocked in a collective (:mod:`.signals`).

Used by our strategies (``hang_timeout=``, on by default) and by ``DistributedDoctor(hang_timeout=...)``
under any other strategy. No Lightning import in this unit: the callbacks that feed it live with
their owners.
"""

from __future__ import annotations

from typing import Optional

from lightning_mgpu._checks import check_real

__all__ = ["DEFAULT_HANG_TIMEOUT_S", "MIN_HANG_TIMEOUT_S", "check_hang_timeout"]

DEFAULT_HANG_TIMEOUT_S = 300.0
"""No progress on a rank for this long (and nobody working in its part of the run) is a hang: five
minutes, far beyond a step, a checkpoint save or a validation that make progress, and well under
torch's 30-minute collective timeout."""
MIN_HANG_TIMEOUT_S = 1.0


def check_hang_timeout(value: object, *, owner: str) -> Optional[float]:
    """``hang_timeout`` as given: None (off) or seconds, at least :data:`MIN_HANG_TIMEOUT_S`."""
    if value is None:
        return None
    seconds = check_real(
        "hang_timeout", value, above=0, owner=owner, what="seconds without progress before a hang is reported, or None"
    )
    if seconds < MIN_HANG_TIMEOUT_S:
        raise ValueError(
            f"{owner}: hang_timeout must be at least {MIN_HANG_TIMEOUT_S:g} s (less would take a step's ordinary "
            f"pauses for hangs), got {value!r}; pass None to turn the watch off"
        )
    return seconds
