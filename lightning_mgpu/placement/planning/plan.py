"""``PlacementPlan``: which layers run on which device, and what that is expected to cost; and the planner that
every rank of a fit agrees on.

:func:`plan_stages` turns per-layer costs (from :func:`~lightning_mgpu.placement.planning.profile.profile_layers`)
into a plan with :func:`~lightning_mgpu.placement.planning.partition.partition`:

* ``balance="time"``: minimise the slowest stage's forward+backward time (the pipeline's pace);
* ``balance="memory"``: minimise the largest stage memory (parameters, gradients, optimizer
  state, one micro-batch of activations);
* ``balance="params"``: minimise the largest stage parameter count (what DeepSpeed's
  ``partition_method="parameters"`` balances, here exactly);
* a list of stage sizes: taken as given (checked).

With ``capacity`` (bytes per device) every mode only considers splits whose stages fit.

:func:`choose_split_points` is the planner of a fit: given split points are checked and used as
they are; else rank 0 measures the candidate blocks (``measure``, e.g. the one profiler,
:mod:`~lightning_mgpu.placement.planning.profile`; parameter counts where there is nothing to
measure on, with a warning), plans them with :func:`plan_stages`, and hands the plan to every
rank (DDP needs the same layout everywhere).

Pipeline efficiency: a GPipe (fill-drain) schedule of ``M`` micro-batches over ``K``
stages takes ``(M + K - 1)`` slots of the slowest stage's time, while one device would need
``M`` times the sum of all stage times, so the ideal speed-up is
``sum(stage) * M / (max(stage) * (M + K - 1))`` and the ideal efficiency (speed-up / K)
is ``balance_efficiency * bubble_efficiency`` with ``balance_efficiency = mean / max`` and
``bubble_efficiency = M / (M + K - 1)``. Transfers and per-micro-batch overheads are not
in it: measured figures are below these (``bench/pipeline.py``).
"""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Callable, Optional, Union

from lightning_mgpu._checks import check_int
from lightning_mgpu.placement.planning.partition import partition
from lightning_mgpu.placement.planning.profile import LayerCost, block_costs
from lightning_mgpu.placement.planning.schedule import make_schedule, peak_in_flight
from lightning_mgpu.placement.planning.split_points import check_split_points, points_from_sizes

__all__ = ["BALANCE_MODES", "PlacementPlan", "check_sizes", "choose_split_points", "make_plan", "plan_stages"]

BALANCE_MODES = ("time", "memory", "params")


@dataclass
class PlacementPlan:
    """A split of ``len(layers)`` layers into ``len(devices)`` contiguous stages."""

    devices: list[str]
    sizes: list[int]
    balance: Union[str, list[int]]
    microbatches: int = 1
    layers: list[LayerCost] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.devices) != len(self.sizes):
            raise ValueError(f"a plan needs one size per device: {len(self.devices)} devices, {len(self.sizes)} sizes")
        if self.layers and sum(self.sizes) != len(self.layers):
            raise ValueError(
                f"stage sizes {self.sizes} add up to {sum(self.sizes)}, not to the {len(self.layers)} layers"
            )

    @property
    def num_stages(self) -> int:
        return len(self.sizes)

    @property
    def boundaries(self) -> list[tuple[int, int]]:
        """``(first, last + 1)`` layer index of every stage."""
        ends = list(accumulate(self.sizes, initial=0))
        return list(zip(ends, ends[1:]))

    def stage_of_layer(self) -> list[int]:
        return [stage for stage, size in enumerate(self.sizes) for _ in range(size)]

    def _stage_sum(self, attribute: str, convert: Callable[[Any], Any] = lambda total: total) -> Optional[list[Any]]:
        if not self.layers:
            return None
        return [convert(sum(getattr(layer, attribute) for layer in self.layers[a:b])) for a, b in self.boundaries]

    @property
    def stage_time_ms(self) -> Optional[list[float]]:
        return self._stage_sum("time_ms")

    @property
    def stage_memory_bytes(self) -> Optional[list[int]]:
        return self._stage_sum("memory_bytes", int)

    @property
    def stage_params(self) -> Optional[list[int]]:
        return self._stage_sum("param_count", int)

    @property
    def bottleneck_stage(self) -> Optional[int]:
        times = self.stage_time_ms
        return None if times is None else max(range(len(times)), key=times.__getitem__)

    @property
    def balance_efficiency(self) -> Optional[float]:
        times = self.stage_time_ms
        if times is None or max(times) <= 0:
            return None
        return sum(times) / len(times) / max(times)

    def peak_activation_bytes(self, schedule: str = "gpipe") -> Optional[list[int]]:
        """Per stage, the saved activations it holds at its peak under ``schedule``: one micro-batch's
        (the layers' profiled ``activation_bytes``) times the most micro-batches the schedule keeps in flight
        on that stage (:func:`~lightning_mgpu.placement.planning.schedule.peak_in_flight`). None without a profile."""
        per_microbatch = self._stage_sum("activation_bytes")
        if per_microbatch is None:
            return None
        in_flight = peak_in_flight(make_schedule(schedule, self.num_stages, self.microbatches))
        return [int(size * count) for size, count in zip(per_microbatch, in_flight)]

    @property
    def bubble_efficiency(self) -> float:
        return self.microbatches / (self.microbatches + self.num_stages - 1)

    @property
    def ideal_efficiency(self) -> Optional[float]:
        balance = self.balance_efficiency
        return None if balance is None else balance * self.bubble_efficiency

    @property
    def ideal_speedup(self) -> Optional[float]:
        efficiency = self.ideal_efficiency
        return None if efficiency is None else efficiency * self.num_stages

    def as_dict(self) -> dict[str, Any]:
        return {
            "devices": list(self.devices),
            "sizes": list(self.sizes),
            "balance": self.balance,
            "microbatches": self.microbatches,
            "stage_time_ms": self.stage_time_ms,
            "stage_memory_bytes": self.stage_memory_bytes,
            "stage_params": self.stage_params,
            "bottleneck_stage": self.bottleneck_stage,
            "balance_efficiency": self.balance_efficiency,
            "bubble_efficiency": self.bubble_efficiency,
            "ideal_efficiency": self.ideal_efficiency,
            "ideal_speedup": self.ideal_speedup,
            "layers": [layer.as_dict() for layer in self.layers],
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlacementPlan:
        """Rebuild a plan from :meth:`as_dict` output (plain JSON data; derived figures are recomputed)."""
        return cls(
            devices=[str(device) for device in data["devices"]],
            sizes=[int(size) for size in data["sizes"]],
            balance=data["balance"],
            microbatches=int(data.get("microbatches", 1)),
            layers=[LayerCost.from_dict(layer) for layer in data.get("layers", [])],
        )

    @classmethod
    def from_json(cls, text: str) -> PlacementPlan:
        return cls.from_dict(json.loads(text))

    def rows(self) -> list[dict[str, Any]]:
        """One row per stage: device, layers, time, memory, parameters, share of the bottleneck."""
        times, memory, params = self.stage_time_ms, self.stage_memory_bytes, self.stage_params
        slowest = max(times) if times else None
        rows = []
        for stage, ((first, end), device) in enumerate(zip(self.boundaries, self.devices)):
            names = [layer.name for layer in self.layers[first:end]] if self.layers else []
            row: dict[str, Any] = {
                "stage": stage,
                "device": device,
                "layers": f"{first}-{end - 1}" if end - first > 1 else f"{first}",
                "num_layers": end - first,
                "names": names,
            }
            if times is not None and memory is not None and params is not None:
                row.update(
                    time_ms=times[stage],
                    memory_bytes=memory[stage],
                    params=params[stage],
                    load=(times[stage] / slowest) if slowest else None,
                )
            rows.append(row)
        return rows

    def summary_line(self) -> str:
        text = (
            f"{self.num_stages} stages, sizes {self.sizes}, balance={self.balance!r}, microbatches={self.microbatches}"
        )
        times = self.stage_time_ms
        if self.ideal_efficiency is not None and times is not None:
            text += (
                f"; bottleneck stage {self.bottleneck_stage} ({max(times):.3g} ms/micro-batch); "
                f"balance {self.balance_efficiency:.0%} x bubble {self.bubble_efficiency:.0%} = ideal efficiency "
                f"{self.ideal_efficiency:.0%} (ideal speed-up {self.ideal_speedup:.2f}x over one device)"
            )
        return text

    def table(self, title: Optional[str] = None) -> Any:
        """A ``rich.table.Table`` of :meth:`rows`."""
        from rich.table import Table

        table = Table(title=title or f"placement: balance={self.balance!r}", caption=self.summary_line())
        for column in ("stage", "device", "layers", "time ms", "memory", "params", "load"):
            table.add_column(column, justify="left" if column in ("device", "layers") else "right")
        for row in self.rows():
            if "time_ms" in row:
                cells = [f"{row['time_ms']:.3f}", _bytes(row["memory_bytes"]), f"{row['params']:,}", _bar(row["load"])]
            else:
                cells = ["-", "-", "-", "-"]
            table.add_row(str(row["stage"]), row["device"], row["layers"], *cells)
        return table

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=120, record=True, file=io.StringIO())  # recorded, not shown
        console.print(self.table())
        return console.export_text().rstrip()


def check_sizes(sizes: object, num_layers: Optional[int], num_stages: int, *, name: str = "balance") -> list[int]:
    """Validate an explicit list of stage sizes (their sum too, unless ``num_layers`` is None:
    not known yet); returns it as a list of ints."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise ValueError(f"{name} must be one of {BALANCE_MODES} or a list of stage sizes, got {sizes!r}")
    values = list(sizes)
    if any(isinstance(size, bool) or not isinstance(size, int) or size < 1 for size in values):
        raise ValueError(f"{name}={values!r}: every stage size must be an integer >= 1 (each stage needs a layer)")
    if len(values) != num_stages:
        raise ValueError(
            f"{name}={values!r} has {len(values)} stage sizes but there are {num_stages} devices per replica"
        )
    if num_layers is not None and sum(values) != num_layers:
        raise ValueError(f"{name}={values!r} adds up to {sum(values)} layers but the split module has {num_layers}")
    return values


def plan_stages(
    layers: Sequence[LayerCost],
    devices: Sequence[Any],
    balance: Union[str, Sequence[int]] = "time",
    *,
    microbatches: int = 1,
    capacity: Optional[Sequence[Optional[float]]] = None,
) -> PlacementPlan:
    """Split ``layers`` over ``devices`` by ``balance``; see the module docstring."""
    layers = list(layers)
    device_names = [str(device) for device in devices]
    if not device_names:
        raise ValueError("plan_stages needs at least one device")
    if len(layers) < len(device_names):
        raise ValueError(
            f"cannot split {len(layers)} layers over {len(device_names)} devices: every stage needs at least one layer"
        )
    check_int("microbatches", microbatches)
    if isinstance(balance, str):
        if balance not in BALANCE_MODES:
            raise ValueError(f"balance must be one of {BALANCE_MODES} or a list of stage sizes, got {balance!r}")
        attribute = {"time": "time_ms", "memory": "memory_bytes", "params": "param_count"}[balance]
        costs = [getattr(layer, attribute) for layer in layers]
        fits: dict[str, Any] = {}
        if capacity is not None and any(value is not None for value in capacity):
            fits = {"memory": [layer.memory_bytes for layer in layers], "capacity": list(capacity)}
        sizes = partition(costs, len(device_names), **fits)
        chosen: Union[str, list[int]] = balance
    else:
        sizes = check_sizes(balance, len(layers), len(device_names))
        chosen = list(sizes)
    return PlacementPlan(devices=device_names, sizes=sizes, balance=chosen, microbatches=microbatches, layers=layers)


def choose_split_points(
    root: Any,
    *,
    split_points: Optional[Sequence[str]],
    candidates: Callable[[], list[str]],
    balance: Union[str, Sequence[int]],
    devices: Sequence[Any],
    microbatches: int,
    rank_zero: bool,
    broadcast: Callable[[Any], Any],
    warn: Callable[[str], None],
    measure: Optional[Callable[[list[str]], list[LayerCost]]] = None,
    capacity: Optional[Sequence[Optional[float]]] = None,
    what: str = "the candidate blocks",
) -> tuple[list[str], PlacementPlan]:
    """The split points in force (names of ``root``'s submodules where stages 1.. begin) and their plan; see the module
    docstring. ``candidates()``: the blocks to cut among; ``measure(candidates)``: their costs, for
    ``balance="time"``/``"memory"`` (without it, or if it fails, parameter counts decide, with a warning naming
    ``what`` was to be measured); ``broadcast(value)``: rank 0's value on every rank."""
    k = len(devices)
    names_of_devices = [str(device) for device in devices]
    if split_points is not None:
        points = check_split_points(root, split_points, k)
        return points, PlacementPlan(names_of_devices, [1] * k, "split_points", microbatches)
    names = candidates()
    if len(names) < k:
        raise ValueError(
            f"{type(root).__name__} has {len(names)} candidate split point(s) ({names}) but "
            f"devices_per_replica={k}: pass split_points=[...] naming where each stage begins"
        )
    if not isinstance(balance, str):
        check_sizes(balance, len(names), k)
    payload: Any = None
    if rank_zero:
        by: Union[str, list[int]] = balance if isinstance(balance, str) else list(balance)
        layers = block_costs(root, names)
        if by in ("time", "memory"):
            if measure is None:
                warn(
                    f"HybridParallelStrategy(balance={balance!r}) needs a sample to measure {what}: set "
                    "`example_input_array` on the LightningModule (one batch of its forward's input). Balancing by "
                    "parameter count instead."
                )
                by = "params"
            else:
                try:
                    layers = measure(names)
                except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
                    warn(
                        f"HybridParallelStrategy(balance={balance!r}): measuring {what} on `example_input_array` "
                        f"failed ({type(exc).__name__}: {exc}); balancing by parameter count instead."
                    )
                    by = "params"
        try:
            sizes = plan_stages(layers, devices, by, microbatches=microbatches, capacity=capacity).sizes
            payload = {"sizes": sizes, "balance": by, "layers": [layer.as_dict() for layer in layers]}
        except ValueError as exc:  # every rank raises it, none waits for a plan that will not come
            payload = {"error": str(exc)}
    payload = broadcast(payload)
    if "error" in payload:
        raise ValueError(payload["error"])
    plan = PlacementPlan(
        devices=names_of_devices,
        sizes=list(payload["sizes"]),
        balance=payload["balance"],
        microbatches=microbatches,
        layers=[LayerCost.from_dict(layer) for layer in payload["layers"]],
    )
    return points_from_sizes(names, plan.sizes), plan


def make_plan(*args: Any, **kwargs: Any) -> PlacementPlan:
    """Deprecated name of :func:`plan_stages` (it clashed with ``lightning_mgpu.tuning.plan.make_plan``)."""
    warnings.warn(
        "lightning_mgpu.placement.make_plan is deprecated: call lightning_mgpu.placement.plan_stages (same arguments)",
        DeprecationWarning,
        stacklevel=2,
    )
    return plan_stages(*args, **kwargs)


def _bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(value)


def _bar(load: Optional[float], width: int = 10) -> str:
    if load is None:
        return "-"
    filled = int(round(load * width))
    return "#" * filled + "." * (width - filled) + f" {load:.0%}"
