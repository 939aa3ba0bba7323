"""``data-not-sharded`` and ``sampler-epoch-not-set``: two verdicts on each epoch's first batch, hashed on every rank.

The same batch on two ranks in one epoch: the data is not sharded. The same batch on one rank in
two epochs while its sampler shuffles: the sampler's epoch is not set.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional, TypedDict

import lightning as L
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler, SequentialSampler

from lightning_mgpu._compat.lightning import sampler_wrapped_for_distribution, trainer_uses_distributed_sampler
from lightning_mgpu.callbacks.doctor.findings import Finding, rank_list
from lightning_mgpu.callbacks.doctor.probes import fingerprint, train_loader
from lightning_mgpu.callbacks.doctor.rule import Check, CheckKind, Rule, Watch

NOT_SHARDED = Rule(
    "data-not-sharded",
    catches="every rank reads the same batches (sampler not distributed, or DistributedSampler(rank=0) everywhere)",
    detection="a hash of each epoch's first batch (up to 1 MiB per tensor), compared across ranks",
    cost="one hash per epoch, sent with the epoch's first check",
    fix="give each rank its shard: DistributedSampler(dataset, num_replicas=world_size, rank=global_rank), or "
    "leave Trainer(use_distributed_sampler=True) to do it",
    severity="wrong",
)
EPOCH_NOT_SET = Rule(
    "sampler-epoch-not-set",
    catches="the same sample order every epoch (a shuffling sampler whose set_epoch is never called)",
    detection="each rank's first-batch hash of this epoch equals the previous epoch's, while its sampler shuffles",
    cost="the same hash as data-not-sharded",
    fix="call sampler.set_epoch(epoch) at the start of every epoch (Lightning does it only for loader.sampler "
    "and loader.batch_sampler.sampler), or derive a custom sampler's seed from the epoch",
    severity="wrong",
)


class DistributedSamplerInfo(TypedDict):
    """A ``DistributedSampler`` found in the train loader, and where (``path`` from the loader, e.g.
    ``loader.sampler.base``)."""

    path: str
    rank: int
    num_replicas: int
    shuffle: bool
    epoch: int


class SamplerInfo(TypedDict, total=False):
    """Where the train loader's order comes from (empty: no ``DataLoader`` found). ``fixed_order``: the same
    order every epoch by design (``SequentialSampler``, an unshuffled distributed one); ``order_unknown``:
    whether it is could not be told (no verdict on the epoch order then); ``lightning_sampler``:
    ``Trainer(use_distributed_sampler=...)``, None when unknown."""

    description: str
    path: str
    distributed: Optional[DistributedSamplerInfo]
    fixed_order: bool
    order_unknown: bool
    lightning_sampler: Optional[bool]


def describe_sampler(loader: DataLoader[Any], trainer: Any) -> SamplerInfo:
    """Where the order comes from: the effective sampler, a DistributedSampler found in it, fixed order or not."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if isinstance(batch_sampler, BatchSampler) and getattr(batch_sampler, "sampler", None) is not None:
        effective = batch_sampler.sampler
        # DataLoader's own BatchSampler wraps loader.sampler: name it the way the user wrote it
        path = "loader.sampler" if effective is getattr(loader, "sampler", None) else "loader.batch_sampler.sampler"
    elif batch_sampler is not None:
        effective, path = batch_sampler, "loader.batch_sampler"
    else:
        effective, path = getattr(loader, "sampler", None), "loader.sampler"  # type: ignore[assignment]

    # The user's own sampler classes may keep a DistributedSampler in any attribute: look one level in.
    candidates: list[tuple[str, Any]] = [(path, effective)]
    for name, value in vars(effective).items() if hasattr(effective, "__dict__") else ():
        if isinstance(value, (Sampler, BatchSampler)) or hasattr(value, "set_epoch"):
            candidates.append((f"{path}.{name}", value))
    distributed: Optional[DistributedSamplerInfo] = None
    for where, obj in candidates:
        if isinstance(obj, DistributedSampler):
            distributed = {
                "path": where,
                "rank": int(obj.rank),
                "num_replicas": int(obj.num_replicas),
                "shuffle": bool(obj.shuffle),
                "epoch": int(getattr(obj, "epoch", 0)),
            }
            break

    info: SamplerInfo = {"description": type(effective).__name__, "path": path, "distributed": distributed}
    fixed = isinstance(effective, SequentialSampler)
    if isinstance(effective, DistributedSampler):
        info["description"] += f"(shuffle={effective.shuffle})"
        if not effective.shuffle:
            # Lightning's DistributedSamplerWrapper shards the user's sampler: its order is that sampler's.
            try:
                inner = sampler_wrapped_for_distribution(effective)
            except LookupError:
                info["order_unknown"] = True
            else:
                fixed = inner is None or isinstance(inner, SequentialSampler)
    info["fixed_order"] = fixed
    info["lightning_sampler"] = trainer_uses_distributed_sampler(trainer)
    return info


def check_data_not_sharded(
    digests: Sequence[Optional[str]], samplers: Sequence[Mapping[str, Any]], epoch: int
) -> Optional[Finding]:
    groups: dict[str, list[int]] = {}
    for rank, digest in enumerate(digests):
        if digest is not None:
            groups.setdefault(digest, []).append(rank)
    shared = [ranks for ranks in groups.values() if len(ranks) > 1]
    if not shared:
        return None
    if len(shared) == 1 and len(shared[0]) == len(digests):
        who = f"all {len(digests)} ranks"
    else:
        who = "; ".join(f"ranks {rank_list(ranks)}" for ranks in shared)
    seen = f"{who} read identical first batches in epoch {epoch}"
    sampler = samplers[shared[0][0]] if samplers else {}
    dist = sampler.get("distributed")
    fix = NOT_SHARDED.fix
    if dist and len({s.get("distributed", {}).get("rank") for s in samplers if s.get("distributed")}) == 1:
        seen += (
            f"; every rank has DistributedSampler(num_replicas={dist.get('num_replicas')}, rank={dist.get('rank')}) "
            f"at {dist.get('path')}"
        )
        fix = (
            "pass each process its own rank: DistributedSampler(dataset, num_replicas=trainer.world_size, "
            "rank=trainer.global_rank) (or torch.distributed.get_rank()), or leave the sampler to Lightning "
            "(Trainer(use_distributed_sampler=True))"
        )
    elif sampler:
        seen += f"; the train loader's sampler is {sampler.get('description', '?')}"
        if sampler.get("lightning_sampler") is False:
            seen += " and Trainer(use_distributed_sampler=False)"
    return NOT_SHARDED.finding(
        seen=seen,
        why="the ranks compute the same gradient: N processes do the work of one, and an 'epoch' passes over the "
        "data N times",
        fix=fix,
    )


def check_epoch_order(
    previous: Sequence[Optional[str]],
    current: Sequence[Optional[str]],
    samplers: Sequence[Mapping[str, Any]],
    epoch: int,
) -> Optional[Finding]:
    repeated = [
        rank
        for rank, (before, now) in enumerate(zip(previous, current))
        if before is not None
        and before == now
        and not (samplers and (samplers[rank].get("fixed_order") or samplers[rank].get("order_unknown")))
    ]
    if not repeated:
        return None
    sampler = samplers[repeated[0]] if samplers else {}
    seen = (
        f"epoch {epoch} starts with the same batch as epoch {epoch - 1} on rank{'s' if len(repeated) > 1 else ''} "
        f"{rank_list(repeated)}; the train sampler is {sampler.get('description', '?')}"
    )
    dist = sampler.get("distributed")
    fix = EPOCH_NOT_SET.fix
    if dist and dist.get("shuffle"):
        path = str(dist.get("path"))
        seen += f", with a shuffling DistributedSampler at {path} still at epoch {dist.get('epoch')}"
        if path not in ("loader.sampler", "loader.batch_sampler.sampler"):
            attribute = path.replace("loader.", "self.trainer.train_dataloader.", 1)
            fix = (
                f"Lightning calls set_epoch only on loader.sampler and loader.batch_sampler.sampler, not on {path}: "
                f"call it yourself at every epoch start (in the LightningModule: def on_train_epoch_start(self): "
                f"{attribute}.set_epoch(self.current_epoch)), or make the DistributedSampler the loader's sampler"
            )
    return EPOCH_NOT_SET.finding(
        seen=seen,
        why="every epoch visits the samples in the same order, which loses what shuffling gives (a different "
        "mini-batch mix each epoch) and can slow or bias training",
        fix=fix,
    )


class FirstBatches(Watch):
    """Hashes each epoch's first batch on this rank; sends the hashes not sent yet, and the sampler at each
    epoch start. Keeps the last two epochs' hashes of every rank (checkpointed)."""

    rules = (NOT_SHARDED, EPOCH_NOT_SET)

    def reset(self) -> None:
        super().reset()
        self.pending: dict[int, Optional[str]] = {}
        """Epoch -> this rank's hash of its first batch (None: not wanted, or could not be hashed), not sent yet."""
        self.epoch_digests: dict[int, list[Optional[str]]] = {}
        """Epoch -> its first batch's hash per rank (the last two epochs: all a comparison needs)."""
        self.samplers: list[SamplerInfo] = []
        """Every rank's sampler, as of the latest epoch start."""

    def batch_start(self, trainer: L.Trainer, batch: Any, batch_idx: int) -> None:
        epoch = trainer.current_epoch
        if epoch not in self.pending and epoch not in self.epoch_digests:
            wanted = any(self.doctor.enabled(rule.id) for rule in self.rules)
            self.pending[epoch] = fingerprint(batch) if wanted else None

    def report(self, trainer: L.Trainer, kind: CheckKind) -> Any:
        digests, self.pending = self.pending, {}
        sampler: Optional[SamplerInfo] = None
        if kind == "epoch_start":
            loader = train_loader(trainer)  # the sampler as this epoch starts (its epoch, for one)
            sampler = describe_sampler(loader, trainer) if loader is not None else {}
            if sampler.get("order_unknown"):
                self.doctor.cannot_check(EPOCH_NOT_SET.id, "the order of the sampler Lightning wraps is unknown")
        return digests, sampler

    def judge(self, reports: list[Any], check: Check) -> Iterable[Optional[Finding]]:
        if reports[0][1] is not None:
            self.samplers = [sampler or SamplerInfo() for _, sampler in reports]
        if len(reports) < 2:
            return
        per_rank: list[dict[int, Optional[str]]] = [digests for digests, _ in reports]
        for epoch in sorted({epoch for digests in per_rank for epoch in digests}):
            digests = [d.get(epoch) for d in per_rank]
            self.epoch_digests[epoch] = digests
            yield check_data_not_sharded(digests, self.samplers, epoch)
            previous = self.epoch_digests.get(epoch - 1)
            if previous is not None:
                yield check_epoch_order(previous, digests, self.samplers, epoch)
        for old in sorted(self.epoch_digests)[:-2]:
            del self.epoch_digests[old]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch_digests": {str(epoch): list(digests) for epoch, digests in self.epoch_digests.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch_digests = {int(epoch): list(d) for epoch, d in state["epoch_digests"].items()}
