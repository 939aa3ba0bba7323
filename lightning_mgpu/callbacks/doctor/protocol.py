"""The doctor's typed check protocol: what a rank observes, what it sends at a check, what the rules judge.

A *check* is one exchange. Every rank sends a :class:`RankReport` (``None`` in a field: not part
of this check); the ledger merges the gathered reports, with what earlier checks agreed on, into
a :class:`Snapshot` (lists indexed by rank), and :func:`~.checks.evaluate` turns a snapshot into
findings. Every rank holds the same snapshot, so all reach the same verdict.

Plain data (dicts, lists, dataclasses): it is pickled between ranks. No torch import here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, TypedDict

from lightning_mgpu.callbacks.doctor.findings import Finding

__all__ = [
    "AugmentInfo",
    "DeviceInfo",
    "DistributedSamplerInfo",
    "FirstBatches",
    "LoaderInfo",
    "ParamUsage",
    "RankReport",
    "SamplerInfo",
    "SetupInfo",
    "Snapshot",
    "Timing",
    "UsageReport",
]

# --------------------------------------------------------------------------- what a rank observes


class DeviceInfo(TypedDict):
    """The devices one rank's node offers and this run uses."""

    node: str
    type: str
    """The root device's type: ``"cuda"``, ``"cpu"``, ..."""
    used: int
    """Devices the Trainer uses on this node."""
    cuda_visible: int


class LoaderInfo(TypedDict):
    """What bounds the train loader's speed on this rank."""

    num_workers: int
    cpus: int
    local_world_size: int
    """Processes on this node."""
    cuda: bool


class AugmentInfo(TypedDict, total=False):
    """Does the training data draw random numbers (see ``probes.probe_augmentation``)?"""

    augments: bool
    how: str
    workers: int
    rank_aware_workers: bool
    """The workers are seeded from their rank (``seed_everything(workers=True)``)."""


class DistributedSamplerInfo(TypedDict):
    """A ``DistributedSampler`` found in the train loader, and where."""

    path: str
    """Attribute path from the loader, e.g. ``loader.sampler.base``."""
    rank: int
    num_replicas: int
    shuffle: bool
    epoch: int


class SamplerInfo(TypedDict, total=False):
    """Where the train loader's order comes from (empty: no ``DataLoader`` found)."""

    description: str
    path: str
    distributed: Optional[DistributedSamplerInfo]
    fixed_order: bool
    """The same order every epoch by design (``SequentialSampler``, an unshuffled distributed one)."""
    order_unknown: bool
    """Whether the order is fixed could not be told (no verdict on the epoch order then)."""
    lightning_sampler: Optional[bool]
    """``Trainer(use_distributed_sampler=...)``; None when unknown."""


class Timing(TypedDict):
    """Time spent since the last check: in the train loader's ``next()``, and in whole iterations."""

    fetch_s: float
    iteration_s: float
    batches: int


@dataclass
class SetupInfo:
    """What one rank saw at fit start."""

    devices: DeviceInfo
    wrapped: list[str]
    """``"DataParallel at 'net'"`` per wrapped submodule."""
    loader: LoaderInfo
    augment: AugmentInfo
    batchnorm: list[str]
    """BatchNorm layers (not SyncBatchNorm) in training mode."""


@dataclass
class UsageReport:
    """Parameter use since the last check, while the use window is open."""

    counts: list[int]
    """Per parameter: batches in which it got a gradient on this rank."""
    batches: int
    done: bool
    """The window closes with this check."""


# --------------------------------------------------------------------------- what a rank sends


@dataclass
class RankReport:
    """One rank's part of a check. ``None``: not part of this check."""

    local_findings: list[Finding] = field(default_factory=list)
    """Findings this rank made on its own since the last check."""
    digests: dict[int, Optional[str]] = field(default_factory=dict)
    """Epoch -> hash of its first batch (None: could not be hashed), for epochs not sent yet."""
    setup: Optional[SetupInfo] = None
    """At the fit's first check."""
    batches: Optional[float] = None
    """Training batches this epoch (inf: unknown length), at epoch start."""
    batches_left: float = math.inf
    """Training batches until ``max_steps`` ends the fit (inf: no such limit), at epoch start (the same on
    every rank)."""
    sampler: Optional[SamplerInfo] = None
    """At epoch start."""
    random_state_sent: bool = False
    random_state: Optional[str] = None
    """Hash of the random state the data's augmentation draws from (None: unknown), once after the first batch."""
    param_sums: Optional[list[int]] = None
    """Exact checksum per parameter (then per buffer), at full checks."""
    metrics: Optional[dict[str, float]] = None
    """Epoch metrics logged without sync_dist, at full checks and validation ends."""
    timing: Optional[Timing] = None
    """At full checks."""
    usage: Optional[UsageReport] = None
    missing_grads: Optional[list[str]] = None
    """Parameters with no gradient after the first backward under ``find_unused_parameters=False`` (DDP then
    skips the all-reduce of their buckets), once, with the check after that backward."""


# --------------------------------------------------------------------------- what the rules judge


@dataclass
class FirstBatches:
    """One epoch's first-batch hashes per rank, and the previous epoch's (None: not known)."""

    epoch: int
    digests: list[Optional[str]]
    previous: Optional[list[Optional[str]]] = None


@dataclass
class ParamUsage:
    """Parameter use over the whole window, per rank."""

    counts: list[list[int]]
    """``counts[r][i]``: batches of the window in which parameter ``names[i]`` got a gradient on rank ``r``."""
    batches: list[int]
    names: list[str]
    find_unused: bool
    """DDP's ``find_unused_parameters``."""


@dataclass
class Snapshot:
    """What every rank knows after one check (lists indexed by rank). Empty or None: nothing to judge."""

    world_size: int
    epoch: int
    local_findings: list[list[Finding]] = field(default_factory=list)
    setups: Optional[list[SetupInfo]] = None
    """At the fit's first check."""
    batch_counts: Optional[list[float]] = None
    batches_left: float = math.inf
    """As the epoch started: training batches until ``max_steps`` ends the fit."""
    samplers: list[SamplerInfo] = field(default_factory=list)
    """As of the latest epoch start."""
    first_batches: list[FirstBatches] = field(default_factory=list)
    """Epochs whose first-batch hashes arrived with this check (with two ranks or more)."""
    augment: list[AugmentInfo] = field(default_factory=list)
    random_states: Optional[list[Optional[str]]] = None
    param_sums: Optional[list[list[int]]] = None
    tensor_names: list[str] = field(default_factory=list)
    """Names for ``param_sums``' entries: parameters, then ``"buffer <name>"``."""
    buffers_checked: bool = False
    metrics: Optional[list[dict[str, float]]] = None
    timings: Optional[list[Timing]] = None
    loaders: list[LoaderInfo] = field(default_factory=list)
    data_wait_threshold: float = 0.25
    usage: Optional[ParamUsage] = None
    """When the parameter-use window closed with this check."""
    unreduced: list[str] = field(default_factory=list)
    """Parameters that got no gradient on some rank under ``find_unused_parameters=False`` this fit (so far):
    DDP did not all-reduce their buckets, and the parameters sharing them drift apart."""
