"""The ``CommProfiler`` callback: Lightning's hooks stamp each synchronising step, feed the
statistics, switch the profiler's hook in and out of DDP on the window schedule, gather from
every rank and log.

The arithmetic is :class:`~.stats.CommStats` (tested without a Trainer), the schedule
:class:`~.schedule.ProfileSchedule`, the outputs :mod:`.report`, the logged keys
:data:`~.metrics.METRICS`. Communication is reached only through the
:class:`~lightning_mgpu.comm.hook_chain.CommHookHost` protocol, never a strategy class.
"""

from __future__ import annotations

import os
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_mgpu._checks import check_int
from lightning_mgpu.callbacks.comm_profiler import advice, report
from lightning_mgpu.callbacks.comm_profiler.schedule import SETTLE_STEPS, Phase, ProfileSchedule
from lightning_mgpu.callbacks.comm_profiler.stats import CommStats
from lightning_mgpu.callbacks.comm_profiler.stock_ddp import StockDDPHookHost
from lightning_mgpu.comm.distributed import gather_objects
from lightning_mgpu.comm.hook_chain import CommHookHost
from lightning_mgpu.comm.timing import (
    BucketTimer,
    Clock,
    MicroBatch,
    Stamp,
    StepTimeline,
    clock_for,
)

MAX_WINDOW = 10_000
"""Micro-batches of one accumulation window kept (the last ones, for a window of more)."""

_Marks = dict[str, Optional[Stamp]]  # None: marked in a step not profiled (no clock read)
_PendingStep = tuple[int, _Marks, list[Any], list[Any], list[_Marks]]
"""A profiled step not yet read: (global step, marks, bucket launches, bucket completions, the marks
of its accumulation window's micro-batches that did not communicate)."""


class CommProfiler(L.Callback):
    """Measure DDP communication per step and per bucket, on CPU and GPU.

    Logged metrics (through the LightningModule's ``log``, so every Lightning logger gets them;
    values are medians over the profiled steps since the last log, gathered from every rank;
    this table is rendered from :data:`~.metrics.METRICS`, and a test keeps the two equal):

    ==============================  ==============================================================
    key                             meaning
    ==============================  ==============================================================
    ``comm/step_ms``                a synchronising training step, start to end (slowest rank)
    ``comm/forward_ms``             forward pass and loss (slowest rank)
    ``comm/backward_compute_ms``    backward until the last gradient was ready (slowest rank)
    ``comm/comm_ms``                first bucket launched -> last bucket done (slowest rank)
    ``comm/exposed_ms``             communication after backward compute ended: time the step
                                    waited for the network (slowest rank)
    ``comm/overlap_ratio``          share of ``comm_ms`` hidden behind backward compute (0..1)
    ``comm/optimizer_ms``           the optimizer's ``step()``, to the end of the batch (slowest
                                    rank)
    ``comm/optimizer_step_ms``      the whole optimizer step: with gradient accumulation every
                                    micro-batch of the window (``step_ms`` plus those that do not
                                    communicate), else ``step_ms`` (slowest rank)
    ``comm/bytes_per_step``         gradient bytes reduced per step
    ``comm/wire_bytes_per_step``    bytes actually sent per step (after fp16/bf16 casting)
    ``comm/compression_ratio``      ``bytes_per_step / wire_bytes_per_step`` (when known)
    ``comm/algbw_gbps``             ``wire bytes / comm_ms`` in GB/s (1e9 B/s)
    ``comm/busbw_gbps``             ``algbw * 2(n-1)/n``: nccl-tests' bus bandwidth of all-reduce
    ``comm/busbw_fraction``         ``busbw`` / the machine's peak from
                                    ``lightning-mgpu bench-comm`` (when ``sweep=`` is given)
    ``comm/straggler_ms``           slowest minus fastest rank's median compute (forward +
                                    backward compute): how long the others wait for the slowest
    ==============================  ==============================================================

    Which steps: by default a window of ``profile_steps`` (20) synchronising steps out of every
    ``profile_every`` (200). Timing a bucket needs a Python communication hook, and with one DDP
    copies each gradient into its bucket and completes each bucket through Python instead of its
    fused C++ all-reduce: on CPU about 2% of an 8M-parameter MLP's step. Between windows the
    profiler takes its hook out (``TunedDDPStrategy`` re-wraps the model in DDP, no weight
    broadcast; with a compression hook, which is Python anyway, the hook stays and only the
    stamping pauses), so a long run pays that for a tenth of its steps. ``profile_every=None``
    profiles every step. The first ``warmup_steps`` synchronising steps of a fit are not
    profiled; nor are the first two steps of every DDP wrapper (at the start of a fit, after a
    resume, after the profiler's or ``bucket_cap_mb="auto"``'s re-wraps): the first runs DDP's
    initial bucket layout, the second rebuilds it. A switch happens only at the end of a
    synchronising step (after its optimizer step), the same step on every rank. With
    ``bucket_cap_mb="auto"`` the steps it measures bucket sizes on are not profiled (with the
    hook in, so that every candidate pays the same): the schedule, warm-up included, starts on
    the size it keeps. With gradient accumulation a profiled step is the synchronising
    micro-batch of an accumulation window (the one that communicates): ``comm/step_ms`` and
    the rest describe it; the window's other micro-batches are timed too (start, forward,
    backward, end: host stamps, CUDA events on GPU) and ``comm/optimizer_step_ms`` is the
    whole optimizer step, all of them (``comm_profile.json``: ``accumulate_grad_batches``,
    ``optimizer_step_ms``, ``accumulation_ms``). Figures are gathered and logged every
    ``every_n_steps`` profiled steps and at the end of each window.

    Timing: on CPU, host clocks, stamped in the communication hook and in gloo's completion
    callback (kept to one stamp and one list append); on CUDA, ``torch.cuda.Event`` pairs, read
    one step later, so no step synchronises for the profiler. Memory is bounded: medians come
    from the last ``history`` profiled steps; full timelines are kept for ``timeline_steps`` steps.

    Args:
        warmup_steps: synchronising steps of a fit not profiled (at least 1; DDP's first two
            steps, on its initial bucket layout and then rebuilding it, never are).
        every_n_steps: gather the figures from every rank and log them every this many
            profiled steps, and at the end of each profiling window.
        export_dir: if given, rank 0 writes ``comm_profile.json``, ``comm_buckets.csv``,
            ``comm_timeline.png`` and ``comm_trace.json`` (Chrome trace) there at the end.
        timeline_steps: profiled steps per rank kept whole for the timeline plot and trace.
        history: profiled steps whose figures are kept for the medians (bounds memory).
        sweep: path to a ``lightning-mgpu bench-comm --json`` result; the summary then
            reports DDP's achieved bus bandwidth as a fraction of that machine's peak.
        profile_steps: synchronising steps profiled per window.
        profile_every: a profiling window starts every this many synchronising steps (the
            first right after ``warmup_steps``); between windows DDP runs without the
            profiler's hook. ``None``: profile every step (on CPU ~2-3% slower steps with
            ``ddp_tuned``, see the README).
        whatif: at the end, rank 0 replays the profile (:mod:`lightning_mgpu.whatif`) and adds a
            short "what would help" block to the summary, to ``comm_profile.json``
            (``"what_would_help"``) and to W&B: ``True`` (default) on the system as profiled; a
            link preset (``"10gbe"``), a rate in Gbit/s or a ``Link`` to predict over that link;
            ``False``/``None`` off. Pure Python, milliseconds; it never fails the fit (a failure
            is one line).
    """

    def __init__(
        self,
        warmup_steps: int = 5,
        every_n_steps: int = 50,
        export_dir: Optional[Union[str, Path]] = None,
        *,
        timeline_steps: int = 4,
        history: int = 10_000,
        sweep: Optional[Union[str, Path]] = None,
        profile_steps: int = 20,
        profile_every: Optional[int] = 200,
        whatif: Optional[advice.WhatIf] = True,
    ) -> None:
        check_int("warmup_steps", warmup_steps, owner="CommProfiler")
        check_int("every_n_steps", every_n_steps, owner="CommProfiler")
        check_int("timeline_steps", timeline_steps, minimum=0, owner="CommProfiler")
        check_int("history", history, owner="CommProfiler")
        # checks profile_steps and profile_every (alone and against the warm-up)
        self.schedule = ProfileSchedule(
            warmup_steps=warmup_steps, profile_steps=profile_steps, profile_every=profile_every
        )
        """Which synchronising steps are profiled."""
        for name, path, what in (
            ("export_dir", export_dir, "a directory path (str or pathlib.Path)"),
            ("sweep", sweep, "the path of a bench-comm JSON result"),
        ):
            if path is not None and (not isinstance(path, (str, os.PathLike)) or not str(path).strip()):
                raise ValueError(f"CommProfiler: {name} must be {what} or None, got {path!r:.80}")
        self.whatif = advice.check_whatif(whatif)
        self.every_n_steps = every_n_steps
        self.export_dir = Path(export_dir) if export_dir is not None else None
        self.timeline_steps = timeline_steps
        self.history = history
        self.peak_busbw_gbps = _read_sweep_peak(sweep) if sweep is not None else None
        self.summary: Optional[dict[str, Any]] = None
        """After fit: the ``summary`` of comm_profile.json (every rank), for code and tests."""
        self.ranks: list[dict[str, float]] = []
        """After fit: each rank's own medians (the ``ranks`` of comm_profile.json)."""
        self.advice: Optional[dict[str, Any]] = None
        """After fit, on rank 0 with ``whatif``: the ``what_would_help`` of comm_profile.json."""
        self._reset_run_state()

    @property
    def warmup_steps(self) -> int:
        return self.schedule.warmup_steps

    @property
    def profile_steps(self) -> int:
        return self.schedule.profile_steps

    @property
    def profile_every(self) -> Optional[int]:
        return self.schedule.profile_every

    @property
    def stats(self) -> CommStats:
        """This fit's statistics on this rank (after fit: what the profile was made from)."""
        return self._stats

    def _reset_run_state(self) -> None:
        self._timer: Optional[BucketTimer] = None
        self._host: Optional[CommHookHost] = None
        """Where the timer joins DDP's hook: the strategy itself, or our adapter for stock DDPStrategy."""
        self._clock: Optional[Clock] = None
        self._sync_steps_seen = 0
        self._origin = 0  # the schedule counts from here: after bucket_cap_mb="auto" has measured
        self._tuning = False  # bucket_cap_mb="auto" was measuring when this batch started
        self._timing_on = True  # the profiler's hook wrapper is in DDP's hook and stamping
        self._stamping = False  # this batch belongs to a step that may be profiled: its marks are stamped
        self._in_train_batch = False  # between a training batch's start and end (not in validation)
        self._settle_left = 0  # steps of a new DDP wrapper still to skip
        self._wrapper: Optional[weakref.ref[torch.nn.Module]] = None
        self.switches: deque[tuple[int, bool]] = deque(maxlen=1000)
        """(global step, on): the hook went into DDP (True) or out of it after that step (last 1000)."""
        self._marks: _Marks = {}
        # this accumulation window's micro-batches so far (no communication); bounded for a loop that
        # never steps an optimizer (manual optimization)
        self._window: deque[_Marks] = deque(maxlen=MAX_WINDOW)
        self._pending: Optional[_PendingStep] = None
        self._stats = self._new_stats()
        self._forward_hook: Optional[torch.utils.hooks.RemovableHandle] = None

    def _new_stats(self) -> CommStats:
        timer = self._timer
        return CommStats(
            history=self.history,
            timeline_steps=self.timeline_steps,
            measures_comm=timer is not None,
            wire_ratio=timer.wire_ratio if timer is not None else None,
            peak_busbw_gbps=self.peak_busbw_gbps,
        )

    # ------------------------------------------------------------------ setup

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset_run_state()
        strategy = trainer.strategy
        if self.export_dir is not None:
            # Rank 0 writes the files after training: a directory it cannot write must fail the fit now,
            # on every rank alike, not after the last step (and skip the code after fit).
            problem = report.export_dir_problem(self.export_dir) if trainer.is_global_zero else None
            problem = strategy.broadcast(problem, src=0)
            if problem is not None:
                raise ValueError(f"CommProfiler: export_dir={str(self.export_dir)!r} {problem}")
        self._clock = clock_for(strategy.root_device)
        host = comm_hook_host(strategy)
        if host is not None:
            self._host = host
            self._timer = BucketTimer(self._clock)
            self._timer.wire_ratio = host.wire_ratio
            host.add_comm_hook_wrapper(self._timer.wrap, pausable=True)
            if isinstance(host, StockDDPHookHost) and not host.measures:
                self._not_measured(strategy, "its communication hook could not be joined")
        else:
            self._not_measured(strategy, "it has no DDP gradient buckets to time (e.g. FSDP's collectives)")
        self._stats = self._new_stats()

    def _not_measured(self, strategy: Any, why: str) -> None:
        self._timer, self._host = None, None
        rank_zero_warn(
            f"CommProfiler: communication is not measured under {type(strategy).__name__}: {why}. Step, forward "
            "and optimizer times are reported; communication figures are reported as 'not measured' (null in "
            "comm_profile.json, not logged). Strategies measured: ddp_tuned (and its presets), hybrid, stock ddp."
        )

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The forward ends when DDP's wrapper returns (training_step, loss included): the
        # instant DDP itself starts its backward-compute clock, so the figures compare.
        model = trainer.strategy.model
        if isinstance(self._host, StockDDPHookHost) and not self._host.attach(model):
            self._host.detach()
            self._not_measured(trainer.strategy, "another communication hook is already registered on its DDP")
            self._stats = self._new_stats()
        if self._clock is not None and isinstance(model, DistributedDataParallel):
            self._forward_hook = model.register_forward_hook(self._forward_ended)

    def _forward_ended(self, *_: Any) -> None:
        # DDP's wrapper also runs validation's forward: that must not touch a training step's marks (on CUDA
        # the last step is read one step later, after a validation in between)
        if self._in_train_batch:
            self._stamp("forward_end")

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = trainer.strategy.model
        self._wrapper = weakref.ref(model) if isinstance(model, torch.nn.Module) else None
        # A new DDP wrapper (a resumed fit has no warm-up left): its first two steps settle.
        # A resumed fit due off the hook switches at its first step's end, as ever after an
        # optimizer step (the restored batch counters may still be mid-accumulation here).
        self._settle_left = SETTLE_STEPS
        self._window = deque(maxlen=MAX_WINDOW)

    # ------------------------------------------------------------------ schedule

    def _phase(self, n: int) -> Phase:
        """What synchronising step ``n`` (1-based, counted across resumes) is for: the schedule
        counts from ``_origin`` (after ``bucket_cap_mb="auto"`` has measured)."""
        return self.schedule.phase(n - self._origin)

    def _switch(self, trainer: L.Trainer, on: bool) -> None:
        """Put the profiler's hook into DDP or take it out (between steps, on every rank alike)."""
        host = self._host
        if self._timer is None or host is None:
            self._timing_on = on  # nothing to switch: step timings only
            return
        if not host.set_comm_hook_wrappers(on):
            return  # bucket_cap_mb="auto" is still measuring: keep the hook as it is for now
        self._timing_on = on
        self.switches.append((trainer.global_step, on))

    # ------------------------------------------------------------------ per step

    def _stamp(self, name: str) -> None:
        """Mark ``name`` in this batch: a clock stamp in a step that may be profiled, else only that it happened
        (between windows a step costs a dictionary write per mark, no clock read or CUDA event)."""
        assert self._clock is not None
        self._marks[name] = self._clock.stamp() if self._stamping else None

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._clock is None:
            return
        model = trainer.strategy.model
        if self._wrapper is not None and self._wrapper() is not model and isinstance(model, torch.nn.Module):
            self._wrapper = weakref.ref(model)  # re-wrapped (by us or by bucket_cap_mb="auto")
            self._settle_left = SETTLE_STEPS
        self._tuning = self._host is not None and self._host.tuning_active
        # the synchronising step this batch belongs to is the next one (accumulating micro-batches included)
        self._stamping = self._timing_on and self._phase(self._sync_steps_seen + 1) == "profile"
        self._marks = {}
        self._in_train_batch = True
        self._stamp("start")
        self._marks["start_ns"] = time.perf_counter_ns() if self._stamping else None
        if self._timer is not None:
            self._timer.take()  # drop anything left from a step that did not reach the optimizer

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._clock is not None and "forward_end" not in self._marks:  # no DDP wrapper to hook
            self._stamp("forward_end")
        if isinstance(self._host, StockDDPHookHost):
            self._host.prescale(loss)  # our averaging all-reduce under stock DDP: the 1/n on the loss

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._clock is not None:
            self._stamp("backward_end")

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._clock is not None:
            self._stamp("optimizer_start")

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._clock is None:
            return
        self._stamp("end")
        self._in_train_batch = False
        if "optimizer_start" not in self._marks:
            # no optimizer step in this batch (accumulating): DDP did not communicate; the batch
            # is part of the optimizer step all the same (a new list per window: a CUDA step is
            # read one step later)
            self._window.append(self._marks)
            return
        window, self._window = list(self._window), deque(maxlen=MAX_WINDOW)
        launches, dones, compute_end = self._timer.take() if self._timer is not None else ([], [], None)
        if compute_end is not None:
            self._marks["compute_end"] = compute_end
        self._sync_steps_seen += 1
        n = self._sync_steps_seen
        if self._tuning:
            # bucket_cap_mb="auto" is trying layouts (it may re-wrap after this very step):
            # profile the one it keeps, from the warm-up on
            self._origin = n
        settling = self._settle_left > 0
        self._settle_left = max(0, self._settle_left - 1)
        if self._phase(n) == "profile" and self._timing_on and not settling:
            step: Optional[_PendingStep] = (trainer.global_step, self._marks, launches, dones, window)
            if self._clock.device_type == "cuda":
                # CUDA events are read one step later, so that no step waits for the GPU here.
                step, self._pending = self._pending, step
            if step is not None:
                self._record(trainer.global_rank, *step)
        following = self._phase(n + 1)
        window_ended = following != "profile" and self.profile_every is not None
        if window_ended and self._pending is not None:
            # the window's last step (CUDA): read now, one wait for the GPU per window
            self._record(trainer.global_rank, *self._pending)
            self._pending = None
        unlogged = self._stats.unlogged_steps
        # also at the fit's last step: a short fit (fewer profiled steps than every_n_steps) logs too
        if unlogged and (unlogged >= self.every_n_steps or window_ended or _fit_ends_here(trainer)):
            self._log(trainer, pl_module)
        if (following != "off") != self._timing_on and not _fit_ends_here(trainer):
            self._switch(trainer, on=following != "off")

    def _record(
        self, rank: int, step: int, marks: _Marks, launches: list[Any], dones: list[Any], window: list[_Marks]
    ) -> None:
        assert self._clock is not None
        stamps = _stamped(marks)
        clock, start = self._clock, stamps["start"]
        buckets = self._timer.intervals(start, launches, dones) if self._timer is not None else ()
        timeline = StepTimeline(
            step=step,
            rank=rank,
            start_ns=int(stamps["start_ns"]),  # type: ignore[arg-type]
            forward_end_ms=clock.elapsed_ms(start, stamps["forward_end"]),
            compute_end_ms=clock.elapsed_ms(start, stamps["compute_end"]) if "compute_end" in stamps else None,
            backward_end_ms=clock.elapsed_ms(start, stamps["backward_end"]),
            optimizer_start_ms=clock.elapsed_ms(start, stamps["optimizer_start"]),
            step_ms=clock.elapsed_ms(start, stamps["end"]),
            buckets=buckets,
            micro_batches=tuple(_micro_batch(clock, micro) for micro in window),
        )
        self._stats.add(timeline)

    # ------------------------------------------------------------------ gather and log

    def _log(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # a collective: every rank enters it (never rank-zero-only)
        per_rank = gather_objects(self._stats.take_unlogged(), trainer.world_size)
        metrics = self._stats.metrics(per_rank, world_size=trainer.world_size)
        # Identical on every rank (all gathered the same values): no further sync needed. As CPU tensors: Lightning
        # makes a float a tensor on the module's device, on a GPU one copy that waits for the GPU per figure.
        values = {name: torch.tensor(value, dtype=torch.float32) for name, value in metrics.items()}
        pl_module.log_dict(values, on_step=True, on_epoch=False, sync_dist=False)

    # ------------------------------------------------------------------ end of fit

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        if self._clock is None:
            return
        if self._pending is not None:
            self._record(trainer.global_rank, *self._pending)
            self._pending = None
        if self._stats.unlogged_steps:  # the same on every rank (one schedule): a collective all enter
            # a fit that ended otherwise (early stopping, max_time, a CUDA step read late): straight to
            # the loggers (self.log is not allowed in on_train_end)
            per_rank = gather_objects(self._stats.take_unlogged(), trainer.world_size)
            metrics = self._stats.metrics(per_rank, world_size=trainer.world_size)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        gathered = gather_objects(self._stats.local_report(), trainer.world_size)
        backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else "none"
        profile = self._stats.profile(
            gathered,
            world_size=trainer.world_size,
            backend=backend,
            device_type=trainer.strategy.root_device.type,
            schedule=self.schedule.as_dict(),
            accumulate_grad_batches=trainer.accumulate_grad_batches,
        )
        if profile is None:
            rank_zero_warn(
                f"CommProfiler: no step was profiled (warmup_steps={self.warmup_steps}, and DDP's first two steps "
                "are always skipped). Train longer or lower warmup_steps."
            )
            return
        profile["nodes"] = trainer.num_nodes  # whatif: CPU ranks sharing one machine's cores measure contention
        self.summary, self.ranks = profile["summary"], profile["ranks"]
        if trainer.global_rank == 0:
            advice.add_bucket_gradients(profile, trainer.strategy)  # for the replay: only if the bytes agree
            report.print_summary(profile)
            if self.whatif is not False:
                found = advice.advise(profile, self.whatif)
                print("\n".join(advice.block_lines(found)), flush=True)
                self.advice = profile["what_would_help"] = found.as_dict()
            if self.export_dir is not None:
                report.write_all(self.export_dir, profile, CommStats.gathered_timelines(gathered))
                rank_zero_info(f"CommProfiler: wrote {', '.join(report.EXPORTED_FILES)} to {self.export_dir}")
            report.log_to_wandb(trainer, profile, self.export_dir)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if isinstance(self._host, StockDDPHookHost):
            self._host.detach()  # the user's ddp_comm_wrapper back on the strategy

    # ------------------------------------------------------------------ state

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"sync_steps_seen": self._sync_steps_seen, "schedule_origin": self._origin}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._sync_steps_seen = int(state_dict.get("sync_steps_seen", 0))
        self._origin = int(state_dict.get("schedule_origin", 0))


def comm_hook_host(strategy: Any) -> Optional[CommHookHost]:
    """Where ``CommProfiler``'s timer joins DDP's communication hook: a strategy that offers it
    (``ddp_tuned``, ``hybrid``), our adapter for Lightning's own ``DDPStrategy``, else None."""
    if isinstance(strategy, CommHookHost):
        return strategy
    if isinstance(strategy, DDPStrategy):
        return StockDDPHookHost(strategy)
    return None


def _fit_ends_here(trainer: L.Trainer) -> bool:
    """True when the step that just ended is the fit's last (as far as can be known now)."""
    if trainer.should_stop:
        return True
    if trainer.max_steps not in (None, -1) and trainer.global_step >= trainer.max_steps:
        return True
    loop = trainer.fit_loop
    last_epoch = loop.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= loop.max_epochs
    return bool(last_epoch and loop.epoch_loop.batch_progress.is_last_batch)


def _stamped(marks: _Marks) -> dict[str, Stamp]:
    """``marks`` of a step being recorded, every one a clock stamp (the schedule stamps every batch of a step it
    may record)."""
    unstamped = sorted(name for name, stamp in marks.items() if stamp is None)
    if unstamped:
        raise RuntimeError(f"CommProfiler: a step was recorded without its clock stamps {unstamped} (a bug)")
    return marks  # type: ignore[return-value]  # checked above


def _micro_batch(clock: Clock, marks: _Marks) -> MicroBatch:
    """A micro-batch that did not communicate, from its marks (a batch whose ``training_step``
    returned None has no backward: its compute ends with its forward, or with the batch)."""
    stamps = _stamped(marks)
    start, end = stamps["start"], stamps["end"]
    forward_end = stamps.get("forward_end", end)
    backward_end = stamps.get("backward_end", forward_end)
    return MicroBatch(
        start_ns=int(stamps["start_ns"]),  # type: ignore[arg-type]
        forward_end_ms=clock.elapsed_ms(start, forward_end),
        backward_end_ms=clock.elapsed_ms(start, backward_end),
        end_ms=clock.elapsed_ms(start, end),
    )


def _read_sweep_peak(path: Union[str, Path]) -> float:
    from lightning_mgpu.comm.allreduce_bench import load_report

    try:
        report = load_report(path)
        peak = float(report["peak_busbw_gbps"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"CommProfiler: sweep={str(path)!r} is not a readable `lightning-mgpu bench-comm --json` result "
            f"with a 'peak_busbw_gbps' entry ({error})"
        ) from error
    if not peak > 0:
        raise ValueError(f"CommProfiler: sweep={str(path)!r} has peak_busbw_gbps={peak}, expected > 0")
    if report.get("dtype", "float32") != "float32":
        raise ValueError(
            f"CommProfiler: sweep={str(path)!r} is a {report['dtype']} sweep only; DDP's gradients are measured "
            "against float32's peak: `lightning-mgpu bench-comm --dtype float32,... --json PATH`"
        )
    return peak
