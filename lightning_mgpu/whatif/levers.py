"""Which change would help most: the levers of one scenario, ranked by predicted step time.

:func:`rank_levers` replays the profile once per lever (fp16/bf16 compression, PowerSGD at a
few ranks, every bucket size of the tuner's grid, a faster link, twice the nodes) and ranks
them by how much of the step they save. :func:`what_would_help` is the short block
``CommProfiler`` prints at the end of a fit: the levers on the system as profiled.

Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Sequence, Union

from lightning_mgpu.tuning.buckets import DEFAULT_GRID_MB
from lightning_mgpu.whatif.compression import NO_COSTS, CompressionCosts
from lightning_mgpu.whatif.links import Link, link_from_gbps, link_from_profile, resolve_link
from lightning_mgpu.whatif.model import Prediction, Scenario, System, predict
from lightning_mgpu.whatif.records import ProfiledRun, load_profile

POWERSGD_RANKS = (1, 4)
MIN_SAVING_PCT = 0.5
"""Bucket sizes saving less than this are reported as "no size helps"."""


@dataclass(frozen=True)
class Lever:
    """One change and its predicted effect on the step (relative to the scenario it was ranked for)."""

    name: str
    change: Mapping[str, Any]
    """The scenario fields it changes (e.g. ``{"compression": "fp16"}``)."""
    step_ms: float
    base_step_ms: float
    lossy: bool = False
    """Changes what the model learns from a step (PowerSGD's low-rank approximation)."""
    kind: str = "step"
    """``"step"``: same ranks, faster step; ``"scale"``: more ranks (compare throughput)."""
    throughput_gain: Optional[float] = None
    """``kind == "scale"``: samples per second relative to the base."""
    note: str = ""

    @property
    def saving_pct(self) -> float:
        """Share of the base step saved, in percent (negative: slower)."""
        return 100.0 * (self.base_step_ms - self.step_ms) / self.base_step_ms if self.base_step_ms > 0 else 0.0

    def sentence(self) -> str:
        arrow = f"{self.base_step_ms:.1f} -> {self.step_ms:.1f} ms/step"
        if self.kind == "scale":
            gain = self.throughput_gain or 0.0
            verb = "costs" if self.saving_pct < 0 else "saves"
            return f"{self.name} {verb} {abs(self.saving_pct):.0f}% per step ({arrow}), throughput x{gain:.2f}"
        verb = "saves" if self.saving_pct >= 0 else "costs"
        text = f"{self.name} {verb} {abs(self.saving_pct):.0f}% ({arrow})"
        if self.lossy:
            text += " (lossy)"
        return text + (f"; {self.note}" if self.note else "")

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "change": {key: _plain(value) for key, value in self.change.items()},
            "step_ms": self.step_ms,
            "saving_pct": self.saving_pct,
            "lossy": self.lossy,
            "kind": self.kind,
            "throughput_gain": self.throughput_gain,
            "sentence": self.sentence(),
        }


def _plain(value: Any) -> Any:
    """A lever's changed field as JSON (a System as its ``as_dict``)."""
    as_dict = getattr(value, "as_dict", None)
    return as_dict() if callable(as_dict) else value


def rank_levers(
    run: ProfiledRun,
    scenario: Scenario,
    *,
    bucket_caps_mb: Sequence[float] = DEFAULT_GRID_MB,
    powersgd_ranks: Sequence[int] = POWERSGD_RANKS,
    link_factor: float = 10.0,
) -> list[Lever]:
    """The levers of ``scenario``, best first (step-time levers, then scale-out).

    PowerSGD is ranked only when the gradients' shapes are known; ``powersgd_ranks=()`` leaves
    it out (e.g. when its compute was not measured and a block should not guess).
    """
    base = predict(run, scenario)
    levers: list[Lever] = []

    def lever(name: str, lossy: bool = False, note: str = "", **change: Any) -> Prediction:
        prediction = predict(run, scenario.with_changes(**change))
        levers.append(Lever(name, change, prediction.step_ms, base.step_ms, lossy=lossy, note=note))
        return prediction

    if scenario.system.world_size > 1:
        if scenario.compression not in ("fp16", "bf16"):
            lever("fp16/bf16 compression", compression="fp16")
        if run.has_parameters:
            for rank in powersgd_ranks:
                if scenario.compression != "powersgd" or scenario.powersgd_rank != rank:
                    note = "" if scenario.costs is not NO_COSTS else "its compute not measured (counted as 0)"
                    lever(f"PowerSGD rank {rank}", lossy=True, note=note, compression="powersgd", powersgd_rank=rank)
        if scenario.compression is not None:
            lever("no compression", compression=None)
        best = _best_bucket_cap(run, scenario, bucket_caps_mb)
        if best is not None:
            cap, prediction = best
            found = Lever(f"bucket {cap:g} MiB", {"bucket_cap_mb": cap}, prediction.step_ms, base.step_ms)
            if found.saving_pct < MIN_SAVING_PCT:
                sizes = f"{min(bucket_caps_mb):g}-{max(bucket_caps_mb):g} MiB"
                found = replace(found, name="another bucket size", note=f"none of {sizes} saves {MIN_SAVING_PCT:g}%")
            levers.append(found)
        faster = _scaled_link(scenario.system, link_factor)
        if faster is not None:
            quicker = lever(f"a {link_factor:g}x faster link", system=faster)
            if (
                scenario.system.host is not None
                and base.step_ms - quicker.step_ms < MIN_SAVING_PCT / 100 * base.step_ms
            ):
                levers[-1] = replace(levers[-1], note="the host's own cost, not the link, sets the pace")
    levers.sort(key=lambda item: -item.saving_pct)
    doubled = _doubled(scenario)
    if doubled is not None:
        prediction = predict(run, doubled)
        nodes = scenario.system.nodes
        name = "a second node" if nodes == 1 else f"{2 * nodes} nodes instead of {nodes}"
        gain = prediction.speedup / base.speedup if base.speedup > 0 else 0.0
        levers.append(
            Lever(
                name,
                {"nodes": doubled.system.nodes},
                prediction.step_ms,
                base.step_ms,
                kind="scale",
                throughput_gain=gain,
            )
        )
    return levers


def _best_bucket_cap(run: ProfiledRun, scenario: Scenario, caps: Sequence[float]) -> Optional[tuple[float, Prediction]]:
    best: Optional[tuple[float, Prediction]] = None
    for cap in caps:
        if scenario.bucket_cap_mb is not None and float(cap) == float(scenario.bucket_cap_mb):
            continue
        prediction = predict(run, scenario.with_changes(bucket_cap_mb=float(cap)))
        if best is None or prediction.step_ms < best[1].step_ms:
            best = (float(cap), prediction)
    return best


def _scaled_link(system: System, factor: float) -> Optional[System]:
    link = system.links[0]
    if link.busbw_gbps == float("inf"):
        return None
    faster = _faster(link, factor)
    if system.nodes == 1 and system.intra is not None:
        return replace(system, intra=faster)
    return replace(system, inter=faster)


def _faster(link: Link, factor: float) -> Link:
    """``link`` with every rate it holds ``factor`` times higher (its curves, beside compute and per dtype included);
    what it measured of the host (CPU share, compute kept) as it is."""
    return replace(
        link,
        name=f"{link.name} x{factor:g}",
        busbw_gbps=link.busbw_gbps * factor,
        curve=tuple((size, busbw * factor) for size, busbw in link.curve),
        beside=tuple((size, busbw * factor) for size, busbw in link.beside),
        by_dtype=tuple((dtype, _faster(other, factor)) for dtype, other in link.by_dtype),
    )


def _doubled(scenario: Scenario) -> Optional[Scenario]:
    system = scenario.system
    if system.world_size == 1 and system.inter.name == "as profiled":
        return None
    return scenario.with_changes(system=replace(system, nodes=2 * system.nodes))


# ------------------------------------------------------------------ for CommProfiler


@dataclass(frozen=True)
class Advice:
    """The "what would help" block: its lines and the levers behind them."""

    title: str
    levers: tuple[Lever, ...]
    notes: tuple[str, ...] = ()

    @property
    def lines(self) -> list[str]:
        return [self.title] + [f"  {lever.sentence()}" for lever in self.levers] + [f"  ({n})" for n in self.notes]

    def as_dict(self) -> dict[str, Any]:
        return {"title": self.title, "levers": [lever.as_dict() for lever in self.levers], "notes": list(self.notes)}


def what_would_help(
    profile: Mapping[str, Any],
    *,
    link: Union[Link, str, float, None] = None,
    nodes: Optional[int] = None,
    costs: CompressionCosts = NO_COSTS,
    top: int = 4,
) -> Advice:
    """The levers on the profiled system (or on ``link`` / ``nodes``), best ``top`` first.

    ``profile`` is the ``comm_profile.json`` document; ``link`` a :class:`Link`, a preset name
    (``"10gbe"``) or a rate in Gbit/s; ``nodes`` the nodes to predict (default: one per profiled
    rank). Never raises for a profile that cannot be replayed: the block then says why in one
    line (the profiler prints it as is). A ``link`` or ``nodes`` that is wrong raises ValueError.
    """
    chosen_link = _as_link(link)
    try:
        run = load_profile(profile)
    except ValueError as error:
        return Advice("what would help: nothing to replay", (), (str(error),))
    as_profiled = link_from_profile(run)
    chosen = chosen_link or as_profiled
    if chosen is None:
        return Advice(
            "what would help: one rank was profiled; name a link to predict more ranks",
            (),
            ("lightning-mgpu whatif comm_profile.json --world-size 2 --link 10gbe",),
        )
    system = System(nodes=nodes or run.world_size, inter=chosen)
    # the configuration as profiled: a profile taken with fp16 replays with it (and is not told to turn it on)
    scenario = Scenario(system=system, costs=costs, compression=run.compression)
    measured = costs is not NO_COSTS
    levers = rank_levers(run, scenario, powersgd_ranks=POWERSGD_RANKS if measured else ())
    step_levers = [lever for lever in levers if lever.kind == "step"][:top]
    scale = [lever for lever in levers if lever.kind == "scale"]
    notes = list(run.notes)
    if not run.has_parameters:
        notes.append("PowerSGD not predicted: the profile lists no gradient shapes")
    elif not measured:
        notes.append("PowerSGD not predicted here (its compute is not measured): lightning-mgpu whatif PROFILE")
    per_step = (
        f", per optimizer step of {run.accumulate_grad_batches} micro-batches"
        if run.accumulate_grad_batches > 1 and run.accumulation_ms > 0
        else ""
    )
    title = f"what would help ({system.describe()}{per_step}, replayed from this profile):"
    return Advice(title, tuple(step_levers + scale), tuple(notes))


def _as_link(link: Union[Link, str, float, None]) -> Optional[Link]:
    if link is None or isinstance(link, Link):
        return link
    if isinstance(link, str):
        return resolve_link(link)
    return link_from_gbps(link)


__all__ = ["POWERSGD_RANKS", "Advice", "Lever", "rank_levers", "what_would_help"]
