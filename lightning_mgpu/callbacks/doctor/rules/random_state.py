"""``same-random-state``: identical random state on every rank while the data is augmented."""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Optional, TypedDict

import lightning as L
import numpy
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_mgpu.callbacks.doctor.findings import Finding
from lightning_mgpu.callbacks.doctor.probes import fingerprint, train_loader
from lightning_mgpu.callbacks.doctor.rule import Check, CheckKind, Rule, Watch

RULE = Rule(
    "same-random-state",
    catches="identical random state on every rank while the data is augmented: every rank draws the same augmentation",
    detection="augmentation: dataset[0] read under two seeds differs (num_workers=0) or the dataset has a "
    "transform (workers); identical: the global random states at the first batch (with workers: the "
    "generator the workers' base seed is drawn from, at fit start) hash the same on every rank",
    cost="three reads of dataset[0] at fit start (random state restored), one hash",
    fix="seed each rank differently once the model is built, e.g. torch.manual_seed(seed + self.global_rank) "
    "in on_train_start; with num_workers > 0, seed_everything(seed, workers=True)",
    severity="wrong",
)


class AugmentInfo(TypedDict, total=False):
    """Does the training data draw random numbers (see :func:`probe_augmentation`)? ``rank_aware_workers``:
    the loader's workers are seeded from their rank (``seed_everything(workers=True)``)."""

    augments: bool
    how: str
    workers: int
    rank_aware_workers: bool


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
    numpy.random.seed(seed)


@contextlib.contextmanager
def _saved_random_state() -> Iterator[None]:
    python_state, numpy_state = random.getstate(), numpy.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(python_state)
        numpy.random.set_state(numpy_state)


def random_state_digest() -> str:
    """A hash of this process's global random states: torch (CPU), numpy and ``random``."""
    digest = hashlib.blake2b(digest_size=12)
    digest.update(torch.get_rng_state().numpy().tobytes())
    state = numpy.random.get_state()
    digest.update(state[1].tobytes() + repr(state[2:]).encode())  # type: ignore[index]  # a tuple at run time
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
    return RULE.finding(
        seen=f"the training data is augmented ({info.get('how', '?')}) and {source}",
        why="each rank applies the same random crops/flips/noise sequence to its samples: the augmentations are "
        "correlated across ranks and the effective variety is that of a single process",
        fix=fix,
    )


class SameRandomState(Watch):
    """Sends this rank's random-state hash once, with the check after the fit's first batch."""

    rules = (RULE,)

    def reset(self) -> None:
        super().reset()
        self.state: Optional[str] = None
        self.ready = False
        """The hash is taken (the fit's first batch has started)."""
        self.sent = False
        """Every rank sent its hash in this fit."""

    def start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loader = train_loader(trainer)
        self.setup: AugmentInfo = probe_augmentation(loader) if loader is not None else {"augments": False}
        if loader is not None and self.setup.get("workers", 0) > 0:
            # Lightning made the first epoch's iterator (its workers' base seed drawn) before this hook,
            # and the LightningModule's on_train_start (where a rank may reseed) runs after it.
            self.state = worker_seed_source_digest(loader)

    def first_batch(self, batch: Any) -> None:
        if self.setup.get("workers", 0) == 0:
            self.state = random_state_digest()
        self.ready = True

    def report(self, trainer: L.Trainer, kind: CheckKind) -> Any:
        return (self.state,) if self.ready and not self.sent else None

    def judge(self, reports: list[Any], check: Check) -> Iterable[Optional[Finding]]:
        if reports[0] is None:
            return
        self.sent = True
        if len(reports) > 1 and self.setups:
            yield check_random_state(self.setups, [state for (state,) in reports])
