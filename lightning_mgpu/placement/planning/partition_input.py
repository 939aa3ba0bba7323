"""What :func:`~lightning_mgpu.placement.planning.partition.partition` accepts: its input checked, then made exact.

Pure Python, no torch import (like ``partition.py``). Every check raises ``ValueError``
naming the argument, the value given, what is allowed and the fix. The conversion turns
the checked floats into integers over one power-of-two denominator (every finite float is
a dyadic rational), so the search in ``partition.py`` sums and compares exactly.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Optional, Sequence, Union

__all__ = [
    "INFINITE",
    "Capacity",
    "Number",
    "capacity_units",
    "common_units",
    "cut_costs_of",
    "entries",
    "layer_costs_of",
    "memory_and_capacity",
    "memory_units",
    "numbers_of",
    "show",
    "stage_count",
]

Number = Union[int, float]
Capacity = Union[Number, Sequence[Number]]

INFINITE = math.inf


# ----------------------------------------------------------------------------- checks
def layer_costs_of(costs: object) -> list[float]:
    """``costs`` as floats: one finite number >= 0 per layer, at least one layer."""
    layer_costs = numbers_of("costs", costs, unit_hint="a layer's time, e.g. ms per micro-batch")
    if not layer_costs:
        raise ValueError(
            "costs is empty: there are no layers to partition. Pass one cost per layer, "
            "e.g. partition([3.0, 1.0, 2.0], 2)"
        )
    return layer_costs


def cut_costs_of(cut_costs: Optional[Sequence[Number]], num_layers: int) -> Optional[list[float]]:
    """``cut_costs`` as floats (one per cut between neighbouring layers), or None when not given."""
    if cut_costs is None:
        return None
    cut_values = numbers_of("cut_costs", cut_costs, unit_hint="a transfer time, in costs' unit")
    if len(cut_values) != num_layers - 1:
        raise ValueError(
            f"cut_costs has {entries(len(cut_values))} but {num_layers} layers have {num_layers - 1} "
            f"cuts between them: pass len(costs) - 1 = {num_layers - 1} values (cut_costs[i] is the "
            "cost of cutting between layer i and layer i + 1)"
        )
    return cut_values


def numbers_of(name: str, values: object, *, unit_hint: str) -> list[float]:
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise ValueError(
            f"{name} must be a sequence of numbers (a list or tuple), got {type(values).__name__}: {values!r:.80}"
        )
    result = []
    for index, value in enumerate(values):
        number = as_float(value)
        if number is None:
            raise ValueError(
                f"{name}[{index}] is {value!r:.80} ({type(value).__name__}), not a number; "
                f"every entry of {name} must be a finite number >= 0 ({unit_hint})"
            )
        if math.isnan(number) or math.isinf(number):
            shown = (
                number
                if isinstance(value, float)
                else f"{value!r:.40}... ({type(value).__name__}, beyond float's range)"
            )
            raise ValueError(
                f"{name}[{index}] is {shown}; every entry of {name} must be a finite number >= 0 ({unit_hint}). "
                f"Measure layer {index} again, or leave it out"
            )
        if number < 0:
            raise ValueError(
                f"{name}[{index}] is {show(number)} < 0; every entry of {name} must be a finite number >= 0 "
                f"({unit_hint}). A negative value usually means a clock or baseline subtraction went wrong"
            )
        result.append(number)
    return result


def stage_count(k: object, num_layers: int) -> int:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise ValueError(
            f"k must be an integer number of stages, got {k!r:.80} ({type(k).__name__}); e.g. partition(costs, 2)"
        )
    count = int(k)
    if count < 1:
        raise ValueError(f"k must be at least 1 (one stage per device), got {count!s:.40}")
    if count > num_layers:
        raise ValueError(
            f"k={count!s:.40} stages but there are only {num_layers} layers (len(costs) = {num_layers}), and every "
            f"stage needs at least one layer: use k <= {num_layers}, e.g. partition(costs, {num_layers}), "
            "or split the model into more layers"
        )
    return count


def memory_and_capacity(
    memory: Optional[Sequence[Number]], capacity: Optional[Capacity], num_layers: int, num_stages: int
) -> tuple[Optional[list[float]], Optional[list[float]]]:
    if memory is None and capacity is None:
        return None, None
    if capacity is None:
        raise ValueError(
            "memory is given without capacity, so it would change nothing: pass capacity= too (what each "
            "stage's device holds, in memory's unit, e.g. capacity=[8e9] * k), or leave memory out"
        )
    if memory is None:
        raise ValueError(
            "capacity is given without memory, so it would change nothing: pass memory= too (one value per "
            "layer, in capacity's unit), or leave capacity out"
        )
    memory_values = numbers_of("memory", memory, unit_hint="what a layer needs on its device, e.g. bytes")
    if len(memory_values) != num_layers:
        raise ValueError(
            f"memory has {entries(len(memory_values))} but costs has {num_layers}: pass one memory value per layer"
        )
    if isinstance(capacity, numbers.Real) and not isinstance(capacity, bool):
        capacities = [capacity_value(capacity, "capacity")] * num_stages
    else:
        if isinstance(capacity, (str, bytes, Mapping)) or not isinstance(capacity, Iterable):
            raise ValueError(
                f"capacity must be a number (the same for every stage) or a list of k = {num_stages} numbers, "
                f"got {type(capacity).__name__}: {capacity!r:.80}"
            )
        given = list(capacity)
        if len(given) != num_stages:
            raise ValueError(
                f"capacity has {entries(len(given))} but k = {num_stages} stages: pass one capacity per stage "
                f"(stage i runs on device i), or a single number for all of them"
            )
        capacities = [capacity_value(value, f"capacity[{index}]") for index, value in enumerate(given)]
    return memory_values, capacities


def as_float(value: object) -> Optional[float]:
    """``float(value)`` for a number (NaN and inf included), None for anything else; strings
    and booleans are not numbers here, although ``float()`` would take them."""
    if isinstance(value, (str, bytes, bool)):
        return None
    try:
        return float(value)  # type: ignore[arg-type]
    except OverflowError:  # an integer (or Fraction, Decimal) beyond float's range
        return math.inf if value > 0 else -math.inf  # type: ignore[operator]
    except (TypeError, ValueError):
        return None


def capacity_value(value: object, name: str) -> float:
    number = as_float(value)
    if number is None:
        raise ValueError(f"{name} is {value!r:.80} ({type(value).__name__}), not a number")
    if math.isnan(number) or number <= 0:
        raise ValueError(
            f"{name} is {show(number)}; a capacity must be a number > 0 (what the stage's device holds, in "
            "memory's unit), or math.inf for no limit"
        )
    return number


def entries(count: int) -> str:
    return f"{count} entry" if count == 1 else f"{count} entries"


def show(value: float) -> str:
    return f"{value:.12g}"


# ----------------------------------------------------------------------------- exact integers
def common_units(groups: list[list[float]]) -> tuple[list[list[int]], int]:
    """Exact integers ``value * D`` for one power-of-two ``D`` shared by every value in ``groups``."""
    ratios = [[value.as_integer_ratio() for value in group] for group in groups]
    denominator = max((d for group in ratios for _, d in group), default=1)
    return [[n * (denominator // d) for n, d in group] for group in ratios], denominator


def capacity_units(capacities: list[float], finite_units: list[int]) -> list[Optional[int]]:
    finite = iter(finite_units)
    return [None if c == INFINITE else next(finite) for c in capacities]


def memory_units(
    memory: Optional[list[float]], capacities: Optional[list[float]]
) -> tuple[Optional[list[int]], Optional[list[Optional[int]]]]:
    if memory is None or capacities is None:
        return None, None
    (memory_units, finite_units), _ = common_units([memory, [c for c in capacities if c != INFINITE]])
    return memory_units, capacity_units(capacities, finite_units)
