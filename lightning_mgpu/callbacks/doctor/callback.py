"""``DistributedDoctor``: catches the classic multi-GPU mistakes while the run trains.

This module holds the Lightning hooks only: they feed the probes (:mod:`.probes`,
:mod:`.parameters`), exchange what each rank saw (:class:`~.protocol.RankReport`, through
:mod:`.exchange`), let the ledger merge it (:mod:`.ledger`) and the checks judge it (:mod:`.checks`),
then warn or raise.

Each rule has a stable id (see :data:`~.rules.RULES`); a finding says what was seen, why it
matters and how to fix it. What stops the run: a *fatal* finding (the run would crash or hang:
uneven batches, a parameter DDP waits for in vain, a reentrant checkpoint DDP cannot follow)
unless ``stop_on_fatal=False``, and with ``strict=True`` any finding. Then every rank raises
:class:`~.findings.DistributedDoctorError` at the same check, naming the rule(s), and the run
stops on all ranks together; other findings are warnings (``DistributedDoctorWarning``, from
rank 0).

How it stays cheap and hang-free:

* Ranks compare notes only at *checks*: at every epoch start and end, after each epoch's first
  batch, after the first batch of the fit and every ``check_every_n_batches`` batches, at the end
  of each validation and at the end of training (and, under DDP with
  ``find_unused_parameters=True``, before the first backward). Everything else is local and costs
  a few clock reads per batch. Every rank evaluates the same gathered data, so all reach the same
  verdict and raise at the same point.
* A check is made only where every rank is certain to be: which checks happen is decided from
  state every rank shares (batch counter, epoch, configuration), and once the ranks' batch counts
  differ (``uneven-batches`` only warned, or disabled) no check is made past the shortest rank's
  last batch.
* Before its collective, a check's ranks meet through the rendezvous store (:mod:`.exchange`): a
  rank that left (an exception, the end of its fit, its process gone) ends the wait at once, and
  no wait lasts longer than ``check_timeout``; both raise :class:`~.findings.DistributedDoctorOutOfStep`
  naming the missing ranks and where each was last seen.

Checkpoints: ``state_dict`` keeps what the ranks have agreed on (see :mod:`.ledger`). Every check
exchanges all that is pending, so a checkpoint saved at an epoch end, a validation end
(ModelCheckpoint's places) or a check resumes exactly as the uninterrupted run goes on. From
anywhere else, what the ranks saw since the last check (data-loading times, parameter use) is
not in the checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_mgpu._checks import check_bool, check_int, check_real
from lightning_mgpu._compat.torch import default_group_store
from lightning_mgpu.callbacks.doctor import checks, probes
from lightning_mgpu.callbacks.doctor.exchange import Exchange, next_namespace
from lightning_mgpu.callbacks.doctor.findings import DistributedDoctorError, DistributedDoctorWarning, Finding
from lightning_mgpu.callbacks.doctor.ledger import Ledger
from lightning_mgpu.callbacks.doctor.parameters import ParameterWatch
from lightning_mgpu.callbacks.doctor.probes import DataWaitClock
from lightning_mgpu.callbacks.doctor.protocol import RankReport, SetupInfo, Snapshot
from lightning_mgpu.callbacks.doctor.rules import RULES, validate_rule_ids
from lightning_mgpu.comm.distributed import gather_objects

__all__ = ["DistributedDoctor"]

_OWNER = "DistributedDoctor"
_DEFAULT_CHECK_EVERY = 100
_MIN_USE_WINDOW = 8  # batches watched for parameter use, at least (a dynamic graph may skip a branch a while)
_DEFAULT_CHECK_TIMEOUT_S = 600.0


class DistributedDoctor(L.Callback):
    """Check a distributed run for the classic multi-GPU mistakes while it trains.

    Args:
        strict: raise :class:`DistributedDoctorError` on every rank (stopping the run) instead of
            warning, when any rule fires. Without it only fatal findings stop the run (see
            ``stop_on_fatal``); the others are warnings.
        check_every_n_batches: training batches between two periodic checks (parameter checksums,
            metrics, data-loading time). Checks also run after the first batch, at every epoch
            start, after each epoch's first batch, at the end of each validation and of training.
            With ``find_unused_parameters=True`` parameter use is watched over the first
            ``max(check_every_n_batches, 8)`` batches.
        every_n_steps: the old name of ``check_every_n_batches`` (it counts batches, not optimizer
            steps or ``CommProfiler``'s profiled steps); deprecated.
        disable: rule ids to switch off (see :data:`RULE_IDS`).
        data_wait_threshold: share of the iteration time spent waiting for the next batch above
            which ``dataloader-starving`` fires (0 < value < 1).
        batchnorm_min_batch: per-device batch below which BatchNorm without SyncBatchNorm is
            reported.
        stop_on_fatal: stop the run on every rank (:class:`DistributedDoctorError`, at the same check)
            when a fatal finding comes up: the run would crash or hang (``uneven-batches``,
            ``unused-parameters`` under ``find_unused_parameters=False``, ``reentrant-checkpoint``).
            False: only warn, and let the run go on into what the finding predicts (the doctor then
            makes no check the ranks might not all reach). Not with ``strict=True``.
        check_timeout: seconds a rank waits at a check for the others before it stops with
            :class:`DistributedDoctorOutOfStep` naming the ranks that did not come and where each was
            last seen; None: no limit (the process group's own timeout). A rank that left the run ends
            the wait at once, whatever this is.

    Attributes:
        findings: every :class:`Finding` reported so far, in order (the same on every rank).
        not_checked: rules this fit could not check (this Lightning offers no way to observe
            them); the end-of-training summary names them.
    """

    def __init__(
        self,
        strict: bool = False,
        check_every_n_batches: int = _DEFAULT_CHECK_EVERY,
        *,
        every_n_steps: Optional[int] = None,
        disable: Iterable[str] = (),
        data_wait_threshold: float = 0.25,
        batchnorm_min_batch: int = 16,
        stop_on_fatal: bool = True,
        check_timeout: Optional[float] = _DEFAULT_CHECK_TIMEOUT_S,
    ) -> None:
        self.strict = check_bool("strict", strict, owner=_OWNER)
        self.stop_on_fatal = check_bool("stop_on_fatal", stop_on_fatal, owner=_OWNER)
        if self.strict and not self.stop_on_fatal:
            raise ValueError(
                f"{_OWNER}: strict=True stops the run at any finding, fatal ones included; stop_on_fatal=False "
                "cannot hold with it (give one of the two)"
            )
        self.check_timeout = (
            None
            if check_timeout is None
            else check_real(
                "check_timeout", check_timeout, above=0, owner=_OWNER, what="seconds to wait at a check, or None"
            )
        )
        if every_n_steps is not None:
            old = check_int("every_n_steps", every_n_steps, owner=_OWNER)
            if check_every_n_batches not in (_DEFAULT_CHECK_EVERY, old):
                raise ValueError(
                    f"{_OWNER}: every_n_steps is the old name of check_every_n_batches; give only "
                    f"check_every_n_batches (got check_every_n_batches={check_every_n_batches!r:.40}, "
                    f"every_n_steps={every_n_steps!r})"
                )
            rank_zero_warn(
                f"{_OWNER}(every_n_steps=...) is deprecated: it counts training batches, so it is now called "
                f"check_every_n_batches; use DistributedDoctor(check_every_n_batches={old})",
                category=DeprecationWarning,
                stacklevel=5,  # the caller of DistributedDoctor(...), through rank_zero_warn's wrappers
            )
            check_every_n_batches = old
        self.check_every_n_batches = check_int("check_every_n_batches", check_every_n_batches, owner=_OWNER)
        self.batchnorm_min_batch = check_int("batchnorm_min_batch", batchnorm_min_batch, owner=_OWNER)
        self.data_wait_threshold = check_real(
            "data_wait_threshold",
            data_wait_threshold,
            above=0,
            below=1,
            owner=_OWNER,
            what="the share of the iteration time spent waiting for data, a number",
        )
        self.disabled = validate_rule_ids(disable)
        self.ledger = Ledger()
        """The state every rank agrees on (checkpointed)."""
        self.parameter_watch = ParameterWatch()
        self._use_window = max(self.check_every_n_batches, _MIN_USE_WINDOW)
        self._clock = DataWaitClock()
        self._exchange = Exchange(timeout=self.check_timeout)
        self._reset_local_state()

    def enabled(self, rule: str) -> bool:
        return rule not in self.disabled

    @property
    def findings(self) -> list[Finding]:
        return self.ledger.findings

    @findings.setter
    def findings(self, findings: list[Finding]) -> None:
        self.ledger.findings = findings

    def _reset_local_state(self) -> None:
        """This rank's observations since the last check: not checkpointed."""
        self._fitting = False
        self._world_size = 1
        self._setup_info: Optional[SetupInfo] = None
        self._local_findings: list[Finding] = []
        self._pending_digests: dict[int, Optional[str]] = {}
        self._missing_grads: Optional[list[str]] = None
        self._first_batch_seen = False
        self._first_backward_seen = False
        self._batch_idx = 0
        self._random_state: Optional[str] = None
        self._window_done = False
        self.not_checked: set[str] = set()

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.ledger.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.ledger.load_state_dict(state_dict):
            rank_zero_warn(
                f"{_OWNER}: checkpoint state version {state_dict.get('version')!r} unknown; starting afresh."
            )

    # ------------------------------------------------------------------ fit start

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # Checkpoint state (if resuming) is loaded after setup: start from a clean slate here.
        self._finish()
        self.parameter_watch.reset()
        self.ledger.reset()
        self._reset_local_state()

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._fitting = True
        self._world_size = trainer.world_size
        self._setup_info = probes.observe_setup(trainer, pl_module)
        if not self._clock.attach(trainer):
            self._cannot_check("dataloader-starving", "the train loader's fetches cannot be timed")
        in_window = self.ledger.batches_seen < self._use_window
        wanted = self.enabled("unused-parameters") or self.enabled("find-unused-wasted")
        model = trainer.strategy.model
        assert model is not None  # fit has wrapped the module by on_train_start
        self.parameter_watch.attach(model, pl_module, count_use=in_window and wanted)
        if trainer.world_size > 1 and self.parameter_watch.ddp is None:
            # e.g. FSDP / ModelParallelStrategy: each rank holds a shard, there are no replicas to compare
            # and no DDP reducer to ask; say so rather than "no problems found" without having looked
            why = f"the model is not replicated by DDP under {type(trainer.strategy).__name__} (e.g. sharded by FSDP)"
            for rule in ("params-diverged", "unused-parameters", "find-unused-wasted"):
                self._cannot_check(rule, why, version=False)
        if self._setup_info.augment.get("workers", 0) > 0:
            # Lightning made the first epoch's iterator (its workers' base seed drawn) before this hook,
            # and the LightningModule's on_train_start (where a rank may reseed) runs after it.
            loader = probes.train_loader(trainer)
            self._random_state = probes.worker_seed_source_digest(loader) if loader is not None else None
        # Ranks on this machine, if ranks are numbered node by node (Lightning's and torchrun's way): their
        # processes are watched while this rank waits at a check (a wrong guess is harmless: hosts are compared).
        per_node = max(1, trainer.world_size // max(1, trainer.num_nodes))
        first = trainer.node_rank * per_node
        self._exchange.open(
            default_group_store() if trainer.world_size > 1 else None,
            namespace=next_namespace(),  # drawn on every rank, store or not: the ranks' namespaces stay equal
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            neighbours=range(first, first + per_node),
        )

    # ------------------------------------------------------------------ per batch

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if not self._fitting or self._first_backward_seen:
            return
        self._first_backward_seen = True
        ddp = self.parameter_watch.ddp
        if ddp is None or not ddp.find_unused or ddp.static_graph or not self.enabled("reentrant-checkpoint"):
            return  # (the same on every rank: DDP's options and this callback's)
        # DDP's first backward fails on a reentrant checkpoint here, before any check: meet now, on this finding
        # alone (what else is pending waits for the next check, as in a fit without this meeting: a resumed
        # fit, which meets here once more, then reports everything at the same steps as the fit that went on).
        if not self.ledger.may_check(trainer.current_epoch, self._batch_idx, during=True):
            return
        regions = probes.reentrant_checkpoints(loss)
        found = [checks.reentrant_checkpoint_finding(regions)] if regions else []
        self._exchange.meet(_where("first_backward", trainer.current_epoch, self._batch_idx))
        gathered: list[list[Finding]] = gather_objects(found, world_size=trainer.world_size)
        snapshot = Snapshot(world_size=len(gathered), epoch=trainer.current_epoch, local_findings=gathered)
        self._report(trainer, checks.evaluate(snapshot, self.disabled))

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        missing = self.parameter_watch.after_backward(check_grads=self.enabled("unused-parameters"))
        if missing:
            self._local_findings.append(checks.unused_needed_finding(missing))
            self._missing_grads = missing

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._fitting:
            return
        self._clock.epoch_start()
        self._check(trainer, "epoch_start")

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._fitting:
            return
        self._clock.batch_start(batch_idx)
        self._batch_idx = batch_idx
        epoch = trainer.current_epoch
        if epoch not in self._pending_digests and epoch not in self.ledger.epoch_digests:
            wanted = self.enabled("data-not-sharded") or self.enabled("sampler-epoch-not-set")
            self._pending_digests[epoch] = probes.fingerprint(batch) if wanted else None
        if not self._first_batch_seen:
            self._first_batch_seen = True
            self._observe_first_batch(batch)

    def _observe_first_batch(self, batch: Any) -> None:
        setup = self._setup_info
        assert setup is not None  # set at train start, before any batch
        if setup.augment.get("workers", 0) == 0:
            self._random_state = probes.random_state_digest()
        if self._world_size > 1 and self.enabled("batchnorm-without-sync") and setup.batchnorm:
            batch_size = probes.batch_size_of(batch)
            finding = checks.check_batchnorm(setup.batchnorm, batch_size, self.batchnorm_min_batch)
            if finding is not None:
                self._local_findings.append(finding)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._fitting:
            return
        self.ledger.batches_seen += 1
        if self.parameter_watch.counting and self.ledger.batches_seen >= self._use_window:
            self._window_done = True  # sent (and the hooks removed) at the next check
        seen = self.ledger.batches_seen
        periodic = seen == 1 or seen % self.check_every_n_batches == 0
        self._batch_idx = batch_idx
        if periodic:
            self._check(trainer, "periodic")
        elif batch_idx == 0:
            self._check(trainer, "epoch_first_batch")

    # ------------------------------------------------------------------ epoch and fit end

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A checkpoint saved at the end of the epoch (ModelCheckpoint runs after this) then holds
        # everything the ranks observed: a resume from it continues exactly.
        if self._fitting:
            self._check(trainer, "epoch_end")

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._fitting and not trainer.sanity_checking:
            self._check(trainer, "validation_end")

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._fitting:
            return
        self._window_done = self.parameter_watch.counting  # a fit shorter than the window: judge what was seen
        in_step = self.ledger.may_check(trainer.current_epoch)
        try:
            self._check(trainer, "train_end")
        finally:
            self._finish()
        reported = sorted({f.rule for f in self.findings})
        verdict = f"{len(reported)} rule(s) fired: {', '.join(reported)}" if reported else "no problems found"
        if self.not_checked:
            verdict += f"; not checked in this run: {', '.join(sorted(self.not_checked))}"
        if not in_step:
            verdict += (
                f"; no check after epoch {self.ledger.out_of_step_epoch}'s batch {int(self.ledger.epoch_batch_limit or 0)}"
                ": the ranks ran different numbers of batches"
            )
        rank_zero_info(
            f"{_OWNER}: {self.ledger.checks} checks over {self.ledger.batches_seen} batches on {trainer.world_size} "
            f"rank(s): {verdict}"
        )

    def _finish(self) -> None:
        self._fitting = False
        self.parameter_watch.detach()
        self._clock.detach()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # Ranks waiting at a check stop at once rather than wait for this one.
        first_line = (str(exception).strip().splitlines() or [""])[0][:200]
        self._exchange.leave(f"{type(exception).__name__}: {first_line}" if first_line else type(exception).__name__)
        self._finish()
        if isinstance(exception, DistributedDoctorError) or not self.enabled("unused-parameters"):
            return
        if "Expected to have finished reduction in the prior iteration" in str(exception):
            missing = self.parameter_watch.missing_grads()
            rule = RULES["unused-parameters"]
            finding = Finding(
                rule.id,
                seen=f"DDP stopped: a parameter got no gradient. No gradient now: {', '.join(missing[:5]) or '?'}",
                why=rule.catches,
                fix=rule.fix,
                step=trainer.global_step,
            )
            rank_zero_warn(f"{_OWNER} " + finding.format(), category=DistributedDoctorWarning)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._exchange.leave(f"it ended its fit after {self.ledger.batches_seen} batch(es)")
            self._exchange.close()
        self._finish()

    # ------------------------------------------------------------------ checks

    def _check(self, trainer: L.Trainer, kind: str) -> None:
        """One exchange: every rank sends what it saw, all evaluate the same gathered data."""
        # After a training batch (periodic and epoch-first-batch checks): the one just ended.
        batch_idx = self._batch_idx if kind in ("periodic", "epoch_first_batch") else None
        if not self.ledger.may_check(trainer.current_epoch, batch_idx):
            return  # some ranks would never come: see Ledger.may_check
        report = RankReport(local_findings=self._local_findings, digests=self._pending_digests)
        if not self.ledger.setup_sent:
            report.setup = self._setup_info
        if kind == "epoch_start":
            report.batches = float(trainer.num_training_batches)
            report.batches_left = _batches_left(trainer)
            loader = probes.train_loader(trainer)  # the sampler as this epoch starts (its epoch, for one)
            report.sampler = probes.describe_sampler(loader, trainer) if loader is not None else {}
            if report.sampler.get("order_unknown"):
                self._cannot_check("sampler-epoch-not-set", "the order of the sampler Lightning wraps is unknown")
        if self._first_batch_seen and not self.ledger.random_sent:
            report.random_state_sent, report.random_state = True, self._random_state
        if kind in ("periodic", "train_end"):
            report.param_sums = self.parameter_watch.checksums() if self._params_wanted(trainer) else None
            report.metrics = self._unsynced_metrics(trainer)
            report.timing = self._clock.take()
        if kind == "validation_end":
            report.metrics = self._unsynced_metrics(trainer)
        report.usage = self.parameter_watch.take_usage(done=self._window_done)  # None unless the window is open
        report.missing_grads = self._missing_grads
        self._local_findings = []
        self._pending_digests = {}
        self._missing_grads = None

        self._exchange.meet(_where(kind, trainer.current_epoch, batch_idx))
        gathered: list[RankReport] = gather_objects(report, world_size=trainer.world_size)
        snapshot = self.ledger.absorb(
            gathered,
            epoch=trainer.current_epoch,
            tensor_names=self.parameter_watch.tensor_names,
            buffers_checked=bool(self.parameter_watch.buffer_names),
            param_names=self.parameter_watch.param_names,
            find_unused=bool(self.parameter_watch.ddp and self.parameter_watch.ddp.find_unused),
            data_wait_threshold=self.data_wait_threshold,
        )
        self._report(trainer, checks.evaluate(snapshot, self.disabled))

    def _params_wanted(self, trainer: L.Trainer) -> bool:
        return self.enabled("params-diverged") and trainer.world_size > 1 and self.parameter_watch.ddp is not None

    def _unsynced_metrics(self, trainer: L.Trainer) -> dict[str, float]:
        if not self.enabled("unsynced-logging"):
            return {}
        values = probes.unsynced_metric_values(trainer)
        if values is None:
            self._cannot_check("unsynced-logging", "the logged metrics' sync_dist options cannot be read")
            return {}
        return values

    def _cannot_check(self, rule: str, why: str, *, version: bool = True) -> None:
        """Note (and say once) that ``rule`` is not checked in this run; ``version``: because of this
        Lightning version (a probe cannot see), else because of the run itself (e.g. the strategy)."""
        if self.enabled(rule) and rule not in self.not_checked:
            self.not_checked.add(rule)
            where = " on this Lightning version" if version else ""
            rank_zero_warn(f"{_OWNER}: {rule} is not checked in this run: {why}{where}.")

    def _report(self, trainer: L.Trainer, found: list[Finding]) -> None:
        new = self.ledger.record(found, trainer.global_step)
        if not new:
            return
        stopping = [f for f in new if self.strict or (self.stop_on_fatal and _severity(f) == "fatal")]
        if stopping:
            # The check's other new findings come with it (the run stops here: they would never be said).
            others = [f for f in new if f not in stopping]
            raise DistributedDoctorError(stopping + others, strict=self.strict, fatal=[f.rule for f in stopping])
        for finding in new:
            rank_zero_warn(f"{_OWNER} " + finding.format(), category=DistributedDoctorWarning)


def _batches_left(trainer: L.Trainer) -> float:
    """Training batches until ``max_steps`` ends the fit (inf: no such limit)."""
    if trainer.max_steps is None or trainer.max_steps < 0:
        return math.inf
    return float(max(0, trainer.max_steps - trainer.global_step) * max(1, trainer.accumulate_grad_batches))


def _severity(finding: Finding) -> str:
    return finding.severity or RULES[finding.rule].severity


def _where(kind: str, epoch: int, batch_idx: Optional[int]) -> str:
    """A check, in words (for the message of a rank that waited for another)."""
    if kind == "epoch_start":
        return f"the start of epoch {epoch}"
    if kind == "epoch_end":
        return f"the end of epoch {epoch}"
    if kind == "validation_end":
        return f"the end of a validation in epoch {epoch}"
    if kind == "train_end":
        return "the end of training"
    if kind == "first_backward":
        return "before the first backward"
    return f"after batch {batch_idx} of epoch {epoch}"
