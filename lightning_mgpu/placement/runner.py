"""What the hybrid strategy runs: one object that checks, plans, places and pipelines a model, kept free of Lightning.

:func:`check_model` refuses, before any process starts, what the pipeline cannot run, and
:meth:`PipelineRunner.setup` builds the one engine
(:class:`~lightning_mgpu.placement.running.engine.Pipeline`) for the model in one of two ways:

* **The loss inside** (``split_points``, ``schedule="1f1b"``/``"zero_bubble"``, or no single
  ``nn.Sequential`` child): the LightningModule's ``training_step`` runs once per micro-batch
  inside the pipeline (:meth:`PipelineRunner.step`), cut where the split points begin, given or
  planned among the model's repeated blocks (:func:`~.planning.split_points.candidate_blocks`)
  and measured on its ``example_input_array``. Its ``self.log`` calls, made in the micro-batches'
  threads, are replayed once per step with the sample-weighted mean. Modules go to their
  stage's device by definition order.
* **The loss outside** (an ``nn.Sequential``, ``schedule="gpipe"``): its layers are cut by
  ``balance``, measured on one micro-batch of its input (``sample_input``, or what it receives
  from ``example_input_array``); while the engine lives its class is a subclass whose forward
  runs the pipeline's forwards (its children, hence its ``state_dict``, never change), and the
  rest of the model and the loss stay on the first device, ``training_step`` running once.

Either way one planner (:func:`~.planning.plan.choose_split_points`, rank 0 plans and every
rank gets its plan), one profiler (:mod:`~.planning.profile`), one engine, and
:meth:`PipelineRunner.backward` right after ``loss.backward()`` accumulates every parameter's
gradient once, as DDP's reducer needs.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Number
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from lightning_mgpu._compat.torch import apply_to_own_tensors, is_batchnorm
from lightning_mgpu.placement.planning.plan import BALANCE_MODES, PlacementPlan, check_sizes, choose_split_points
from lightning_mgpu.placement.planning.profile import LayerCost, profile_batch_size, profile_blocks, profile_layers
from lightning_mgpu.placement.planning.schedule import SCHEDULES
from lightning_mgpu.placement.planning.split_points import (
    candidate_blocks,
    check_split_points,
    recompute_units,
    stage_of_modules,
)
from lightning_mgpu.placement.running.engine import Pipeline
from lightning_mgpu.placement.running.handover import current_microbatch
from lightning_mgpu.placement.running.microbatch import map_tensors, split_batch
from lightning_mgpu.placement.running.recompute import CHECKPOINT_MODES, check_recompute_randomness

__all__ = [
    "BALANCE_MODES",
    "CHECKPOINT_MODES",
    "SCHEDULES",
    "PipelineOptions",
    "PipelineRunner",
    "PlacementPlan",
    "block_profiler",
    "check_model",
    "check_sizes",
    "find_split_module",
    "layer_profiler",
    "place_modules",
]


@dataclass(frozen=True)
class PipelineOptions:
    """``HybridParallelStrategy``'s pipeline arguments, checked (``strategies/hybrid_options.py``)."""

    devices_per_replica: int
    balance: Union[str, list[int]] = "time"
    microbatches: int = 1
    checkpoint: str = "never"
    split_module: Optional[str] = None
    split_points: Optional[list[str]] = None
    schedule: str = "gpipe"
    sample_input: Optional[torch.Tensor] = None
    threads_per_stage: Optional[int] = None

    def loss_outside(self, module: nn.Module) -> bool:
        """Whether an ``nn.Sequential`` is split with its loss outside (else the training step runs inside)."""
        if self.split_points is not None or self.schedule != "gpipe":
            return False
        return self.split_module is not None or sum(isinstance(c, nn.Sequential) for c in module.children()) == 1


def check_model(module: nn.Module, options: PipelineOptions, devices: Sequence[torch.device]) -> Optional[str]:
    """Raise ``ValueError`` naming what the pipeline cannot run in ``module`` and how to fix it; return a warning
    where its numerics differ from full-batch training (BatchNorm with micro-batches or recomputation), else None."""
    k = options.devices_per_replica
    if options.loss_outside(module):
        name, seq = find_split_module(module, options.split_module)
        _check_sequential(module, name, seq, options)
        units: list[nn.Module] = list(seq)
        norms = [m for m in seq.modules() if is_batchnorm(m)]
        threaded: nn.Module = seq  # what runs in the pipeline's threads
    else:
        if options.split_points is not None:
            check_split_points(module, options.split_points, k)
        elif len(_candidates(module, options.split_module)) < k:
            raise ValueError(
                f"{type(module).__name__} has fewer candidate split points than devices_per_replica={k}: pass "
                "split_points=[...] naming where each stage begins"
            )
        if getattr(module, "automatic_optimization", True) is False:
            raise ValueError(
                "manual optimization (automatic_optimization = False) is not supported with split_points or schedule="
                "'1f1b'/'zero_bubble': the pipeline runs training_step once per micro-batch and computes the gradients "
                "itself. Use automatic optimization, or split an nn.Sequential (split_module) with schedule='gpipe'."
            )
        name = type(module).__name__
        units = [module.get_submodule(unit) for unit in recompute_units(module, options.split_points or [])]
        norms = [m for m in module.modules() if is_batchnorm(m)] if options.checkpoint != "never" else []
        threaded = module
    if any(isinstance(m, nn.SyncBatchNorm) for m in threaded.modules()):
        raise ValueError(
            f"`{name}` contains SyncBatchNorm: its collectives would run in the pipeline's threads, in an order that "
            "differs between ranks. Use BatchNorm (per micro-batch statistics) or GroupNorm/LayerNorm."
        )
    check_recompute_randomness(units, options.checkpoint, devices)
    if norms and (options.microbatches > 1 or options.checkpoint != "never"):
        m = options.microbatches
        return (
            f"`{name}` contains BatchNorm with microbatches={m}, checkpoint={options.checkpoint!r}: "
            "in training, BatchNorm normalises each micro-batch with that micro-batch's statistics (as in GPipe) "
            f"and updates its running statistics up to {m * (2 if options.checkpoint != 'never' else 1)} times per "
            "step (recomputation updates them again), so results differ from full-batch training. Use "
            "microbatches=1 and checkpoint='never', a larger batch, or GroupNorm/LayerNorm for identical numerics."
        )
    return None


class PipelineRunner:
    """The model's pipeline during a fit: :meth:`step` (loss inside), :meth:`backward`, :meth:`discard`,
    :meth:`check_backward_ran`, :meth:`close`; ``plan`` and ``split_points`` say what was chosen."""

    def __init__(
        self,
        engine: Pipeline,
        plan: PlacementPlan,
        split_points: list[str],
        *,
        split: Optional[tuple[nn.Sequential, type]] = None,
    ) -> None:
        self.engine, self.plan, self.split_points = engine, plan, split_points
        self._split = split  # the nn.Sequential whose class is swapped, and its own class

    @property
    def steps_inside(self) -> bool:
        """Whether ``training_step`` runs inside the pipeline (call :meth:`step`), else once, around it."""
        return self._split is None

    @classmethod
    def setup(
        cls,
        module: nn.Module,
        options: PipelineOptions,
        devices: Sequence[torch.device],
        *,
        rank_zero: bool,
        broadcast: Callable[[Any], Any],
        warn: Callable[[str], None],
        info: Callable[[str], None],
    ) -> PipelineRunner:
        """Check ``module``, plan its stages (rank 0; ``broadcast`` hands rank 0's value to every rank), place its
        modules on ``devices`` and build the engine (see the module docstring)."""
        warning = check_model(module, options, devices)
        if warning is not None:
            warn(warning)
        outside = options.loss_outside(module)
        if outside:
            name, seq = find_split_module(module, options.split_module)
            inside = {id(m) for m in seq.modules()}
            for sub in module.modules():  # the rest of the model: on the first device, the split module stays put
                if id(sub) not in inside:
                    apply_to_own_tensors(sub, lambda t: t.to(devices[0]))
            threads = options.threads_per_stage or max(1, torch.get_num_threads() // len(devices))
            root: nn.Module = seq
            measure = layer_profiler(module, seq, options, devices[0], threads)
            what = f"`{name}` (or pass sample_input=, one batch of its input)"
        else:
            name, root, measure, what = "", module, block_profiler(module, options.microbatches), "the candidate blocks"
        points, plan = choose_split_points(
            root,
            split_points=options.split_points,
            candidates=lambda: (
                [str(i) for i in range(len(seq))] if outside else _candidates(module, options.split_module)
            ),
            balance=options.balance,
            devices=devices,
            microbatches=options.microbatches,
            rank_zero=rank_zero,
            broadcast=broadcast,
            warn=warn,
            measure=measure,
            capacity=[_capacity(device) for device in devices],
            what=what,
        )
        units: Optional[list[str]] = None
        if outside:  # each stage's layers as one module: the stage's unit of recomputation, as in GPipe
            layers = list(seq)
            chunks = [nn.Sequential(*layers[a:b]).to(device) for (a, b), device in zip(plan.boundaries, devices)]
            root, units = nn.Sequential(*chunks), [str(j) for j in range(len(chunks))]
        else:
            place_modules(module, points, devices)
        engine = Pipeline(
            root,
            units[1:] if units is not None else points,
            devices,
            schedule=options.schedule,
            microbatches=options.microbatches,
            checkpoint=options.checkpoint,
            threads_per_stage=options.threads_per_stage,
            checkpoint_units=units,
        )
        if outside:
            info(f"split `{name}` as {plan.summary_line()}\n{plan}")
            return cls(engine, plan, [f"{name}.{point}" for point in points], split=(seq, _install(seq, engine, root)))
        measured = any(layer.time_ms > 0 for layer in plan.layers)
        info(
            f"{len(devices)} stages beginning at {points}, schedule={options.schedule!r}, "
            f"microbatches={options.microbatches}" + (f"\n{plan}" if measured else "")
        )
        return cls(engine, plan, points)

    # ------------------------------------------------------------------ a step
    def step(self, call_through: Callable[..., Any], module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``module.training_step(*args, **kwargs)`` run once per micro-batch inside the pipeline, reached through
        ``call_through`` (the DDP wrapper, whose forward must run for its reducer): ``module.forward`` is redirected
        to the pipelined step for that one call, as Lightning's own forward redirection does for ``training_step``."""
        engine = self.engine

        def pipelined(*step_args: Any, **step_kwargs: Any) -> Any:
            module.__dict__.pop("forward", None)  # the real forward again: the micro-batches call it
            return _run_logged(engine, module, module.training_step, step_args, step_kwargs)

        module.forward = pipelined
        try:
            return call_through(*args, **kwargs)
        finally:
            module.__dict__.pop("forward", None)

    def backward(self) -> bool:
        """Right after ``loss.backward()``: the stages' backward where it is pending, every gradient accumulated once."""
        return self.engine.backward()

    def discard(self) -> None:
        """Forget a step whose backward never came (e.g. a skipped step)."""
        self.engine.discard()

    def check_backward_ran(self) -> None:
        """After an optimizer step: raise if an output of the split module got a gradient whose stages' backward did
        not run (``loss.backward()`` called directly under manual optimization)."""
        pending = self.engine.pending_with_grad()
        self.engine.discard()
        if pending:
            raise RuntimeError(
                "the split module's backward did not run: loss.backward() was called directly. With the hybrid "
                "strategy call self.manual_backward(loss) (manual optimization), which runs the pipeline's backward."
            )

    def close(self) -> None:
        """Stop the engine; the split ``nn.Sequential`` gets its class back."""
        self.engine.close()
        if self._split is not None:
            seq, original = self._split
            seq.__class__ = original
            seq.__dict__.pop(_ENGINE, None)
            self._split = None


# ----------------------------------------------------------------------------- the loss outside: an nn.Sequential
_ENGINE = "lightning_mgpu_pipeline"


class PipelinedSequential(nn.Sequential):
    """The split ``nn.Sequential`` during a fit: same children (same state_dict), pipelined forward."""

    lightning_mgpu_pipeline: tuple[Pipeline, nn.Module]

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Sequential's own name
        engine, stages = self.lightning_mgpu_pipeline
        return engine.forward(stages, input)


def _install(seq: nn.Sequential, engine: Pipeline, stages: nn.Module) -> type:
    original = type(seq)
    seq.__class__ = PipelinedSequential
    object.__setattr__(seq, _ENGINE, (engine, stages))  # not a submodule: nn.Module.__setattr__ would register it
    return original


def find_split_module(module: nn.Module, split_module: Optional[str]) -> tuple[str, nn.Sequential]:
    """``(name, nn.Sequential)`` to split: ``split_module`` if given, else ``module``'s only ``nn.Sequential`` child."""
    if split_module is not None:
        try:
            found = module.get_submodule(split_module)
        except AttributeError:
            found = None
        if not isinstance(found, nn.Sequential):
            what = "nothing" if found is None else type(found).__name__
            raise ValueError(
                f"split_module={split_module!r}: {type(module).__name__}.{split_module} is {what}, "
                "not an nn.Sequential. Point split_module at the nn.Sequential holding the layers to split."
            )
        return split_module, found
    candidates = [(n, child) for n, child in module.named_children() if isinstance(child, nn.Sequential)]
    if len(candidates) != 1:
        names = ", ".join(n for n, _ in candidates) or "none"
        raise ValueError(
            f"HybridParallelStrategy needs to know which nn.Sequential of {type(module).__name__} to split: it has "
            f"{len(candidates)} nn.Sequential children ({names}). Pass split_module='<attribute name>'."
        )
    return candidates[0]


def _check_sequential(module: nn.Module, name: str, seq: nn.Sequential, options: PipelineOptions) -> None:
    k = options.devices_per_replica
    if len(seq) < k:
        raise ValueError(
            f"`{name}` has {len(seq)} layer(s) but devices_per_replica={k}: every device needs at least one layer. "
            f"Use devices_per_replica <= {len(seq)} or a deeper nn.Sequential."
        )
    if not isinstance(options.balance, str):
        check_sizes(options.balance, len(seq), k)
    inside = {id(p) for p in seq.parameters()}
    outside = [
        n
        for n, p in module.named_parameters(remove_duplicate=False)
        if id(p) in inside and not n.startswith(name + ".")
    ]
    if outside:
        raise ValueError(
            f"parameters shared between `{name}` and the rest of the model are not supported by the hybrid strategy "
            f"({', '.join(outside[:3])}): the pipeline would accumulate their gradient separately. Untie them or move "
            "the sharing module inside the split nn.Sequential, or use split_points (the pipeline then runs the whole "
            "training step and sums a shared parameter's gradients over its stages)."
        )
    owner: dict[int, int] = {}
    for index, layer in enumerate(seq):
        for p in layer.parameters():
            if owner.setdefault(id(p), index) != index:
                raise ValueError(
                    f"layers {owner[id(p)]} and {index} of `{name}` share a parameter: the hybrid strategy may place "
                    "them on different devices and would accumulate its gradient twice. Untie them or keep the "
                    "sharing layers in one layer of the nn.Sequential (e.g. wrap them in a sub-module)."
                )


def _candidates(module: nn.Module, split_module: Optional[str]) -> list[str]:
    if split_module is not None:
        name, seq = find_split_module(module, split_module)
        return [f"{name}.{child}" for child, _ in seq.named_children()]
    return candidate_blocks(module)


def layer_profiler(
    module: nn.Module, seq: nn.Sequential, options: PipelineOptions, device: torch.device, threads: int
) -> Optional[Callable[[list[str]], list[LayerCost]]]:
    """``measure`` for the planner: ``seq``'s layers profiled where they are, on one micro-batch of ``sample_input``
    or of what ``seq`` receives from the module's ``example_input_array``; None without either."""
    sample = options.sample_input if options.sample_input is not None else _capture_input(module, seq, device)
    if sample is None:
        return None
    rows = profile_batch_size(sample.shape[0], options.microbatches, seq)
    home = next((p.device for p in seq.parameters()), sample.device)
    return lambda _: profile_layers(seq, sample[:rows].to(home), threads=threads)


def block_profiler(module: nn.Module, microbatches: int) -> Optional[Callable[[list[str]], list[LayerCost]]]:
    """``measure`` for the planner: the candidate blocks profiled on one micro-batch of the module's
    ``example_input_array`` (at least 2 samples with BatchNorm) run through its forward where the module is now, in
    training mode; None without an ``example_input_array``."""
    example = getattr(module, "example_input_array", None)
    if example is None:
        return None
    _, sizes = split_batch(example, 1)
    rows = profile_batch_size(sizes[0], microbatches, module)
    piece = map_tensors(example, lambda t: t[:rows] if t.dim() > 0 else t)

    def measure(candidates: list[str]) -> list[LayerCost]:
        was_training = module.training
        module.train()
        try:
            return profile_blocks(module, candidates, lambda: _call(module, piece))
        finally:
            module.train(was_training)

    return measure


def _call(module: nn.Module, example: Any) -> Any:
    """``module`` run on an ``example_input_array``: a tuple or list as its arguments, a dict as keyword arguments."""
    if isinstance(example, (tuple, list)):
        return module(*example)
    if isinstance(example, dict):
        return module(**example)
    return module(example)


class _Captured(Exception):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__("captured")
        self.value = value


def _capture_input(module: nn.Module, seq: nn.Sequential, device: torch.device) -> Optional[torch.Tensor]:
    """The input ``seq`` receives when ``module`` runs its ``example_input_array`` on ``device`` (None without one,
    or when the forward never reaches ``seq``). Nothing after ``seq`` runs; buffers and the random state are
    restored."""
    example = getattr(module, "example_input_array", None)
    if example is None:
        return None

    def capture(_: nn.Module, args: tuple[Any, ...]) -> None:
        raise _Captured(args[0].detach())

    handle = seq.register_forward_pre_hook(capture)
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        with torch.random.fork_rng(devices=[d for d in {device} if d.type == "cuda"]), torch.no_grad():
            _call(module, map_tensors(example, lambda t: t.to(device)))
    except _Captured as captured:
        return captured.value
    finally:
        handle.remove()
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    return None


def _capacity(device: torch.device) -> Optional[float]:
    """A device's memory in bytes for the planner's capacity check (None: the CPU, not checked)."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return None


# ----------------------------------------------------------------------------- the loss inside
def place_modules(module: nn.Module, split_points: Sequence[str], devices: Sequence[torch.device]) -> None:
    """Move every module's own parameters and buffers to its stage's device (definition order decides the stage);
    a parameter or buffer registered by several modules (tied embeddings) goes with the first of them, and the
    others use a copy (:mod:`~lightning_mgpu.placement.running.shared_params`)."""
    stages = stage_of_modules(module, split_points)
    placed: set[int] = set()

    def mover(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        def move(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) in placed:
                return tensor
            placed.add(id(tensor))
            return tensor.to(device)

        return move

    for name, sub in module.named_modules():
        apply_to_own_tensors(sub, mover(devices[stages.get(name, 0)]))


def _run_logged(
    engine: Pipeline, owner: Any, step: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``engine.run(step, *args, **kwargs)`` with ``owner.log`` calls, made once per micro-batch in the micro-batches'
    threads, collected and replayed once, in the calling thread, with the sample-weighted mean over the micro-batches
    (the full batch's value for per-sample means such as the loss)."""
    real_log = owner.log
    calls: list[tuple[int, float, str, Any, tuple[Any, ...], dict[str, Any]]] = []
    lock = threading.Lock()

    def log(name: str, value: Any, *log_args: Any, **log_kwargs: Any) -> None:
        where = current_microbatch()
        if where is None:
            real_log(name, value, *log_args, **log_kwargs)
            return
        with lock:
            calls.append((where[0], where[1], name, value, log_args, log_kwargs))

    owner.log = log
    try:
        result = engine.run(step, *args, **kwargs)
    finally:
        owner.__dict__.pop("log", None)
    by_name: dict[str, list[tuple[float, Any, tuple[Any, ...], dict[str, Any]]]] = {}  # in first-logged order
    for _, weight, name, value, log_args, log_kwargs in sorted(calls, key=lambda call: call[0]):
        by_name.setdefault(name, []).append((weight, value, log_args, log_kwargs))
    for name, entries in by_name.items():
        values = [value for _, value, _, _ in entries]
        _, _, log_args, log_kwargs = entries[0]
        if all(isinstance(value, torch.Tensor) and value.numel() == 1 for value in values):
            combined: Any = sum(w * value.detach().float().to(values[0].device) for w, value, _, _ in entries)
        elif all(isinstance(value, Number) and not isinstance(value, bool) for value in values):
            combined = float(sum(w * float(value) for w, value, _, _ in entries))
        else:
            combined = values[-1]  # e.g. a torchmetrics Metric: updated by every micro-batch, logged once
        real_log(name, combined, *log_args, **log_kwargs)
    return result
