"""Pipeline schedules as data: pure tests on action lists, no tensor anywhere."""

from __future__ import annotations

import doctest
import itertools

import pytest

from lightning_mgpu.placement.planning import schedule as schedule_module
from lightning_mgpu.placement.planning.schedule import (
    BACKWARD,
    FORWARD,
    SCHEDULES,
    WEIGHT,
    Action,
    check_schedule,
    fill_drain,
    make_schedule,
    one_f_one_b,
    peak_in_flight,
    simulate,
    zero_bubble,
)

SIZES = [(k, m) for k, m in itertools.product((1, 2, 3, 4, 8), (1, 2, 3, 4, 8, 16))]


def test_the_module_examples_hold() -> None:
    result = doctest.testmod(schedule_module)
    assert result.attempted >= 4 and result.failed == 0


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize(("k", "m"), SIZES)
def test_every_schedule_is_complete_ordered_and_free_of_deadlock(name: str, k: int, m: int) -> None:
    schedule = make_schedule(name, k, m)
    assert len(schedule) == k
    check_schedule(schedule, m)
    kinds = {action.kind for actions in schedule for action in actions}
    assert kinds == ({FORWARD, BACKWARD, WEIGHT} if name == "zero_bubble" else {FORWARD, BACKWARD})


@pytest.mark.parametrize(("k", "m"), SIZES)
def test_1f1b_holds_at_most_k_minus_j_micro_batches_gpipe_all_of_them(k: int, m: int) -> None:
    assert peak_in_flight(fill_drain(k, m)) == [m] * k
    assert peak_in_flight(one_f_one_b(k, m)) == [min(k - j, m) for j in range(k)]
    assert peak_in_flight(zero_bubble(k, m)) == [min(k - j + 1, m) for j in range(k)]


def test_1f1b_is_warm_up_then_one_forward_one_backward() -> None:
    assert one_f_one_b(3, 4) == [
        [Action(FORWARD, 0), Action(FORWARD, 1), Action(FORWARD, 2), Action(BACKWARD, 0), Action(FORWARD, 3)]
        + [Action(BACKWARD, i) for i in (1, 2, 3)],
        [Action(FORWARD, 0), Action(FORWARD, 1), Action(BACKWARD, 0), Action(FORWARD, 2), Action(BACKWARD, 1)]
        + [Action(FORWARD, 3), Action(BACKWARD, 2), Action(BACKWARD, 3)],
        [a for i in range(4) for a in (Action(FORWARD, i), Action(BACKWARD, i))],
    ]


@pytest.mark.parametrize(("k", "m"), [(2, 8), (4, 8), (4, 16), (8, 32)])
def test_zero_bubble_closes_the_bubble_that_1f1b_and_gpipe_leave(k: int, m: int) -> None:
    """Unit times (F = B = W = 1): fill-drain and 1F1B take 3(M + K - 1) slots; ZB-H1's bound is 3M + K - 1,
    reached at K = 2; the greedy order stays within K - 1 slots of it (a third of 1F1B's bubble at most)."""
    _, one_f_one_b_time = simulate(k, m, split_weight=False)
    assert one_f_one_b_time == 3 * (m + k - 1)
    order, zb_time = simulate(k, m, split_weight=True, limit=lambda stage: k - stage + 1)
    assert order == zero_bubble(k, m)
    assert 3 * m + k - 1 <= zb_time <= 3 * m + 2 * (k - 1)
    if k == 2:
        assert zb_time == 3 * m + 1


def test_w_passes_are_deferred_into_the_last_stage_s_gaps() -> None:
    last = zero_bubble(2, 4)[1]
    assert last[:4] == [Action(FORWARD, 0), Action(BACKWARD, 0), Action(FORWARD, 1), Action(BACKWARD, 1)]
    assert last[-1] == Action(WEIGHT, 3)


def test_invalid_schedules_are_explained() -> None:
    with pytest.raises(ValueError, match="must run each of"):
        check_schedule([[Action(FORWARD, 0)]], 1)
    with pytest.raises(ValueError, match="B0 comes before F0"):
        check_schedule([[Action(BACKWARD, 0), Action(FORWARD, 0)]], 1)
    with pytest.raises(ValueError, match="W0 comes before B0"):
        check_schedule([[Action(FORWARD, 0), Action(WEIGHT, 0), Action(BACKWARD, 0)]], 1)
    # stage 0 waits for stage 1's B0 before its F1; stage 1 waits for that F1 before its B0
    stuck = [
        [Action(FORWARD, 0), Action(BACKWARD, 0), Action(FORWARD, 1), Action(BACKWARD, 1)],
        [Action(FORWARD, 0), Action(FORWARD, 1), Action(BACKWARD, 0), Action(BACKWARD, 1)],
    ]
    with pytest.raises(ValueError, match="deadlocks"):
        check_schedule(stuck, 2)
    with pytest.raises(ValueError, match=r"schedule must be one of \('gpipe', '1f1b', 'zero_bubble'\)"):
        make_schedule("interleaved", 2, 4)
    with pytest.raises(ValueError, match="num_microbatches must be an integer >= 1"):
        make_schedule("1f1b", 2, 0)
