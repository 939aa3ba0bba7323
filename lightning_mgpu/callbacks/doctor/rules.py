"""The doctor's rule catalogue: for each rule, what it catches, how, at what cost, how bad it is, the usual fix.

This table is the single source for the documentation's rule table and ``lightning-mgpu doctor
--rules``; the checks that fire each rule are in :mod:`.checks`. No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["RULES", "RULE_IDS", "SEVERITIES", "Rule", "Severity", "table_rows", "validate_rule_ids"]

Severity = Literal["fatal", "wrong", "wasteful"]

SEVERITIES: dict[Severity, str] = {
    "fatal": "the run crashes or hangs",
    "wrong": "training, or what is recorded of it, is silently not what was meant",
    "wasteful": "the run is correct but pays for time or devices it does not use",
}


@dataclass(frozen=True)
class Rule:
    """One named check: what it catches, how it is detected, what it costs and the usual fix."""

    id: str
    """Stable id (``DistributedDoctor(disable=[id])``, ``Finding.rule``)."""
    catches: str
    detection: str
    cost: str
    fix: str
    """The usual fix; a finding may give a more specific one."""
    severity: Severity


RULES: dict[str, Rule] = {
    rule.id: rule
    for rule in (
        Rule(
            "unused-devices",
            catches="more GPUs visible than the run uses (or GPUs visible while training on CPU)",
            detection="at fit start: torch.cuda.device_count() against the devices this node's Trainer uses",
            cost="none (once)",
            fix="Trainer(devices=-1) uses every visible GPU; if sharing the machine is intended, hide the others "
            "with CUDA_VISIBLE_DEVICES",
            severity="wasteful",
        ),
        Rule(
            "dataparallel-wrapped",
            catches="a module still wrapped in nn.DataParallel (or DistributedDataParallel) inside the LightningModule",
            detection="at fit start: isinstance over the LightningModule's submodules",
            cost="none (once)",
            fix="remove the wrapper and let the strategy replicate the model (strategy='ddp_tuned': one process per "
            "device)",
            severity="wasteful",
        ),
        Rule(
            "data-not-sharded",
            catches="every rank reads the same batches (sampler not distributed, or DistributedSampler(rank=0) "
            "everywhere)",
            detection="a hash of each epoch's first batch (up to 1 MiB per tensor), compared across ranks",
            cost="one hash per epoch, sent with the epoch's first check",
            fix="give each rank its shard: DistributedSampler(dataset, num_replicas=world_size, rank=global_rank), or "
            "leave Trainer(use_distributed_sampler=True) to do it",
            severity="wrong",
        ),
        Rule(
            "sampler-epoch-not-set",
            catches="the same sample order every epoch (a shuffling sampler whose set_epoch is never called)",
            detection="each rank's first-batch hash of this epoch equals the previous epoch's, while its sampler "
            "shuffles",
            cost="the same hash as data-not-sharded",
            fix="call sampler.set_epoch(epoch) at the start of every epoch (Lightning does it only for loader.sampler "
            "and loader.batch_sampler.sampler), or derive a custom sampler's seed from the epoch",
            severity="wrong",
        ),
        Rule(
            "params-diverged",
            catches="parameters that differ across ranks (rank-dependent code, in-place edits, weights loaded on one "
            "rank, buffers not broadcast; or a DDP bucket never all-reduced because a parameter in it got no gradient "
            "under find_unused_parameters=False: then the finding says so and gives unused-parameters' fix)",
            detection="per tensor, an exact checksum of the bit patterns (integer sum, wrapping) of every parameter "
            "(and buffer, when DDP does not broadcast them), compared across ranks after the first step and every "
            "check_every_n_batches",
            cost="one read of the parameters per check (about 1 ms per 10M parameters on a CPU core)",
            fix="change parameters only through the optimizer, the same way on every rank; load weights on every rank "
            "before DDP wraps the model; keep DDP's broadcast_buffers=True or use SyncBatchNorm",
            severity="wrong",
        ),
        Rule(
            "uneven-batches",
            catches="ranks with different numbers of training batches (the classic hang or crash at the end of an "
            "epoch)",
            detection="each rank's number of batches this epoch, compared at every epoch start, before the first step; "
            "the run stops there unless stop_on_fatal=False (only a warning when max_steps ends the fit before the "
            "shortest rank runs out)",
            cost="one small exchange per epoch",
            fix="give every rank the same number of batches: DistributedSampler pads (drop_last=False) or trims "
            "(drop_last=True) the shards to equal length; split your own shards evenly",
            severity="fatal",
        ),
        Rule(
            "batchnorm-without-sync",
            catches="BatchNorm under DDP at a small per-device batch, without SyncBatchNorm",
            detection="BatchNorm layers (not SyncBatchNorm) in training mode and a first batch smaller than "
            "batchnorm_min_batch (16)",
            cost="none (once)",
            fix="Trainer(sync_batchnorm=True) (SyncBatchNorm: statistics over the global batch), a larger per-device "
            "batch, or GroupNorm/LayerNorm",
            severity="wrong",
        ),
        Rule(
            "unused-parameters",
            catches="parameters that get no gradient: DDP fails at the next step (find_unused_parameters=False; "
            "fatal), or they never train (find_unused_parameters=True; rated wrong, the run goes on)",
            detection="find_unused_parameters=False: .grad still None after the first backward; =True: gradient hooks "
            "over the first max(check_every_n_batches, 8) batches, summed over ranks",
            cost="a loop over the parameters after the first backward; with find_unused_parameters=True one hook call "
            "per parameter per batch, first window only",
            fix="for a graph that really skips parameters, find_unused_parameters=True "
            "(strategy='ddp_find_unused_parameters_true' or TunedDDPStrategy(find_unused_parameters=True)); "
            "parameters that never train: requires_grad_(False) or remove them",
            severity="fatal",
        ),
        Rule(
            "reentrant-checkpoint",
            catches="reentrant activation checkpointing (torch.utils.checkpoint with use_reentrant=True, "
            "checkpoint_sequential, a Hugging Face model's gradient checkpointing) under DDP with "
            "find_unused_parameters=True: the first backward fails ('Expected to mark a variable ready only once')",
            detection="before the first backward: the loss's autograd graph holds a reentrant checkpoint's node, "
            "while DDP has find_unused_parameters=True and no static graph",
            cost="one walk over the first loss's autograd graph (find_unused_parameters=True only), and one small "
            "exchange",
            fix="TunedDDPStrategy(static_graph=True) (stock: DDPStrategy(static_graph=True)) if the graph is the same at "
            "every step (DDP then finds unused parameters itself: find_unused_parameters is not needed); or "
            "checkpoint(..., use_reentrant=False) (Hugging Face: "
            "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})); or "
            "find_unused_parameters=False if every parameter gets a gradient",
            severity="fatal",
        ),
        Rule(
            "find-unused-wasted",
            catches="find_unused_parameters=True although every parameter gets a gradient on every rank and step",
            detection="the same gradient hooks: every parameter used in every batch of the first window, on every rank",
            cost="as unused-parameters",
            fix="find_unused_parameters=False (the default), or static_graph=True: DDP then skips a traversal of the "
            "autograd graph at every step",
            severity="wasteful",
        ),
        Rule(
            "unsynced-logging",
            catches="epoch metrics logged from every rank without sync_dist: the logger records rank 0's shard only",
            detection="values of self.log(..., on_epoch=True, sync_dist=False) compared across ranks at each check "
            "and at the end of validation",
            cost="one small exchange per check",
            fix="self.log(..., sync_dist=True), or log a torchmetrics Metric (it syncs its state itself)",
            severity="wrong",
        ),
        Rule(
            "same-random-state",
            catches="identical random state on every rank while the data is augmented: every rank draws the same "
            "augmentation",
            detection="augmentation: dataset[0] read under two seeds differs (num_workers=0) or the dataset has a "
            "transform (workers); identical: the global random states at the first batch (with workers: the "
            "generator the workers' base seed is drawn from, at fit start) hash the same on every rank",
            cost="three reads of dataset[0] at fit start (random state restored), one hash",
            fix="seed each rank differently once the model is built, e.g. torch.manual_seed(seed + self.global_rank) "
            "in on_train_start; with num_workers > 0, seed_everything(seed, workers=True)",
            severity="wrong",
        ),
        Rule(
            "dataloader-starving",
            catches="the step waits for data: time in the train loader's next() above data_wait_threshold (25%) of "
            "the iteration time",
            detection="Lightning's fetch hooks timed on every rank between checks (each epoch's first 2 batches left "
            "out)",
            cost="two clock reads per batch",
            fix="more DataLoader workers (num_workers), persistent_workers=True, pin_memory=True on GPUs, or less work "
            "per sample",
            severity="wasteful",
        ),
    )
}

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
