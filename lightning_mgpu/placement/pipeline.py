"""The pipeline: an ``nn.Sequential`` split over several devices, run micro-batch by micro-batch (GPipe fill-drain).

:class:`Pipeline` runs ``K`` stages, each on its own device, with **one worker thread per
stage**: the batch is cut into ``M`` micro-batches; stage ``j`` runs micro-batch ``i`` as
soon as stage ``j - 1`` has handed it over, so while stage 1 works on micro-batch 0,
stage 0 already runs micro-batch 1. Backward runs the same way in reverse. On CUDA each
device's kernels run on that device's stream and cross-device copies on a copy stream of
their own; on CPU every "cpu" stage gets ``threads_per_stage`` intra-op threads (default:
the process's threads divided among the stages), so two stages really run on two cores.

How gradients flow (and why this works under DDP)
-------------------------------------------------
Autograd runs every CPU backward on the thread that called it, so a single backward
over all stages could never overlap stages on CPU. The pipeline therefore keeps the
stages' graphs apart:

1. ``forward`` returns the concatenated output as a fresh leaf (``requires_grad=True``)
   on the input's device and remembers each micro-batch's stage inputs and outputs.
2. The ordinary ``loss.backward()`` stops at that leaf (its ``.grad`` is the gradient
   of the output).
3. :meth:`Pipeline.backward` (the hybrid strategy calls it right after ``loss.backward()``;
   ``post_backward``) runs the stages' backward in the worker threads, micro-batch by
   micro-batch, with ``torch.autograd.grad`` so nothing is accumulated yet; each stage
   sums its parameters' gradients over the micro-batches and then accumulates the sum
   into ``.grad`` with **one** ``torch.autograd.backward`` on the parameters themselves.
   So every parameter's gradient accumulator fires exactly once per step, which is what
   DDP's reducer requires, and the last stage's buckets are reduced while earlier stages
   are still computing. Finally the input gradient flows into whatever came before the
   split module (e.g. an embedding outside it).

Summing per-micro-batch weight gradients costs, for every micro-batch, a fresh weight-sized
tensor and one more pass over it; a stage's plain ``nn.Linear`` layers avoid both by adding
their weight gradient straight into the step's running sum
(:mod:`~lightning_mgpu.placement.accumulate`).

Gradients equal those of the full batch whenever the layers treat samples independently
(no BatchNorm in training mode: it normalises per micro-batch), up to float summation
order. Parameters shared between the split module and the rest of the model are not
supported (they would receive two accumulations; the strategy refuses them).

Checkpointing (``checkpoint=``): ``"never"`` keeps every micro-batch's activations;
``"always"`` recomputes each stage's forward during backward
(``torch.utils.checkpoint``, non-reentrant, RNG state preserved); ``"except_last"``
recomputes all but the last micro-batch, whose backward starts at once (GPipe's choice).
Dropout draws from the device's generator: concurrent CPU stages share one, so the order
of draws (not their distribution) may differ from run to run; for the same reason
recomputation (``checkpoint != "never"``) of dropout layers over several CPU stages is
refused (the recomputed masks would differ). Not supported: using the pipelined module's
input elsewhere in the loss (a skip connection around it: a clear error says so) and
differentiating through it with ``torch.autograd.grad`` (its output is a fresh leaf).

The parts, one module each: :mod:`~lightning_mgpu.placement.planning.schedule` (which action each
stage runs when, as data), :mod:`~lightning_mgpu.placement.running.worker` (the stage threads that
run any schedule), :mod:`~lightning_mgpu.placement.running.microbatch` (scatter, gather, the
pending record), :mod:`~lightning_mgpu.placement.transfer` (copies between devices),
:mod:`~lightning_mgpu.placement.running.recompute` (recomputation) and
:mod:`~lightning_mgpu.placement.accumulate` (one gradient accumulation per step); this
module is the stage work itself, forward and backward.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from lightning_mgpu._checks import check_int
from lightning_mgpu.placement.accumulate import StageGradients
from lightning_mgpu.placement.running.recompute import (
    CHECKPOINT_MODES,
    check_checkpoint_mode,
    check_recompute_randomness,
    recomputes,
    run_checkpointed,
)
from lightning_mgpu.placement.running.microbatch import PendingForward, gather, scatter
from lightning_mgpu.placement.planning.schedule import BACKWARD, FORWARD, Action, fill_drain, phase
from lightning_mgpu.placement.transfer import CopyStreams
from lightning_mgpu.placement.running.worker import (
    PipelineError,
    Receive,
    Send,
    StageWorkers,
    autocast_on,
    stage_context,
    thread_modes,
)

__all__ = ["CHECKPOINT_MODES", "Pipeline", "PipelineError", "check_recompute_randomness"]


class Pipeline:
    """Run ``stages`` (already on ``devices``) as a fill-drain pipeline of ``microbatches``.

    ``output_device``: where :meth:`forward` returns the output (default: the input's device,
    so a loss computed next to the targets just works).
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        devices: Sequence[Union[str, torch.device]],
        *,
        microbatches: int = 1,
        checkpoint: str = "never",
        threads_per_stage: Optional[int] = None,
        output_device: Union[str, torch.device, None] = None,
    ) -> None:
        if len(stages) == 0 or len(stages) != len(devices):
            raise ValueError(
                f"need one device per stage and at least one stage: {len(stages)} stages, {len(devices)} devices"
            )
        self.microbatches = check_int("microbatches", microbatches)
        self.checkpoint = check_checkpoint_mode(checkpoint)
        self.stages = list(stages)
        self.devices = [torch.device(device) for device in devices]
        self.output_device = None if output_device is None else torch.device(output_device)
        cpu_stages = sum(device.type == "cpu" for device in self.devices)
        if threads_per_stage is None:
            threads_per_stage = max(1, torch.get_num_threads() // max(1, cpu_stages))
        self.threads_per_stage = check_int("threads_per_stage", threads_per_stage)
        check_recompute_randomness(self.stages, checkpoint, self.devices)
        self._inplace_first = [_starts_in_place(stage) for stage in self.stages]
        self._gradients = [StageGradients(stage) for stage in self.stages]
        self.params = [gradients.params for gradients in self._gradients]
        self._pending: list[PendingForward] = []
        self._copies = CopyStreams()
        self._workers = StageWorkers(self.devices, self._copies.move)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chunks = scatter(x, self.microbatches)
        record_graph = torch.is_grad_enabled() and (x.requires_grad or any(self.params))
        grad_of_input = record_graph and x.requires_grad and (x.is_floating_point() or x.is_complex())
        modes = thread_modes()
        k, m = len(self.stages), len(chunks)
        inputs: list[list[Optional[torch.Tensor]]] = [[None] * m for _ in range(k)]
        outputs: list[list[Optional[torch.Tensor]]] = [[None] * m for _ in range(k)]

        def run_stage(j: int, actions: list[Action], receive: Receive, send: Send) -> None:
            with stage_context(self.devices[j], self.threads_per_stage, modes):
                # once per call (inside the stage's autocast/grad context), not per micro-batch
                run = (
                    self._gradients[j].forward_fn(autocast_on=autocast_on()) if record_graph else None
                ) or self.stages[j]
                for action in actions:
                    i = action.microbatch
                    inp = receive(action)
                    if record_graph and (j > 0 or grad_of_input) and (inp.is_floating_point() or inp.is_complex()):
                        inp = inp.detach().requires_grad_()
                    else:
                        inp = inp.detach()
                    out = self._run_forward(j, run, inp, record_graph and recomputes(self.checkpoint, i, m))
                    if record_graph:
                        inputs[j][i] = inp if inp.requires_grad else None
                        outputs[j][i] = out
                    send(action, out)

        outputs_sink: list[Any] = [None] * m
        self._workers.run(phase(fill_drain(k, m), FORWARD), run_stage, chunks, outputs_sink)
        result = gather(outputs_sink, self.output_device or x.device, self._copies.move)
        if not record_graph:
            return result
        result.requires_grad_()
        with self._lock:
            self._pending.append(
                PendingForward(
                    source=x,
                    splits=[len(chunk) for chunk in chunks],
                    inputs=inputs,
                    outputs=outputs,
                    result=result,
                )
            )
        return result.clone()  # not the leaf itself: the caller may modify the output in place

    def _run_forward(
        self, j: int, run: Callable[[torch.Tensor], torch.Tensor], inp: torch.Tensor, recompute: bool
    ) -> torch.Tensor:
        if inp.requires_grad and self._inplace_first[j]:
            inp = inp.clone()  # an in-place first layer cannot modify the leaf we differentiate against
        out = run_checkpointed(run, inp) if recompute else run(inp)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"stage {j} returned {type(out).__name__}; every stage must return one tensor")
        return out

    # ------------------------------------------------------------------ backward
    @property
    def has_pending_backward(self) -> bool:
        return bool(self._pending)

    def pending_with_grad(self) -> int:
        """Forward calls whose output received a gradient but whose stages' backward has not run."""
        with self._lock:
            return sum(record.result.grad is not None for record in self._pending)

    def discard_pending(self) -> None:
        """Forget forward calls whose backward never came (e.g. a skipped step)."""
        with self._lock:
            self._pending.clear()

    def backward(self) -> None:
        """Backward through every forward since the last call (see the module docstring)."""
        with self._lock:
            # Outputs without a gradient yet (e.g. a second loss whose manual_backward comes later) stay pending.
            records = [r for r in self._pending if r.result.grad is not None]
            self._pending = [r for r in self._pending if r.result.grad is None]
        if not records:
            return
        # Micro-batches numbered in forward order across the records; the schedule runs them backwards.
        entries = [(r, i) for r, record in enumerate(records) for i in range(len(record.splits))]
        grads_in = [record.output_grads() for record in records]
        for record in records:
            record.input_grads = [None] * len(record.splits)

        def run_stage(j: int, actions: list[Action], receive: Receive, send: Send) -> None:
            gradients = self._gradients[j]
            params = gradients.params
            gradients.start()
            with stage_context(self.devices[j], self.threads_per_stage):
                for action in actions:
                    r, i = entries[action.microbatch]
                    record = records[r]
                    grad_out = receive(action)
                    out, inp = record.outputs[j][i], record.inputs[j][i]
                    wrt = ([inp] if inp is not None else []) + params
                    grads: tuple[Optional[torch.Tensor], ...]
                    if out is not None and out.requires_grad and wrt:
                        grads = torch.autograd.grad(out, wrt, grad_out, allow_unused=True)
                    else:
                        grads = (None,) * len(wrt)
                    record.outputs[j][i] = None  # free the graph as we go
                    if inp is not None:
                        grad_in = grads[0] if grads[0] is not None else torch.zeros_like(inp)
                        grads = grads[1:]
                    else:
                        grad_in = None
                    gradients.add(grads, grad_in)
                    send(action, grad_in)
                gradients.accumulate()

        first_grads: list[Any] = [None] * len(entries)
        self._workers.run(
            phase(fill_drain(len(self.stages), len(entries)), BACKWARD),
            run_stage,
            [grads_in[r][i] for r, i in entries],
            first_grads,
        )
        for n, (r, i) in enumerate(entries):
            records[r].input_grads[i] = first_grads[n]
        roots, grads = [], []
        for record in records:
            if record.source.requires_grad and all(g is not None for g in record.input_grads):
                moved = [self._copies.move(g, record.source.device) for g in record.input_grads]
                grad = torch.cat([g for g in moved if g is not None])  # none is None: checked above
                roots.append(record.source)
                grads.append(grad.reshape(record.source.shape))
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

    def close(self) -> None:
        """Stop the worker threads and drop pending graphs."""
        self.discard_pending()
        self._workers.close()


def _starts_in_place(stage: nn.Module) -> bool:
    """Whether the first leaf module a stage runs is an in-place one (``nn.ReLU(inplace=True)``)."""
    module = stage
    while isinstance(module, nn.Sequential) and len(module) > 0:
        module = module[0]
    return bool(getattr(module, "inplace", False))
