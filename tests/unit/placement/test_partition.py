"""``lightning_mgpu.placement.planning.partition``: exact, reproducible, and loud about bad input.

Plain lists only (the module imports no torch). Three independent oracles:

* ``brute_force``: every composition of L into k parts, stage costs and memory summed
  exactly with ``fractions.Fraction``; it also applies the documented tie rule
  (lexicographically smallest sizes), so the tests compare whole answers, not just the
  bottleneck.
* ``dp_bottleneck``: the O(k L^2) dynamic programme, vectorised with numpy on integers,
  for L in the thousands where enumeration is hopeless.
* hand-checked known answers and error messages.

That the module imports no torch is checked in a fresh interpreter: tests/dist/placement/test_partition.py.
"""

from __future__ import annotations

import itertools
import math
import random
import re
import sys
from fractions import Fraction
from typing import Optional, Sequence, Union

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lightning_mgpu.placement import partition
from lightning_mgpu.placement.planning.partition import stage_costs

Capacity = Union[float, list[float], None]


# ----------------------------------------------------------------------------- oracles
def compositions(num_layers: int, num_stages: int) -> list[list[int]]:
    """All ways to cut ``num_layers`` layers into ``num_stages`` non-empty runs, in lexicographic order."""
    result = []
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = (0, *cuts, num_layers)
        result.append([bounds[i + 1] - bounds[i] for i in range(num_stages)])
    return sorted(result)


def exact_stage_costs(
    costs: Sequence[float], sizes: Sequence[int], cut_costs: Optional[Sequence[float]]
) -> list[Fraction]:
    """The documented model, in exact rationals: layer costs plus each boundary's cut cost."""
    result = []
    start = 0
    for size in sizes:
        stop = start + size
        total = sum((Fraction(c) for c in costs[start:stop]), Fraction(0))
        if cut_costs is not None and start > 0:
            total += Fraction(cut_costs[start - 1])
        if cut_costs is not None and stop < len(costs):
            total += Fraction(cut_costs[stop - 1])
        result.append(total)
        start = stop
    return result


def capacities_of(capacity: Capacity, num_stages: int) -> Optional[list[float]]:
    if capacity is None:
        return None
    return list(capacity) if isinstance(capacity, list) else [capacity] * num_stages


def fits(memory: Optional[Sequence[float]], capacity: Capacity, sizes: Sequence[int]) -> bool:
    if memory is None:
        return True
    limits = capacities_of(capacity, len(sizes))
    assert limits is not None
    start = 0
    for size, limit in zip(sizes, limits):
        if limit != math.inf and sum((Fraction(m) for m in memory[start : start + size]), Fraction(0)) > Fraction(
            limit
        ):
            return False
        start += size
    return True


def brute_force(
    costs: Sequence[float],
    k: int,
    *,
    memory: Optional[Sequence[float]] = None,
    capacity: Capacity = None,
    cut_costs: Optional[Sequence[float]] = None,
) -> Optional[tuple[Fraction, list[int]]]:
    """(optimal bottleneck, lexicographically smallest optimal sizes), or None if nothing fits."""
    best: Optional[tuple[Fraction, list[int]]] = None
    for sizes in compositions(len(costs), k):  # lexicographic order: the first optimum found wins ties
        if not fits(memory, capacity, sizes):
            continue
        bottleneck = max(exact_stage_costs(costs, sizes, cut_costs))
        if best is None or bottleneck < best[0]:
            best = (bottleneck, sizes)
    return best


def least_overflow(memory: Sequence[float], capacity: Capacity, k: int) -> Fraction:
    """min over splits of the largest (stage memory - stage capacity), exactly."""
    limits = capacities_of(capacity, k)
    assert limits is not None
    best: Optional[Fraction] = None
    for sizes in compositions(len(memory), k):
        start, worst = 0, None
        for size, limit in zip(sizes, limits):
            if limit != math.inf:
                over = sum((Fraction(m) for m in memory[start : start + size]), Fraction(0)) - Fraction(limit)
                worst = over if worst is None else max(worst, over)
            start += size
        if worst is not None and (best is None or worst < best):
            best = worst
    assert best is not None
    return best


def to_units(values: Sequence[float], scale: int) -> list[int]:
    units = [Fraction(v) * scale for v in values]
    assert all(u.denominator == 1 for u in units), "values must be multiples of 1/scale"
    return [int(u) for u in units]


def dp_bottleneck(
    cost_units: list[int],
    k: int,
    *,
    cut_units: Optional[list[int]] = None,
    memory_units: Optional[list[int]] = None,
    capacity_units: Optional[list[int]] = None,
) -> Optional[int]:
    """O(k L^2) DP: best[j][b] = min over a of max(best[j-1][a], cost of stage [a, b)); numpy int64."""
    num_layers = len(cost_units)
    prefix = np.zeros(num_layers + 1, dtype=np.int64)
    prefix[1:] = np.cumsum(np.asarray(cost_units, dtype=np.int64))
    exit_cost, entry_cost = prefix.copy(), prefix.copy()
    if cut_units is not None:
        exit_cost[1:num_layers] += np.asarray(cut_units, dtype=np.int64)
        entry_cost[1:num_layers] -= np.asarray(cut_units, dtype=np.int64)
    memory_prefix = None
    if memory_units is not None:
        memory_prefix = np.zeros(num_layers + 1, dtype=np.int64)
        memory_prefix[1:] = np.cumsum(np.asarray(memory_units, dtype=np.int64))
    unreachable = np.iinfo(np.int64).max // 4
    best = np.full(num_layers + 1, unreachable, dtype=np.int64)
    best[0] = 0
    for stage in range(1, k + 1):
        new = np.full(num_layers + 1, unreachable, dtype=np.int64)
        first_start = None
        if memory_prefix is not None and capacity_units is not None:
            # smallest a with memory_prefix[b] - memory_prefix[a] <= capacity
            first_start = np.searchsorted(memory_prefix, memory_prefix - capacity_units[stage - 1], side="left")
        for end in range(stage, num_layers - (k - stage) + 1):
            low = stage - 1 if first_start is None else max(stage - 1, int(first_start[end]))
            if low >= end:
                continue
            candidates = np.maximum(best[low:end], exit_cost[end] - entry_cost[low:end])
            new[end] = candidates.min()
        best = new
    result = int(best[num_layers])
    return None if result >= unreachable else result


def bottleneck_units(cost_units: list[int], sizes: list[int], cut_units: Optional[list[int]] = None) -> int:
    worst, start = 0, 0
    for size in sizes:
        stop = start + size
        total = sum(cost_units[start:stop])
        if cut_units is not None and start > 0:
            total += cut_units[start - 1]
        if cut_units is not None and stop < len(cost_units):
            total += cut_units[stop - 1]
        worst = max(worst, total)
        start = stop
    return worst


def assert_valid(sizes: list[int], num_layers: int, k: int) -> None:
    assert isinstance(sizes, list) and len(sizes) == k
    assert all(isinstance(s, int) and s >= 1 for s in sizes) and sum(sizes) == num_layers


# ----------------------------------------------------------------------------- known answers
@pytest.mark.parametrize(
    ("costs", "k", "options", "expected"),
    [
        ([7.5], 1, {}, [1]),
        ([1, 2, 3], 1, {}, [3]),
        ([1, 2, 3], 3, {}, [1, 1, 1]),
        ([1, 1, 1, 1, 4], 2, {}, [4, 1]),
        ([1] * 6, 3, {}, [2, 2, 2]),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, {}, [5, 2, 2]),  # 15 | 13 | 17
        # ties: every optimal split has bottleneck 10; the lexicographically smallest sizes win
        ([5, 5, 5, 5], 3, {}, [1, 1, 2]),
        ([0, 0, 0], 2, {}, [1, 2]),
        # one huge layer sits alone, the rest share the other stages
        ([1, 1, 1, 1, 1, 1, 20, 1, 1], 3, {}, [6, 1, 2]),
        # exact integers beyond float precision: 2**60 + 1 is not a float, and it matters here
        ([2**60, 1, 1, 2**60], 2, {}, [2, 2]),
        # a cut's cost counts on both sides, so cutting where it is free wins
        ([1, 1, 1, 1, 4], 2, {"cut_costs": [0, 0, 0, 3]}, [3, 2]),
        ([1, 1, 1, 1], 2, {"cut_costs": [0, 5, 0]}, [1, 3]),
        # memory: stage 0 can hold only layer 0, whatever that does to the time
        ([1, 1, 1, 1], 2, {"memory": [3, 1, 1, 1], "capacity": [3, 10]}, [1, 3]),
        ([1, 1, 1, 1], 2, {"memory": [3, 1, 1, 1], "capacity": 4}, [2, 2]),
        # per-stage capacities: the small device gets the short stage, wherever it is
        ([1] * 6, 2, {"memory": [1] * 6, "capacity": [2, 100]}, [2, 4]),
        ([1] * 6, 2, {"memory": [1] * 6, "capacity": [100, 2]}, [4, 2]),
        ([1] * 6, 2, {"memory": [1] * 6, "capacity": [math.inf, 2]}, [4, 2]),
    ],
)
def test_known_answers(costs: list[float], k: int, options: dict, expected: list[int]) -> None:
    assert partition(costs, k, **options) == expected
    oracle = brute_force(costs, k, **options)
    assert oracle is not None and oracle[1] == expected


def test_stage_costs_counts_each_cut_on_both_sides() -> None:
    assert stage_costs([1, 2, 3, 4], [2, 2]) == [3.0, 7.0]
    assert stage_costs([1, 2, 3, 4], [2, 2], cut_costs=[0.5, 0.25, 0.5]) == [3.25, 7.25]
    assert stage_costs([1, 2, 3, 4], [1, 2, 1], cut_costs=[1, 10, 100]) == [2.0, 106.0, 104.0]
    with pytest.raises(ValueError, match=r"sizes must be positive integers summing to len\(costs\) = 4"):
        stage_costs([1, 2, 3, 4], [2, 1])
    with pytest.raises(ValueError, match="cut_costs needs len"):
        stage_costs([1, 2, 3, 4], [2, 2], cut_costs=[1])


def test_accepts_numpy_and_tuples() -> None:
    costs = np.array([1.0, 1.0, 1.0, 1.0, 4.0])
    assert partition(costs, np.int64(2)) == [4, 1]
    assert partition(tuple(costs.tolist()), 2, memory=np.ones(5), capacity=(4, np.float32(1.5))) == [4, 1]


def test_deterministic_across_calls() -> None:
    rng = random.Random(7)
    costs = [rng.choice([1.0, 2.0, 3.0]) for _ in range(200)]  # many ties
    first = partition(costs, 7)
    assert all(partition(list(costs), 7) == first for _ in range(3))


def test_float_sums_are_exact_not_rounded() -> None:
    # In float64, 1e16 + 1 == 1e16, so prefix sums would call [1e16 | 1, 1] and [1e16, 1 | 1]
    # equal; exactly, the second is worse (1e16 + 1 > 1e16).
    costs = [1e16, 1.0, 1.0]
    assert partition(costs, 2) == [1, 2]
    # Lexicographic tie-breaking would pick [1, 2] anyway; this one it would get wrong:
    costs = [1.0, 1e16, 1.0]
    assert brute_force(costs, 2) == (Fraction(10**16 + 1), [1, 2])
    assert partition(costs, 2) == [1, 2]
    costs = [2.0, 1e16, 1.0]  # exact: [1, 2] -> 1e16 + 1 beats [2, 1] -> 1e16 + 2
    assert partition(costs, 2) == [1, 2]
    costs = [1.0, 1e16, 2.0]  # exact: [2, 1] -> 1e16 + 1 beats [1, 2] -> 1e16 + 2
    assert partition(costs, 2) == [2, 1]


# ----------------------------------------------------------------------------- error messages
@pytest.mark.parametrize(
    ("costs", "k", "options", "message"),
    [
        ([], 2, {}, r"costs is empty: there are no layers to partition.*partition\(\[3\.0, 1\.0, 2\.0\], 2\)"),
        ([1, 2], 3, {}, r"k=3 stages but there are only 2 layers .* use k <= 2, e\.g\. partition\(costs, 2\)"),
        ([1, 2], 0, {}, r"k must be at least 1 \(one stage per device\), got 0"),
        ([1, 2], -1, {}, r"k must be at least 1 .*got -1"),
        ([1, 2], 2.0, {}, r"k must be an integer number of stages, got 2\.0 \(float\)"),
        ([1, 2], "2", {}, r"k must be an integer number of stages, got '2' \(str\)"),
        ([1, 2], True, {}, r"k must be an integer number of stages, got True \(bool\)"),
        ([1, math.nan], 2, {}, r"costs\[1\] is nan; every entry of costs must be a finite number >= 0"),
        ([1, math.inf], 2, {}, r"costs\[1\] is inf; every entry of costs must be a finite number >= 0"),
        ([-math.inf, 1], 2, {}, r"costs\[0\] is -inf"),
        ([1, -2], 2, {}, r"costs\[1\] is -2 < 0; every entry of costs must be a finite number >= 0"),
        ([1, "a"], 2, {}, r"costs\[1\] is 'a' \(str\), not a number"),
        ([1, None], 2, {}, r"costs\[1\] is None \(NoneType\), not a number"),
        ([1, [2]], 2, {}, r"costs\[1\] is \[2\] \(list\), not a number"),
        ("12", 2, {}, r"costs must be a sequence of numbers \(a list or tuple\), got str"),
        (3, 2, {}, r"costs must be a sequence of numbers \(a list or tuple\), got int"),
        ({"a": 1}, 1, {}, r"costs must be a sequence of numbers \(a list or tuple\), got dict"),
        ([1, 2, 3], 2, {"cut_costs": [1]}, r"cut_costs has 1 entry but 3 layers have 2 cuts between them"),
        ([1, 2, 3], 2, {"cut_costs": [1, math.nan]}, r"cut_costs\[1\] is nan"),
        ([1, 2, 3], 2, {"cut_costs": [1, -1]}, r"cut_costs\[1\] is -1 < 0"),
        ([1, 2, 3], 2, {"memory": [1, 2, 3]}, r"memory is given without capacity.*pass capacity= too"),
        ([1, 2, 3], 2, {"capacity": 3}, r"capacity is given without memory.*pass memory= too"),
        ([1, 2, 3], 2, {"memory": [1, 2], "capacity": 3}, r"memory has 2 entries but costs has 3: pass one memory"),
        ([1, 2, 3], 2, {"memory": [1, math.inf, 1], "capacity": 3}, r"memory\[1\] is inf"),
        ([1, 2, 3], 2, {"memory": [1, -1, 1], "capacity": 3}, r"memory\[1\] is -1 < 0"),
        ([1, 2, 3], 2, {"memory": [1, 2, 3], "capacity": [3]}, r"capacity has 1 entry but k = 2 stages"),
        ([1, 2, 3], 2, {"memory": [1, 2, 3], "capacity": [3, 3, 3]}, r"capacity has 3 entries but k = 2 stages"),
        ([1, 2, 3], 2, {"memory": [1, 2, 3], "capacity": 0}, r"capacity is 0; a capacity must be a number > 0"),
        ([1, 2, 3], 2, {"memory": [1, 2, 3], "capacity": -1.5}, r"capacity is -1.5; a capacity must be a number > 0"),
        ([1, 2, 3], 2, {"memory": [1, 2, 3], "capacity": [3, math.nan]}, r"capacity\[1\] is nan"),
        ([1, 2, 3], 2, {"memory": [1, 2, 3], "capacity": "3"}, r"capacity must be a number .* or a list of k = 2"),
    ],
)
def test_input_errors(costs: object, k: object, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        partition(costs, k, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("memory", "capacity", "k", "message"),
    [
        # one layer bigger than every stage
        ([1, 1, 1, 1, 1, 1, 1, 12, 1, 1], 8.0, 3, r"^layer 7 alone needs memory 12 but every stage's capacity is 8;"),
        # ... bigger than the only stage that can take it (the last layer must be on the last stage)
        ([1, 1, 1, 1, 4], [6, 3], 2, r"^layer 4 alone needs memory 4 but it can only go on stage 1 .*capacity is 3;"),
        # ... bigger than the stages that can take it (layer 1 of 4 on 3 stages: stage 0 or 1)
        ([1, 5, 1, 1], [4, 4, 100], 3, r"^layer 1 alone needs memory 5 but it can only go on stages 0 to 1 .*\[4, 4\]"),
        ([1, 9, 1], [4, 8], 2, r"^layer 1 alone needs memory 9 but no stage holds that much \(capacities \[4, 8\]\)"),
        # the total does not fit
        ([5] * 10, [8, 8, 8], 3, r"^the 10 layers need memory 50 in total but the 3 stages hold 24 together"),
        # every layer fits somewhere and the total fits, but no split does: say by how much
        (
            [3] * 6,
            [5, 7, 6],
            3,
            r"^no way to place 6 layers on 3 stages within capacities \[5, 7, 6\]: every split overflows some "
            r"stage by at least 1 \(the best, sizes \[2, 2, 2\], needs \[6, 6, 6\]\); raising every capacity by 1",
        ),
        (
            [3, 1, 1, 3],
            [3.5, 4.5],
            2,
            r"overflows some stage by at least 0\.5 \(the best, sizes \[1, 3\], needs \[3, 5\]\)",
        ),
    ],
)
def test_capacity_errors_say_what_does_not_fit(memory: list[float], capacity: Capacity, k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        partition([1.0] * len(memory), k, memory=memory, capacity=capacity)
    assert "use more stages, give the stages more memory" in str(raised.value)


def test_module_docstring_examples() -> None:
    import doctest

    import lightning_mgpu.placement.planning.partition  # noqa: F401  (the module, not the function)

    module = sys.modules["lightning_mgpu.placement.planning.partition"]
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 4 and result.failed == 0


# ----------------------------------------------------------------------------- properties vs brute force
small_int = st.integers(min_value=0, max_value=12)
wide_float = st.floats(min_value=0.0, max_value=1e300, allow_nan=False, allow_infinity=False, allow_subnormal=True)
plain_float = st.floats(min_value=0.0, max_value=100.0, allow_nan=False, allow_infinity=False)
value = st.one_of(small_int, plain_float, wide_float, st.sampled_from([0.1, 0.2, 0.3, 1e16, 1.0, 2.0]))


@st.composite
def instances(draw: st.DrawFn, *, with_cuts: bool, with_memory: bool) -> dict:
    num_layers = draw(st.integers(min_value=1, max_value=9))
    k = draw(st.integers(min_value=1, max_value=min(4, num_layers)))
    # Mostly small integers (many ties), sometimes floats of any magnitude (rounding traps).
    element = draw(st.sampled_from([small_int, small_int, value]))
    instance: dict = {"costs": draw(st.lists(element, min_size=num_layers, max_size=num_layers)), "k": k}
    if with_cuts:
        instance["cut_costs"] = draw(st.lists(element, min_size=num_layers - 1, max_size=num_layers - 1))
    if with_memory:
        instance["memory"] = draw(st.lists(small_int, min_size=num_layers, max_size=num_layers))
        limit = st.one_of(st.integers(min_value=1, max_value=30), st.just(math.inf), st.sampled_from([2.5, 7.75]))
        instance["capacity"] = draw(st.one_of(limit, st.lists(limit, min_size=k, max_size=k)))
    return instance


def check_against_brute_force(instance: dict) -> None:
    costs, k = instance["costs"], instance["k"]
    options = {key: instance[key] for key in ("memory", "capacity", "cut_costs") if key in instance}
    oracle = brute_force(costs, k, **options)
    if oracle is None:
        with pytest.raises(ValueError) as raised:
            partition(costs, k, **options)
        check_infeasible_message(str(raised.value), instance)
        return
    sizes = partition(costs, k, **options)
    assert_valid(sizes, len(costs), k)
    assert fits(options.get("memory"), options.get("capacity"), sizes), "capacity not respected"
    assert max(exact_stage_costs(costs, sizes, options.get("cut_costs"))) == oracle[0], "not optimal"
    assert sizes == oracle[1], "not the lexicographically smallest optimal split"
    # The float report is the correctly rounded optimum.
    assert max(stage_costs(costs, sizes, cut_costs=options.get("cut_costs"))) == float(oracle[0])


def check_infeasible_message(message: str, instance: dict) -> None:
    """Whatever the message claims must be true."""
    memory, k = instance["memory"], instance["k"]
    limits = capacities_of(instance["capacity"], k)
    assert limits is not None
    single = re.match(r"layer (\d+) alone needs memory", message)
    if single:
        layer = int(single.group(1))
        possible = range(max(0, k - (len(memory) - layer)), min(k - 1, layer) + 1)
        assert all(memory[layer] > limits[stage] for stage in possible), message
    elif message.startswith(f"the {len(memory)} layers need memory"):
        assert sum(map(Fraction, memory)) > sum(map(Fraction, limits)), message
    else:
        assert message.startswith(f"no way to place {len(memory)} layers on {k} stages"), message
        overflow = least_overflow(memory, instance["capacity"], k)
        assert f"by at least {float(overflow):.12g} " in message, (message, overflow)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(with_cuts=False, with_memory=False))
def test_optimal_and_tie_rule_vs_brute_force(instance: dict) -> None:
    check_against_brute_force(instance)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(with_cuts=True, with_memory=False))
def test_optimal_with_cut_costs_vs_brute_force(instance: dict) -> None:
    check_against_brute_force(instance)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(with_cuts=False, with_memory=True))
def test_capacities_respected_and_error_iff_infeasible(instance: dict) -> None:
    check_against_brute_force(instance)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(with_cuts=True, with_memory=True))
def test_everything_together_vs_brute_force(instance: dict) -> None:
    check_against_brute_force(instance)


# ----------------------------------------------------------------------------- fuzz: bad numbers never slip through
bad_number = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, -1e-300, -5])


@settings(max_examples=300, deadline=None)
@given(
    instance=instances(with_cuts=True, with_memory=True),
    field=st.sampled_from(["costs", "cut_costs", "memory", "capacity"]),
    bad=bad_number,
    data=st.data(),
)
def test_nan_inf_negative_always_raise(instance: dict, field: str, bad: float, data: st.DataObject) -> None:
    if field == "cut_costs":
        assume(len(instance["cut_costs"]) > 0)
    if field == "capacity":
        assume(not (bad == math.inf))  # an infinite capacity is allowed: no limit
        k = instance["k"]
        limits = capacities_of(instance["capacity"], k)
        assert limits is not None
        index = data.draw(st.integers(min_value=0, max_value=k - 1))
        limits[index] = bad
        instance["capacity"] = limits if data.draw(st.booleans()) or k > 1 else bad
        name = r"capacity(\[\d+\])?"
    else:
        values = list(instance[field])
        index = data.draw(st.integers(min_value=0, max_value=len(values) - 1))
        values[index] = bad
        instance[field] = values
        name = re.escape(f"{field}[{index}]")
    costs, k = instance.pop("costs"), instance.pop("k")
    with pytest.raises(ValueError, match=rf"^{name} is "):
        partition(costs, k, **instance)


@settings(max_examples=200, deadline=None)
@given(
    costs=st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=12),
    k=st.integers(min_value=-2, max_value=14),
)
def test_arbitrary_floats_either_answer_correctly_or_raise(costs: list[float], k: int) -> None:
    bad_input = any(math.isnan(c) or math.isinf(c) or c < 0 for c in costs) or not 1 <= k <= len(costs)
    if bad_input:
        with pytest.raises(ValueError):
            partition(costs, k)
        return
    sizes = partition(costs, k)
    assert_valid(sizes, len(costs), k)
    if len(costs) <= 9:
        oracle = brute_force(costs, k)
        assert oracle is not None and sizes == oracle[1]


# ----------------------------------------------------------------------------- large L vs the O(k L^2) DP
SCALE = 2**30  # costs drawn as multiples of 2**-30: exact in int64 for the DP, still "random floats"


def random_floats(rng: random.Random, count: int, *, heavy: bool) -> list[float]:
    values = []
    for _ in range(count):
        value = rng.getrandbits(30) / SCALE
        if heavy and rng.random() < 0.01:
            value *= 64  # a few huge layers
        values.append(value)
    return values


@pytest.mark.parametrize(
    ("num_layers", "k", "heavy", "with_cuts", "with_memory"),
    [
        (5000, 8, False, False, False),
        (5000, 3, True, True, False),
        (2000, 16, True, True, True),
    ],
)
def test_large_random_instances_match_the_dp(
    num_layers: int, k: int, heavy: bool, with_cuts: bool, with_memory: bool
) -> None:
    rng = random.Random(num_layers * 100 + k)
    costs = random_floats(rng, num_layers, heavy=heavy)
    options: dict = {}
    cut_units = memory_units = capacity_units = None
    if with_cuts:
        options["cut_costs"] = [c / 8 for c in random_floats(rng, num_layers - 1, heavy=False)]
        cut_units = to_units(options["cut_costs"], SCALE * 8)
    if with_memory:
        options["memory"] = [float(rng.randint(1, 100)) for _ in range(num_layers)]
        total = sum(options["memory"])
        options["capacity"] = [math.floor(total / k * 1.1)] * (k - 1) + [math.floor(total / k * 0.6)]
        memory_units = [int(m) for m in options["memory"]]
        capacity_units = list(options["capacity"])
    cost_units = to_units(costs, SCALE * 8 if with_cuts else SCALE)

    sizes = partition(costs, k, **options)

    assert_valid(sizes, num_layers, k)
    assert fits(options.get("memory"), options.get("capacity"), sizes)
    expected = dp_bottleneck(
        cost_units, k, cut_units=cut_units, memory_units=memory_units, capacity_units=capacity_units
    )
    assert expected is not None
    assert bottleneck_units(cost_units, sizes, cut_units) == expected


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(min_value=0, max_value=2**32),
    num_layers=st.integers(min_value=10, max_value=60),
    k=st.integers(min_value=2, max_value=10),
)
def test_medium_random_instances_match_the_dp(seed: int, num_layers: int, k: int) -> None:
    rng = random.Random(seed)
    k = min(k, num_layers)
    costs = random_floats(rng, num_layers, heavy=True)
    cuts = [c / 8 for c in random_floats(rng, num_layers - 1, heavy=False)]
    memory = [float(rng.randint(0, 9)) for _ in range(num_layers)]
    share = int(sum(memory)) // k
    capacity = [float(rng.randint(max(1, share), share + 20)) for _ in range(k)]
    expected = dp_bottleneck(
        to_units(costs, SCALE * 8),
        k,
        cut_units=to_units(cuts, SCALE * 8),
        memory_units=[int(m) for m in memory],
        capacity_units=[int(c) for c in capacity],
    )
    if expected is None:
        with pytest.raises(ValueError, match="memory|capacit"):
            partition(costs, k, memory=memory, capacity=capacity, cut_costs=cuts)
        return
    sizes = partition(costs, k, memory=memory, capacity=capacity, cut_costs=cuts)
    assert_valid(sizes, num_layers, k)
    assert fits(memory, capacity, sizes)
    assert bottleneck_units(to_units(costs, SCALE * 8), sizes, to_units(cuts, SCALE * 8)) == expected


def test_without_cuts_or_capacities_the_greedy_probe_answers_as_the_window_probe() -> None:
    """The plain instance's probe (each stage as far as the threshold allows, by binary search) against the
    sliding-window probe every instance can use: at the optimum, just below it, and at thresholds drawn between
    the largest layer and the total."""
    from lightning_mgpu.placement.planning.partition import _Problem

    rng = random.Random(3)
    for _ in range(200):
        num_layers = rng.randint(1, 60)
        k = rng.randint(1, num_layers)
        costs = [rng.choice([0, 1, 2, 3, 7, 50]) for _ in range(num_layers)]
        plain = _Problem(costs, None, k)
        window = _Problem(costs, None, k)
        window.plain = False
        assert plain.plain
        optimum = window.optimum()
        assert optimum is not None and plain.optimum() == optimum
        drawn = {rng.randint(max(costs), sum(costs)) for _ in range(20)}
        for threshold in sorted(drawn | {optimum, max(optimum - 1, max(costs))}):
            fast, slow = plain.probe(threshold), window.probe(threshold)
            assert fast[0] == slow[0] == (threshold >= optimum), (costs, k, threshold)
            if fast[0]:
                assert fast[1] is not None and optimum <= fast[1] <= threshold
            else:
                assert fast[1] == threshold + 1 and slow[1] is not None and slow[1] > threshold
