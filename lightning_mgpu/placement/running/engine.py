"""The pipeline engine: any ``nn.Module`` as it is, cut into stages where named submodules are called, run micro-batch
by micro-batch under any schedule.

:class:`Pipeline` takes a root module, the qualified names of the submodules where a new stage
begins (``split_points``, torch's convention), one device per stage and a schedule, and runs a
function of the root once per micro-batch, in one of two ways:

* :meth:`Pipeline.run`: **the loss inside** (a LightningModule's ``training_step``: forward
  **and** loss). The function's result on the last stage is the micro-batch's loss, so the
  last stage can start that micro-batch's backward at once, which is what 1F1B and
  zero-bubble need; the whole schedule runs within the call. The loss's gradient is
  ``n_i / N`` (the micro-batch's share of the batch): the step's gradient is that of the
  sample-weighted mean of the micro-batch losses, the full batch's loss when the loss is a
  mean over samples (``reduction="mean"``; pass ``loss_reduction="sum"`` for sums).
* :meth:`Pipeline.forward`: **the loss outside** (an ``nn.Sequential`` split as a module of a
  larger model, with any loss after it): the forwards run now, fill-drain, and the call
  returns the joined output as a tensor of its own; the stages' backward waits for
  :meth:`Pipeline.backward`, called after ``loss.backward()`` has left the output's gradient;
  the input's gradient then flows on into whatever made it.

How it runs:

* **Forward.** Each micro-batch runs the function in a thread of its own (its Python call
  stack cannot move between threads); a forward pre-hook on every split point stops it there
  until the stage that begins at that point gives it its turn
  (:mod:`~lightning_mgpu.placement.running.handover`). Stage ``j``'s worker thread
  (:mod:`~lightning_mgpu.placement.running.worker`) is the stage's clock: it runs its
  schedule's actions in order, and for an ``F`` action lets micro-batch ``i`` run from split
  point ``j`` to split point ``j + 1``. So a stage never runs two things at once, and the
  user's code, however it is written, runs unchanged.
* **The cut.** At a split point, every tensor argument that requires grad is replaced by a
  detached copy of itself, a new leaf of the next stage's graph, moved to that stage's device
  (on CUDA on a copy stream of its own); the original's gradient edge is remembered. So the
  stages' autograd graphs are apart and each stage's backward runs in its own worker thread
  (:mod:`~lightning_mgpu.placement.running.gradients`). A tensor passed to several split points
  (encoder states given to every block) is cut each time and its gradients go back to the
  stage that made it.
* **Gradients** are summed per stage and accumulated into ``.grad`` once, by
  :meth:`Pipeline.backward`, so each gradient accumulator (and DDP's hook on it) fires once per
  step. **Activation checkpointing** (``checkpoint=``) runs chosen modules' forwards again in
  backward (:mod:`~lightning_mgpu.placement.running.recompute`).

Supported: any Python between the split points, tuples/dicts of tensors as arguments,
non-tensor arguments, in-place layers at a split point (their input is copied first),
BatchNorm (per micro-batch statistics, as in every micro-batched pipeline), dropout, tied
parameters across stages (:mod:`~lightning_mgpu.placement.running.shared_params`). Refused with a
clear error (:class:`PipelineModelError`): a split point that is not called, called twice or out
of order in one step; a tensor computed before a split point used after it without being passed
to it (a skip connection around the split point), at the first backward, before any parameter
changed. A stage that fails is named (:class:`~lightning_mgpu.placement.running.worker.PipelineError`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from lightning_mgpu._checks import check_int
from lightning_mgpu.placement.planning.schedule import (
    BACKWARD,
    FORWARD,
    SCHEDULES,
    WEIGHT,
    Action,
    Schedule,
    fill_drain,
    make_schedule,
    phase,
)
from lightning_mgpu.placement.planning.split_points import recompute_units
from lightning_mgpu.placement.running.gradients import StageGradients, combine_results, loss_of
from lightning_mgpu.placement.running.handover import (
    Aborted,
    CopyStreams,
    Cut,
    MicroRun,
    PipelineModelError,
    current_run,
    running,
)
from lightning_mgpu.placement.running.microbatch import map_tensors, split_batch
from lightning_mgpu.placement.running.recompute import (
    CHECKPOINT_MODES,
    Recompute,
    check_recompute_randomness,
    recomputes,
    starts_in_place,
)
from lightning_mgpu.placement.running.shared_params import SharedParameterCopies
from lightning_mgpu.placement.running.worker import Receive, Send, StageWorkers, stage_context, thread_modes

__all__ = ["LOSS_REDUCTIONS", "Pipeline", "PipelineModelError"]

LOSS_REDUCTIONS = ("mean", "sum")


@dataclass
class _Forward:
    """One :meth:`Pipeline.forward` call whose backward is pending."""

    source: torch.Tensor  # the input as the caller gave it (may carry a graph from earlier layers)
    micros: list[MicroRun]
    sizes: list[int]  # the micro-batches' sizes
    output: torch.Tensor  # the leaf whose gradient the caller's loss.backward() fills


class Pipeline:
    """Run a function of ``root`` micro-batch by micro-batch over the stages that ``split_points`` cut it into.

    ``devices[j]``: stage ``j``'s device (``len(split_points) + 1`` of them). Modules are not moved here (the
    strategy places them). ``schedule``: a name of :data:`~lightning_mgpu.placement.planning.schedule.SCHEDULES`.
    ``checkpoint``: one of :data:`~lightning_mgpu.placement.running.recompute.CHECKPOINT_MODES`, recomputing the
    modules named by ``checkpoint_units`` (default: the split points and the model's repeated blocks that hold
    none). A parameter used by modules of stages on different devices (tied embeddings) is used through a
    differentiable copy on the using stage's device; ``copy_shared=True`` copies it even where the devices are the
    same (how the tests run that path on CPU stages).
    """

    def __init__(
        self,
        root: nn.Module,
        split_points: Sequence[str],
        devices: Sequence[Union[str, torch.device]],
        *,
        schedule: str = "gpipe",
        microbatches: int = 1,
        threads_per_stage: Optional[int] = None,
        loss_reduction: str = "mean",
        checkpoint: str = "never",
        checkpoint_units: Optional[Sequence[str]] = None,
        copy_shared: bool = False,
    ) -> None:
        self.split_points = list(split_points)
        self.devices = [torch.device(device) for device in devices]
        if len(self.devices) != len(self.split_points) + 1:
            raise ValueError(
                f"{len(self.split_points)} split point(s) make {len(self.split_points) + 1} stages, but "
                f"{len(self.devices)} device(s) were given: pass one device per stage"
            )
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {schedule!r}")
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
        self.schedule_name = schedule
        self.microbatches = check_int("microbatches", microbatches)
        self.loss_reduction = loss_reduction
        self.checkpoint = checkpoint
        self.root = root
        self.modules = [_submodule(root, name) for name in self.split_points]
        cpu_stages = sum(device.type == "cpu" for device in self.devices)
        if threads_per_stage is None:
            threads_per_stage = max(1, torch.get_num_threads() // max(1, cpu_stages))
        self.threads_per_stage = check_int("threads_per_stage", threads_per_stage)
        units = list(recompute_units(root, self.split_points) if checkpoint_units is None else checkpoint_units)
        check_recompute_randomness([root.get_submodule(unit) for unit in units], checkpoint, self.devices)
        self._in_place = [starts_in_place(module) for module in (root, *self.modules)]  # by boundary
        self._copies = CopyStreams()
        self._workers = StageWorkers(self.devices, self._move)
        self._threads: Optional[ThreadPoolExecutor] = None
        self._thread_count = 0
        self._result_leaf: Optional[torch.Tensor] = None
        self._pending: list[_Forward] = []
        self._lock = threading.Lock()
        self._handles = [
            module.register_forward_pre_hook(self._hook(n + 1), with_kwargs=True)
            for n, module in enumerate(self.modules)
        ]
        # after the split-point hooks: a split point that also uses a shared parameter gets its copy once its turn came
        self._shared = SharedParameterCopies(root, self.split_points, self.devices, always=copy_shared)
        copied = {id(getattr(root.get_submodule(module), name)) for module, name, _ in self._shared.uses}
        self.gradients = StageGradients(root, self.split_points, self.devices, self._copies, exclude=frozenset(copied))
        self._recompute = Recompute(root, units if checkpoint != "never" else [], owner=self)

    @property
    def num_stages(self) -> int:
        return len(self.devices)

    @property
    def linear_grads(self) -> Any:
        """The ``nn.Linear`` fast path (:class:`~lightning_mgpu.placement.running.linear_grads.LinearWeightGrads`)."""
        return self.gradients.linear_grads

    def _move(self, value: Any, device: torch.device) -> Any:
        return self._copies.move(value, device) if isinstance(value, torch.Tensor) else value

    # ------------------------------------------------------------------ the loss inside
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` run once per micro-batch (the tensors of ``args``/``kwargs`` cut along their first
        dimension) through the stages and the whole schedule, backward included; returns the combined result
        (:func:`~lightning_mgpu.placement.running.gradients.combine_results`). Parameter gradients are summed, not accumulated: call :meth:`backward` after the combined
        loss's backward."""
        micros, _ = self._micro_runs(args, kwargs, entry=False)
        self.gradients.clear()
        self._result_leaf = None
        self._execute(make_schedule(self.schedule_name, self.num_stages, len(micros)), micros, fn)
        combined, self._result_leaf = combine_results(
            [micro.result for micro in micros],
            [micro.weight for micro in micros],
            trains=any(micro.trains for micro in micros),
        )
        return combined

    # ------------------------------------------------------------------ the loss outside
    def forward(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``fn(x)`` (e.g. the split module itself; one tensor in, one out) run once per micro-batch through the
        stages, forwards only (fill-drain); returns the micro-batches' outputs joined on ``x``'s device, as a tensor
        of its own. With grad enabled, the stages' backward waits for :meth:`backward`."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"the pipelined module takes one tensor (batch first), got {type(x).__name__}")
        micros, sizes = self._micro_runs((x,), {}, entry=True)
        self._execute(phase(fill_drain(self.num_stages, len(micros)), FORWARD), micros, fn)
        results = [micro.result for micro in micros]
        for result in results:
            if not isinstance(result, torch.Tensor):
                raise TypeError(f"the pipelined module returned {type(result).__name__}; it must return one tensor")
        joined = [self._copies.move(result.detach(), x.device) for result in results]
        output = torch.cat(joined) if len(joined) > 1 else joined[0].clone()
        if not torch.is_grad_enabled() or not any(result.requires_grad for result in results):
            return output
        output.requires_grad_()
        with self._lock:
            self._pending.append(_Forward(source=x, micros=micros, sizes=sizes, output=output))
        return output.clone()  # not the leaf itself: the caller may change the output in place

    @property
    def has_pending_backward(self) -> bool:
        return bool(self._pending)

    def pending_with_grad(self) -> int:
        """:meth:`forward` calls whose output received a gradient but whose stages' backward has not run."""
        with self._lock:
            return sum(record.output.grad is not None for record in self._pending)

    def _backward_outside(self, records: list[_Forward]) -> None:
        """The stages' backward of ``records`` (fill-drain, in forward order numbered across them), then their inputs'."""
        micros = [micro for record in records for micro in record.micros]
        feed: list[Any] = []
        for record in records:
            grad = record.output.grad
            assert grad is not None  # only records whose output received one
            record.output.grad = None
            feed += list(torch.split(grad, record.sizes))
        sink: list[Any] = [None] * len(micros)
        self.gradients.clear()
        self._execute(phase(fill_drain(self.num_stages, len(micros)), BACKWARD), micros, None, feed=feed, sink=sink)
        roots, grads, start = [], [], 0
        for record in records:
            sent = sink[start : start + len(record.micros)]
            start += len(record.micros)
            if not record.source.requires_grad or not all(sent):
                continue
            pieces = [self._copies.move(grad, record.source.device) for message in sent for grad in message.values()]
            roots.append(record.source)
            grads.append(torch.cat(pieces).reshape(record.source.shape))
        if roots:
            try:
                torch.autograd.backward(roots, grads)
            except RuntimeError as exc:
                if "backward through the graph a second time" not in str(exc):
                    raise
                raise RuntimeError(
                    "the pipelined module's input is also used elsewhere in the loss (e.g. a skip connection around "
                    "the split nn.Sequential, or an auxiliary loss on its input): its graph was already freed by "
                    "loss.backward(). Move the skip connection inside the split module (a layer that returns "
                    "f(x) + x), or detach the other use."
                ) from exc

    # ------------------------------------------------------------------ both
    def backward(self) -> bool:
        """After the loss's backward: the stages' backward of pending :meth:`forward` calls, then the step's summed
        gradients accumulated into ``.grad`` (times the gradient :meth:`run`'s combined loss received: 1 for a plain
        ``loss.backward()``; a loss scale or a pre-division shows up here). Each parameter's accumulator fires once.
        Returns False when there was nothing to accumulate. A :meth:`forward` output without a gradient yet (a second
        loss whose backward comes later) stays pending."""
        with self._lock:
            records = [record for record in self._pending if record.output.grad is not None]
            self._pending = [record for record in self._pending if record.output.grad is None]
        if records:
            self._backward_outside(records)
            return self.gradients.accumulate()
        leaf, self._result_leaf = self._result_leaf, None
        if leaf is None or leaf.grad is None:
            self.gradients.clear()
            return False
        return self.gradients.accumulate(leaf.grad)

    def discard(self) -> None:
        """Forget a step's summed gradients and pending forwards (e.g. a skipped step)."""
        self._result_leaf = None
        with self._lock:
            self._pending.clear()
        self.gradients.clear()

    def _micro_runs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], *, entry: bool
    ) -> tuple[list[MicroRun], list[int]]:
        pieces, sizes = split_batch((args, kwargs), self.microbatches)
        recompute = self.checkpoint != "never" and torch.is_grad_enabled()
        micros = []
        for i, (piece_args, piece_kwargs) in enumerate(pieces):
            micro = MicroRun(
                index=i,
                weight=sizes[i] / sum(sizes) if self.loss_reduction == "mean" else 1.0,
                args=tuple(piece_args),
                kwargs=dict(piece_kwargs),
                num_stages=self.num_stages,
                owner=self,
                recompute=recompute and recomputes(self.checkpoint, i, len(pieces)),
                loss_inside=not entry,
            )
            if entry:  # the loss outside: the input is cut too, its gradient handed back by stage 0
                micro.args, micro.kwargs = map_tensors((micro.args, micro.kwargs), self._cut(micro, 0))
            micros.append(micro)
        return micros, sizes

    def _execute(
        self,
        schedule: Schedule,
        micros: list[MicroRun],
        fn: Optional[Callable[..., Any]],
        *,
        feed: Optional[list[Any]] = None,
        sink: Optional[list[Any]] = None,
    ) -> None:
        """Run ``schedule`` over ``micros``: an ``F`` starts (stage 0) or continues a micro-batch's thread running
        ``fn``, a ``B``/``W`` runs the stage's backward; ``feed``: the output gradients of a backward-only run."""
        modes = thread_modes()
        m = len(micros)
        threads = self._get_threads(m) if fn is not None else None
        running_threads: list[Optional[Future[None]]] = [None] * m
        split_weight = any(action.kind == WEIGHT for actions in schedule for action in actions)

        def program(j: int, actions: list[Action], receive: Receive, send: Send) -> None:
            with stage_context(self.devices[j], self.threads_per_stage, modes):
                for action in actions:
                    micro = micros[action.microbatch]
                    if action.kind == FORWARD:
                        receive(action)
                        if j == 0:
                            assert threads is not None and fn is not None
                            running_threads[micro.index] = threads.submit(self._run_micro, micro, fn, modes)
                        micro.grant(j)
                        micro.wait_reached(j + 1)
                        send(action, None)
                    elif action.kind == BACKWARD:
                        message = receive(action)
                        send(action, self.gradients.backward(j, micro, message, split_weight))
                    else:
                        self.gradients.weight(j, micro)

        try:
            self._workers.run(schedule, program, feed or [None] * m, sink if sink is not None else [None] * m)
        finally:
            for micro in micros:
                micro.abort()  # threads still waiting for a turn (after a failure) unwind
            for future in running_threads:
                if future is not None:
                    future.exception()  # wait: no user code keeps running after the step

    def _run_micro(self, micro: MicroRun, fn: Callable[..., Any], modes: dict[str, Any]) -> None:
        try:
            with running(micro), stage_context(self.devices[0], self.threads_per_stage, modes):
                micro.arrive(0)
                result = fn(*micro.args, **micro.kwargs)
            if micro.reached != self.num_stages - 1:
                missing = self.split_points[micro.reached]
                raise PipelineModelError(
                    f"split point {missing!r} was not called in this step (micro-batch {micro.index} ended in stage "
                    f"{micro.reached}): every split point must be called once per step, in order. Check the name, "
                    "or whether the model skips that submodule for this input."
                )
            micro.result = result
            if micro.loss_inside:
                micro.loss = loss_of(result)
            micro.trains = micro.loss is not None and micro.loss.requires_grad
            micro.arrive(self.num_stages)
        except Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the stage that waits for this micro-batch
            micro.fail(exc)

    def _hook(self, boundary: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            micro = current_run()
            device = self.devices[boundary]
            if micro is None:  # not a pipelined step (e.g. validation): move the inputs, nothing else
                return map_tensors((args, kwargs), lambda t: self._copies.move(t, device))
            if micro.owner is not self:
                return None
            if micro.reached != boundary - 1 or micro.granted != boundary - 1:
                raise PipelineModelError(
                    f"split point {self.split_points[boundary - 1]!r} was called while stage {micro.reached} was "
                    f"running micro-batch {micro.index}: every split point must be called exactly once per step, in "
                    "the order the split points are given. Is a split-point submodule used twice (shared blocks)?"
                )
            new = map_tensors((args, kwargs), self._cut(micro, boundary))
            micro.arrive(boundary)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            return new

        return hook

    def _cut(self, micro: MicroRun, boundary: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """What a tensor becomes when it enters stage ``boundary`` (see the module docstring)."""
        clone, device = self._in_place[boundary], self.devices[boundary]
        made: dict[tuple[int, int], torch.Tensor] = {}

        def cut(tensor: torch.Tensor) -> torch.Tensor:
            if not tensor.requires_grad or not (tensor.is_floating_point() or tensor.is_complex()):
                return self._copies.move(tensor, device)
            if boundary and tensor.grad_fn is None and id(tensor) not in micro.leaf_stage:
                return tensor  # a parameter (or another leaf of the user's) passed along: used where it is
            edge = get_gradient_edge(tensor)
            key = (id(edge.node), edge.output_nr)
            if key in made:
                return made[key]
            known = micro.sources.get(key)
            if known is None:
                stage = micro.leaf_stage.get(id(tensor), boundary - 1)
                micro.sources[key] = (stage, edge)
            else:
                stage = known[0]
            leaf = self._copies.move(tensor.detach(), device).requires_grad_()
            micro.cuts[boundary].append(Cut(key=key, source_stage=stage, leaf=leaf))
            micro.leaf_stage[id(leaf)] = boundary
            made[key] = leaf.clone() if clone else leaf
            return made[key]

        return cut

    # ------------------------------------------------------------------ threads
    def _get_threads(self, count: int) -> ThreadPoolExecutor:
        if self._threads is None or self._thread_count < count:
            if self._threads is not None:
                self._threads.shutdown(wait=True)
            self._threads = ThreadPoolExecutor(max_workers=count, thread_name_prefix="lightning_mgpu-microbatch")
            self._thread_count = count
        return self._threads

    def close(self) -> None:
        """Remove the hooks, give the modules their forwards and classes back, and stop the threads."""
        self.discard()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._recompute.close()
        self._shared.close()
        self.gradients.linear_grads.close()
        self._workers.close()
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None


def _submodule(root: nn.Module, name: str) -> nn.Module:
    try:
        return root.get_submodule(name)
    except AttributeError:
        raise ValueError(
            f"split point {name!r} is not a submodule of {type(root).__name__}: give qualified names as "
            "root.named_modules() lists them (e.g. 'model.transformer.h.2')"
        ) from None
