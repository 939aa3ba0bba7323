"""``DistributedDoctor``: catches the classic multi-GPU mistakes while the run trains.

This module holds the Lightning hooks only: at each, it calls every rule's watch (:data:`~.rules.WATCHES`);
at a check it exchanges what each rank's watches report (:class:`~.rule.RankReport`, through
:mod:`.exchange`), lets every watch judge the gathered reports, records the findings,
then warns or raises.

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
* A hang anywhere else (a collective some rank never reaches, a rank stuck in its data loader) is
  the hang watch's (``hang_timeout``, :mod:`lightning_mgpu.watch`): started at ``setup`` for every
  Trainer call, fed the phases by a callback of its own under a strategy that does not feed it.

Checkpoints: ``state_dict`` keeps what the ranks have agreed on (the findings, each watch's agreed
state). Every check exchanges all that is pending, so a checkpoint saved at an epoch end, a validation end
(ModelCheckpoint's places) or a check resumes exactly as the uninterrupted run goes on. From
anywhere else, what the ranks saw since the last check (data-loading times, parameter use) is
not in the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional, TypeVar

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_mgpu._checks import check_bool, check_int, check_real
from lightning_mgpu._compat.torch import default_group_store
from lightning_mgpu.callbacks.doctor.exchange import Exchange, next_namespace
from lightning_mgpu.callbacks.doctor.findings import (
    DistributedDoctorError,
    DistributedDoctorWarning,
    Finding,
    merge_local,
)
from lightning_mgpu.callbacks.doctor.probes import ParameterWatch
from lightning_mgpu.callbacks.doctor.rule import Check, CheckKind, RankReport, Watch
from lightning_mgpu.callbacks.doctor.rules import RULES, WATCHES, validate_rule_ids
from lightning_mgpu.comm.distributed import gather_objects, lost_peer
from lightning_mgpu.watch import DEFAULT_HANG_TIMEOUT_S, check_hang_timeout
from lightning_mgpu.watch.hooks import PhaseHooks, local_ranks, watch_trainer
from lightning_mgpu.watch.watcher import the_watch

__all__ = ["DistributedDoctor"]

_OWNER = "DistributedDoctor"
_DEFAULT_CHECK_EVERY = 100
_DEFAULT_CHECK_TIMEOUT_S = 600.0
STATE_VERSION = 1
"""The version of :meth:`DistributedDoctor.state_dict`'s layout."""
W = TypeVar("W", bound=Watch)


class _PhaseFeed(PhaseHooks, L.Callback):
    """What the hang watch is told of each phase under a strategy that does not tell it itself."""


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
        hang_timeout: seconds without progress on a rank before the hang watch reports where every
            rank is (phase, collective, line of your code, likely cause) and ends the job, every rank
            exiting non-zero (:mod:`lightning_mgpu.watch`); default 300, None: off. This brings the
            watch of ``ddp_tuned`` and ``hybrid`` to any other strategy (``"ddp"``, ...); under ours,
            whose watch is on already, the smaller of the two timeouts holds.

    Attributes:
        findings: every :class:`Finding` reported so far, in order (the same on every rank).
        batches_seen, checks: training batches and checks so far (like the findings: checkpointed).
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
        hang_timeout: Optional[float] = DEFAULT_HANG_TIMEOUT_S,
    ) -> None:
        self.hang_timeout = check_hang_timeout(hang_timeout, owner=_OWNER)
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
        self.parameter_watch = ParameterWatch()
        """The model's parameters, which several rules watch."""
        self.watches = [watch(self) for watch in WATCHES]
        """One per rule module, in :data:`~.rules.WATCHES` order."""
        self._exchange = Exchange(timeout=self.check_timeout)
        self._watching = False
        self._phase_feed: Optional[_PhaseFeed] = None
        self._start_afresh()

    def enabled(self, rule: str) -> bool:
        return rule not in self.disabled

    def watch(self, kind: type[W]) -> W:
        """This callback's watch of that kind (e.g. ``doctor.watch(FirstBatches).epoch_digests``)."""
        return next(watch for watch in self.watches if isinstance(watch, kind))

    def _start_afresh(self) -> None:
        """A new fit (checkpoint state, if any, is loaded afterwards): no checks, every watch afresh."""
        # What every rank agrees on, checkpointed with every watch's agreed state.
        self.batches_seen = 0
        self.checks = 0
        self.findings: list[Finding] = []
        # This fit only.
        self.not_checked: set[str] = set()
        self._setups_sent = False  # every watch's setup went out with the fit's first check
        self._fitting = self._first_batch_seen = self._first_backward_seen = False
        self._batch_idx = 0
        for watch in self.watches:
            watch.reset()

    @override
    def state_dict(self) -> dict[str, Any]:
        # Plain types only: checkpoints load with weights_only=True.
        state = {
            "version": STATE_VERSION,
            "batches_seen": self.batches_seen,
            "checks": self.checks,
            "reported": sorted({f.rule for f in self.findings}),
            "findings": [f.as_dict() for f in self.findings],
        }
        for watch in self.watches:
            state.update(watch.state_dict())
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != STATE_VERSION:
            rank_zero_warn(
                f"{_OWNER}: checkpoint state version {state_dict.get('version')!r} unknown; starting afresh."
            )
            return
        self.batches_seen, self.checks = int(state_dict["batches_seen"]), int(state_dict["checks"])
        self.findings = [Finding.from_dict(f) for f in state_dict["findings"]]
        for watch in self.watches:
            watch.load_state_dict(state_dict)

    # ------------------------------------------------------------------ fit start

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._watch(trainer)
        if stage != "fit":
            return
        # Checkpoint state (if resuming) is loaded after setup: start from a clean slate here.
        self._finish()
        self.parameter_watch.reset()
        self._start_afresh()

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._fitting = True
        model = trainer.strategy.model
        assert model is not None  # fit has wrapped the module by on_train_start
        self.parameter_watch.attach(model, pl_module)
        if trainer.world_size > 1 and self.parameter_watch.ddp is None:
            # e.g. FSDP / ModelParallelStrategy: each rank holds a shard, there are no replicas to compare
            # and no DDP reducer to ask; say so rather than "no problems found" without having looked
            why = f"the model is not replicated by DDP under {type(trainer.strategy).__name__} (e.g. sharded by FSDP)"
            for rule in (rule for watch in self.watches if watch.needs_replicas for rule in watch.rules):
                self.cannot_check(rule.id, why, version=False)
        for watch in self.watches:
            watch.start(trainer, pl_module)
        # Ranks on this machine, if ranks are numbered node by node (Lightning's and torchrun's way): their
        # processes are watched while this rank waits at a check (a wrong guess is harmless: hosts are compared).
        self._exchange.open(
            default_group_store() if trainer.world_size > 1 else None,
            namespace=next_namespace(),  # drawn on every rank, store or not: the ranks' namespaces stay equal
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            neighbours=local_ranks(trainer),
        )

    # ------------------------------------------------------------------ per batch

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if not self._fitting or self._first_backward_seen:
            return
        self._first_backward_seen = True
        wanted = [watch.before_first_backward(loss) for watch in self.watches]
        # DDP's first backward fails on a reentrant checkpoint here, before any check: meet now, on these findings
        # alone (what else is pending waits for the next check, as in a fit without this meeting: a resumed
        # fit, which meets here once more, then reports everything at the same steps as the fit that went on).
        if all(found is None for found in wanted) or not self._may_check(trainer, self._batch_idx, during=True):
            return
        self._exchange.meet(_where("first_backward", trainer.current_epoch, self._batch_idx))
        mine = [finding for found in wanted for finding in found or ()]
        gathered: list[list[Finding]] = gather_objects(mine, world_size=trainer.world_size)
        self._report(trainer, [f for f in merge_local(gathered) if self.enabled(f.rule)])

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for watch in self.watches:
            watch.after_backward()

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._fitting:
            self._check(trainer, "epoch_start")

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._fitting:
            return
        self._batch_idx = batch_idx
        if not self._first_batch_seen:
            self._first_batch_seen = True
            for watch in self.watches:
                watch.first_batch(batch)
        for watch in self.watches:
            watch.batch_start(trainer, batch, batch_idx)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._fitting:
            return
        self.batches_seen += 1
        self._batch_idx = batch_idx
        if self.batches_seen == 1 or self.batches_seen % self.check_every_n_batches == 0:
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
        try:
            self._check(trainer, "train_end")
        finally:
            self._finish()
        reported = sorted({f.rule for f in self.findings})
        verdict = f"{len(reported)} rule(s) fired: {', '.join(reported)}" if reported else "no problems found"
        if self.not_checked:
            verdict += f"; not checked in this run: {', '.join(sorted(self.not_checked))}"
        for note in filter(None, (watch.out_of_step() for watch in self.watches)):
            verdict += f"; {note}"
        rank_zero_info(
            f"{_OWNER}: {self.checks} checks over {self.batches_seen} batches on {trainer.world_size} "
            f"rank(s): {verdict}"
        )

    def _finish(self) -> None:
        self._fitting = False
        for watch in self.watches:
            watch.finish()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # Ranks waiting at a check stop at once rather than wait for this one.
        first_line = (str(exception).strip().splitlines() or [""])[0][:200]
        self._exchange.leave(f"{type(exception).__name__}: {first_line}" if first_line else type(exception).__name__)
        if self._watching and getattr(trainer.strategy, "hang_timeout", None) is None:  # ours report it themselves
            if lost_peer(exception):
                the_watch().report_failure(exception)
            the_watch().note_failure(exception)
        self._finish()
        for watch in self.watches:
            watch.on_exception(trainer, exception)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._exchange.leave(f"it ended its fit after {self.batches_seen} batch(es)")
            self._exchange.close()
        self._finish()
        self._unwatch(trainer)

    # ------------------------------------------------------------------ the hang watch

    def _watch(self, trainer: L.Trainer) -> None:
        """Start this rank's hang watch for the Trainer call starting (it joins the strategy's, if that has one)."""
        if self.hang_timeout is None or trainer.world_size < 2 or self._watching:
            return
        self._watching = watch_trainer(trainer, owner=_OWNER, timeout=self.hang_timeout)
        # Our strategies feed the watch from their own callback; any other strategy gets ours.
        if self._watching and getattr(trainer.strategy, "hang_timeout", None) is None:
            self._phase_feed = _PhaseFeed()
            trainer.callbacks.append(self._phase_feed)  # type: ignore[attr-defined]  # set by Lightning

    def _unwatch(self, trainer: L.Trainer) -> None:
        if self._phase_feed is not None:
            callbacks: list[L.Callback] = trainer.callbacks  # type: ignore[attr-defined]
            if self._phase_feed in callbacks:
                callbacks.remove(self._phase_feed)
            self._phase_feed = None
        if self._watching:
            self._watching = False
            the_watch().finish(_OWNER)

    # ------------------------------------------------------------------ checks

    def _may_check(self, trainer: L.Trainer, batch_idx: Optional[int], *, during: bool = False) -> bool:
        """Whether every rank is certain to reach a check made now: after training batch ``batch_idx``
        (``during``: within it, e.g. before its backward), or, with ``batch_idx`` None, at an epoch's start
        or end, a validation's end, the end of training (see :meth:`~.rule.Watch.may_check`)."""
        return all(w.may_check(trainer.current_epoch, batch_idx, during=during) for w in self.watches)

    def _check(self, trainer: L.Trainer, kind: CheckKind) -> None:
        """One exchange: every rank sends what it saw, all judge the same gathered data."""
        # After a training batch (periodic and epoch-first-batch checks): the one just ended.
        batch_idx = self._batch_idx if kind in ("periodic", "epoch_first_batch") else None
        if not self._may_check(trainer, batch_idx):
            return  # some ranks would never come
        report = RankReport(
            local_findings=[finding for watch in self.watches for finding in watch.local],
            setups=None if self._setups_sent else {type(w).__name__: w.setup for w in self.watches},
            payloads={type(w).__name__: w.report(trainer, kind) for w in self.watches},
        )
        for watch in self.watches:
            watch.local = []
        self._exchange.meet(_where(kind, trainer.current_epoch, batch_idx))
        gathered: list[RankReport] = gather_objects(report, world_size=trainer.world_size)
        self._report(trainer, self.judge(gathered, trainer.current_epoch))

    def judge(self, gathered: list[RankReport], epoch: int) -> list[Finding]:
        """Every rank's verdict on one check's reports (by rank), disabled rules left out: the ranks' own
        findings first (merged, one per rule), then each watch's, in :data:`~.rules.WATCHES` order."""
        self.checks += 1
        check = Check(epoch, gathered, first=gathered[0].setups is not None)
        self._setups_sent = True
        found = merge_local([report.local_findings for report in gathered])
        for watch in self.watches:
            if check.first:
                watch.setups = [r.setups.get(type(watch).__name__) for r in gathered if r.setups is not None]
            found += [finding for finding in watch.judge(check.of(type(watch)), check) if finding is not None]
        return [finding for finding in found if self.enabled(finding.rule)]

    def cannot_check(self, rule: str, why: str, *, version: bool = True) -> None:
        """Note (and say once) that ``rule`` is not checked in this run; ``version``: because of this
        Lightning version (a probe cannot see), else because of the run itself (e.g. the strategy)."""
        if self.enabled(rule) and rule not in self.not_checked:
            self.not_checked.add(rule)
            where = " on this Lightning version" if version else ""
            rank_zero_warn(f"{_OWNER}: {rule} is not checked in this run: {why}{where}.")

    def _report(self, trainer: L.Trainer, found: list[Finding]) -> None:
        reported = {f.rule for f in self.findings}
        new = [f for f in found if f.rule not in reported]  # a rule reports once per run
        for finding in new:
            finding.step = trainer.global_step
        self.findings += new
        if not new:
            return
        stopping = [f for f in new if self.strict or (self.stop_on_fatal and _severity(f) == "fatal")]
        if stopping:
            # The check's other new findings come with it (the run stops here: they would never be said).
            others = [f for f in new if f not in stopping]
            raise DistributedDoctorError(stopping + others, strict=self.strict, fatal=[f.rule for f in stopping])
        for finding in new:
            rank_zero_warn(f"{_OWNER} " + finding.format(), category=DistributedDoctorWarning)


def _severity(finding: Finding) -> str:
    return finding.severity or RULES[finding.rule].severity


_WHERE = {
    "epoch_start": "the start of epoch {epoch}",
    "epoch_end": "the end of epoch {epoch}",
    "validation_end": "the end of a validation in epoch {epoch}",
    "train_end": "the end of training",
    "first_backward": "before the first backward",
}


def _where(kind: str, epoch: int, batch_idx: Optional[int]) -> str:
    """A check, in words (for the message of a rank that waited for another)."""
    return _WHERE.get(kind, "after batch {batch} of epoch {epoch}").format(epoch=epoch, batch=batch_idx)
