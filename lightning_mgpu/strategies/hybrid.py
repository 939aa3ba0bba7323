"""``HybridParallelStrategy`` (``strategy="hybrid"``): a model split over K devices per process,
micro-batch pipelining inside each replica, DDP across replicas.

Each process owns ``devices_per_replica`` (K) consecutive devices of the ones the Trainer
was given: ``Trainer(devices=8, strategy=HybridParallelStrategy(devices_per_replica=2))``
runs 4 processes (replicas), process ``r`` on devices ``2r`` and ``2r + 1``. On CPU,
``accelerator="cpu", devices=4`` gives 2 processes with two "cpu" stages each; stages run
in their own threads, so pipelining is real there too. K = 1 with ``microbatches=1`` is
plain ``ddp_tuned``.

Two pipelines, both accumulating each parameter's gradient once per step after
``loss.backward()``, so DDP's reducer works unchanged (no ``device_ids``: the module spans
devices), and both exact against one process with the full batch:

* **Staged** (``split_points``, or ``schedule="1f1b"``/``"zero_bubble"``, or no single
  ``nn.Sequential`` child): any ``nn.Module`` as it is, cut where the named submodules
  begin; ``training_step`` runs once per micro-batch inside the pipeline, loss included
  (:class:`~lightning_mgpu.placement.running.engine.StagedStep`; setup in
  :mod:`~lightning_mgpu.placement.staged_fit`).
* **Sequential** (an ``nn.Sequential``, ``schedule="gpipe"``): its layers are split by
  :func:`~lightning_mgpu.placement.planning.plan.plan_stages` (``balance``) from per-layer costs
  measured on one micro-batch (:mod:`~lightning_mgpu.placement.sequential_fit`); the rest
  of the model and the loss stay on the replica's first device.

Rank 0 plans and broadcasts, so every replica has the same layout. ``state_dict`` keys
never change, and checkpoints are written with every tensor on the CPU, so they load into
``ddp_tuned``, a single device or another placement. Refused with a clear error:
``find_unused_parameters=True`` and ``static_graph=True`` (the stages' gradients come from
the pipeline's own backward), ``SyncBatchNorm``, and what each pipeline cannot run (see its
module).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_mgpu.placement.pipeline import Pipeline
from lightning_mgpu.placement.planning.plan import PlacementPlan, plan_stages
from lightning_mgpu.placement.planning.profile import LayerCost
from lightning_mgpu.placement.sequential_fit import (
    capture_input,
    check_sequential,
    device_capacity,
    find_split_module,
    install_pipeline,
    measure_layers,
    remove_pipeline,
)
from lightning_mgpu.placement.planning.split_points import candidate_blocks, check_split_points
from lightning_mgpu.placement.running.engine import StagedStep
from lightning_mgpu.placement.staged_fit import (
    block_profiler,
    check_staged_model,
    choose_split_points,
    place_modules,
    run_logged,
)
from lightning_mgpu._compat.lightning import StrategyRegistryType
from lightning_mgpu._compat.torch import apply_to_own_tensors, copy_state_dict_metadata
from lightning_mgpu.strategies.hybrid_options import check_hybrid_options
from lightning_mgpu.strategies.tuned_ddp import TunedDDPStrategy

__all__ = ["HybridParallelStrategy"]


class HybridParallelStrategy(TunedDDPStrategy):
    """Model split over ``devices_per_replica`` devices, pipelined, with DDP across replicas.

    Args:
        devices_per_replica: K, devices per process; the Trainer's device count must be a
            multiple of it (world size = devices / K per node).
        balance: ``"time"`` (default), ``"memory"``, ``"params"``, or a list of K stage
            sizes (layers per stage, in order).
        microbatches: M, micro-batches per step in the fill-drain schedule (a batch
            smaller than M runs as that many micro-batches of one sample).
        checkpoint: activation recomputation, ``"never"``, ``"except_last"`` or ``"always"``.
        split_module: attribute name (dotted for nested) of the ``nn.Sequential`` to split;
            default: the LightningModule's only ``nn.Sequential`` child.
        split_points: qualified names (relative to the LightningModule) of the K - 1
            submodules where stages 1.. begin, on an unmodified model.
        schedule: ``"gpipe"``, ``"1f1b"`` (at most K micro-batches of activations per
            stage) or ``"zero_bubble"`` (weight gradients deferred into the bubble).
        sample_input: one batch of the split module's input, used to measure per-layer
            time and memory for ``balance="time"``/``"memory"``.
        threads_per_stage: intra-op threads of each CPU stage (default: the process's
            threads divided among its CPU stages).
        **kwargs: everything :class:`TunedDDPStrategy` takes (``bucket_cap_mb``,
            ``compression``, ``timeout``, ``process_group_backend``, DDP options). ``timeout``
            (a ``timedelta``, torch's 30 minutes by default) bounds how long a rank that hangs
            without exiting, e.g. a pipeline stage stuck in user code, can hold the others;
            a rank whose process ends stops the others within seconds.

    Example::

        trainer = Trainer(accelerator="gpu", devices=8,
                          strategy=HybridParallelStrategy(devices_per_replica=2, microbatches=8))
    """

    strategy_name = "hybrid"

    def __init__(
        self,
        devices_per_replica: int = 2,
        balance: Union[str, Sequence[int]] = "time",
        microbatches: int = 1,
        checkpoint: str = "never",
        split_module: Optional[str] = None,
        split_points: Optional[Sequence[str]] = None,
        schedule: str = "gpipe",
        *,
        sample_input: Optional[torch.Tensor] = None,
        threads_per_stage: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        balance = check_hybrid_options(
            devices_per_replica=devices_per_replica,
            balance=balance,
            microbatches=microbatches,
            checkpoint=checkpoint,
            split_module=split_module,
            split_points=split_points,
            schedule=schedule,
            sample_input=sample_input,
            threads_per_stage=threads_per_stage,
            ddp_kwargs=kwargs,
        )
        super().__init__(**kwargs)
        self._devices_per_replica = devices_per_replica
        self._balance = balance
        self._microbatches = microbatches
        self._checkpoint = checkpoint
        self._split_module = split_module
        self._split_points = None if split_points is None else list(split_points)
        self._schedule = schedule
        self._staged: Optional[StagedStep] = None
        self._split_points_used: Optional[list[str]] = None
        self._sample_input = sample_input
        self._threads_per_stage = threads_per_stage
        self._pipeline: Optional[Pipeline] = None
        self._plan: Optional[PlacementPlan] = None
        self._split: Optional[nn.Sequential] = None
        self._split_class: Optional[type] = None

    # ------------------------------------------------------------------ devices
    @property
    def devices_per_replica(self) -> int:
        return self._devices_per_replica

    @property
    def microbatches(self) -> int:
        return self._microbatches

    @property
    def plan(self) -> Optional[PlacementPlan]:
        """The placement in force (after setup)."""
        return self._plan

    @property
    def num_processes(self) -> int:
        if self.parallel_devices is None:
            return 0
        return len(self.parallel_devices) // self._devices_per_replica

    @property
    def replica_devices(self) -> list[torch.device]:
        """The K devices this process's replica runs on."""
        assert self.parallel_devices is not None
        k = self._devices_per_replica
        return list(self.parallel_devices[self.local_rank * k : (self.local_rank + 1) * k])

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank * self._devices_per_replica]

    def _check_device_count(self) -> None:
        count = len(self.parallel_devices or [])
        k = self._devices_per_replica
        if count == 0 or count % k:
            raise ValueError(
                f"HybridParallelStrategy(devices_per_replica={k}) needs a device count per node that is a multiple of {k}, "
                f"but the Trainer has {count} device(s). Use Trainer(devices={max(k, count - count % k) or k}) or change "
                "devices_per_replica."
            )

    def configure_launcher(self) -> None:
        self._check_device_count()
        super().configure_launcher()

    def process_group_device(self) -> Optional[torch.device]:
        # NCCL bound to the first GPU would refuse the buckets of the replica's other GPUs.
        return None if self._devices_per_replica > 1 else super().process_group_device()

    def determine_ddp_device_ids(self) -> Optional[list[int]]:
        return None  # the module spans several devices: DDP must not be given device_ids

    # ------------------------------------------------------------------ placement
    def model_to_device(self) -> None:
        self._check_device_count()
        module = self.lightning_module
        assert module is not None
        if self._devices_per_replica == 1 and self._microbatches == 1:
            module.to(self.root_device)
            return  # plain ddp_tuned
        if self._uses_staged(module):
            self._setup_staged(module)
            return
        name, seq = find_split_module(module, self._split_module)
        self._check_sequential(module, name, seq, warn=True)
        # Everything but the split module goes to the replica's first device; the split module
        # stays where it is (the CPU, usually: it may not fit one device) until each stage
        # moves to its own device. Profiling moves one layer at a time.
        inside = {id(m) for m in seq.modules()}
        for sub in module.modules():
            if id(sub) not in inside:
                apply_to_own_tensors(sub, lambda t: t.to(self.root_device))
        plan = self._make_plan(module, name, seq)
        self._plan = plan
        stages, start = [], 0
        for size, device in zip(plan.sizes, self.replica_devices):
            stage = seq[start : start + size]
            stage.to(device)
            stages.append(stage)
            start += size
        self._pipeline = Pipeline(
            stages,
            self.replica_devices,
            microbatches=self._microbatches,
            checkpoint=self._checkpoint,
            threads_per_stage=self._threads_per_stage,
        )
        self._split, self._split_class = seq, install_pipeline(seq, self._pipeline)
        rank_zero_info(f"{type(self).__name__}: split `{name}` as {plan.summary_line()}\n{plan}")

    def _uses_staged(self, module: nn.Module) -> bool:
        """The staged pipeline (any module, loss inside, every schedule) unless an nn.Sequential is split with GPipe."""
        if self._split_points is not None or self._schedule != "gpipe":
            return True
        if self._split_module is not None:
            return False
        return sum(isinstance(child, nn.Sequential) for child in module.children()) != 1

    def _candidates(self, module: nn.Module) -> list[str]:
        if self._split_module is not None:
            name, seq = find_split_module(module, self._split_module)
            return [f"{name}.{child}" for child, _ in seq.named_children()]
        return candidate_blocks(module)

    def _setup_staged(self, module: nn.Module) -> None:
        devices = self.replica_devices
        points, self._plan = choose_split_points(
            module,
            split_points=self._split_points,
            candidates=lambda: self._candidates(module),
            balance=self._balance,
            devices=devices,
            microbatches=self._microbatches,
            rank_zero=self.global_rank == 0,
            broadcast=lambda sizes: self.broadcast(sizes, src=0),
            warn=rank_zero_warn,
            measure=block_profiler(module, self._microbatches),
        )
        check_staged_model(module, points, devices, checkpoint=self._checkpoint)
        place_modules(module, points, devices)
        self._split_points_used = points
        self._staged = StagedStep(
            module,
            points,
            devices,
            schedule=self._schedule,
            microbatches=self._microbatches,
            threads_per_stage=self._threads_per_stage,
        )
        measured = any(layer.time_ms > 0 for layer in self._plan.layers)
        rank_zero_info(
            f"{type(self).__name__}: {len(devices)} stages beginning at {points}, schedule={self._schedule!r}, "
            f"microbatches={self._microbatches}" + (f"\n{self._plan}" if measured else "")
        )

    @property
    def split_points(self) -> Optional[list[str]]:
        """The submodules where stages 1.. begin, when the staged pipeline runs (after setup)."""
        return self._split_points_used

    def check_model(self, model: Any) -> None:
        super().check_model(model)
        if self._devices_per_replica == 1 and self._microbatches == 1:
            return  # plain ddp_tuned
        if self._uses_staged(model):
            points = self._split_points
            if points is not None:
                check_split_points(model, points, self._devices_per_replica)
            elif len(self._candidates(model)) < self._devices_per_replica:
                raise ValueError(
                    f"{type(model).__name__} has fewer candidate split points than devices_per_replica="
                    f"{self._devices_per_replica}: pass split_points=[...] naming where each stage begins"
                )
            k = self._devices_per_replica
            devices = self.replica_devices if self.parallel_devices else [torch.device("cpu")] * k
            check_staged_model(model, points or [], devices, checkpoint=self._checkpoint)
            return
        name, seq = find_split_module(model, self._split_module)
        self._check_sequential(model, name, seq, warn=False)

    def _check_sequential(self, module: nn.Module, name: str, seq: nn.Sequential, *, warn: bool) -> None:
        warning = check_sequential(
            module,
            name,
            seq,
            num_stages=self._devices_per_replica,
            balance=self._balance,
            microbatches=self._microbatches,
            checkpoint=self._checkpoint,
            devices=self.replica_devices if self.parallel_devices else None,
        )
        if warn and warning is not None:
            rank_zero_warn(warning)

    def _make_plan(self, module: nn.Module, name: str, seq: nn.Sequential) -> PlacementPlan:
        devices = self.replica_devices
        balance: Union[str, list[int]] = self._balance
        layers: list[LayerCost] = []
        sizes: Optional[list[int]] = None
        if self.global_rank == 0:
            sample: Optional[torch.Tensor] = None
            if balance in ("time", "memory"):
                sample = (
                    self._sample_input.to(self.root_device)
                    if self._sample_input is not None
                    else capture_input(module, seq, self.root_device)
                )
                if sample is None:
                    rank_zero_warn(
                        f"HybridParallelStrategy(balance={balance!r}) needs a sample to measure `{name}`: set "
                        "`example_input_array` on the LightningModule or pass sample_input=. Balancing by parameter "
                        "count instead."
                    )
                    balance = "params"
            threads = self._threads_per_stage or max(1, torch.get_num_threads() // len(devices))
            layers = measure_layers(
                seq, sample, microbatches=self._microbatches, device=self.root_device, threads=threads
            )
            capacity = [device_capacity(device) for device in devices]
            sizes = plan_stages(layers, devices, balance, microbatches=self._microbatches, capacity=capacity).sizes
        payload = self.broadcast({"sizes": sizes, "balance": balance, "layers": [c.as_dict() for c in layers]}, src=0)
        return PlacementPlan(
            devices=[str(d) for d in devices],
            sizes=list(payload["sizes"]),  # type: ignore[arg-type]  # broadcast: plain data from rank 0
            balance=payload["balance"],  # type: ignore[arg-type]
            microbatches=self._microbatches,
            layers=[LayerCost.from_dict(c) for c in payload["layers"]],  # type: ignore[union-attr, arg-type]
        )

    # ------------------------------------------------------------------ training hooks
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._pipeline is not None:
            self._pipeline.discard_pending()
        if self._staged is not None:
            self._staged.discard()
        super().on_train_batch_start(batch, batch_idx)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """With the staged pipeline, the LightningModule's ``training_step`` runs once per micro-batch inside the
        pipeline (the loss too, so 1F1B can start backwards early), still called through DDP's forward."""
        staged, module = self._staged, self.lightning_module
        if staged is None or module is None:
            return super().training_step(*args, **kwargs)
        step = module.training_step

        def pipelined(*step_args: Any, **step_kwargs: Any) -> Any:
            module.__dict__.pop("training_step", None)
            return run_logged(staged, module, step, step_args, step_kwargs)

        module.training_step = pipelined  # type: ignore[method-assign]  # read by Lightning's forward redirection
        try:
            return super().training_step(*args, **kwargs)
        finally:
            module.__dict__.pop("training_step", None)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Lightning's ``Strategy.backward`` with the stages' backward right after ``loss.backward()``,
        so that ``on_after_backward`` (called by the precision plugin's ``post_backward``) sees every gradient."""
        runner: Optional[Callable[[], object]] = self._pipeline.backward if self._pipeline is not None else None
        if self._staged is not None:
            runner = self._staged.accumulate
        if runner is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        # The loss was divided by the world size for the whole backward (CommProfiler's
        # prescaled all-reduce): buckets launched by the stages' backward must not divide again.
        prescaler = self.prescaler
        if prescaler is not None and prescaler.world_size > 1 and closure_loss.requires_grad:
            with prescaler.prescaled_backward():
                runner()
        else:
            runner()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_backend() == "nccl"
        ):
            torch.distributed.barrier(device_ids=[self.root_device.index])  # don't let torch guess rank % GPUs
            return
        super().barrier(*args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._pipeline is not None and self._pipeline.has_pending_backward:
            pending = self._pipeline.pending_with_grad()
            self._pipeline.discard_pending()
            if pending:
                raise RuntimeError(
                    "the split module's backward did not run: loss.backward() was called directly. With the hybrid "
                    "strategy call self.manual_backward(loss) (manual optimization), which runs the pipeline's backward."
                )
        return result

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()
        # Only rank 0 writes the checkpoint: the other ranks skip the copy.
        split = self._pipeline is not None or self._staged is not None
        return _to_device(state, torch.device("cpu")) if split and self.is_global_zero else state

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        split = self._pipeline is not None or self._staged is not None
        return _to_device(state, torch.device("cpu")) if split and self.is_global_zero else state

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self._pipeline is None and self._staged is None:
            return super().load_optimizer_state_dict(checkpoint)
        # torch moves each state tensor to its parameter's device; don't move it all to the root device after.
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)

    def state_for_checkpoint(self) -> dict[str, Any]:
        state = super().state_for_checkpoint()
        if self._plan is not None:
            state["hybrid"] = {
                "devices_per_replica": self._devices_per_replica,
                "sizes": list(self._plan.sizes),
                "microbatches": self._microbatches,
                "schedule": self._schedule,
                "split_points": self.split_points,
            }
        return state

    # ------------------------------------------------------------------ registration / teardown
    @classmethod
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        strategy_registry.register(
            "hybrid",
            cls,
            description="model split over devices_per_replica devices, micro-batch pipelined, DDP across replicas",
            override=True,
        )

    def teardown(self) -> None:
        if self._pipeline is not None:
            self._pipeline.close()
        if self._staged is not None:
            self._staged.close()
            self._staged = None
        if self._split is not None and self._split_class is not None:
            remove_pipeline(self._split, self._split_class)
        self._pipeline, self._split, self._split_class = None, None, None
        super().teardown()


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        out = type(value)((k, _to_device(v, device)) for k, v in value.items())
        copy_state_dict_metadata(value, out)  # state_dict versions (e.g. BatchNorm's) survive the copy
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value
