"""What the doctor measures and inspects on the trainer, the model and the train loader.

Each probe reads public state (``trainer.train_dataloader``, ``trainer.strategy``, the loader's
sampler, the global random generators, ...) and returns plain data (:mod:`.protocol`'s types).
What Lightning offers no public way to see goes through ``lightning_mgpu._compat.lightning``;
when that cannot see it either, the probe says so (``None``, ``order_unknown``) and the rule
is reported as not checked rather than as passed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import socket
import time
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Optional

import lightning as L
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler, SequentialSampler

from lightning_mgpu._compat.lightning import (
    epoch_metrics_logged_without_sync,
    sampler_wrapped_for_distribution,
    time_train_fetches,
    trainer_uses_distributed_sampler,
)
from lightning_mgpu._compat.torch import is_batchnorm, is_reentrant_checkpoint_node
from lightning_mgpu.callbacks.doctor.protocol import (
    AugmentInfo,
    DistributedSamplerInfo,
    LoaderInfo,
    SamplerInfo,
    SetupInfo,
    Timing,
)

__all__ = [
    "DataWaitClock",
    "batch_size_of",
    "batchnorm_layers",
    "cuda_device_count",
    "describe_loader",
    "describe_sampler",
    "fingerprint",
    "observe_setup",
    "probe_augmentation",
    "random_state_digest",
    "reentrant_checkpoints",
    "train_loader",
    "unsynced_metric_values",
    "worker_seed_source_digest",
    "wrapped_modules",
]

EPOCH_EDGE_BATCHES = 2
"""Each epoch's first batches wait for the loader's workers to start: not timed."""


def cuda_device_count() -> int:
    """GPUs this process can see (a module-level function so tests can stand in for a GPU machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# --------------------------------------------------------------------------- fit start


def observe_setup(trainer: L.Trainer, pl_module: L.LightningModule) -> SetupInfo:
    """What this rank sees at fit start: devices, wrappers, the train loader, augmentation, BatchNorm."""
    loader = train_loader(trainer)
    return SetupInfo(
        devices={
            "node": socket.gethostname(),
            "type": trainer.strategy.root_device.type,
            "used": len(trainer.device_ids),
            "cuda_visible": cuda_device_count(),
        },
        wrapped=wrapped_modules(pl_module),
        loader=describe_loader(loader, trainer),
        augment=probe_augmentation(loader) if loader is not None else {"augments": False},
        batchnorm=batchnorm_layers(pl_module),
    )


def train_loader(trainer: L.Trainer) -> Optional[DataLoader[Any]]:
    """The first ``DataLoader`` among the fit's train loaders (as Lightning uses them: samplers replaced)."""

    def walk(item: Any) -> Iterator[Any]:
        if isinstance(item, DataLoader):
            yield item
        elif isinstance(item, Mapping):
            for value in item.values():
                yield from walk(value)
        elif isinstance(item, (list, tuple)):
            for value in item:
                yield from walk(value)

    return next(walk(trainer.train_dataloader), None)


def wrapped_modules(pl_module: nn.Module) -> list[str]:
    found = []
    for name, module in pl_module.named_modules():
        if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            found.append(f"{type(module).__name__} at '{name or 'self'}'")
    return found


def batchnorm_layers(pl_module: nn.Module) -> list[str]:
    """BatchNorm layers (not SyncBatchNorm) in training mode."""
    return [
        name
        for name, module in pl_module.named_modules()
        if is_batchnorm(module) and not isinstance(module, nn.SyncBatchNorm) and module.training
    ]


def describe_loader(loader: Optional[DataLoader[Any]], trainer: L.Trainer) -> LoaderInfo:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return {
        "num_workers": int(getattr(loader, "num_workers", 0) or 0),
        "cpus": cpus,
        "local_world_size": max(1, trainer.world_size // max(1, trainer.num_nodes)),  # processes on this node
        "cuda": trainer.strategy.root_device.type == "cuda",
    }


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


def probe_augmentation(loader: DataLoader[Any]) -> AugmentInfo:
    """Does reading a sample draw random numbers from the global generators?

    With ``num_workers=0``: ``dataset[0]`` three times, under seeds (1, 1, 2), with the global
    random states saved and restored around it. Same result under the same seed but a
    different one under another seed: the dataset augments with the global generators.
    With workers, reading in this process could open files before the workers fork, so
    only the presence of a ``transform``-like attribute is taken as a sign.
    """
    from lightning.fabric.utilities.seed import pl_worker_init_function

    workers = int(getattr(loader, "num_workers", 0) or 0)
    init_fn = getattr(loader, "worker_init_fn", None)
    rank_aware = getattr(init_fn, "func", init_fn) is pl_worker_init_function
    info: AugmentInfo = {"augments": False, "how": "", "workers": workers, "rank_aware_workers": rank_aware}
    dataset = getattr(loader, "dataset", None)
    if dataset is None or isinstance(dataset, IterableDataset):
        return info
    if workers > 0:
        inner = dataset
        for _ in range(4):  # Subset / ConcatDataset-like wrappers
            for attribute in ("transform", "transforms", "augment", "augmentation", "augmentations"):
                if getattr(inner, attribute, None) is not None:
                    info["augments"], info["how"] = True, f"the dataset has .{attribute}"
                    return info
            inner = getattr(inner, "dataset", None)
            if inner is None:
                break
        return info
    try:
        if len(dataset) == 0:
            return info
    except TypeError:
        return info
    with _saved_random_state():
        try:
            samples = []
            for seed in (1, 1, 2):
                _seed_all(seed)
                samples.append(fingerprint(dataset[0]))
        except Exception:  # noqa: BLE001 - a dataset that cannot be read out of its loader: no verdict
            return info
    if None not in samples and samples[0] == samples[1] != samples[2]:
        info["augments"], info["how"] = True, "dataset[0] changes with the global random seed"
    return info


def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(seed)


@contextlib.contextmanager
def _saved_random_state() -> Iterator[None]:
    python_state = random.getstate()
    torch_state = torch.get_rng_state()
    numpy_state = None
    with contextlib.suppress(ImportError):
        import numpy

        numpy_state = numpy.random.get_state()
    try:
        yield
    finally:
        random.setstate(python_state)
        torch.set_rng_state(torch_state)
        if numpy_state is not None:
            import numpy

            numpy.random.set_state(numpy_state)


# --------------------------------------------------------------------------- random state


def random_state_digest() -> str:
    """A hash of this process's global random states: torch (CPU), numpy (if present) and ``random``."""
    digest = hashlib.blake2b(digest_size=12)
    digest.update(torch.get_rng_state().numpy().tobytes())
    try:
        import numpy

        state = numpy.random.get_state()
        digest.update(state[1].tobytes() + repr(state[2:]).encode())  # type: ignore[index]  # a tuple at run time
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        pass
    digest.update(repr(random.getstate()).encode())
    return digest.hexdigest()


def worker_seed_source_digest(loader: DataLoader[Any]) -> str:
    """A hash of the generator the loader's workers' base seed is drawn from: the loader's own, else torch's
    global CPU generator.

    Called at fit start, after Lightning made the first epoch's iterator (which drew the base seed)
    and before the LightningModule's ``on_train_start``: equal states on two ranks mean equal base
    seeds, so equal worker seeds (worker seed = base seed + worker id).
    """
    generator = getattr(loader, "generator", None)
    state = generator.get_state() if isinstance(generator, torch.Generator) else torch.get_rng_state()
    return "worker-seed-source:" + hashlib.blake2b(state.numpy().tobytes(), digest_size=12).hexdigest()


# --------------------------------------------------------------------------- batches


def fingerprint(obj: Any, max_bytes: int = 1 << 20) -> Optional[str]:
    """A short hash of a batch (tensors, arrays, numbers, strings, nested in lists/dicts).

    Each tensor contributes its shape, dtype and its first ``max_bytes`` bytes. ``None`` when
    nothing in ``obj`` could be hashed (opaque objects): no verdict is better than a wrong one.
    """
    digest = hashlib.blake2b(digest_size=12)
    return digest.hexdigest() if _feed(digest, obj, max_bytes) else None


def _feed(digest: Any, obj: Any, max_bytes: int) -> bool:
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


def batch_size_of(batch: Any) -> Optional[int]:
    """The batch's size as Lightning infers it; None for an opaque batch (no verdict)."""
    from lightning.pytorch.utilities.data import extract_batch_size

    try:
        return int(extract_batch_size(batch))
    except Exception:  # noqa: BLE001 - an opaque batch: no verdict
        return None


# --------------------------------------------------------------------------- the first loss's graph


def reentrant_checkpoints(output: Any) -> int:
    """Reentrant checkpoint regions (``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``, and what
    calls it: ``checkpoint_sequential``, Hugging Face's gradient checkpointing) in the autograd graph that
    produced ``output`` (a tensor, or tensors nested in lists/tuples/dicts).

    The graph itself, not the call: it finds the regions however ``checkpoint`` was imported or wrapped.
    A region whose inputs need no gradient is not in the graph (it gives its parameters no gradient either).
    """
    roots = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
    seen: dict[int, Any] = {}  # the nodes themselves kept: a freed node's id may come back for another
    found = 0
    while roots:
        node = roots.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        if is_reentrant_checkpoint_node(node):
            found += 1
        roots.extend(child for child, _ in node.next_functions if child is not None)
    return found


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


# --------------------------------------------------------------------------- logged metrics


def unsynced_metric_values(trainer: L.Trainer) -> Optional[dict[str, float]]:
    """This rank's current value of every tensor metric logged with on_epoch=True and sync_dist=False
    (the mean so far for mean reductions); None when this Lightning does not let us see them."""
    return epoch_metrics_logged_without_sync(trainer)


# --------------------------------------------------------------------------- data-loading time


class DataWaitClock:
    """Time in the train loader's ``next()`` against whole iterations, between two :meth:`take` calls.

    Fed by the fetch timing Lightning's epoch loop offers (``_compat``) and the callback's
    ``on_train_batch_start``; each epoch's first :data:`EPOCH_EDGE_BATCHES` batches are left out.
    """

    def __init__(self) -> None:
        self._undo: Optional[Callable[[], None]] = None
        self._reset()

    def _reset(self) -> None:
        self._last_fetch_s = 0.0
        self._last_batch_start: Optional[float] = None
        self._fetch_s = 0.0
        self._iteration_s = 0.0
        self._batches = 0

    def attach(self, trainer: L.Trainer) -> bool:
        """Start timing this fit's fetches, from zero; False when this Lightning offers no way to (not checked)."""
        self.detach()
        self._reset()
        self._undo = time_train_fetches(trainer, self._on_fetched)
        return self._undo is not None

    @property
    def attached(self) -> bool:
        return self._undo is not None

    def detach(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None

    def _on_fetched(self, seconds: float) -> None:
        self._last_fetch_s = seconds

    def epoch_start(self) -> None:
        self._last_batch_start = None

    def batch_start(self, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last_batch_start is not None and batch_idx >= EPOCH_EDGE_BATCHES:
            self._iteration_s += now - self._last_batch_start
            self._fetch_s += self._last_fetch_s
            self._batches += 1
        self._last_batch_start = now
        self._last_fetch_s = 0.0

    def take(self) -> Timing:
        """The time since the last call, and start afresh."""
        timing: Timing = {"fetch_s": self._fetch_s, "iteration_s": self._iteration_s, "batches": self._batches}
        self._fetch_s = self._iteration_s = 0.0
        self._batches = 0
        return timing
