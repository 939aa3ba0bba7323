"""The bucket-size search that runs inside ``fit``: observe, plan, measure, decide.

:class:`BucketTuner` is driven by ``TunedDDPStrategy`` at two points of every training
step: :meth:`~BucketTuner.window_start` when the first batch of an optimizer step starts,
and :meth:`~BucketTuner.step_end` right after the optimizer step, which is the only place a
new bucket size may be applied (every rank reaches it at the same step, and no gradient
is half-accumulated there). ``step_end`` returns the size to re-wrap the model with, or None.

1. **Observe** (the fit's first step, DDP's default layout): hooks on the parameters record
   the order in which gradients become ready, the order DDP's bucket rebuild will use.
2. **Plan** (end of that step, rank 0, broadcast): predict each candidate's layout from
   that order, keep one candidate per distinct layout, schedule the visits
   (:mod:`~lightning_mgpu.tuning.plan`). If the run is too short for the schedule, or the
   budget too small, or there is only one layout: stop here and keep DDP's default.
3. **Measure**: each timed step's wall time, from the first batch of the step to the end
   of the optimizer step (on CUDA, after synchronising the device: the only moments the
   tuner waits for the GPU, and only during tuning).
4. **Decide** (end of the last visit): element-wise maximum of every rank's step times (the
   slowest rank sets a DDP step's time), the choice made on rank 0
   (:mod:`~lightning_mgpu.tuning.decision`: DDP's default unless another layout is faster with
   confidence) and broadcast: every rank applies the same size.
5. **Measure more, if undecided**: when a layout might be faster but its interval straddles
   the threshold, one more round of the default and those contenders, and decide again, while
   the step budget lasts (:func:`~lightning_mgpu.tuning.plan.extra_budget`); then DDP's default,
   and the summary says the machine was too noisy to decide.

Communication goes through a small :class:`TunerComm`, so that the state machine can be
tested in one process with a fake one.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from lightning_mgpu.tuning.decision import (
    NOISY,
    CandidateResult,
    decide,
    format_table,
    gain_over_default,
    noise_note,
    summarize,
)
from lightning_mgpu.tuning.layout import Candidate, candidates_from_ready_order
from lightning_mgpu.tuning.plan import (
    Plan,
    TuningSettings,
    Visit,
    extension_visits,
    extra_budget,
    make_plan,
    steps_needed,
)

# Where the search stands. "resumed": the size came from a checkpoint, no search this fit;
# "unfinished": the fit ended before the search did (the size being measured stays).
WAITING, OBSERVING, MEASURING = "waiting", "observing", "measuring"
DONE, SKIPPED, RESUMED, UNFINISHED = "done", "skipped", "resumed", "unfinished"
FINAL_STATES = (DONE, SKIPPED, RESUMED, UNFINISHED)


class TunerComm(Protocol):
    """The collectives the tuner needs; every rank calls them at the same step."""

    rank: int

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""

    def max_over_ranks(self, values: list[float]) -> list[float]:
        """Element-wise maximum of ``values`` (same length on every rank)."""


class LocalComm:
    """One process: nothing to exchange."""

    rank = 0

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def max_over_ranks(self, values: list[float]) -> list[float]:
        return list(values)


class TorchComm:
    """``torch.distributed`` on the default process group (tensors on ``device``: NCCL needs CUDA)."""

    def __init__(self, device: torch.device) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.device = device
        self.rank = dist.get_rank()

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def max_over_ranks(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MAX)
        return [float(v) for v in tensor.tolist()]


def host_clock(device: Optional[torch.device] = None) -> Callable[[], float]:
    """Seconds from ``perf_counter``; on CUDA the device is synchronised first."""
    if device is not None and device.type == "cuda":

        def cuda_clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return cuda_clock
    return time.perf_counter


class BucketTuner:
    """Searches the gradient-bucket size during the first steps of a fit (see the module docstring).

    Args:
        settings: the search's knobs (``TunedDDPStrategy``'s ``tune_*`` arguments).
        default_mb: DDP's default bucket size; the fit starts with it, and it is the baseline.
        first_cap_for: the first bucket's cap for a given bucket size (MiB).
        comm: collectives; :class:`TorchComm` in a real run.
        clock: seconds, monotonic.
    """

    def __init__(
        self,
        settings: TuningSettings,
        *,
        default_mb: float,
        first_cap_for: Callable[[float], float],
        comm: Optional[TunerComm] = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.settings = settings
        self.default_mb = float(default_mb)
        self.first_cap_for = first_cap_for
        self.comm: TunerComm = comm if comm is not None else LocalComm()
        self.clock = clock
        self.status = WAITING
        self.reason = ""
        """Why the search was skipped or left unfinished (empty when it completed)."""
        self.candidates: list[Candidate] = []
        self.plan: Optional[Plan] = None
        self.results: list[CandidateResult] = []
        self.chosen_mb: Optional[float] = None
        self.gain: Optional[float] = None
        self.outcome: Optional[str] = None
        """The decision's outcome: ``faster``, ``not faster`` or ``too noisy`` (None before it)."""
        self.extra_rounds = 0
        """Rounds measured beyond the plan because the decision was open."""
        self._extra_left = 0
        self.steps_taken = 0
        """Training steps spent in the search (the observing step included)."""
        self._params: list[torch.Tensor] = []
        self._ready: list[int] = []
        self._hooks: list[Any] = []
        self._remaining: Optional[float] = None
        self._visit = 0
        self._in_visit = 0
        self._t0: Optional[float] = None
        self._timed: list[tuple[int, int, float]] = []
        self._built: dict[int, tuple[int, ...]] = {}
        self._resumed_record: dict[str, Any] = {}
        self._timed_slowest: list[tuple[int, int, float]] = []

    # ------------------------------------------------------------------ state

    @property
    def active(self) -> bool:
        """True while the tuner still drives the fit (observing or measuring)."""
        return self.status in (OBSERVING, MEASURING)

    @property
    def current_mb(self) -> float:
        """The size the tuner wants in force now."""
        if self.chosen_mb is not None:
            return self.chosen_mb
        if self.status == MEASURING and self.plan is not None and self._visit < len(self.plan.visits):
            return self.candidates[self.plan.visits[self._visit].candidate].cap_mb
        return self.default_mb

    def skip(self, reason: str) -> None:
        """Keep DDP's default without searching."""
        self._remove_hooks()
        self.status, self.reason, self.chosen_mb = SKIPPED, reason, self.default_mb

    def abandon(self, reason: str) -> None:
        """The fit ends before the search does: keep whatever size is in force."""
        self._remove_hooks()
        self.status, self.reason = UNFINISHED, reason

    def resume(self, chosen_mb: float, record: Optional[dict[str, Any]] = None) -> None:
        """Use a size found by an earlier run (from its checkpoint); no search."""
        self._remove_hooks()
        self.status, self.chosen_mb = RESUMED, float(chosen_mb)
        self.reason = "bucket size restored from the checkpoint"
        self._resumed_record = dict(record or {})

    def adopt(self, record: dict[str, Any]) -> None:
        """Take over the outcome of a search run elsewhere (a spawned worker's :meth:`record`)."""
        self._remove_hooks()
        self.status = str(record.get("status", self.status))
        self.reason = str(record.get("reason") or "")
        chosen = record.get("chosen_mb")
        self.chosen_mb = None if chosen is None else float(chosen)
        self.gain = record.get("gain_over_default")
        self.outcome = record.get("outcome")
        self.extra_rounds = int(record.get("extra_rounds") or 0)
        self.steps_taken = int(record.get("steps") or 0)
        self.results = [CandidateResult.from_dict(c) for c in record.get("candidates", []) if "step_ms" in c]
        self.candidates = [r.candidate for r in self.results] or [
            Candidate.from_dict(c) for c in record.get("candidates", [])
        ]

    # ------------------------------------------------------------------ driving

    def begin(self, params: Sequence[torch.Tensor], *, remaining_steps: Optional[float]) -> None:
        """Start observing the gradient-ready order; call before the fit's first backward."""
        if self.status != WAITING:
            return
        self._params = list(params)
        self._remaining = remaining_steps
        shortest = steps_needed(2, self.settings)
        if remaining_steps is not None and remaining_steps < self.settings.min_run_multiple * shortest:
            self.skip(
                f"the fit has {remaining_steps:g} optimizer steps left; tuning takes at least {shortest} and runs only "
                f"when the fit is {self.settings.min_run_multiple:g}x longer"
            )
            return
        ready = self._ready
        self._hooks.extend(
            param.register_post_accumulate_grad_hook(lambda _, index=index: ready.append(index))  # type: ignore[no-untyped-call]
            for index, param in enumerate(self._params)
        )
        self.status = OBSERVING

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def window_start(self) -> None:
        """The first batch of an optimizer step starts."""
        if self.status == MEASURING:
            self._t0 = self.clock()

    def step_end(self, built_layout: Callable[[], Optional[tuple[int, ...]]]) -> Optional[float]:
        """An optimizer step just ended, on every rank. Returns a size to re-wrap with, or None.

        ``built_layout`` reads the bucket sizes DDP built (None until it has rebuilt them);
        it is called once per visit, at its end.
        """
        if self.status == OBSERVING:
            self.steps_taken += 1
            return self._make_plan()
        if self.status != MEASURING:
            return None
        assert self.plan is not None
        self.steps_taken += 1
        visit = self.plan.visits[self._visit]
        if visit.skip <= self._in_visit < visit.steps and self._t0 is not None:
            self._timed.append((visit.candidate, visit.round, (self.clock() - self._t0) * 1e3))
        self._t0 = None
        self._in_visit += 1
        if self._in_visit < visit.steps:
            return None
        layout = built_layout()
        if layout is not None:
            self._built[visit.candidate] = tuple(layout)
        self._visit, self._in_visit = self._visit + 1, 0
        if self._visit == len(self.plan.visits):
            return self._decide(current=visit.candidate)
        upcoming: Visit = self.plan.visits[self._visit]
        return self.candidates[upcoming.candidate].cap_mb if upcoming.rewrap else None

    # ------------------------------------------------------------------ plan and decision

    def _predict(self) -> list[dict[str, Any]]:
        candidates = candidates_from_ready_order(
            self._params, self._ready, self.settings.candidates_mb, self.default_mb, self.first_cap_for
        )
        return [c.as_dict() for c in candidates]

    def _make_plan(self) -> Optional[float]:
        self._remove_hooks()
        proposal = self.comm.broadcast_object(self._predict() if self.comm.rank == 0 else None)
        self.candidates = [Candidate.from_dict(c) for c in proposal]
        self._ready = []
        if len(self.candidates) == 1:
            self.status, self.chosen_mb = DONE, self.default_mb
            self.reason = "every candidate size gives the same bucket layout as DDP's default"
            return None
        plan = make_plan(len(self.candidates), self.settings)
        if plan is None:
            needed = steps_needed(len(self.candidates), self.settings)
            self.skip(
                f"tune_steps={self.settings.steps} is too small for {len(self.candidates)} distinct layouts "
                f"(needs at least {needed}); raise tune_steps or pass fewer tune_candidates"
            )
            return None
        if self._remaining is not None and self._remaining < self.settings.min_run_multiple * plan.steps:
            self.skip(
                f"the fit has {self._remaining:g} optimizer steps; tuning {len(self.candidates)} layouts takes "
                f"{plan.steps} and runs only when the fit is {self.settings.min_run_multiple:g}x longer"
            )
            return None
        self.plan, self.status = plan, MEASURING
        self._extra_left = extra_budget(self.settings, plan, self._remaining)
        self._visit, self._in_visit = 0, 1  # the observing step was the first visit's first step
        return None

    def _decide(self, current: int) -> Optional[float]:
        slowest = self.comm.max_over_ranks([ms for _, _, ms in self._timed])
        timed = [(c, r, ms) for (c, r, _), ms in zip(self._timed, slowest)]
        self._timed_slowest = timed
        decision = None
        if self.comm.rank == 0:
            results = summarize(self.candidates, timed, self._built)
            verdict = decide(results, min_gain=self.settings.min_gain, confidence=self.settings.confidence)
            decision = {**verdict.as_dict(), "results": [r.as_dict() for r in verdict.results]}
        decision = self.comm.broadcast_object(decision)  # rank 0's, everywhere: every rank does the same next
        self.results = [CandidateResult.from_dict(r) for r in decision["results"]]
        self.outcome = str(decision["outcome"])
        if self.outcome == NOISY and self._extend(decision["contenders"], current):
            upcoming = self.plan.visits[self._visit] if self.plan is not None else None
            return self.candidates[upcoming.candidate].cap_mb if upcoming is not None and upcoming.rewrap else None
        chosen = int(decision["chosen"])
        self.chosen_mb = self.candidates[chosen].cap_mb
        self.gain = gain_over_default(self.results, chosen)
        self.status = DONE
        return None if chosen == current else self.chosen_mb

    def _extend(self, contenders: Sequence[int], current: int) -> bool:
        """Append one more round over ``contenders`` to the plan if the budget allows it."""
        assert self.plan is not None
        visits = extension_visits(
            contenders,
            previous=current,
            round_index=max(v.round for v in self.plan.visits) + 1,
            settings=self.settings,
            measure=self.plan.measure,
        )
        cost = sum(v.steps for v in visits)
        if cost > self._extra_left:
            return False
        self._extra_left -= cost
        self.plan = Plan(self.plan.visits + visits, self.plan.measure)
        self.extra_rounds += 1
        return True

    # ------------------------------------------------------------------ report

    @property
    def chosen_index(self) -> Optional[int]:
        return next((i for i, result in enumerate(self.results) if result.candidate.cap_mb == self.chosen_mb), None)

    def table(self) -> str:
        index = self.chosen_index
        return format_table(self.results, index) if self.results and index is not None else ""

    def summary(self) -> str:
        """One paragraph for ``rank_zero_info``: what was chosen, why, and the table."""
        if self.status == RESUMED:
            return (
                f"bucket_cap_mb={self.chosen_mb:g} restored from the checkpoint (tuned by an earlier run); not tuning."
            )
        if self.status == SKIPPED:
            return f"not tuning the bucket size ({self.reason}); using DDP's default bucket_cap_mb={self.default_mb:g}."
        if self.status == DONE and not self.results:
            return f"bucket_cap_mb={self.chosen_mb:g}: {self.reason}."
        if self.status != DONE:
            return f"bucket-size tuning did not finish ({self.reason or 'the fit ended first'}); DDP's buckets stay as they are."
        assert self.plan is not None
        index = self.chosen_index
        chosen = self.results[index] if index is not None else None
        confidence = f"{self.settings.confidence:.0%} confidence"
        if chosen is not None and chosen.candidate.is_default:
            others = {r.candidate.cap_mb: _ratio(r, chosen) for r in self.results if not r.candidate.is_default}
            if self.outcome == NOISY:
                verdict = f"kept DDP's default {self.chosen_mb:g} MiB: the machine was too noisy to decide"
            else:
                verdict = (
                    f"kept DDP's default {self.chosen_mb:g} MiB: no other layout was at least "
                    f"{self.settings.min_gain:.0%} faster with {confidence}"
                )
            if others:
                best = min(others, key=lambda cap: others[cap])
                verdict += f" (best other: {best:g} MiB, {others[best] - 1:+.1%})"
        else:
            change = (
                "" if self.gain is None else f", {-self.gain:+.1%} step time vs DDP's default {self.default_mb:g} MiB"
            )
            verdict = f"chose {self.chosen_mb:g} MiB{change}, faster with {confidence}"
        extra = f" + {self.extra_rounds} more of the closest" if self.extra_rounds else ""
        head = (
            f"bucket_cap_mb='auto' {verdict}; tuned in {self.steps_taken} ordinary training steps: "
            f"{len(self.candidates)} distinct layouts x {self.settings.rounds} rounds{extra}, {self.plan.measure} timed "
            "steps per visit; slowest rank's median step time (* = chosen):"
        )
        note = noise_note(self.results, self.outcome or "", self.settings.min_gain)
        if chosen is not None and chosen.candidate.is_default:
            tail = "Leave bucket_cap_mb=None (DDP's default) to skip tuning in a run like this one."
        else:
            tail = f"Pass bucket_cap_mb={self.chosen_mb:g} to skip tuning in a run like this one."
        return "\n".join(part for part in (head, self.table(), note, tail) if part)

    def record(self) -> dict[str, Any]:
        """The search as plain JSON types (checkpoints, ``lightning-mgpu tune``)."""
        if self.status == RESUMED:
            return {**self._resumed_record, "status": RESUMED, "chosen_mb": self.chosen_mb}
        return {
            "status": self.status,
            "reason": self.reason,
            "chosen_mb": self.chosen_mb,
            "default_mb": self.default_mb,
            "gain_over_default": self.gain,
            "steps": self.steps_taken,
            "rounds": self.settings.rounds,
            "extra_rounds": self.extra_rounds,
            "outcome": self.outcome,
            "confidence": self.settings.confidence,
            "min_gain": self.settings.min_gain,
            "measure": None if self.plan is None else self.plan.measure,
            "candidates": [r.as_dict() for r in self.results] or [c.as_dict() for c in self.candidates],
            "timed_ms": [[c, r, ms] for c, r, ms in self._timed_slowest],
        }


def _ratio(result: CandidateResult, default: CandidateResult) -> float:
    """``result``'s step time over the default's: the decision's estimate when it made one, else the medians'."""
    if result.vs_default is not None:
        return result.vs_default.ratio
    return result.step_ms / default.step_ms if default.step_ms > 0 else 1.0
