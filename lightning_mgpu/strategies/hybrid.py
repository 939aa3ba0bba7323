"""``HybridParallelStrategy`` (``strategy="hybrid"``): a model split over K devices per process,
micro-batch pipelining inside each replica, DDP across replicas.

Each process owns ``devices_per_replica`` (K) consecutive devices of the ones the Trainer
was given: ``Trainer(devices=8, strategy=HybridParallelStrategy(devices_per_replica=2))``
runs 4 processes (replicas), process ``r`` on devices ``2r`` and ``2r + 1``. On CPU,
``accelerator="cpu", devices=4`` gives 2 processes with two "cpu" stages each; stages run
in their own threads, so pipelining is real there too. K = 1 with ``microbatches=1`` is
plain ``ddp_tuned``.

One pipeline engine, run through one facade
(:class:`~lightning_mgpu.placement.runner.PipelineRunner`): it accumulates each parameter's
gradient once per step after ``loss.backward()``, so DDP's reducer works unchanged (no
``device_ids``: the module spans devices), exact against one process with the full batch.
With ``split_points``, ``schedule="1f1b"``/``"zero_bubble"`` or no single ``nn.Sequential``
child, ``training_step`` runs once per micro-batch inside the pipeline, loss included
(:meth:`training_step` reaches it through DDP's forward, as Lightning's own redirection does);
an ``nn.Sequential`` split with ``schedule="gpipe"`` is pipelined as a module, its loss outside.

Rank 0 plans and broadcasts, so every replica has the same layout. ``state_dict`` keys
never change, and checkpoints are written with every tensor on the CPU, so they load into
``ddp_tuned``, a single device or another placement. Refused with a clear error:
``find_unused_parameters=True`` and ``static_graph=True`` (the stages' gradients come from
the pipeline's own backward), ``SyncBatchNorm``, and what the pipeline cannot run (see
:mod:`~lightning_mgpu.placement.runner`).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any, Optional, Union

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_mgpu.placement.runner import PipelineRunner, PlacementPlan, check_model
from lightning_mgpu._compat.lightning import StrategyRegistryType
from lightning_mgpu._compat.torch import copy_state_dict_metadata
from lightning_mgpu.strategies.parts.hybrid_options import check_hybrid_options
from lightning_mgpu.strategies.tuned_ddp import TunedDDPStrategy
from lightning_mgpu.watch import DEFAULT_HANG_TIMEOUT_S

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
        hang_timeout: seconds without progress before the hang watch reports every rank's place
            and ends the job (default 300; ``None``: off), as :class:`TunedDDPStrategy`'s. A
            step's work runs in the stage threads while the main thread waits for them: a
            pipeline stage stuck for that long is reported as its rank's main thread waiting
            in the pipeline.
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
    accepts_static_graph = False  # refused (parts/hybrid_options.py): not a fix this strategy can offer

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
        hang_timeout: Optional[float] = DEFAULT_HANG_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        self._options = check_hybrid_options(
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
        super().__init__(hang_timeout=hang_timeout, **kwargs)
        self._devices_per_replica = devices_per_replica
        self._microbatches = microbatches
        self._runner: Optional[PipelineRunner] = None
        self._plan: Optional[PlacementPlan] = None  # kept after teardown, as the split points
        self._split_points: Optional[list[str]] = None

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
    def _pipelined(self) -> bool:
        return self._devices_per_replica > 1 or self._microbatches > 1  # else plain ddp_tuned

    def model_to_device(self) -> None:
        self._check_device_count()
        module = self.lightning_module
        assert module is not None
        if not self._pipelined():
            module.to(self.root_device)
            return
        name = type(self).__name__
        self._runner = PipelineRunner.setup(
            module,
            self._options,
            self.replica_devices,
            rank_zero=self.global_rank == 0,
            broadcast=lambda value: self.broadcast(value, src=0),
            warn=rank_zero_warn,
            info=lambda text: rank_zero_info(f"{name}: {text}"),
        )
        self._plan, self._split_points = self._runner.plan, self._runner.split_points

    @property
    def split_points(self) -> Optional[list[str]]:
        """The submodules where stages 1.. begin (after setup)."""
        return self._split_points

    def check_model(self, model: Any) -> None:
        super().check_model(model)
        if self._pipelined():
            k = self._devices_per_replica
            devices = self.replica_devices if self.parallel_devices else [torch.device("cpu")] * k
            check_model(model, self._options, devices)  # its warning comes at setup, on rank 0

    # ------------------------------------------------------------------ training hooks
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._runner is not None:
            self._runner.discard()
        super().on_train_batch_start(batch, batch_idx)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Where the training step runs inside the pipeline, the LightningModule's ``training_step`` runs once per
        micro-batch, loss included (so 1F1B can start backwards early), still reached through DDP's forward."""
        runner, module = self._runner, self.lightning_module
        if runner is None or not runner.steps_inside or module is None or self.model is None:
            return super().training_step(*args, **kwargs)
        with self.precision_plugin.train_step_context():
            return runner.step(self.model, module, args, kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Lightning's ``Strategy.backward`` with the stages' backward right after ``loss.backward()``,
        so that ``on_after_backward`` (called by the precision plugin's ``post_backward``) sees every gradient."""
        runner = self._runner
        if runner is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        with (
            self.backward_errors_explained()
        ):  # DDP's error for reentrant checkpointing: its fixes (parts/reliability.py)
            return self._pipelined_backward(runner, closure_loss, optimizer, *args, **kwargs)

    def _pipelined_backward(
        self, runner: PipelineRunner, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        # The loss was divided by the world size for the whole backward (CommProfiler's
        # prescaled all-reduce): buckets launched by the stages' backward must not divide again.
        prescaler = self.prescaler
        prescaled = prescaler is not None and prescaler.world_size > 1 and closure_loss.requires_grad
        with prescaler.prescaled_backward() if prescaled else nullcontext():
            runner.backward()
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
        if self._runner is not None:
            self._runner.check_backward_ran()
        return result

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._for_checkpoint(super().lightning_module_state_dict())

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self._for_checkpoint(super().optimizer_state(optimizer))

    def _for_checkpoint(self, state: dict[str, Any]) -> dict[str, Any]:
        # Only rank 0 writes the checkpoint: the other ranks skip the copy.
        split = self._runner is not None
        return _to_device(state, torch.device("cpu")) if split and self.is_global_zero else state

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self._runner is None:
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
                "schedule": self._options.schedule,
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
        if self._runner is not None:
            self._runner.close()
            self._runner = None
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
