"""CommProfiler's profiling-window schedule, pure: no Trainer, no process, no torch tensor."""

from __future__ import annotations

import itertools

import pytest

from lightning_mgpu.callbacks.comm_profiler.schedule import SETTLE_STEPS, ProfileSchedule


def phases(schedule: ProfileSchedule, steps: int) -> str:
    """s(kip), p(rofile), o(ff) for synchronising steps 1..steps."""
    return "".join(schedule.phase(n)[0] for n in range(1, steps + 1))


def test_first_window_after_the_warm_up_later_ones_after_the_settling_steps() -> None:
    schedule = ProfileSchedule(warmup_steps=3, profile_steps=4, profile_every=10)
    assert phases(schedule, 30) == "sssppppooo" + "ssppppoooo" * 2


def test_a_warm_up_shorter_than_the_settling_steps_still_skips_only_the_warm_up_first() -> None:
    # the first window runs on the fit's first DDP wrapper, whose settling the callback tracks itself
    schedule = ProfileSchedule(warmup_steps=1, profile_steps=2, profile_every=5)
    assert SETTLE_STEPS == 2
    assert phases(schedule, 15) == "sppoo" + "ssppo" * 2


def test_profile_every_none_profiles_every_step_after_the_warm_up() -> None:
    schedule = ProfileSchedule(warmup_steps=3, profile_every=None)
    assert phases(schedule, 8) == "sssppppp"
    assert schedule.phase(10**9) == "profile"


@pytest.mark.parametrize("n", [0, -1, -100])
def test_steps_before_the_origin_are_skipped(n: int) -> None:
    assert ProfileSchedule(warmup_steps=1, profile_steps=1, profile_every=4).phase(n) == "skip"
    assert ProfileSchedule(warmup_steps=1, profile_every=None).phase(n) == "skip"


def test_every_window_profiles_exactly_profile_steps_and_leaves_a_step_off() -> None:
    for warmup, profiled, extra in itertools.product((1, 2, 5), (1, 3, 20), (1, 7)):
        every = max(warmup, SETTLE_STEPS) + profiled + extra
        schedule = ProfileSchedule(warmup_steps=warmup, profile_steps=profiled, profile_every=every)
        for window in range(4):
            steps = [schedule.phase(window * every + offset) for offset in range(1, every + 1)]
            assert steps.count("profile") == profiled
            assert steps[-1] == "off" and steps[0] == "skip"
            # skip -> profile -> off, each phase one contiguous run
            assert steps == sorted(steps, key=["skip", "profile", "off"].index)


def test_the_defaults() -> None:
    schedule = ProfileSchedule()
    assert (schedule.warmup_steps, schedule.profile_steps, schedule.profile_every) == (5, 20, 200)
    assert schedule.as_dict() == {"warmup_steps": 5, "profile_steps": 20, "profile_every": 200}
    assert ProfileSchedule(profile_every=None).as_dict()["profile_every"] is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"warmup_steps": 0}, "warmup_steps must be an integer >= 1"),
        ({"warmup_steps": True}, "warmup_steps must be an integer >= 1"),
        ({"profile_steps": 0}, "profile_steps must be an integer >= 1"),
        ({"profile_steps": 2.0}, "profile_steps must be an integer >= 1"),
        ({"profile_every": 0}, "profile_every must be an integer >= 1"),
        ({"profile_every": 25}, "profile_every=25 leaves no step outside the profiling window"),
        ({"profile_steps": 3, "profile_every": 5}, "the 2 settling steps of a re-wrap"),
    ],
)
def test_bad_schedules_are_refused_with_the_reason(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ProfileSchedule(**kwargs)  # type: ignore[arg-type]


def test_the_shortest_period_that_leaves_one_step_off_is_accepted() -> None:
    assert ProfileSchedule(warmup_steps=5, profile_steps=20, profile_every=26).phase(26) == "off"
    with pytest.raises(ValueError, match="profile_every=None to profile every step"):
        ProfileSchedule(warmup_steps=5, profile_steps=20, profile_every=25)
