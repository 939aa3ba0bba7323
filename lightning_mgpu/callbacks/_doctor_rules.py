"""The rules of :class:`~lightning_mgpu.callbacks.doctor.DistributedDoctor`: catalogue, findings and checks.

Everything here is plain Python over what the ranks exchanged (lists indexed by rank), so
each rule can be tested without starting processes. The callback (``doctor.py``) collects
the observations, exchanges them in one collective that every rank enters, and runs
these checks on the gathered data: every rank reaches the same verdict.

No torch import at module level: ``lightning-mgpu doctor --rules`` reads the catalogue.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class Rule:
    """One named check: what it catches, how it is detected, what it costs and the usual fix."""

    id: str
    catches: str
    detection: str
    cost: str
    fix: str


RULES: dict[str, Rule] = {
    rule.id: rule
    for rule in (
        Rule(
            "unused-devices",
            "more GPUs visible than the run uses (or GPUs visible while training on CPU)",
            "at fit start: torch.cuda.device_count() against the devices this node's Trainer uses",
            "none (once)",
            "Trainer(devices=-1) uses every visible GPU; if sharing the machine is intended, hide the others "
            "with CUDA_VISIBLE_DEVICES",
        ),
        Rule(
            "dataparallel-wrapped",
            "a module still wrapped in nn.DataParallel (or DistributedDataParallel) inside the LightningModule",
            "at fit start: isinstance over the LightningModule's submodules",
            "none (once)",
            "remove the wrapper and let the strategy replicate the model (strategy='ddp_tuned': one process per "
            "device)",
        ),
        Rule(
            "data-not-sharded",
            "every rank reads the same batches (sampler not distributed, or DistributedSampler(rank=0) everywhere)",
            "a hash of each epoch's first batch (up to 1 MiB per tensor), compared across ranks",
            "one hash per epoch, sent with the epoch's first check",
            "give each rank its shard: DistributedSampler(dataset, num_replicas=world_size, rank=global_rank), or "
            "leave Trainer(use_distributed_sampler=True) to do it",
        ),
        Rule(
            "sampler-epoch-not-set",
            "the same sample order every epoch (a shuffling sampler whose set_epoch is never called)",
            "each rank's first-batch hash of this epoch equals the previous epoch's, while its sampler shuffles",
            "the same hash as data-not-sharded",
            "call sampler.set_epoch(epoch) at the start of every epoch (Lightning does it only for loader.sampler "
            "and loader.batch_sampler.sampler), or derive a custom sampler's seed from the epoch",
        ),
        Rule(
            "params-diverged",
            "parameters that differ across ranks (rank-dependent code, in-place edits, weights loaded on one rank, "
            "buffers not broadcast)",
            "per tensor, an exact checksum of the bit patterns (integer sum, wrapping) of every parameter (and buffer, "
            "when DDP does not broadcast them), compared across ranks after the first step and every every_n_steps",
            "one read of the parameters per check (about 1 ms per 10M parameters on a CPU core)",
            "change parameters only through the optimizer, the same way on every rank; load weights on every rank "
            "before DDP wraps the model; keep DDP's broadcast_buffers=True or use SyncBatchNorm",
        ),
        Rule(
            "uneven-batches",
            "ranks with different numbers of training batches (the classic hang at the end of an epoch)",
            "each rank's number of batches this epoch, compared at every epoch start, before the first step",
            "one small exchange per epoch",
            "give every rank the same number of batches: DistributedSampler pads (drop_last=False) or trims "
            "(drop_last=True) the shards to equal length; split your own shards evenly",
        ),
        Rule(
            "batchnorm-without-sync",
            "BatchNorm under DDP at a small per-device batch, without SyncBatchNorm",
            "BatchNorm layers (not SyncBatchNorm) in training mode and a first batch smaller than "
            "batchnorm_min_batch (16)",
            "none (once)",
            "Trainer(sync_batchnorm=True) (SyncBatchNorm: statistics over the global batch), a larger per-device "
            "batch, or GroupNorm/LayerNorm",
        ),
        Rule(
            "unused-parameters",
            "parameters that get no gradient: DDP fails at the next step (find_unused_parameters=False), or they "
            "never train (find_unused_parameters=True)",
            "find_unused_parameters=False: .grad still None after the first backward; =True: gradient hooks over "
            "the first max(every_n_steps, 8) batches, summed over ranks",
            "a loop over the parameters after the first backward; with find_unused_parameters=True one hook call "
            "per parameter per batch, first window only",
            "for a graph that really skips parameters, find_unused_parameters=True "
            "(strategy='ddp_find_unused_parameters_true' or TunedDDPStrategy(find_unused_parameters=True)); "
            "parameters that never train: requires_grad_(False) or remove them",
        ),
        Rule(
            "find-unused-wasted",
            "find_unused_parameters=True although every parameter gets a gradient on every rank and step",
            "the same gradient hooks: every parameter used in every batch of the first window, on every rank",
            "as unused-parameters",
            "find_unused_parameters=False (the default), or static_graph=True: DDP then skips a traversal of the "
            "autograd graph at every step",
        ),
        Rule(
            "unsynced-logging",
            "epoch metrics logged from every rank without sync_dist: the logger records rank 0's shard only",
            "values of self.log(..., on_epoch=True, sync_dist=False) compared across ranks at each check and at the "
            "end of validation",
            "one small exchange per check",
            "self.log(..., sync_dist=True), or log a torchmetrics Metric (it syncs its state itself)",
        ),
        Rule(
            "same-random-state",
            "identical random state on every rank while the data is augmented: every rank draws the same "
            "augmentation",
            "augmentation: dataset[0] read under two seeds differs (num_workers=0) or the dataset has a transform "
            "(workers); identical: the random states (or the workers' base seed) hash the same on every rank at the "
            "first batch",
            "three reads of dataset[0] at fit start (random state restored), one hash",
            "seed each rank differently once the model is built, e.g. torch.manual_seed(seed + self.global_rank) in "
            "on_train_start; with num_workers > 0, seed_everything(seed, workers=True)",
        ),
        Rule(
            "dataloader-starving",
            "the step waits for data: time in the train loader's next() above data_wait_threshold (25%) of the "
            "iteration time",
            "Lightning's fetch hooks timed on every rank between checks (each epoch's first 2 batches left out)",
            "two clock reads per batch",
            "more DataLoader workers (num_workers), persistent_workers=True, pin_memory=True on GPUs, or less work "
            "per sample",
        ),
    )
}

RULE_IDS: tuple[str, ...] = tuple(RULES)


def validate_rule_ids(ids: Any, argument: str = "disable") -> frozenset[str]:
    """``ids`` as a set of known rule ids; a clear ``ValueError`` naming ``argument`` otherwise."""
    if isinstance(ids, str):
        ids = [ids]
    try:
        items = list(ids)
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


@dataclass
class Finding:
    """What a rule saw, why it matters and how to fix it."""

    rule: str
    seen: str
    why: str
    fix: str
    step: int = -1
    ranks: list[int] = field(default_factory=list)

    def format(self) -> str:
        where = f" at step {self.step}" if self.step >= 0 else ""
        return f"[{self.rule}]{where}: {self.seen}\n  why: {self.why}\n  fix: {self.fix}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Finding":
        return cls(
            rule=str(data["rule"]),
            seen=str(data["seen"]),
            why=str(data["why"]),
            fix=str(data["fix"]),
            step=int(data.get("step", -1)),
            ranks=[int(r) for r in data.get("ranks", [])],
        )


def merge_local(per_rank: Sequence[Sequence[Mapping[str, Any]]]) -> list[Finding]:
    """Findings each rank made on its own, one per rule: the lowest rank's words, every rank named."""
    merged: dict[str, Finding] = {}
    for rank, findings in enumerate(per_rank):
        for data in findings:
            finding = Finding.from_dict(data)
            if finding.rule in merged:
                merged[finding.rule].ranks.append(rank)
            else:
                finding.ranks = [rank]
                merged[finding.rule] = finding
    for finding in merged.values():
        if len(finding.ranks) == len(per_rank) and len(per_rank) > 1:
            finding.seen += " (on every rank)"
        elif len(per_rank) > 1:
            finding.seen += f" (on rank{'s' if len(finding.ranks) > 1 else ''} {_rank_list(finding.ranks)})"
    return list(merged.values())


def _rank_list(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _names(names: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# --------------------------------------------------------------------------- fingerprints


def fingerprint(obj: Any, max_bytes: int = 1 << 20) -> Optional[str]:
    """A short hash of a batch (tensors, arrays, numbers, strings, nested in lists/dicts).

    Each tensor contributes its shape, dtype and its first ``max_bytes`` bytes. ``None`` when
    nothing in ``obj`` could be hashed (opaque objects): no verdict is better than a wrong one.
    """
    digest = hashlib.blake2b(digest_size=12)
    return digest.hexdigest() if _feed(digest, obj, max_bytes) else None


def _feed(digest: Any, obj: Any, max_bytes: int) -> bool:
    import torch

    if isinstance(obj, torch.Tensor):
        tensor = obj.detach()
        digest.update(f"T{tuple(tensor.shape)}{tensor.dtype}".encode())
        if tensor.is_sparse or tensor.numel() == 0:
            return True
        count = max(1, max_bytes // max(1, tensor.element_size()))
        part = tensor.reshape(-1)[:count]
        if part.device.type != "cpu":
            part = part.cpu()
        digest.update(part.contiguous().view(torch.uint8).numpy().tobytes())
        return True
    if isinstance(obj, (str, bytes, int, float, bool, type(None))):
        digest.update(repr(obj).encode())
        return True
    if isinstance(obj, Mapping):
        seen = False
        for key in sorted(obj, key=str):
            digest.update(repr(key).encode())
            seen = _feed(digest, obj[key], max_bytes) or seen
        return seen
    if isinstance(obj, (list, tuple)):
        digest.update(f"L{len(obj)}".encode())
        seen = False
        for item in obj:
            seen = _feed(digest, item, max_bytes) or seen
        return seen
    tobytes = getattr(obj, "tobytes", None)  # numpy arrays and scalars
    if callable(tobytes) and hasattr(obj, "shape"):
        digest.update(f"A{obj.shape}".encode())
        digest.update(bytes(tobytes())[:max_bytes])
        return True
    return False


def random_state_digest() -> str:
    """A hash of this process's global random states: torch (CPU), numpy (if present) and ``random``."""
    import random

    import torch

    digest = hashlib.blake2b(digest_size=12)
    digest.update(torch.get_rng_state().numpy().tobytes())
    try:
        import numpy

        state = numpy.random.get_state()
        digest.update(state[1].tobytes() + repr(state[2:]).encode())
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        pass
    digest.update(repr(random.getstate()).encode())
    return digest.hexdigest()


# --------------------------------------------------------------------------- checks over gathered data
# Each takes lists indexed by rank and returns a Finding or None.


def check_unused_devices(devices: Sequence[Mapping[str, Any]]) -> Optional[Finding]:
    """``devices[r]``: {"node": hostname, "type": "cuda"|"cpu"|..., "used": int, "cuda_visible": int}."""
    seen_nodes: dict[str, Mapping[str, Any]] = {}
    for info in devices:
        seen_nodes.setdefault(str(info.get("node")), info)
    problems = []
    for node, info in seen_nodes.items():
        visible, used, kind = int(info.get("cuda_visible", 0)), int(info.get("used", 0)), info.get("type")
        if kind != "cuda" and visible > 0:
            problems.append(f"{node}: {visible} GPU(s) visible, but the run trains on {kind} ({used} process(es))")
        elif kind == "cuda" and visible > used:
            problems.append(f"{node}: {visible} GPUs visible, the run uses {used}")
    if not problems:
        return None
    return Finding(
        "unused-devices",
        seen="; ".join(problems),
        why="the idle GPUs add nothing; the same job could run that many times faster",
        fix="Trainer(accelerator='gpu', devices=-1) to use every visible GPU (the global batch grows with it: "
        "adjust the learning rate), or hide the GPUs you leave to others with CUDA_VISIBLE_DEVICES",
    )


def check_dataparallel(wrapped: Sequence[str]) -> Optional[Finding]:
    if not wrapped:
        return None
    return Finding(
        "dataparallel-wrapped",
        seen=f"the LightningModule holds {_names(list(wrapped))}",
        why="nn.DataParallel runs in one process and copies the model to every GPU at every step; under a DDP "
        "strategy each process would do so again over the GPUs it sees (or wrap twice): slow at best, wrong "
        "device placement at worst",
        fix="build the plain module (drop nn.DataParallel(...)/DistributedDataParallel(...)) and let the strategy "
        "replicate it: Trainer(strategy='ddp_tuned', devices=N)",
    )


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
        who = "; ".join(f"ranks {_rank_list(ranks)}" for ranks in shared)
    seen = f"{who} read identical first batches in epoch {epoch}"
    sampler = samplers[shared[0][0]] if samplers else {}
    dist = sampler.get("distributed")
    fix = RULES["data-not-sharded"].fix
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
    return Finding(
        "data-not-sharded",
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
        if before is not None and before == now and not (samplers and samplers[rank].get("fixed_order"))
    ]
    if not repeated:
        return None
    sampler = samplers[repeated[0]] if samplers else {}
    seen = (
        f"epoch {epoch} starts with the same batch as epoch {epoch - 1} on rank{'s' if len(repeated) > 1 else ''} "
        f"{_rank_list(repeated)}; the train sampler is {sampler.get('description', '?')}"
    )
    dist = sampler.get("distributed")
    fix = RULES["sampler-epoch-not-set"].fix
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
    return Finding(
        "sampler-epoch-not-set",
        seen=seen,
        why="every epoch visits the samples in the same order, which loses what shuffling gives (a different "
        "mini-batch mix each epoch) and can slow or bias training",
        fix=fix,
    )


def check_batch_counts(counts: Sequence[float], epoch: int) -> Optional[Finding]:
    finite = [c for c in counts if c is not None and math.isfinite(c)]
    if len(finite) != len(counts) or len(set(finite)) <= 1:
        return None
    low = int(min(finite))
    per_rank = ", ".join(f"rank {r}: {int(c)}" for r, c in enumerate(finite))
    return Finding(
        "uneven-batches",
        seen=f"epoch {epoch} has different numbers of training batches per rank ({per_rank})",
        why=f"after batch {low} the ranks with {low} batches end the epoch while the others wait in the next "
        "gradient all-reduce: the job hangs until the collective timeout (30 minutes by default)",
        fix=RULES["uneven-batches"].fix + f"; or stop every rank at the shortest: Trainer(limit_train_batches={low})",
    )


def check_params(bitsums: Sequence[Sequence[int]], names: Sequence[str], buffers_checked: bool) -> Optional[Finding]:
    """``bitsums[r][i]``: the exact bit-pattern checksum of tensor ``names[i]`` on rank ``r``
    (see ``DistributedDoctor``): equal for bitwise-equal tensors, different for any change."""
    if len(bitsums) < 2 or any(len(s) != len(names) for s in bitsums):
        return None
    differ: list[str] = []
    ranks: set[int] = set()
    for index, name in enumerate(names):
        bad = [r for r in range(1, len(bitsums)) if bitsums[r][index] != bitsums[0][index]]
        if bad:
            differ.append(name)
            ranks.update(bad)
    if not differ:
        return None
    kinds = "parameters" + (" and buffers" if buffers_checked else "")
    return Finding(
        "params-diverged",
        seen=f"{len(differ)} tensor(s) differ between rank 0 and rank(s) {_rank_list(sorted(ranks))}: {_names(differ)}",
        why=f"DDP keeps replicas identical only if every change goes through the averaged gradients; {kinds} that "
        "drifted stay apart for the rest of the run (each rank trains a different model, the checkpoint keeps "
        "rank 0's)",
        fix=RULES["params-diverged"].fix,
    )


def check_unsynced_metrics(values: Sequence[Mapping[str, float]], rtol: float = 1e-6) -> Optional[Finding]:
    if len(values) < 2:
        return None
    common = set(values[0])
    for other in values[1:]:
        common &= set(other)
    differ = []
    for key in sorted(common):
        row = [v[key] for v in values]
        if any(math.isnan(x) for x in row):
            continue
        if max(row) - min(row) > rtol * max(abs(x) for x in row) + 1e-12:
            differ.append(f"{key.split('.', 1)[-1]} ({', '.join(f'{x:.4g}' for x in row)} on ranks 0..{len(row) - 1})")
    if not differ:
        return None
    return Finding(
        "unsynced-logging",
        seen=f"epoch-level metric(s) logged with sync_dist=False differ across ranks: {_names(differ, 3)}",
        why="each rank averages only its own shard and the logger keeps rank 0's value: the curve you read is one "
        "shard's, not the data set's",
        fix=RULES["unsynced-logging"].fix,
    )


def check_random_state(
    augment: Sequence[Mapping[str, Any]], states: Sequence[Optional[str]]
) -> Optional[Finding]:
    """``augment[r]``: {"augments": bool, "how": str, "workers": int, "rank_aware_workers": bool}."""
    if len(states) < 2 or not augment or not all(a.get("augments") for a in augment):
        return None
    if any(s is None for s in states) or len(set(states)) != 1:
        return None
    info = augment[0]
    workers = int(info.get("workers", 0))
    if workers > 0 and info.get("rank_aware_workers"):
        return None
    source = (
        f"the {workers} DataLoader workers per rank start from the same base seed on every rank"
        if workers > 0
        else "the global random states (torch, numpy, random) are identical on every rank"
    )
    fix = (
        "L.seed_everything(seed, workers=True) (Lightning then seeds each worker from its rank), or a "
        "worker_init_fn that mixes in the rank"
        if workers > 0
        else "seed each rank differently once the model is built, e.g. in the LightningModule: def on_train_start(self): "
        "torch.manual_seed(SEED + self.global_rank) (DDP has already made the weights equal)"
    )
    return Finding(
        "same-random-state",
        seen=f"the training data is augmented ({info.get('how', '?')}) and {source}",
        why="each rank applies the same random crops/flips/noise sequence to its samples: the augmentations are "
        "correlated across ranks and the effective variety is that of a single process",
        fix=fix,
    )


def check_data_wait(
    timings: Sequence[Mapping[str, float]], threshold: float, loaders: Sequence[Mapping[str, Any]], min_batches: int = 4
) -> Optional[Finding]:
    """``timings[r]``: {"fetch_s", "iteration_s", "batches"} since the last check."""
    shares = []
    for rank, timing in enumerate(timings):
        if timing.get("batches", 0) >= min_batches and timing.get("iteration_s", 0) > 0:
            shares.append((timing["fetch_s"] / timing["iteration_s"], rank, timing))
    starving = [(share, rank, t) for share, rank, t in shares if share > threshold]
    if not starving:
        return None
    share, rank, timing = max(starving)
    loader = loaders[rank] if loaders else {}
    workers = loader.get("num_workers")
    cpus, local_ranks = loader.get("cpus"), loader.get("local_world_size")
    fix = RULES["dataloader-starving"].fix
    if workers == 0:
        fix = (
            f"num_workers=0: the samples are loaded in the training process, between steps. Use DataLoader("
            f"num_workers={max(1, min(8, (cpus or 2) // max(1, local_ranks or 1) - 1))}, persistent_workers=True"
            f"{', pin_memory=True' if loader.get('cuda') else ''}) ({cpus} CPUs for {local_ranks} rank(s) on this node)"
        )
    elif workers:
        fix = (
            f"the {workers} workers per rank do not keep up: raise num_workers (this node has {cpus} CPUs for "
            f"{local_ranks} rank(s)), set persistent_workers=True{', pin_memory=True' if loader.get('cuda') else ''}, "
            "or make __getitem__ cheaper (decode/resize once, offline)"
        )
    per_batch = 1e3 * timing["fetch_s"] / timing["batches"]
    step = 1e3 * timing["iteration_s"] / timing["batches"]
    return Finding(
        "dataloader-starving",
        seen=f"rank {rank} spent {share:.0%} of its training time waiting for the next batch "
        f"({per_batch:.1f} ms of a {step:.1f} ms iteration, over {int(timing['batches'])} batches; threshold "
        f"{threshold:.0%})",
        why="the devices idle while the loader works: adding devices will not make this run faster",
        fix=fix,
    )


def check_param_usage(
    counts: Sequence[Sequence[int]],
    batches: Sequence[int],
    names: Sequence[str],
    find_unused: bool,
    min_batches: int = 4,
) -> Optional[Finding]:
    """``counts[r][i]``: batches of the window in which parameter ``names[i]`` got a gradient on rank ``r``.
    No verdict on fewer than ``min_batches`` batches: a dynamic graph may skip a branch for a few steps."""
    if not counts or any(len(c) != len(names) for c in counts) or min(batches) < min_batches:
        return None
    never = [name for i, name in enumerate(names) if all(c[i] == 0 for c in counts)]
    if never:
        return Finding(
            "unused-parameters",
            seen=f"{len(never)} parameter(s) got no gradient on any rank in the first {min(batches)} batches: "
            f"{_names(never)}",
            why="they never train, yet DDP (find_unused_parameters=True) searches the autograd graph for them at "
            "every step",
            fix="requires_grad_(False) on them (or remove them) if they are not meant to train; check the forward "
            "pass if they are",
        )
    always = all(c[i] == b for c, b in zip(counts, batches) for i in range(len(names)))
    if find_unused and always:
        return Finding(
            "find-unused-wasted",
            seen=f"find_unused_parameters=True, but every parameter got a gradient in all of the first "
            f"{min(batches)} batches on every rank",
            why="DDP then walks the autograd graph after every forward to look for unused parameters: time spent "
            "for nothing (and it delays the first bucket's all-reduce)",
            fix=RULES["find-unused-wasted"].fix,
        )
    return None


def unused_needed_finding(names: Sequence[str]) -> Finding:
    return Finding(
        "unused-parameters",
        seen=f"{len(names)} parameter(s) got no gradient in the first backward pass, with "
        f"find_unused_parameters=False: {_names(list(names))}",
        # (Not DDP's error text: Lightning rewrites any exception message that contains it.)
        why="DDP waits for a gradient from every parameter: the next step fails (DDP did not finish reducing the "
        "previous step's gradients), and the gradients in their bucket were never averaged across ranks",
        fix=RULES["unused-parameters"].fix,
    )


def check_batchnorm(layers: Sequence[str], batch_size: Optional[int], minimum: int) -> Optional[Finding]:
    if not layers or batch_size is None or batch_size >= minimum:
        return None
    return Finding(
        "batchnorm-without-sync",
        seen=f"{len(layers)} BatchNorm layer(s) ({_names(list(layers), 3)}) normalise over a per-device batch of "
        f"{batch_size} (< {minimum}) without SyncBatchNorm",
        why="each rank normalises with the statistics of its own few samples: noisy statistics, worse accuracy, and "
        "running statistics that differ per rank",
        fix=RULES["batchnorm-without-sync"].fix,
    )


def table_rows() -> list[tuple[str, str, str, str, str]]:
    """(id, catches, detection, cost, fix) per rule, for documentation and ``doctor --rules``."""
    return [(r.id, r.catches, r.detection, r.cost, r.fix) for r in RULES.values()]
