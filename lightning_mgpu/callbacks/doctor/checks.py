"""The doctor's checks: pure functions from what the ranks exchanged to findings, and which check judges what.

The functions ``check_*`` take lists indexed by rank and return a :class:`~.findings.Finding` or
None; they are tested with plain lists, no Trainer, no processes. :data:`CHECKS` binds them to
the typed :class:`~.protocol.Snapshot` and :func:`evaluate` runs them all: every rank evaluates
the same snapshot and reaches the same verdict. No torch import here.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

from lightning_mgpu.callbacks.doctor.findings import Finding, merge_local, name_list, rank_list
from lightning_mgpu.callbacks.doctor.protocol import Snapshot, Timing
from lightning_mgpu.callbacks.doctor.rules import RULES

__all__ = [
    "CHECKS",
    "LOCAL_RULES",
    "Check",
    "check_batch_counts",
    "check_batchnorm",
    "check_data_not_sharded",
    "check_data_wait",
    "check_dataparallel",
    "check_epoch_order",
    "check_param_usage",
    "check_params",
    "check_random_state",
    "check_unsynced_metrics",
    "check_unused_devices",
    "evaluate",
    "reentrant_checkpoint_finding",
    "unused_needed_finding",
]

# --------------------------------------------------------------------------- checks over per-rank data
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
        seen=f"the LightningModule holds {name_list(list(wrapped))}",
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
        who = "; ".join(f"ranks {rank_list(ranks)}" for ranks in shared)
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


def check_batch_counts(counts: Sequence[float], epoch: int, batches_left: float = math.inf) -> Optional[Finding]:
    """``counts[r]``: rank ``r``'s training batches this epoch (inf: unknown); ``batches_left``: batches until
    the fit ends (``max_steps``), inf without a limit. Fatal only when the fit would run past the shortest
    rank's last batch."""
    finite = [c for c in counts if c is not None and math.isfinite(c)]
    if len(finite) != len(counts) or len(set(finite)) <= 1:
        return None
    low = int(min(finite))
    per_rank = ", ".join(f"rank {r}: {int(c)}" for r, c in enumerate(finite))
    fix = RULES["uneven-batches"].fix + f"; or stop every rank at the shortest: Trainer(limit_train_batches={low})"
    seen = f"epoch {epoch} has different numbers of training batches per rank ({per_rank})"
    if batches_left <= low:
        return Finding(
            "uneven-batches",
            seen=seen + f"; this fit ends (max_steps) after {int(batches_left)} more batch(es), before the shortest "
            "rank runs out",
            why="this run ends before the ranks fall out of step, but a longer one (more steps, another epoch) hangs "
            "or fails at the shortest rank's last batch",
            fix=fix,
            severity="wrong",  # not this run's crash: it goes on
        )
    return Finding(
        "uneven-batches",
        seen=seen,
        why=f"after batch {low} the ranks with {low} batches end the epoch while the others run one more step: "
        "from then on the ranks' collectives no longer pair up, and the job hangs until the collective timeout "
        "(30 minutes by default) or fails when a rank exits",
        fix=fix,
    )


def check_params(
    bitsums: Sequence[Sequence[int]], names: Sequence[str], buffers_checked: bool, unreduced: Sequence[str] = ()
) -> Optional[Finding]:
    """``bitsums[r][i]``: the exact bit-pattern checksum of tensor ``names[i]`` on rank ``r``
    (see ``DistributedDoctor``): equal for bitwise-equal tensors, different for any change.
    ``unreduced``: parameters that got no gradient under ``find_unused_parameters=False``; DDP then did
    not all-reduce their buckets, which explains the divergence (the finding says so, with that fix)."""
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
    seen = f"{len(differ)} tensor(s) differ between rank 0 and rank(s) {rank_list(sorted(ranks))}: {name_list(differ)}"
    if unreduced:
        # DDP launches a bucket's all-reduce once every parameter in it has its gradient: a parameter that gets
        # none holds its whole bucket back, and at the end of that backward the bucket's gradients stay local.
        return Finding(
            "params-diverged",
            seen=seen + f"; they follow from unused-parameters: {len(unreduced)} parameter(s) got no gradient with "
            f"find_unused_parameters=False ({name_list(list(unreduced))})",
            why="DDP all-reduces a bucket only once every parameter in it has a gradient: the buckets holding "
            "those parameters were never averaged, so every parameter sharing them stepped with its own rank's "
            "gradient, and the replicas drifted apart",
            fix="fix the unused parameters and this goes with them: " + RULES["unused-parameters"].fix,
        )
    kinds = "parameters" + (" and buffers" if buffers_checked else "")
    return Finding(
        "params-diverged",
        seen=seen,
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
        seen=f"epoch-level metric(s) logged with sync_dist=False differ across ranks: {name_list(differ, 3)}",
        why="each rank averages only its own shard and the logger keeps rank 0's value: the curve you read is one "
        "shard's, not the data set's",
        fix=RULES["unsynced-logging"].fix,
    )


def check_random_state(augment: Sequence[Mapping[str, Any]], states: Sequence[Optional[str]]) -> Optional[Finding]:
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
    timings: Sequence[Timing], threshold: float, loaders: Sequence[Mapping[str, Any]], min_batches: int = 4
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
            f"{name_list(never)}",
            why="they never train, yet DDP (find_unused_parameters=True) searches the autograd graph for them at "
            "every step",
            fix="requires_grad_(False) on them (or remove them) if they are not meant to train; check the forward "
            "pass if they are",
            severity="wrong",  # DDP copes (find_unused_parameters=True): the run goes on, without them training
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
        f"find_unused_parameters=False: {name_list(list(names))}",
        # (Not DDP's error text: Lightning rewrites any exception message that contains it.)
        why="DDP waits for a gradient from every parameter: the next step fails (DDP did not finish reducing the "
        "previous step's gradients), and the gradients in their bucket were never averaged across ranks",
        fix=RULES["unused-parameters"].fix,
    )


def reentrant_checkpoint_finding(regions: int) -> Finding:
    return Finding(
        "reentrant-checkpoint",
        seen=f"the first loss's autograd graph holds {regions} reentrant checkpoint region(s) "
        "(torch.utils.checkpoint with use_reentrant=True), and DDP has find_unused_parameters=True without a "
        "static graph",
        why="a reentrant checkpoint runs its region without a graph and recomputes it during backward: DDP's search "
        "for unused parameters after the forward misses the region's parameters and marks them ready, then their "
        "gradients arrive in the backward and DDP stops with an error at the first backward",
        fix=RULES["reentrant-checkpoint"].fix,
    )


def check_batchnorm(layers: Sequence[str], batch_size: Optional[int], minimum: int) -> Optional[Finding]:
    if not layers or batch_size is None or batch_size >= minimum:
        return None
    return Finding(
        "batchnorm-without-sync",
        seen=f"{len(layers)} BatchNorm layer(s) ({name_list(list(layers), 3)}) normalise over a per-device batch of "
        f"{batch_size} (< {minimum}) without SyncBatchNorm",
        why="each rank normalises with the statistics of its own few samples: noisy statistics, worse accuracy, and "
        "running statistics that differ per rank",
        fix=RULES["batchnorm-without-sync"].fix,
    )


# --------------------------------------------------------------------------- the typed protocol


@dataclass(frozen=True)
class Check:
    """One check over a snapshot: the rules it may report, and the function (None entries: nothing found)."""

    rules: tuple[str, ...]
    run: Callable[[Snapshot], Iterable[Optional[Finding]]]


def _devices(s: Snapshot) -> Iterable[Optional[Finding]]:
    if s.setups:
        yield check_unused_devices([setup.devices for setup in s.setups])


def _dataparallel(s: Snapshot) -> Iterable[Optional[Finding]]:
    if s.setups:
        yield check_dataparallel(s.setups[0].wrapped)


def _batch_counts(s: Snapshot) -> Iterable[Optional[Finding]]:
    if s.batch_counts is not None:
        yield check_batch_counts(s.batch_counts, s.epoch, s.batches_left)


def _first_batches(s: Snapshot) -> Iterable[Optional[Finding]]:
    for batches in s.first_batches:
        yield check_data_not_sharded(batches.digests, s.samplers, batches.epoch)
        if batches.previous is not None:
            yield check_epoch_order(batches.previous, batches.digests, s.samplers, batches.epoch)


def _random_state(s: Snapshot) -> Iterable[Optional[Finding]]:
    if s.random_states is not None and s.world_size > 1 and s.augment:
        yield check_random_state(s.augment, s.random_states)


def _params(s: Snapshot) -> Iterable[Optional[Finding]]:
    if s.param_sums is not None and s.world_size > 1:
        yield check_params(s.param_sums, s.tensor_names, s.buffers_checked, s.unreduced)


def _metrics(s: Snapshot) -> Iterable[Optional[Finding]]:
    if s.metrics is not None and s.world_size > 1:
        yield check_unsynced_metrics(s.metrics)


def _data_wait(s: Snapshot) -> Iterable[Optional[Finding]]:
    if s.timings is not None:
        yield check_data_wait(s.timings, s.data_wait_threshold, s.loaders)


def _usage(s: Snapshot) -> Iterable[Optional[Finding]]:
    if s.usage is not None:
        yield check_param_usage(s.usage.counts, s.usage.batches, s.usage.names, s.usage.find_unused)


CHECKS: tuple[Check, ...] = (
    Check(("unused-devices",), _devices),
    Check(("dataparallel-wrapped",), _dataparallel),
    Check(("uneven-batches",), _batch_counts),
    Check(("data-not-sharded", "sampler-epoch-not-set"), _first_batches),
    Check(("same-random-state",), _random_state),
    Check(("params-diverged",), _params),
    Check(("unsynced-logging",), _metrics),
    Check(("dataloader-starving",), _data_wait),
    Check(("unused-parameters", "find-unused-wasted"), _usage),
)
"""In the order their findings are reported within one check."""

LOCAL_RULES: frozenset[str] = frozenset({"batchnorm-without-sync", "unused-parameters", "reentrant-checkpoint"})
"""Rules a rank judges on its own (the findings arrive in ``Snapshot.local_findings``)."""


def evaluate(snapshot: Snapshot, disabled: Collection[str] = ()) -> list[Finding]:
    """Every finding the snapshot shows, rules in ``disabled`` left out: the ranks' own findings
    first (merged, one per rule), then each of :data:`CHECKS` in order."""
    found = [f for f in merge_local(snapshot.local_findings) if f.rule not in disabled]
    for check in CHECKS:
        if all(rule in disabled for rule in check.rules):
            continue
        found.extend(f for f in check.run(snapshot) if f is not None and f.rule not in disabled)
    return found
