"""``DistributedDoctor``: catches the classic multi-GPU mistakes while the run trains.

This module holds the Lightning hooks only: they feed the probes (:mod:`.probes`,
:mod:`.parameters`), exchange what each rank saw (:class:`~.protocol.RankReport`), let the
ledger merge it (:mod:`.ledger`) and the checks judge it (:mod:`.checks`), then warn or, in
strict mode, raise.

Each rule has a stable id (see :data:`~.rules.RULES`); a finding says what was seen, why it
matters and how to fix it. With ``strict=False`` findings are warnings
(``DistributedDoctorWarning``, from rank 0); with ``strict=True`` every rank raises
:class:`~.findings.DistributedDoctorError` at the same check, naming the rule(s), and the run
stops on all ranks together.

How it stays cheap and hang-free:

* Ranks compare notes only at *checks*: at every epoch start and end, after each epoch's first
  batch, after the first batch of the fit and every ``check_every_n_batches`` batches, at the end
  of each validation and at the end of training. A check is one ``all_gather_object`` that
  every rank enters (never inside rank-zero-only code); everything else is local and costs
  a few clock reads per batch. Every rank evaluates the same gathered data, so all reach
  the same verdict and, in strict mode, raise at the same point.
* Which observations a check carries is decided from state every rank shares (batch
  counter, epoch, configuration), so the collectives always line up.

Checkpoints: ``state_dict`` keeps what the ranks have agreed on (see :mod:`.ledger`). Every check
exchanges all that is pending, so a checkpoint saved at an epoch end, a validation end
(ModelCheckpoint's places) or a check resumes exactly as the uninterrupted run goes on. From
anywhere else, what the ranks saw since the last check (data-loading times, parameter use) is
not in the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_mgpu._checks import check_bool, check_int, check_real
from lightning_mgpu.callbacks.doctor import checks, probes
from lightning_mgpu.callbacks.doctor.findings import DistributedDoctorError, DistributedDoctorWarning, Finding
from lightning_mgpu.callbacks.doctor.ledger import Ledger
from lightning_mgpu.callbacks.doctor.parameters import ParameterWatch
from lightning_mgpu.callbacks.doctor.probes import DataWaitClock
from lightning_mgpu.callbacks.doctor.protocol import RankReport, SetupInfo
from lightning_mgpu.callbacks.doctor.rules import RULES, validate_rule_ids
from lightning_mgpu.comm.distributed import gather_objects

__all__ = ["DistributedDoctor"]

_OWNER = "DistributedDoctor"
_DEFAULT_CHECK_EVERY = 100
_MIN_USE_WINDOW = 8  # batches watched for parameter use, at least (a dynamic graph may skip a branch a while)


class DistributedDoctor(L.Callback):
    """Check a distributed run for the classic multi-GPU mistakes while it trains.

    Args:
        strict: raise :class:`DistributedDoctorError` on every rank (stopping the run) instead of
            warning, when a rule fires.
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
    ) -> None:
        self.strict = check_bool("strict", strict, owner=_OWNER)
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
        self._first_batch_seen = False
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

    # ------------------------------------------------------------------ per batch

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        missing = self.parameter_watch.after_backward(check_grads=self.enabled("unused-parameters"))
        if missing:
            self._local_findings.append(checks.unused_needed_finding(missing))

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
        limit = self.ledger.epoch_batch_limit
        if limit is not None and batch_idx + 1 >= limit:
            return  # uneven batches (reported): past the shortest rank's last batch, others would not join
        if periodic:
            self._check(trainer, "periodic")
        elif batch_idx == 0:
            self._check(trainer, "epoch_first_batch")

    # ------------------------------------------------------------------ epoch and fit end

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A checkpoint saved at the end of the epoch (ModelCheckpoint runs after this) then holds
        # everything the ranks observed: a resume from it continues exactly.
        if self._fitting and self.ledger.epoch_batch_limit is None:  # uneven ranks would not meet here
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
        try:
            self._check(trainer, "train_end")
        finally:
            self._finish()
        reported = sorted({f.rule for f in self.findings})
        verdict = f"{len(reported)} rule(s) fired: {', '.join(reported)}" if reported else "no problems found"
        if self.not_checked:
            verdict += f"; not checked in this run: {', '.join(sorted(self.not_checked))}"
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
        self._finish()

    # ------------------------------------------------------------------ checks

    def _check(self, trainer: L.Trainer, kind: str) -> None:
        """One exchange: every rank sends what it saw, all evaluate the same gathered data."""
        report = RankReport(local_findings=self._local_findings, digests=self._pending_digests)
        if not self.ledger.setup_sent:
            report.setup = self._setup_info
        if kind == "epoch_start":
            report.batches = float(trainer.num_training_batches)
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
        self._local_findings = []
        self._pending_digests = {}

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
        if self.strict:
            raise DistributedDoctorError(new)
        for finding in new:
            rank_zero_warn(f"{_OWNER} " + finding.format(), category=DistributedDoctorWarning)
