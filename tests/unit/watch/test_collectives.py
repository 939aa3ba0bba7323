"""The collective wrappers: what a rank's main thread is in, counted once, restored after, never wrapped twice."""

from __future__ import annotations

import threading
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

from lightning_mgpu.watch import collectives
from lightning_mgpu.watch.heartbeat import Heartbeat


@pytest.fixture
def beat(one_rank_group: None) -> Iterator[Heartbeat]:
    originals = {name: getattr(dist, name) for name in collectives.TRACKED if hasattr(dist, name)}
    heartbeat = Heartbeat()
    collectives.install(heartbeat)
    try:
        yield heartbeat
    finally:
        collectives.uninstall()
        for name, original in originals.items():
            setattr(dist, name, original)


def test_a_collective_of_the_main_thread_is_counted_once_and_left(beat: Heartbeat) -> None:
    progress = beat.progress
    dist.barrier()
    dist.all_gather_object([None], {"a": 1})  # built on other collectives inside: counted once
    assert beat.collective is None
    assert beat.collectives == 2 and beat.last_collective == ("all_gather_object", 2)
    assert beat.progress == progress + 2


def test_inside_a_collective_its_kind_sequence_and_group_are_there(beat: Heartbeat) -> None:
    inside: list[Any] = []

    def broadcast(tensor: torch.Tensor, src: int, group: Any = None) -> None:
        inside.append(beat.collective)

    collectives._tracked("broadcast", broadcast)(torch.zeros(2), 0, group=dist.group.WORLD)
    ((kind, seq, size, entered),) = inside
    assert (kind, seq, size) == ("broadcast", 1, 1) and entered > 0
    assert beat.collective is None and beat.last_collective == ("broadcast", 1)


def test_another_threads_collectives_do_not_count(beat: Heartbeat) -> None:
    thread = threading.Thread(target=lambda: dist.all_reduce(torch.ones(1)))
    thread.start()
    thread.join()
    assert beat.collectives == 0


def test_installed_once_and_restored(one_rank_group: None) -> None:
    original = dist.all_reduce
    beat = Heartbeat()
    collectives.install(beat)
    wrapped = dist.all_reduce
    collectives.install(beat)  # a second run's install does not wrap the wrapper
    assert dist.all_reduce is wrapped is not original
    collectives.uninstall()
    assert dist.all_reduce is original
    dist.all_reduce(torch.ones(1))
    assert beat.collectives == 0


def test_a_wrapper_put_on_top_of_ours_is_left_in_place(one_rank_group: None) -> None:
    original = dist.barrier
    collectives.install(Heartbeat())
    theirs = lambda *a, **k: dist_barrier_ours(*a, **k)  # noqa: E731
    dist_barrier_ours = dist.barrier
    dist.barrier = theirs  # type: ignore[assignment]
    try:
        collectives.uninstall()
        assert dist.barrier is theirs  # not ours to take away
        dist.barrier()  # ours underneath passes straight through
    finally:
        dist.barrier = original
        collectives._originals.pop("barrier", None)
