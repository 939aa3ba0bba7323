"""How the ranks meet at a check: through the rendezvous store first, bounded; then one collective.

A check's collective (``all_gather_object``) waits, like any collective, for every rank of the
group, for as long as the group's timeout (30 minutes by default), and a rank blocked in it acts
on no signal. The doctor must never be what hangs a run, so before a check's collective every
rank first *meets* the others through the default process group's store:

* each rank says where it is (``at/<rank>``) and adds itself to the check's counter; the last to
  arrive opens the check, the others poll for it (``Store.check``, backing off to 0.1 s), so the
  main thread is back in Python between polls;
* while it waits, a rank watches for ranks that left: one that raised or finished its fit says so
  (the callback's ``on_exception``/``teardown`` call :meth:`Exchange.leave`), and one on this
  machine (same host, same pid namespace) whose process is gone is seen by its pid; either ends
  the wait at once;
* after ``timeout`` seconds the wait ends anyway.

Both end in :class:`~.findings.DistributedDoctorOutOfStep` naming the ranks that did not arrive
and the last check each reached. Only once every rank has arrived does the collective run: all
ranks are then in the same check, so it can neither pair with another collective nor wait on a
rank that is elsewhere.

Keys live under ``lightning_mgpu/doctor/<namespace>/``; :func:`next_namespace` counts the fits of
this process (the same on every rank: every rank runs the same fits).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Callable, Optional

import torch.distributed as dist

from lightning_mgpu.callbacks.doctor.findings import DistributedDoctorOutOfStep, rank_list
from lightning_mgpu.comm.distributed import process_gone, this_process

__all__ = ["Exchange", "next_namespace", "process_gone", "this_process"]

_SERIAL = itertools.count()
_FIRST_POLL_S = 0.0005


def next_namespace() -> str:
    """A fresh key namespace for a fit's meetings: the fit's number in this process."""
    return str(next(_SERIAL))


class Exchange:
    """One rank's side of the meetings before each check (see the module's docstring).

    Args:
        timeout: seconds a rank waits at a check for the others (None: as long as it takes).
        poll_max_s: the longest pause between two looks at the check's key.
        watch_every_s: how often a waiting rank looks for ranks that left.
        clock, sleep: stand-ins for tests.
    """

    def __init__(
        self,
        *,
        timeout: Optional[float],
        poll_max_s: float = 0.1,
        watch_every_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.timeout = timeout
        self.poll_max_s = poll_max_s
        self.watch_every_s = watch_every_s
        self._clock, self._sleep = clock, sleep
        self._store: Optional[dist.Store] = None
        self._rank, self._world = 0, 1
        self._neighbours: list[int] = []
        self._who: dict[int, tuple[str, int]] = {}
        self._count = 0
        self._left = False

    @property
    def bounded(self) -> bool:
        """The checks meet through the store (False: only their collective is left, unbounded)."""
        return self._store is not None

    def open(
        self,
        store: Optional[dist.Store],
        *,
        namespace: str,
        rank: int,
        world_size: int,
        neighbours: Sequence[int] = (),
    ) -> bool:
        """Meet the other ranks through ``store`` (under ``namespace``, the same on every rank) from now on;
        ``neighbours``: ranks that may run on this machine (their processes are watched). False when there is
        nothing to meet through."""
        self._store, self._rank, self._world = None, rank, world_size
        self._neighbours = [r for r in neighbours if r != rank and 0 <= r < world_size]
        self._who, self._count, self._left = {}, 0, False
        if store is None or world_size < 2:
            return False
        prefixed = dist.PrefixStore(f"lightning_mgpu/doctor/{namespace}/", store)
        try:
            prefixed.set(f"who/{rank}", this_process())
        except (dist.DistError, RuntimeError):
            return False
        self._store = prefixed
        return True

    def close(self) -> None:
        self._store = None

    # ------------------------------------------------------------------ meeting

    def meet(self, where: str) -> None:
        """Return once every rank has reached this check (``where``: what it is, for the others' messages);
        raise :class:`DistributedDoctorOutOfStep` if a rank left, or when ``timeout`` has passed."""
        store = self._store
        if store is None:
            return
        self._count += 1
        n = self._count
        try:
            store.set(f"at/{self._rank}", f"{n}\t{where}")
            if store.add(f"check/{n}", 1) >= self._world:
                store.set(f"check/{n}/open", "1")
            else:
                self._wait(store, n, where)
            if self._rank == 0 and n > 2:
                # Every rank has passed check n - 1, so none still looks at check n - 2's keys.
                store.delete_key(f"check/{n - 2}")
                store.delete_key(f"check/{n - 2}/open")
        except DistributedDoctorOutOfStep:
            raise
        except (dist.DistError, RuntimeError) as error:
            raise DistributedDoctorOutOfStep(
                f"DistributedDoctor: the rendezvous store cannot be reached at check {n} ({where}): "
                f"{str(error).splitlines()[0] if str(error) else type(error).__name__}. The rank that serves it "
                "(rank 0 under Lightning's launcher, the torchrun agent under torchrun) has probably ended; this "
                "rank stops rather than wait for ranks it can no longer hear from."
            ) from None

    def _wait(self, store: dist.Store, n: int, where: str) -> None:
        start = self._clock()
        next_watch = start + self.watch_every_s
        delay = _FIRST_POLL_S
        key = [f"check/{n}/open"]
        while not store.check(key):
            now = self._clock()
            if now >= next_watch:
                self._watch(store, n, where)
                next_watch = now + self.watch_every_s
            if self.timeout is not None and now - start >= self.timeout:
                missing = self._missing(store, n)
                raise DistributedDoctorOutOfStep(
                    f"DistributedDoctor: rank{'s' if len(missing) > 1 else ''} {rank_list(missing)} did not reach "
                    f"check {n} ({where}) within {self.timeout:g} s (check_timeout); "
                    f"{self._last_seen(store, missing)}. The ranks are out of step: a rank ran out of batches before "
                    "the others (data of unknown length: give every rank the same number of batches), a collective "
                    "only some ranks reach (a barrier or sync_dist=True under a rank condition), a rank stuck "
                    "elsewhere (data loading, I/O), or one rank far slower than the others (rank-0-only work between "
                    "checks: raise DistributedDoctor(check_timeout=...)).",
                    missing,
                )
            self._sleep(delay)
            delay = min(2 * delay, self.poll_max_s)

    def _watch(self, store: dist.Store, n: int, where: str) -> None:
        """Raise if a rank left (its word in the store) or a neighbour's process is gone."""
        left = int(store.add("left", 0))
        if left:
            words = [str(store.get(f"left/#{i}"), "utf-8").split("\t", 1) for i in range(1, left + 1)]
            ranks = sorted({int(rank) for rank, _ in words})
            reasons = "; ".join(f"rank {rank}: {why}" for rank, why in words)
            raise DistributedDoctorOutOfStep(
                f"DistributedDoctor: rank{'s' if len(ranks) > 1 else ''} {rank_list(ranks)} left the run before check "
                f"{n} ({where}) could be made ({reasons}); this rank stops rather than wait for "
                f"{'them' if len(ranks) > 1 else 'it'}.",
                ranks,
            )
        here = this_process().rsplit(" ", 1)[0]
        for rank in self._neighbours:
            if self._reached(store, rank) >= n:
                continue
            who = self._whois(store, rank)  # its pid means something here only on this host, in this pid namespace
            if who is not None and who[0] == here and process_gone(who[1]):
                raise DistributedDoctorOutOfStep(
                    f"DistributedDoctor: rank {rank}'s process (pid {who[1]} on this machine) has ended without a "
                    f"word (killed, out of memory, or a crash below Python) before check {n} ({where}); "
                    f"{self._last_seen(store, [rank])}. This rank stops rather than wait for it.",
                    [rank],
                )

    # ------------------------------------------------------------------ leaving

    def leave(self, why: str) -> None:
        """Tell ranks waiting at a check that this one will not come (once; never raises)."""
        store = self._store
        if store is None or self._left:
            return
        self._left = True
        try:
            index = int(store.add("left", 1))
            store.set(f"left/#{index}", f"{self._rank}\t{why}")
        except (dist.DistError, RuntimeError):
            pass  # the store is gone with its rank: the others learn it from the store

    # ------------------------------------------------------------------ what the others did

    def _reached(self, store: dist.Store, rank: int) -> int:
        """The last check ``rank`` reached (0: none yet)."""
        if not store.check([f"at/{rank}"]):
            return 0
        return int(str(store.get(f"at/{rank}"), "utf-8").split("\t", 1)[0])

    def _whois(self, store: dist.Store, rank: int) -> Optional[tuple[str, int]]:
        if rank not in self._who:
            if not store.check([f"who/{rank}"]):
                return None
            where, pid = str(store.get(f"who/{rank}"), "utf-8").rsplit(" ", 1)
            self._who[rank] = (where, int(pid))
        return self._who[rank]

    def _missing(self, store: dist.Store, n: int) -> list[int]:
        return [rank for rank in range(self._world) if rank != self._rank and self._reached(store, rank) < n]

    def _last_seen(self, store: dist.Store, ranks: Sequence[int]) -> str:
        parts = []
        for rank in ranks[:8]:
            if store.check([f"at/{rank}"]):
                check, where = str(store.get(f"at/{rank}"), "utf-8").split("\t", 1)
                parts.append(f"rank {rank} was last at check {check} ({where})")
            else:
                parts.append(f"rank {rank} reached no check in this fit")
        if len(ranks) > 8:
            parts.append(f"and {len(ranks) - 8} more")
        return ", ".join(parts)
