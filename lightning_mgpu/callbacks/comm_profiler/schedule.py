"""Which synchronising steps ``CommProfiler`` profiles: the profiling-window schedule, pure arithmetic.

A step is one of three phases (:data:`Phase`): ``"skip"`` (the profiler's hook is in DDP but
the step is not recorded: warm-up, or a new DDP wrapper settling), ``"profile"``, or ``"off"``
(DDP runs without the profiler's hook, between windows). No torch, no Lightning: the callback
asks :meth:`ProfileSchedule.phase` at the end of every synchronising step and switches the hook
when the next step's phase says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, Optional

from lightning_mgpu._checks import check_int

SETTLE_STEPS = 2
"""Steps of a new DDP wrapper never profiled: the first runs DDP's initial bucket layout, the
second rebuilds it (in its forward)."""

Phase = Literal["skip", "profile", "off"]


@dataclass(frozen=True, kw_only=True)
class ProfileSchedule:
    """A window of ``profile_steps`` profiled steps every ``profile_every`` synchronising steps.

    The first window starts after ``warmup_steps``; each later window starts on a fresh DDP
    wrapper (the profiler's hook went back in), so it skips that wrapper's :data:`SETTLE_STEPS`
    first. ``profile_every=None``: one endless window after the warm-up (the hook never leaves).
    """

    warmup_steps: int = 5
    """Synchronising steps at the start not profiled (at least 1)."""
    profile_steps: int = 20
    """Profiled steps per window."""
    profile_every: Optional[int] = 200
    """A window starts every this many synchronising steps; ``None``: profile every step."""

    def __post_init__(self) -> None:
        check_int("warmup_steps", self.warmup_steps, owner="CommProfiler")
        check_int("profile_steps", self.profile_steps, owner="CommProfiler")
        if self.profile_every is None:
            return
        check_int("profile_every", self.profile_every, owner="CommProfiler")
        # every window must leave at least one step "off", or the hook would leave DDP and come
        # straight back in (two re-wraps for nothing)
        if self.profile_every <= max(self.warmup_steps, SETTLE_STEPS) + self.profile_steps:
            raise ValueError(
                f"CommProfiler: profile_every={self.profile_every} leaves no step outside the profiling window "
                f"(warmup_steps={self.warmup_steps} or the {SETTLE_STEPS} settling steps of a re-wrap, plus "
                f"profile_steps={self.profile_steps}); make it larger, or profile_every=None to profile every step"
            )

    def phase(self, n: int) -> Phase:
        """The phase of synchronising step ``n``, counted from 1 at the schedule's origin
        (``n <= 0``: before the origin, e.g. while ``bucket_cap_mb="auto"`` measures: "skip")."""
        if n <= 0:
            return "skip"
        if self.profile_every is None:
            return "skip" if n <= self.warmup_steps else "profile"
        window, offset = divmod(n - 1, self.profile_every)
        skip = self.warmup_steps if window == 0 else SETTLE_STEPS
        if offset < skip:
            return "skip"
        return "profile" if offset < skip + self.profile_steps else "off"

    def as_dict(self) -> dict[str, Optional[int]]:
        """The ``summary["schedule"]`` entry of ``comm_profile.json``."""
        return asdict(self)
