"""One rank's state as every rank reads it from the store: its heartbeat, where its main thread is, how long it has idled.

A rank's watch thread publishes :meth:`RankState.as_dict` once a second (JSON); the others read it
back with :meth:`RankState.from_dict` and add what only a reader can know: how long the rank has
been silent (its beat number not moving) and whether its process is gone. The verdict, the
diagnosis and the report work on these, without torch or threads (pure functions of the states).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

from lightning_mgpu.watch.heartbeat import PHASES, family
from lightning_mgpu.watch.sampling import Frame

__all__ = ["RankState"]


@dataclass
class RankState:
    rank: int
    host: str = "?"
    pid: int = 0
    watching: bool = True
    """Inside a watched run (False: past the end of its run, its watch only listening)."""
    stage: Optional[str] = None
    phase: str = "setup"
    epoch: int = 0
    step: int = 0
    batch: Optional[int] = None
    batches: Optional[int] = None
    batches_done: int = 0
    backwards: int = 0
    collectives: int = 0
    collective: Optional[dict[str, Any]] = None
    """The tracked collective it is in: kind, seq, group_size, for_s."""
    last_collective: Optional[dict[str, Any]] = None
    c10d: Optional[str] = None
    """The ``torch.distributed`` function its stack is in (seen even when not tracked)."""
    idle_s: float = 0.0
    """Seconds since its main thread last made progress (its own watch measured it)."""
    site: Optional[Frame] = None
    """The innermost frame of user code on its main thread's stack."""
    in_hook: bool = False
    """Lightning called that code (a hook or step of the user's): else the site is only the line that started
    the run (``trainer.fit(...)``), or code after it."""
    caller: Optional[Frame] = None
    """The innermost frame outside torch."""
    failure: Optional[str] = None
    signal: Optional[int] = None
    beat: int = 0
    log_dir: Optional[str] = None
    stack: list[Frame] = field(default_factory=list)
    # what the reader adds
    silent_s: float = 0.0
    """Seconds its beat number has not moved, as the reader saw it."""
    gone: bool = False
    """Its process has ended (the reader runs on the same machine and looked)."""
    missing: bool = False
    """Nothing published at all."""

    # ------------------------------------------------------------------ derived

    @property
    def family(self) -> str:
        return family(self.phase)

    @property
    def in_collective(self) -> bool:
        return self.collective is not None or self.c10d is not None

    @property
    def waiting_in(self) -> Optional[str]:
        """What it waits in, in words: a collective (tracked or seen on its stack), or DDP's gradient all-reduce."""
        if self.collective is not None:
            c = self.collective
            size = f", {c['group_size']} ranks" if c.get("group_size") else ""
            return f"{c['kind']} (collective #{c['seq']}{size})"
        if self.c10d is not None:
            return f"{self.c10d} (torch.distributed)"
        if self.phase == "backward":
            return f"backward #{self.backwards} (DDP's gradient all-reduce)"
        return None

    @property
    def doing(self) -> str:
        """Its phase, in words, with the batch where there is one."""
        words = PHASES.get(self.phase, (self.phase, self.phase))[1]
        if self.batch is not None and self.phase not in ("after_run", "teardown", "failed", "setup"):
            of = f"/{self.batches}" if self.batches else ""
            words += f", after batch {self.batch}{of}" if self.phase == "data_fetch" else f", batch {self.batch}{of}"
        if self.stage == "fit" and self.family == "train":
            words += f" (epoch {self.epoch}, step {self.step})"
        return words

    # ------------------------------------------------------------------ as data

    def as_dict(self, *, with_stack: bool = False) -> dict[str, Any]:
        data: dict[str, Any] = {key: getattr(self, key) for key in _PLAIN}
        data["site"] = None if self.site is None else self.site.as_dict()
        data["caller"] = None if self.caller is None else self.caller.as_dict()
        if with_stack:
            data["stack"] = [frame.as_dict() for frame in self.stack]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RankState":
        state = cls(**{key: data[key] for key in _PLAIN if key in data})
        state.site = Frame.from_dict(data.get("site"))
        state.caller = Frame.from_dict(data.get("caller"))
        state.stack = [f for f in (Frame.from_dict(d) for d in data.get("stack") or []) if f is not None]
        return state


_PLAIN = tuple(f.name for f in fields(RankState) if f.name not in ("site", "caller", "stack"))
"""The fields that go to JSON as they are (in their order; the frames go after them, as dicts)."""
