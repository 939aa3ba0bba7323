"""The watch's line to the other ranks: the rendezvous store, never the process group (which may be what is stuck).

Keys, under ``lightning_mgpu/watch/<attempt>/`` of the default process group's store (``<attempt>``:
torchrun's restart count, so that a restarted job never reads the keys of the attempt before it):

    beat/<rank>      the rank's :class:`~lightning_mgpu.watch.state.RankState`, JSON, rewritten every tick
    hang             the first rank to judge the job hung declares it here (``compare_set``: one declaration)
    reporter         the rank that prints the report (rank 0 claims it at once; another only if rank 0 does not)
    final/<rank>     the rank's last state with its main thread's stack, once a hang is declared
    done             the report is out: every rank may exit
    left             how many ranks saw ``done`` (the reporter waits for them: it may be the store's host)
    failure/reporter after a collective failed: the one surviving rank that reports it

The watch thread talks through its own clone of the store client (``Store.clone()``: one client
per thread), so it never waits behind a store call of the main thread; the main thread's rare calls
(a failure noted on the way out) use the store itself. Everything here depends only on the store's
address, as the process group has it: the same on one machine, across nodes, under torchrun or SLURM.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

__all__ = ["Channel"]

STORE_TIMEOUT = timedelta(seconds=10)


class Channel:
    """Reads and writes of the watch's keys (see the module docstring); every call may raise ``dist.DistError``/``RuntimeError``."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    @classmethod
    def open(cls, store: dist.Store, *, own_client: bool) -> "Channel":
        """The keys of this job attempt in ``store``; ``own_client``: through a clone of its client (for a thread)."""
        if own_client:
            try:
                store = store.clone()  # type: ignore[attr-defined]  # torch's stubs lack it (torch >= 2.5 has it)
                store.set_timeout(STORE_TIMEOUT)
            except (AttributeError, RuntimeError, NotImplementedError, dist.DistError):
                pass  # a store that cannot clone: shared with the main thread
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(dist.PrefixStore(f"lightning_mgpu/watch/{attempt}/", store))

    # ------------------------------------------------------------------ beats

    def publish(self, rank: int, state: dict[str, Any]) -> None:
        self.store.set(f"beat/{rank}", json.dumps(state, default=str))

    def beats(self, world_size: int) -> list[Optional[dict[str, Any]]]:
        """Every rank's last beat (None where a rank never published)."""
        keys = [f"beat/{rank}" for rank in range(world_size)]
        if self.store.check(keys):
            return [json.loads(value) for value in self.store.multi_get(keys)]
        return [json.loads(self.store.get(key)) if self.store.check([key]) else None for key in keys]

    # ------------------------------------------------------------------ a hang

    def declare(self, declaration: dict[str, Any]) -> dict[str, Any]:
        """Declare the hang unless a rank did already; the declaration in force (ours or the first one)."""
        mine = json.dumps(declaration, default=str)
        current = self.store.compare_set("hang", "", mine)
        result: dict[str, Any] = json.loads(current)
        return result

    def declared(self) -> Optional[dict[str, Any]]:
        if not self.store.check(["hang"]):
            return None
        result: dict[str, Any] = json.loads(self.store.get("hang"))
        return result

    def claim(self, key: str, rank: int) -> int:
        """Claim ``key`` (e.g. ``reporter``) for ``rank`` unless claimed; the rank that holds it."""
        return int(self.store.compare_set(key, "", str(rank)))

    def claimed(self, key: str) -> Optional[int]:
        return int(self.store.get(key)) if self.store.check([key]) else None

    def put_final(self, rank: int, state: dict[str, Any]) -> None:
        self.store.set(f"final/{rank}", json.dumps(state, default=str))

    def finals(self, ranks: list[int]) -> dict[int, dict[str, Any]]:
        return {
            rank: json.loads(self.store.get(f"final/{rank}")) for rank in ranks if self.store.check([f"final/{rank}"])
        }

    def mark_done(self) -> None:
        self.store.set("done", "1")

    def done(self) -> bool:
        return bool(self.store.check(["done"]))

    def leave(self) -> None:
        self.store.add("left", 1)

    def left(self) -> int:
        return int(self.store.add("left", 0))
