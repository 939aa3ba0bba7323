"""The hang verdict, a pure function of every rank's state: what fires it, and the legitimate pauses that must not."""

from __future__ import annotations

from lightning_mgpu.watch.verdict import judge
from tests.unit.watch.builders import collective, in_backward, in_barrier, state

TIMEOUT = 20.0
SILENT = 10.0


def test_every_rank_blocked_is_a_hang() -> None:
    found = judge([in_barrier(0), in_backward(1)], timeout=TIMEOUT, silent_limit=SILENT)
    assert found.hang and found.blocked == [0, 1]


def test_a_rank_still_working_in_the_same_part_of_the_run_excuses_the_others() -> None:
    """Rank 0 runs a slow step (or rank-0-only work between two collectives): rank 1 waits for it in the next one."""
    slow = state(0, "forward", idle=0.5)
    waiting = state(1, "data_fetch", idle=60.0, collective=collective("broadcast", 9))
    assert not judge([slow, waiting], timeout=TIMEOUT, silent_limit=SILENT).hang


def test_a_slow_step_of_three_times_the_median_never_fires() -> None:
    """Whatever its length against the timeout: the slow rank progresses (its own watch says idle ~0)."""
    median_s = TIMEOUT  # a step as long as the timeout, three times over
    for elapsed in (median_s, 2 * median_s, 3 * median_s):
        slow = state(0, "optimizer", idle=0.0)
        waiting = in_backward(1, idle=elapsed)
        assert not judge([slow, waiting], timeout=TIMEOUT, silent_limit=SILENT).hang, elapsed


def test_a_checkpoint_save_excuses_the_ranks_waiting_at_the_barrier_after_it() -> None:
    writing = state(0, "checkpoint_save", idle=1.0)
    waiting = state(1, "checkpoint_save", idle=45.0, collective=collective("barrier", 12))
    assert not judge([writing, waiting], timeout=TIMEOUT, silent_limit=SILENT).hang


def test_work_in_another_part_of_the_run_does_not_excuse() -> None:
    """Rank 0 still validates (busy) while rank 1 waits in training: out of step, however busy."""
    validating = state(0, "validation", idle=0.2, batch=57, batches=200)
    waiting = state(1, "data_fetch", idle=TIMEOUT, collective=collective("broadcast", 17))
    found = judge([validating, waiting], timeout=TIMEOUT, silent_limit=SILENT)
    assert found.hang and found.blocked == [1]


def test_a_rank_in_a_collective_excuses_no_one() -> None:
    """Both wait: rank 0 has waited 25 s, rank 1 only 5 s, but in a collective: nobody is working."""
    found = judge([in_barrier(0), in_barrier(1, idle=5.0)], timeout=TIMEOUT, silent_limit=SILENT)
    assert found.hang and found.blocked == [0]


def test_nothing_fires_before_the_timeout() -> None:
    assert not judge([in_barrier(0, idle=19.9), in_backward(1, idle=19.9)], timeout=TIMEOUT, silent_limit=SILENT).hang


def test_a_rank_past_its_run_is_neither_blocked_nor_an_excuse() -> None:
    finished = state(1, "after_run", idle=300.0, watching=False)
    waiting = state(0, "data_fetch", idle=TIMEOUT, collective=collective("broadcast", 14))
    found = judge([waiting, finished], timeout=TIMEOUT, silent_limit=SILENT)
    assert found.hang and found.blocked == [0]
    assert not judge([finished], timeout=TIMEOUT, silent_limit=SILENT).hang


def test_a_dead_rank_shortens_the_wait_and_cannot_excuse() -> None:
    dead = state(1, "forward", idle=0.0, gone=True)
    assert not judge([in_barrier(0, idle=9.0), dead], timeout=TIMEOUT, silent_limit=SILENT).hang
    found = judge([in_barrier(0, idle=10.0), dead], timeout=TIMEOUT, silent_limit=SILENT)
    assert found.hang and found.dead == [1] and found.timeout == 10.0


def test_a_silent_rank_excuses_no_one() -> None:
    """Its beat stopped (killed on another node, the GIL held in C code): its last 'busy' state is stale."""
    silent = state(1, "forward", idle=0.0, silent_s=SILENT)
    found = judge([in_barrier(0), silent], timeout=TIMEOUT, silent_limit=SILENT)
    assert found.hang and found.unresponsive == [1]
    missing = state(1, missing=True)
    assert judge([in_barrier(0), missing], timeout=TIMEOUT, silent_limit=SILENT).unresponsive == [1]


def test_a_rank_stuck_outside_any_collective_is_blocked_itself() -> None:
    """The sleeping rank has idled as long as the others: nobody in training progresses."""
    sleeping = state(1, "forward", idle=TIMEOUT)
    found = judge([in_backward(0), sleeping], timeout=TIMEOUT, silent_limit=SILENT)
    assert found.hang and found.blocked == [0, 1]
