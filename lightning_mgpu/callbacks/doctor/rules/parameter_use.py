"""``unused-parameters`` and ``find-unused-wasted``: which parameters get a gradient, and what DDP is told.

Under ``find_unused_parameters=False``: ``.grad`` still None after the first backward (DDP fails
at the next step), a finding each rank makes on its own. Under ``find_unused_parameters=True``:
gradient hooks count each parameter's use over a first window of batches on every rank; the
sums say which parameters never train, or that no parameter ever needed the search.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_mgpu.callbacks.doctor.findings import (
    DistributedDoctorError,
    DistributedDoctorWarning,
    Finding,
    name_list,
)
from lightning_mgpu.callbacks.doctor.rule import Check, CheckKind, Rule, Watch

UNUSED = Rule(
    "unused-parameters",
    catches="parameters that get no gradient: DDP fails at the next step (find_unused_parameters=False; "
    "fatal), or they never train (find_unused_parameters=True; rated wrong, the run goes on)",
    detection="find_unused_parameters=False: .grad still None after the first backward; =True: gradient hooks "
    "over the first max(check_every_n_batches, 8) batches, summed over ranks",
    cost="a loop over the parameters after the first backward; with find_unused_parameters=True one hook call "
    "per parameter per batch, first window only",
    fix="for a graph that really skips parameters, find_unused_parameters=True "
    "(strategy='ddp_find_unused_parameters_true' or TunedDDPStrategy(find_unused_parameters=True)); "
    "parameters that never train: requires_grad_(False) or remove them",
    severity="fatal",
)
WASTED = Rule(
    "find-unused-wasted",
    catches="find_unused_parameters=True although every parameter gets a gradient on every rank and step",
    detection="the same gradient hooks: every parameter used in every batch of the first window, on every rank",
    cost="as unused-parameters",
    fix="find_unused_parameters=False (the default), or static_graph=True: DDP then skips a traversal of the "
    "autograd graph at every step",
    severity="wasteful",
)

MIN_USE_WINDOW = 8
"""Batches watched for parameter use, at least (a dynamic graph may skip a branch a while)."""


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
        return UNUSED.finding(
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
        return WASTED.finding(
            seen=f"find_unused_parameters=True, but every parameter got a gradient in all of the first "
            f"{min(batches)} batches on every rank",
            why="DDP then walks the autograd graph after every forward to look for unused parameters: time spent "
            "for nothing (and it delays the first bucket's all-reduce)",
        )
    return None


def unused_needed_finding(names: Sequence[str]) -> Finding:
    """The finding a rank makes on its own when ``names`` got no gradient under ``find_unused_parameters=False``."""
    return UNUSED.finding(
        seen=f"{len(names)} parameter(s) got no gradient in the first backward pass, with "
        f"find_unused_parameters=False: {name_list(list(names))}",
        # (Not DDP's error text: Lightning rewrites any exception message that contains it.)
        why="DDP waits for a gradient from every parameter: the next step fails (DDP did not finish reducing the "
        "previous step's gradients), and the gradients in their bucket were never averaged across ranks",
    )


@dataclass
class UseReport:
    """What a rank sends at each check: per parameter, the ``batches`` since the last check in which it got a
    gradient (``counts``; None: the use window is not open; ``done``: it closes with this report); and, once,
    the parameters with no gradient after the first backward under ``find_unused_parameters=False``."""

    counts: Optional[list[int]] = None
    batches: int = 0
    done: bool = False
    missing_grads: list[str] = field(default_factory=list)


class ParameterUse(Watch):
    """Counts each parameter's use with gradient hooks over the first window of batches (under
    ``find_unused_parameters=True`` without a static graph), else looks for missing gradients after the
    first backward; keeps every rank's use counts over the window (checkpointed)."""

    rules = (UNUSED, WASTED)
    needs_replicas = True

    def reset(self) -> None:
        super().reset()
        self.hooks: list[Any] = []
        """In place while the use window is open."""
        self.counts: list[int] = []
        self.batches = 0
        self.used_now: set[int] = set()
        self.grads_checked = False
        self.missing_grads: list[str] = []
        self.use_counts: list[list[int]] = []
        """Per rank, per parameter: batches of the use window in which it got a gradient."""
        self.use_batches: list[int] = []

    @property
    def window(self) -> int:
        return max(self.doctor.check_every_n_batches, MIN_USE_WINDOW)

    def start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        watch = self.doctor.parameter_watch
        if watch.ddp is None or not watch.ddp.find_unused or watch.ddp.static_graph:
            return
        if self.doctor.batches_seen < self.window and any(self.doctor.enabled(r.id) for r in self.rules):
            # Local use, whatever other ranks did: .grad alone would show the all-reduced result.
            self.counts = [0] * len(watch.params)
            for index, param in enumerate(watch.params):
                self.hooks.append(param.register_post_accumulate_grad_hook(lambda _p, i=index: self.used_now.add(i)))  # type: ignore[no-untyped-call]

    def after_backward(self) -> None:
        if self.hooks:
            self.batches += 1
            for index in self.used_now:
                self.counts[index] += 1
            self.used_now = set()
            return
        ddp = self.doctor.parameter_watch.ddp
        waits_for_all = ddp is not None and not ddp.find_unused and not ddp.static_graph
        if self.grads_checked or not waits_for_all or not self.doctor.enabled(UNUSED.id):
            return
        self.grads_checked = True  # once per fit
        self.missing_grads = self.doctor.parameter_watch.missing_grads()
        if self.missing_grads:
            self.local.append(unused_needed_finding(self.missing_grads))

    def report(self, trainer: L.Trainer, kind: CheckKind) -> Any:
        # A fit shorter than the window: judge what was seen.
        done = bool(self.hooks) and (kind == "train_end" or self.doctor.batches_seen >= self.window)
        report = UseReport(self.counts if self.hooks else None, self.batches, done, self.missing_grads)
        self.counts, self.batches, self.missing_grads = [0] * len(self.counts), 0, []
        if done:
            self.finish()
        return report

    def judge(self, reports: list[Any], check: Check) -> Iterable[Optional[Finding]]:
        usage: list[UseReport] = [report for report in reports if report.counts is not None]
        if not usage:
            return
        if len(self.use_counts) != len(usage):
            self.use_counts = [[0] * len(u.counts or ()) for u in usage]
            self.use_batches = [0] * len(usage)
        for rank, u in enumerate(usage):
            self.use_counts[rank] = [a + b for a, b in zip(self.use_counts[rank], u.counts or ())]
            self.use_batches[rank] += u.batches
        if usage[0].done:
            watch = self.doctor.parameter_watch
            find_unused = bool(watch.ddp and watch.ddp.find_unused)
            yield check_param_usage(self.use_counts, self.use_batches, watch.param_names, find_unused)

    def on_exception(self, trainer: L.Trainer, exception: BaseException) -> None:
        if isinstance(exception, DistributedDoctorError) or not self.doctor.enabled(UNUSED.id):
            return
        if "Expected to have finished reduction in the prior iteration" in str(exception):
            missing = ", ".join(self.doctor.parameter_watch.missing_grads()[:5]) or "?"
            finding = UNUSED.finding(
                f"DDP stopped: a parameter got no gradient. No gradient now: {missing}", UNUSED.catches
            )
            finding.step = trainer.global_step
            rank_zero_warn("DistributedDoctor " + finding.format(), category=DistributedDoctorWarning)

    def finish(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks = []

    def state_dict(self) -> dict[str, Any]:
        return {"use_counts": [list(c) for c in self.use_counts], "use_batches": list(self.use_batches)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.use_counts = [[int(v) for v in c] for c in state.get("use_counts", [])]
        self.use_batches = [int(v) for v in state.get("use_batches", [])]
