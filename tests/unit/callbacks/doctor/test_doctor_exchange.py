"""DistributedDoctor's meetings before a check (``callbacks/doctor/exchange.py``), in this process.

Ranks are threads sharing one in-memory store (``HashStore``). Rank 0, the one under test, runs in
the test's thread on a stand-in clock that advances with each of its pauses, so a timeout of
minutes passes in microseconds; the other ranks run on the real clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Optional

import pytest
import torch.distributed as dist

from lightning_mgpu.callbacks.doctor import DistributedDoctorOutOfStep
from lightning_mgpu.callbacks.doctor.exchange import Exchange, next_namespace, process_gone, this_process

NO_SUCH_PID = 4_194_304 + 17  # above Linux's largest pid_max: never a process


class FakeTime:
    """A clock that moves only when the code under test pauses."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _ranks(
    store: dist.Store, world: int, *, timeout: Optional[float] = 600.0, neighbours: Sequence[int] = ()
) -> tuple[list[Exchange], FakeTime, dist.Store]:
    """``world`` ranks' exchanges on ``store``, rank 0's clock, and the store as they see it (their namespace)."""
    namespace = next_namespace()
    fake = FakeTime()
    exchanges = [Exchange(timeout=timeout, clock=fake.clock, sleep=fake.sleep)]
    exchanges += [Exchange(timeout=timeout, watch_every_s=0.05) for _ in range(1, world)]
    for rank, exchange in enumerate(exchanges):
        assert exchange.open(store, namespace=namespace, rank=rank, world_size=world, neighbours=neighbours)
    return exchanges, fake, dist.PrefixStore(f"lightning_mgpu/doctor/{namespace}/", store)


def _in_thread(exchange: Exchange, where: str, errors: list[BaseException]) -> threading.Thread:
    def meet() -> None:
        try:
            exchange.meet(where)
        except BaseException as error:  # noqa: BLE001 - handed to the test
            errors.append(error)

    thread = threading.Thread(target=meet)
    thread.start()
    return thread


def _meet_all(exchanges: list[Exchange], keys: dist.Store, n: int, where: str) -> None:
    """Every rank meets at check ``n``: ranks 1.. first (in threads, as in their own processes), rank 0 last
    (its clock runs without real time passing: waiting first, it would time out at once)."""
    errors: list[BaseException] = []
    threads = [_in_thread(exchange, where, errors) for exchange in exchanges[1:]]
    deadline = time.monotonic() + 30
    while keys.add(f"check/{n}", 0) < len(threads) and time.monotonic() < deadline:
        time.sleep(0.001)
    exchanges[0].meet(where)
    for thread in threads:
        thread.join(timeout=30)
    assert not errors and not any(t.is_alive() for t in threads)


def test_ranks_meet_check_after_check_and_the_old_keys_go() -> None:
    exchanges, _, keys = _ranks(dist.HashStore(), 3)
    for n in range(1, 5):
        _meet_all(exchanges, keys, n, f"check {n}")
    # Rank 0 cleans up behind the ranks: check 2's keys went at check 4.
    assert [n for n in range(1, 5) if keys.check([f"check/{n}"])] == [3, 4]


def test_a_rank_that_never_comes_is_named_with_where_it_was_last_seen() -> None:
    exchanges, fake, keys = _ranks(dist.HashStore(), 2, timeout=600.0)
    _meet_all(exchanges, keys, 1, "the start of epoch 0")
    with pytest.raises(DistributedDoctorOutOfStep) as info:
        exchanges[0].meet("the start of epoch 1")
    message = str(info.value)
    assert info.value.missing == [1]
    assert "rank 1 did not reach check 2 (the start of epoch 1) within 600 s" in message
    assert "rank 1 was last at check 1 (the start of epoch 0)" in message
    assert "check_timeout" in message and "same number of batches" in message
    assert 600 <= fake.now < 601  # it waited the timeout, polling at most every 0.1 s, no longer


def test_a_rank_that_left_ends_the_wait_at_once_even_without_a_timeout() -> None:
    exchanges, fake, keys = _ranks(dist.HashStore(), 3, timeout=None)
    _meet_all(exchanges, keys, 1, "after batch 0 of epoch 0")
    errors: list[BaseException] = []
    waiting = _in_thread(exchanges[2], "the end of epoch 0", errors)  # arrives, then waits in vain like rank 0
    exchanges[1].leave("RuntimeError: CUDA out of memory")
    exchanges[1].leave("said twice")  # once only
    with pytest.raises(DistributedDoctorOutOfStep, match="rank 1 left the run") as info:
        exchanges[0].meet("the end of epoch 0")
    assert "rank 1: RuntimeError: CUDA out of memory" in str(info.value) and "said twice" not in str(info.value)
    assert info.value.missing == [1]
    assert fake.now <= 1.2  # found at the first look for ranks that left (every second)
    waiting.join(timeout=30)
    assert [type(e) for e in errors] == [DistributedDoctorOutOfStep] and "rank 1 left the run" in str(errors[0])


def test_a_rank_on_this_machine_whose_process_is_gone_ends_the_wait() -> None:
    exchanges, fake, keys = _ranks(dist.HashStore(), 2, timeout=None, neighbours=[0, 1])
    _meet_all(exchanges, keys, 1, "after batch 0 of epoch 0")
    # Rank 1 was killed (SIGKILL, out of memory): it said nothing, and its pid is gone.
    here = this_process().rsplit(" ", 1)[0]  # this host and pid namespace
    keys.set("who/1", f"{here} {NO_SUCH_PID}")
    with pytest.raises(DistributedDoctorOutOfStep, match=f"rank 1's process \\(pid {NO_SUCH_PID} on this machine\\)"):
        exchanges[0].meet("after batch 3 of epoch 0")
    assert fake.now <= 1.2


@pytest.mark.parametrize("elsewhere", ["another host", "another pid namespace"])
def test_a_rank_elsewhere_is_not_taken_for_dead(elsewhere: str) -> None:
    exchanges, _, keys = _ranks(dist.HashStore(), 2, timeout=30.0, neighbours=[0, 1])
    host, namespace, _ = this_process().split(" ")
    if elsewhere == "another host":
        keys.set("who/1", f"another-{host} {namespace} {NO_SUCH_PID}")
    else:  # e.g. a container with the same host name: its pids are not this namespace's
        keys.set("who/1", f"{host} {int(namespace) + 1} {NO_SUCH_PID}")
    with pytest.raises(DistributedDoctorOutOfStep, match="did not reach check 1"):  # only the timeout
        exchanges[0].meet("the start of epoch 0")


def test_without_a_store_or_alone_there_is_nothing_to_meet() -> None:
    alone = Exchange(timeout=1.0)
    assert not alone.open(None, namespace=next_namespace(), rank=0, world_size=2)
    assert not alone.bounded
    alone.meet("the start of epoch 0")  # returns: the collective alone, as before
    one = Exchange(timeout=1.0)
    assert not one.open(dist.HashStore(), namespace=next_namespace(), rank=0, world_size=1)
    one.meet("the start of epoch 0")
    one.leave("done")


def test_a_store_that_went_away_is_said_not_waited_for() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=10))
    exchange = Exchange(timeout=None)
    assert exchange.open(client, namespace=next_namespace(), rank=0, world_size=2)
    del server  # the rank that served it ended
    with pytest.raises(DistributedDoctorOutOfStep, match="the rendezvous store cannot be reached at check 1"):
        exchange.meet("the start of epoch 0")
    exchange.leave("gone too")  # never raises


def test_process_gone_tells_a_live_process_from_a_missing_one() -> None:
    import os

    assert not process_gone(os.getpid())
    assert process_gone(NO_SUCH_PID)
