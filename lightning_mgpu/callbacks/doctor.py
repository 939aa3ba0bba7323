"""``DistributedDoctor``: catches the classic multi-GPU mistakes while the run trains.

Each rule has a stable id (see :data:`RULES` and the table in the README); a finding says
what was seen, why it matters and how to fix it. With ``strict=False`` findings are
warnings (``DistributedDoctorWarning``, from rank 0); with ``strict=True`` every rank
raises :class:`DistributedDoctorError` at the same check, naming the rule(s), and the run
stops on all ranks together.

How it stays cheap and hang-free:

* Ranks compare notes only at *checks*: at every epoch start and end, after each epoch's first
  batch, after the first batch of the fit and every ``every_n_steps`` batches, at the end of
  each validation and at the end of training. A check is one ``all_gather_object`` that
  every rank enters (never inside rank-zero-only code); everything else is local and costs
  a few clock reads per batch. Every rank evaluates the same gathered data, so all reach
  the same verdict and, in strict mode, raise at the same point.
* Which observations a check carries is decided from state every rank shares (batch
  counter, epoch, configuration), so the collectives always line up.

Checkpoints: ``state_dict`` keeps what the ranks have agreed on: batch counter, checks run,
rules already reported, findings, the last epochs' batch fingerprints and the
parameter-use counts of every rank. Every check exchanges all that is pending, so a
checkpoint saved at an epoch end, a validation end (ModelCheckpoint's places) or a check
resumes exactly as the uninterrupted run goes on. From anywhere else, what the ranks saw
since the last check (data-loading times, parameter use) is not in the checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import time
from collections.abc import Iterable
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_mgpu.callbacks import _doctor_rules as rules
from lightning_mgpu.callbacks._doctor_rules import RULE_IDS, RULES, Finding

__all__ = ["DistributedDoctor", "DistributedDoctorError", "DistributedDoctorWarning", "RULES", "RULE_IDS"]

_STATE_VERSION = 1
_EPOCH_EDGE_BATCHES = 2  # each epoch's first batches wait for workers to start: not timed
_MIN_USE_WINDOW = 8  # batches watched for parameter use, at least (a dynamic graph may skip a branch a while)


class DistributedDoctorWarning(UserWarning):
    """A DistributedDoctor finding (``strict=False``)."""


class DistributedDoctorError(RuntimeError):
    """Raised on every rank at the same check when ``strict=True`` and a rule fires."""

    def __init__(self, findings: list[Finding]) -> None:
        self.findings = findings
        self.rules = [f.rule for f in findings]
        body = "\n".join(f.format() for f in findings)
        super().__init__(
            f"DistributedDoctor(strict=True) stopped the run on every rank: {', '.join(self.rules)}\n{body}\n"
            f"(turn a rule off with DistributedDoctor(disable=[...]) if this run is meant to be that way)"
        )

    def __reduce__(self) -> tuple[Any, tuple[list[Finding]]]:
        return type(self), (self.findings,)  # survives pickling (spawned processes, multiprocessing queues)


def _cuda_device_count() -> int:
    """GPUs this process can see (a module-level function so tests can stand in for a GPU machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class DistributedDoctor(L.Callback):
    """Check a distributed run for the classic multi-GPU mistakes while it trains.

    Args:
        strict: raise :class:`DistributedDoctorError` on every rank (stopping the run) instead of
            warning, when a rule fires.
        every_n_steps: training batches between two periodic checks (parameter checksums,
            metrics, data-loading time). Checks also run after the first batch, at every epoch
            start, after each epoch's first batch, at the end of each validation and of training.
            With ``find_unused_parameters=True`` parameter use is watched over the first
            ``max(every_n_steps, 8)`` batches.
        disable: rule ids to switch off (see :data:`RULE_IDS`).
        data_wait_threshold: share of the iteration time spent waiting for the next batch above
            which ``dataloader-starving`` fires (0 < value < 1).
        batchnorm_min_batch: per-device batch below which BatchNorm without SyncBatchNorm is
            reported.

    Attributes:
        findings: every :class:`Finding` reported so far, in order (the same on every rank).
    """

    def __init__(
        self,
        strict: bool = False,
        every_n_steps: int = 100,
        *,
        disable: Iterable[str] = (),
        data_wait_threshold: float = 0.25,
        batchnorm_min_batch: int = 16,
    ) -> None:
        if not isinstance(strict, bool):
            raise ValueError(f"DistributedDoctor: strict must be True or False, got {strict!r}")
        for name, value, minimum in (("every_n_steps", every_n_steps, 1), ("batchnorm_min_batch", batchnorm_min_batch, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"DistributedDoctor: {name} must be an integer >= {minimum}, got {value!r}")
        if (
            isinstance(data_wait_threshold, bool)
            or not isinstance(data_wait_threshold, (int, float))
            or not 0 < data_wait_threshold < 1
        ):
            raise ValueError(
                f"DistributedDoctor: data_wait_threshold must be a number between 0 and 1 (a share of the iteration "
                f"time, e.g. 0.25), got {data_wait_threshold!r}"
            )
        self.strict = strict
        self.every_n_steps = every_n_steps
        self.disabled = rules.validate_rule_ids(disable)
        self.data_wait_threshold = float(data_wait_threshold)
        self.batchnorm_min_batch = batchnorm_min_batch
        self._use_window = max(every_n_steps, _MIN_USE_WINDOW)
        self.findings: list[Finding] = []
        self._reset_agreed_state()
        self._reset_local_state()

    def enabled(self, rule: str) -> bool:
        return rule not in self.disabled

    # ------------------------------------------------------------------ state

    def _reset_agreed_state(self) -> None:
        """What every rank holds identically (exchanged): checkpointed."""
        self.findings = []
        self._batches_seen = 0
        self._checks = 0
        self._reported: set[str] = set()
        self._epoch_digests: dict[int, list[Optional[str]]] = {}  # epoch -> first-batch digest per rank
        # parameter use over the window, per rank: batches that gave each parameter a gradient, and batches
        self._use_counts: list[list[int]] = []
        self._use_batches: list[int] = []

    def _reset_local_state(self) -> None:
        """This rank's observations since the last check: not checkpointed."""
        self._fitting = False
        self._world_size = 1
        self._setup_info: Optional[dict[str, Any]] = None
        self._setup_sent = False
        self._local_findings: list[dict[str, Any]] = []
        self._pending_digests: dict[int, Optional[str]] = {}
        self._first_batch_seen = False
        self._random_sent = False
        self._random_state: Optional[str] = None
        self._epoch_batch_limit: Optional[float] = None
        self._samplers: list[dict[str, Any]] = []
        # timing
        self._fetch_start: Optional[float] = None
        self._last_fetch_s = 0.0
        self._last_batch_start: Optional[float] = None
        self._fetch_s = 0.0
        self._iteration_s = 0.0
        self._timed_batches = 0
        self._patched_fetch: Optional[Any] = None
        # parameter use
        self._ddp_flags: dict[str, bool] = {}
        self._param_names: list[str] = []
        self._params: list[nn.Parameter] = []
        self._module: Optional[nn.Module] = None
        self._buffer_names: list[str] = []
        self._gathered_setup: list[dict[str, Any]] = []
        self._used_counts: list[int] = []  # since the last check (then added to the agreed totals)
        self._used_now: set[int] = set()
        self._window_batches = 0
        self._window_done = False
        self._hooks: list[Any] = []
        self._grad_none_checked = False

    @override
    def state_dict(self) -> dict[str, Any]:
        # Plain types only: checkpoints load with weights_only=True.
        return {
            "version": _STATE_VERSION,
            "batches_seen": self._batches_seen,
            "checks": self._checks,
            "reported": sorted(self._reported),
            "findings": [f.as_dict() for f in self.findings],
            "epoch_digests": {str(epoch): list(digests) for epoch, digests in self._epoch_digests.items()},
            "use_counts": [list(c) for c in self._use_counts],
            "use_batches": list(self._use_batches),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        version = state_dict.get("version")
        if version != _STATE_VERSION:
            rank_zero_warn(f"DistributedDoctor: checkpoint state version {version!r} unknown; starting afresh.")
            return
        self._batches_seen = int(state_dict["batches_seen"])
        self._checks = int(state_dict["checks"])
        self._reported = set(state_dict["reported"])
        self.findings = [Finding.from_dict(f) for f in state_dict["findings"]]
        self._epoch_digests = {int(epoch): list(d) for epoch, d in state_dict["epoch_digests"].items()}
        self._use_counts = [[int(v) for v in c] for c in state_dict.get("use_counts", [])]
        self._use_batches = [int(v) for v in state_dict.get("use_batches", [])]

    # ------------------------------------------------------------------ setup

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # Checkpoint state (if resuming) is loaded after setup: start from a clean slate here.
        self._remove_hooks()
        self._reset_agreed_state()
        self._reset_local_state()

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._fitting = True
        self._world_size = trainer.world_size
        self._setup_info = self._observe_setup(trainer, pl_module)
        self._patch_fetch_timing(trainer)
        self._setup_param_probe(trainer, pl_module)

    def _observe_setup(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        loader = _train_loader(trainer)
        return {
            "devices": {
                "node": socket.gethostname(),
                "type": trainer.strategy.root_device.type,
                "used": len(trainer.device_ids),
                "cuda_visible": _cuda_device_count(),
            },
            "wrapped": _wrapped_modules(pl_module),
            "loader": _describe_loader(loader, trainer),
            "augment": _probe_augmentation(loader) if loader is not None else {"augments": False},
            "batchnorm": [
                name
                for name, module in pl_module.named_modules()
                if isinstance(module, nn.modules.batchnorm._BatchNorm)
                and not isinstance(module, nn.SyncBatchNorm)
                and module.training
            ],
        }

    # ------------------------------------------------------------------ data-loading time

    def _patch_fetch_timing(self, trainer: L.Trainer) -> None:
        # Lightning's epoch loop times `next(train_loader)` through these two methods (for its
        # profiler); the instance attributes shadow them, and are removed again at the end.
        epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        before = getattr(epoch_loop, "_on_before_fetch", None)
        after = getattr(epoch_loop, "_on_after_fetch", None)
        if epoch_loop is None or not callable(before) or not callable(after):
            return

        def on_before_fetch() -> None:
            self._fetch_start = time.perf_counter()
            before()

        def on_after_fetch() -> None:
            after()
            if self._fetch_start is not None:
                self._last_fetch_s = time.perf_counter() - self._fetch_start
                self._fetch_start = None

        epoch_loop._on_before_fetch = on_before_fetch
        epoch_loop._on_after_fetch = on_after_fetch
        self._patched_fetch = epoch_loop

    def _unpatch_fetch_timing(self) -> None:
        if self._patched_fetch is not None:
            for name in ("_on_before_fetch", "_on_after_fetch"):
                self._patched_fetch.__dict__.pop(name, None)
            self._patched_fetch = None

    # ------------------------------------------------------------------ parameter use

    def _setup_param_probe(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = trainer.strategy.model
        if not isinstance(model, nn.parallel.DistributedDataParallel):
            return
        self._ddp_flags = {
            "find_unused": bool(model.find_unused_parameters),
            "static_graph": bool(getattr(model, "static_graph", False)),
            "broadcast_buffers": bool(getattr(model, "broadcast_buffers", True)),
        }
        named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
        self._param_names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._module = pl_module
        if not self._ddp_flags["broadcast_buffers"]:
            # DDP leaves buffers (BatchNorm's running statistics, ...) to each rank: compare them too.
            self._buffer_names = [n for n, b in pl_module.named_buffers() if b.is_floating_point()]
        in_window = self._batches_seen < self._use_window
        wanted = self.enabled("unused-parameters") or self.enabled("find-unused-wasted")
        if in_window and wanted and self._ddp_flags["find_unused"] and not self._ddp_flags["static_graph"]:
            # Local use, whatever other ranks did: .grad alone would show the all-reduced result.
            self._used_counts = [0] * len(self._params)
            for index, param in enumerate(self._params):
                self._hooks.append(param.register_post_accumulate_grad_hook(lambda _p, i=index: self._used_now.add(i)))

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._hooks:
            self._window_batches += 1
            for index in self._used_now:
                self._used_counts[index] += 1
            self._used_now = set()
        elif (
            not self._grad_none_checked
            and self._ddp_flags
            and not self._ddp_flags["find_unused"]
            and not self._ddp_flags["static_graph"]
            and self.enabled("unused-parameters")
        ):
            self._grad_none_checked = True
            missing = [name for name, p in zip(self._param_names, self._params) if p.grad is None]
            if missing:
                self._local_findings.append(rules.unused_needed_finding(missing).as_dict())

    # ------------------------------------------------------------------ per batch

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._fitting:
            return
        self._last_batch_start = None
        self._check(trainer, pl_module, "epoch_start")

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._fitting:
            return
        now = time.perf_counter()
        if self._last_batch_start is not None and batch_idx >= _EPOCH_EDGE_BATCHES:
            self._iteration_s += now - self._last_batch_start
            self._fetch_s += self._last_fetch_s
            self._timed_batches += 1
        self._last_batch_start = now
        self._last_fetch_s = 0.0
        epoch = trainer.current_epoch
        if epoch not in self._pending_digests and epoch not in self._epoch_digests:
            wanted = self.enabled("data-not-sharded") or self.enabled("sampler-epoch-not-set")
            self._pending_digests[epoch] = rules.fingerprint(batch) if wanted else None
        if not self._first_batch_seen:
            self._first_batch_seen = True
            self._observe_first_batch(trainer, pl_module, batch)

    def _observe_first_batch(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any) -> None:
        assert self._setup_info is not None
        augment = self._setup_info["augment"]
        if augment.get("workers", 0) > 0:
            base = _worker_base_seed(trainer)
            self._random_state = None if base is None else f"base-seed:{base}"
        else:
            self._random_state = rules.random_state_digest()
        if self._world_size > 1 and self.enabled("batchnorm-without-sync") and self._setup_info["batchnorm"]:
            from lightning.pytorch.utilities.data import extract_batch_size

            try:
                batch_size: Optional[int] = int(extract_batch_size(batch))
            except Exception:  # noqa: BLE001 - an opaque batch: no verdict
                batch_size = None
            finding = rules.check_batchnorm(self._setup_info["batchnorm"], batch_size, self.batchnorm_min_batch)
            if finding is not None:
                self._local_findings.append(finding.as_dict())

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._fitting:
            return
        self._batches_seen += 1
        if self._hooks and self._batches_seen >= self._use_window:
            self._window_done = True  # sent (and the hooks removed) at the next check
        periodic = self._batches_seen == 1 or self._batches_seen % self.every_n_steps == 0
        if self._epoch_batch_limit is not None and batch_idx + 1 >= self._epoch_batch_limit:
            return  # uneven batches (reported): past the shortest rank's last batch, others would not join
        if periodic:
            self._check(trainer, pl_module, "periodic")
        elif batch_idx == 0:
            self._check(trainer, pl_module, "epoch_first_batch")

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A checkpoint saved at the end of the epoch (ModelCheckpoint runs after this) then holds
        # everything the ranks observed: a resume from it continues exactly.
        if self._fitting and self._epoch_batch_limit is None:  # uneven ranks would not meet here
            self._check(trainer, pl_module, "epoch_end")

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._fitting and not trainer.sanity_checking:
            self._check(trainer, pl_module, "validation_end")

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._fitting:
            return
        self._window_done = bool(self._hooks)  # a fit shorter than the window: judge what was seen
        try:
            self._check(trainer, pl_module, "train_end")
        finally:
            self._finish()
        reported = sorted({f.rule for f in self.findings})
        verdict = f"{len(reported)} rule(s) fired: {', '.join(reported)}" if reported else "no problems found"
        rank_zero_info(
            f"DistributedDoctor: {self._checks} checks over {self._batches_seen} batches on {trainer.world_size} "
            f"rank(s): {verdict}"
        )

    def _finish(self) -> None:
        self._fitting = False
        self._remove_hooks()
        self._unpatch_fetch_timing()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._finish()
        if isinstance(exception, DistributedDoctorError) or not self.enabled("unused-parameters"):
            return
        if "Expected to have finished reduction in the prior iteration" in str(exception):
            missing = [name for name, p in zip(self._param_names, self._params) if p.grad is None]
            seen = f"DDP stopped: a parameter got no gradient. No gradient now: {', '.join(missing[:5]) or '?'}"
            finding = Finding("unused-parameters", seen=seen, why=RULES["unused-parameters"].catches,
                              fix=RULES["unused-parameters"].fix, step=trainer.global_step)
            rank_zero_warn("DistributedDoctor " + finding.format(), category=DistributedDoctorWarning)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._finish()

    # ------------------------------------------------------------------ checks

    def _check(self, trainer: L.Trainer, pl_module: L.LightningModule, kind: str) -> None:
        """One exchange: every rank sends what it saw, all evaluate the same gathered data."""
        full = kind in ("periodic", "train_end")
        payload: dict[str, Any] = {"local": self._local_findings, "digests": self._pending_digests}
        if not self._setup_sent:
            payload["setup"] = self._setup_info
        if kind == "epoch_start":
            payload["batches"] = float(trainer.num_training_batches)
            loader = _train_loader(trainer)  # the sampler as this epoch starts (its epoch, for one)
            payload["sampler"] = _describe_sampler(loader, trainer) if loader is not None else {}
        if self._first_batch_seen and not self._random_sent:
            payload["random"] = self._random_state
        if full:
            payload["params"] = self._param_stats() if self._params_wanted(trainer) else None
            payload["metrics"] = _unsynced_metric_values(trainer) if self.enabled("unsynced-logging") else {}
            payload["timing"] = {"fetch_s": self._fetch_s, "iteration_s": self._iteration_s, "batches": self._timed_batches}
            self._fetch_s = self._iteration_s = 0.0
            self._timed_batches = 0
        if kind == "validation_end":
            payload["metrics"] = _unsynced_metric_values(trainer) if self.enabled("unsynced-logging") else {}
        if self._hooks:  # the window is open (the same on every rank): send the counts since the last check
            payload["usage"] = {"counts": self._used_counts, "batches": self._window_batches, "done": self._window_done}
            self._used_counts = [0] * len(self._used_counts)
            self._window_batches = 0
            if self._window_done:
                self._remove_hooks()
        self._local_findings = []
        self._pending_digests = {}

        gathered = _gather(trainer, payload)
        self._checks += 1
        new = self._evaluate(trainer, gathered, kind)
        self._report(trainer, new)

    def _params_wanted(self, trainer: L.Trainer) -> bool:
        return self.enabled("params-diverged") and trainer.world_size > 1 and bool(self._ddp_flags)

    def _param_stats(self) -> list[int]:
        """Per tensor, the sum of its bit patterns as integers, wrapping (mod 2**32 or 2**64): exact and
        independent of the reduction order, so bitwise-equal tensors agree on any kernel or thread count,
        and any changed bit shows. Cheap: one integer pass, no float64 copies."""
        tensors = [p.detach() for p in self._params]
        if self._buffer_names and self._module is not None:
            # Looked up by name each time: a module may replace a buffer tensor.
            buffers = dict(self._module.named_buffers())
            tensors += [buffers[name].detach() for name in self._buffer_names]
        if not tensors:
            return []
        with torch.no_grad():
            sums = torch.stack([_bitsum(t) for t in tensors])
            return [int(v) for v in sums.cpu().tolist()]

    def _evaluate(self, trainer: L.Trainer, gathered: list[dict[str, Any]], kind: str) -> list[Finding]:
        found: list[Finding] = []
        world = len(gathered)

        def add(finding: Optional[Finding]) -> None:
            if finding is not None and self.enabled(finding.rule):
                found.append(finding)

        for finding in rules.merge_local([g["local"] for g in gathered]):
            add(finding)
        if "setup" in gathered[0]:
            self._setup_sent = True
            setups = [g["setup"] or {} for g in gathered]
            self._gathered_setup = setups
            add(rules.check_unused_devices([s.get("devices", {}) for s in setups]))
            add(rules.check_dataparallel(setups[0].get("wrapped", [])))
        if "sampler" in gathered[0]:
            self._samplers = [g["sampler"] for g in gathered]
        if "batches" in gathered[0]:
            counts = [g["batches"] for g in gathered]
            finding = rules.check_batch_counts(counts, trainer.current_epoch)
            self._epoch_batch_limit = min(counts) if finding is not None else None
            add(finding)
        if world > 1:
            self._evaluate_digests([g["digests"] for g in gathered], add)
        if "random" in gathered[0]:
            self._random_sent = True
            if world > 1 and self._gathered_setup:
                augment = [s.get("augment", {}) for s in self._gathered_setup]
                add(rules.check_random_state(augment, [g["random"] for g in gathered]))
        if gathered[0].get("params") is not None and world > 1:
            names = self._param_names + [f"buffer {n}" for n in self._buffer_names]
            add(rules.check_params([g["params"] for g in gathered], names, bool(self._buffer_names)))
        if "metrics" in gathered[0] and world > 1:
            add(rules.check_unsynced_metrics([g["metrics"] for g in gathered]))
        if "timing" in gathered[0] and self.enabled("dataloader-starving"):
            loaders = [s.get("loader", {}) for s in self._gathered_setup]
            add(rules.check_data_wait([g["timing"] for g in gathered], self.data_wait_threshold, loaders))
        if "usage" in gathered[0]:
            usage = [g["usage"] for g in gathered]
            if len(self._use_counts) != world:
                self._use_counts = [[0] * len(u["counts"]) for u in usage]
                self._use_batches = [0] * world
            for rank, u in enumerate(usage):
                self._use_counts[rank] = [a + b for a, b in zip(self._use_counts[rank], u["counts"])]
                self._use_batches[rank] += u["batches"]
            if usage[0]["done"]:
                add(
                    rules.check_param_usage(
                        self._use_counts, self._use_batches, self._param_names, self._ddp_flags.get("find_unused", False)
                    )
                )
        return found

    def _evaluate_digests(self, per_rank: list[dict[int, Optional[str]]], add: Any) -> None:
        epochs = sorted({epoch for digests in per_rank for epoch in digests})
        for epoch in epochs:
            digests = [d.get(epoch) for d in per_rank]
            self._epoch_digests[epoch] = digests
            if self.enabled("data-not-sharded"):
                add(rules.check_data_not_sharded(digests, self._samplers, epoch))
            previous = self._epoch_digests.get(epoch - 1)
            if previous is not None and self.enabled("sampler-epoch-not-set"):
                add(rules.check_epoch_order(previous, digests, self._samplers, epoch))
        for old in sorted(self._epoch_digests)[:-2]:  # the last two epochs are all a comparison needs
            del self._epoch_digests[old]

    def _report(self, trainer: L.Trainer, found: list[Finding]) -> None:
        new = [f for f in found if f.rule not in self._reported]
        if not new:
            return
        for finding in new:
            finding.step = trainer.global_step
            self._reported.add(finding.rule)
            self.findings.append(finding)
        if self.strict:
            raise DistributedDoctorError(new)
        for finding in new:
            rank_zero_warn("DistributedDoctor " + finding.format(), category=DistributedDoctorWarning)


# --------------------------------------------------------------------------- helpers


_INT_VIEWS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bitsum(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=tensor.device)
    size = tensor.element_size()
    try:
        bits = tensor.view(_INT_VIEWS[size])
    except (KeyError, RuntimeError):  # an odd dtype or layout: bytes instead
        bits, size = tensor.contiguous().reshape(-1).view(torch.uint8), 1
    accumulate = torch.int64 if size == 8 else torch.int32
    return bits.sum(dtype=accumulate).to(torch.int64)


def _gather(trainer: L.Trainer, local: Any) -> list[Any]:
    """Every rank's ``local``: a collective every rank enters."""
    if trainer.world_size == 1 or not dist.is_available() or not dist.is_initialized():
        return [local]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return gathered


def _train_loader(trainer: L.Trainer) -> Optional[Any]:
    from torch.utils.data import DataLoader

    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    candidates = list(getattr(combined, "flattened", [])) if combined is not None else []
    if not candidates:
        loaders = trainer.train_dataloader
        candidates = list(loaders.values()) if isinstance(loaders, dict) else (
            list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]
        )
    for loader in candidates:
        if isinstance(loader, DataLoader):
            return loader
    return None


def _describe_sampler(loader: Any, trainer: L.Trainer) -> dict[str, Any]:
    """Where the order comes from: the effective sampler, a DistributedSampler found in it, fixed order or not."""
    from torch.utils.data import BatchSampler, DistributedSampler, Sampler, SequentialSampler

    batch_sampler = getattr(loader, "batch_sampler", None)
    if isinstance(batch_sampler, BatchSampler) and getattr(batch_sampler, "sampler", None) is not None:
        effective = batch_sampler.sampler
        # DataLoader's own BatchSampler wraps loader.sampler: name it the way the user wrote it
        path = "loader.sampler" if effective is getattr(loader, "sampler", None) else "loader.batch_sampler.sampler"
    elif batch_sampler is not None:
        effective, path = batch_sampler, "loader.batch_sampler"
    else:
        effective, path = getattr(loader, "sampler", None), "loader.sampler"

    candidates: list[tuple[str, Any]] = [(path, effective)]
    for name, value in vars(effective).items() if hasattr(effective, "__dict__") else ():
        if isinstance(value, (Sampler, BatchSampler)) or hasattr(value, "set_epoch"):
            candidates.append((f"{path}.{name}", value))
    distributed = None
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

    fixed = isinstance(effective, SequentialSampler)
    if isinstance(effective, DistributedSampler) and not effective.shuffle:
        inner = getattr(getattr(effective, "dataset", None), "_sampler", None)  # Lightning's DistributedSamplerWrapper
        fixed = inner is None or isinstance(inner, SequentialSampler)
    description = type(effective).__name__
    if isinstance(effective, DistributedSampler):
        description += f"(shuffle={effective.shuffle})"
    return {
        "description": description,
        "path": path,
        "distributed": distributed,
        "fixed_order": fixed,
        "lightning_sampler": getattr(trainer._accelerator_connector, "use_distributed_sampler", None),
    }


def _describe_loader(loader: Any, trainer: L.Trainer) -> dict[str, Any]:
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


def _wrapped_modules(pl_module: nn.Module) -> list[str]:
    found = []
    for name, module in pl_module.named_modules():
        if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            found.append(f"{type(module).__name__} at '{name or 'self'}'")
    return found


def _probe_augmentation(loader: Any) -> dict[str, Any]:
    """Does reading a sample draw random numbers from the global generators?

    With ``num_workers=0``: ``dataset[0]`` three times, under seeds (1, 1, 2), with the global
    random states saved and restored around it. Same result under the same seed but a
    different one under another seed: the dataset augments with the global generators.
    With workers, reading in this process could open files before the workers fork, so
    only the presence of a ``transform``-like attribute is taken as a sign.
    """
    from lightning.fabric.utilities.seed import pl_worker_init_function
    from torch.utils.data import IterableDataset

    workers = int(getattr(loader, "num_workers", 0) or 0)
    init_fn = getattr(loader, "worker_init_fn", None)
    rank_aware = getattr(init_fn, "func", init_fn) is pl_worker_init_function
    info: dict[str, Any] = {"augments": False, "how": "", "workers": workers, "rank_aware_workers": rank_aware}
    dataset = getattr(loader, "dataset", None)
    if dataset is None or isinstance(dataset, IterableDataset):
        return info
    if workers > 0:
        inner = dataset
        for _ in range(4):  # Subset / ConcatDataset-like wrappers
            for attribute in ("transform", "transforms", "augment", "augmentation", "augmentations"):
                if getattr(inner, attribute, None) is not None:
                    info.update(augments=True, how=f"the dataset has .{attribute}")
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
                samples.append(rules.fingerprint(dataset[0]))
        except Exception:  # noqa: BLE001 - a dataset that cannot be read out of its loader: no verdict
            return info
    if None not in samples and samples[0] == samples[1] != samples[2]:
        info.update(augments=True, how="dataset[0] changes with the global random seed")
    return info


def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(seed)


@contextlib.contextmanager
def _saved_random_state() -> Any:
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


def _worker_base_seed(trainer: L.Trainer) -> Optional[int]:
    """The base seed the train DataLoader's iterator gave its workers (worker seed = base + id)."""
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    combined = getattr(fetcher, "iterator", None)
    mode_iterator = getattr(combined, "_iterator", None)
    for iterator in getattr(mode_iterator, "iterators", []) or []:
        base = getattr(iterator, "_base_seed", None)
        if base is not None:
            return int(base)
    return None


def _unsynced_metric_values(trainer: L.Trainer) -> dict[str, float]:
    """This rank's current value of every tensor metric logged with on_epoch=True and sync_dist=False."""
    results = trainer._results
    values: dict[str, float] = {}
    if results is None:
        return values
    for key, metric in list(results.items()):
        meta = getattr(metric, "meta", None)
        if meta is None or not getattr(metric, "is_tensor", False) or not meta.on_epoch:
            continue
        sync = getattr(meta, "_sync", None)
        if sync is None or sync.should or sync.rank_zero_only:
            continue
        value = metric.value
        if meta.is_mean_reduction:
            count = float(metric.cumulated_batch_size)
            if count == 0:
                continue
            values[str(key)] = float(value) / count
        else:
            values[str(key)] = float(value)
    return values
