"""The ``DistributedDoctor`` callback's rules: one module each (two verdicts on one observation share one).

Each module holds its rule's catalogue entry (:class:`~..rule.Rule`: what it catches, how, at
what cost, how bad it is, the usual fix), what it observes on a rank and its check over what the
ranks gathered (its :class:`~..rule.Watch`). :data:`WATCHES` lists them in the order their findings
are reported within one check; :data:`RULES` is the catalogue in the same order, the single source
of the documentation's rule table and ``lightning-mgpu doctor --rules``.
"""

from __future__ import annotations

from lightning_mgpu.callbacks.doctor.rule import Rule, Watch
from lightning_mgpu.callbacks.doctor.rules.batchnorm import BatchNormWithoutSync
from lightning_mgpu.callbacks.doctor.rules.data_wait import DataWait
from lightning_mgpu.callbacks.doctor.rules.dataparallel import DataParallelWrapped
from lightning_mgpu.callbacks.doctor.rules.first_batches import FirstBatches
from lightning_mgpu.callbacks.doctor.rules.parameter_use import ParameterUse
from lightning_mgpu.callbacks.doctor.rules.params_diverged import ParamsDiverged
from lightning_mgpu.callbacks.doctor.rules.random_state import SameRandomState
from lightning_mgpu.callbacks.doctor.rules.reentrant_checkpoint import ReentrantCheckpoint
from lightning_mgpu.callbacks.doctor.rules.uneven_batches import UnevenBatches
from lightning_mgpu.callbacks.doctor.rules.unsynced_logging import UnsyncedLogging
from lightning_mgpu.callbacks.doctor.rules.unused_devices import UnusedDevices

__all__ = ["RULES", "RULE_IDS", "WATCHES", "table_rows", "validate_rule_ids"]

WATCHES: tuple[type[Watch], ...] = (
    UnusedDevices,
    DataParallelWrapped,
    UnevenBatches,
    FirstBatches,
    SameRandomState,
    ParamsDiverged,
    UnsyncedLogging,
    DataWait,
    BatchNormWithoutSync,  # before ParameterUse: a rank's own findings are sent in this order too
    ParameterUse,
    ReentrantCheckpoint,
)
"""Every watch, in the order its findings are reported within one check."""

RULES: dict[str, Rule] = {rule.id: rule for watch in WATCHES for rule in watch.rules}
RULE_IDS: tuple[str, ...] = tuple(RULES)


def validate_rule_ids(ids: object, argument: str = "disable") -> frozenset[str]:
    """``ids`` (one id or an iterable of ids) as a set of known rule ids; a ``ValueError`` naming ``argument``
    and listing the valid ids otherwise."""
    if isinstance(ids, str):
        ids = [ids]
    try:
        items = list(ids)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(
            f"DistributedDoctor: {argument} must be a list of rule ids, got {type(ids).__name__} {ids!r}; "
            f"valid ids: {', '.join(RULE_IDS)}"
        ) from None
    unknown = [item for item in items if not isinstance(item, str) or item not in RULES]
    if unknown:
        raise ValueError(
            f"DistributedDoctor: {argument} has unknown rule id(s) {', '.join(repr(u) for u in unknown)}; "
            f"valid ids: {', '.join(RULE_IDS)}"
        )
    return frozenset(items)


def table_rows() -> list[tuple[str, str, str, str, str]]:
    """(id, catches, detection, cost, fix) per rule, for documentation and ``doctor --rules``."""
    return [(r.id, r.catches, r.detection, r.cost, r.fix) for r in RULES.values()]
