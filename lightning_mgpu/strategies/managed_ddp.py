"""``ManagedDDPStrategy``: Lightning's DDP whose processes start, meet and fail safely.

The first of our DDP layers (``ManagedDDPStrategy`` -> ``HookedDDPStrategy`` ->
``TunedDDPStrategy``). It owns the process side: Lightning's launchers checked before any
rank starts (:mod:`~lightning_mgpu.strategies.launchers`), the rendezvous that listens on
loopback only on one machine and survives torchrun's restarts, the backend checked when the
group is made (names registered after construction count), the environment variable it sets
for that call removed when the call returns, the group torn down at exit
(:mod:`~lightning_mgpu.strategies.process_group`),
a failed collective explained by naming the lost ranks, and DDP's error for reentrant activation
checkpointing translated into its fixes (:mod:`~lightning_mgpu.strategies._failures`).
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.fabric.utilities.seed import reset_seed
from typing_extensions import override

from lightning_mgpu._compat.lightning import DDPStrategyBase
from lightning_mgpu.strategies import _failures
from lightning_mgpu.strategies.ddp_options import check_backend_registered
from lightning_mgpu.strategies.launchers import checked_launcher
from lightning_mgpu.strategies.process_group import destroy_process_group_at_exit, rendezvous

if TYPE_CHECKING:
    import lightning.pytorch as pl


class ManagedDDPStrategy(DDPStrategyBase):
    """DDP with checked launches, a loopback-only rendezvous on one machine and explained failures."""

    accepts_static_graph = True
    """Whether ``static_graph=True`` is a fix this strategy can offer (the hybrid strategy refuses it)."""

    @override
    def configure_launcher(self) -> None:
        super().configure_launcher()
        self.set_launcher(checked_launcher(self, self.launcher))

    def check_model(self, model: "pl.LightningModule") -> None:
        """Checks of the arguments that need the LightningModule. Lightning's own launchers run them in
        the launching process before they start the other ranks, so that a mistake is one clear error
        rather than one traceback per rank (each rank checks again at setup). Subclasses extend it."""

    def launcher_results(self) -> Optional[dict[str, Any]]:
        """Plain data rank 0 sends back to the launching process after a spawn (None: nothing)."""
        return None

    def adopt_launcher_results(self, results: dict[str, Any]) -> None:
        """Take :meth:`launcher_results` in the launching process."""

    def process_group_device(self) -> Optional[torch.device]:
        """The device NCCL binds its communicator to (``init_process_group(device_id=...)``); None on CPU.
        A strategy whose process spans several GPUs returns None: a bound NCCL group refuses
        collectives on any other device."""
        return self.root_device if self.root_device.type != "cpu" else None

    @override
    def setup_distributed(self) -> None:
        # DDPStrategy.setup_distributed, with a rendezvous that listens on the loopback interface
        # only when every rank runs on this machine, and survives torchrun's restarts (process_group.py).
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        check_backend_registered(self.resolved_backend())  # names registered after construction count
        kwargs: dict[str, Any] = {"device_id": self.process_group_device()}
        with rendezvous(
            self.cluster_environment,
            self.global_rank,
            self.world_size,
            self.collective_timeout,
            self.resolved_backend(),
        ) as store:
            if store is not None:  # torchrun restarts only: init_process_group is otherwise called as Lightning does
                kwargs["store"] = store
            self.init_process_group(**kwargs)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_process_group_at_exit()

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self.backward_errors_explained():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    # ------------------------------------------------------------------ failures

    def backward_errors_explained(self) -> AbstractContextManager[None]:
        """Around the backward: DDP's "Expected to mark a variable ready only once" (reentrant activation
        checkpointing) re-raised as a :class:`~lightning_mgpu.strategies._failures.ReentrantCheckpointError`
        naming the fixes, torch's error as its cause."""
        return _failures.reentrant_backward_explained(**self._ddp_facts())

    def _ddp_facts(self) -> dict[str, Any]:
        ddp_kwargs = self.user_ddp_kwargs
        return {
            "strategy": type(self).__name__,
            "find_unused_parameters": bool(ddp_kwargs.get("find_unused_parameters")),
            "static_graph": bool(ddp_kwargs.get("static_graph")),
            "static_graph_supported": self.accepts_static_graph,
        }

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        # The same error raised outside our backward (loss.backward() called directly): its fixes appended.
        _failures.explain_reentrant_failure(exception, **self._ddp_facts())
        # Name the lost ranks in the error, and leave no child rank behind (strategies/_failures.py).
        children = _failures.launched_children(self.launcher, self.global_rank)
        note = _failures.explain_collective_failure(
            exception, rank=self.global_rank, timeout=self.collective_timeout, children=children
        )
        if note is not None and children:
            # Lightning's child-process watcher (it polls every 5 s) SIGKILLs this launching process
            # when it sees a dead child, possibly before the traceback is printed: say it now too.
            print(note, file=sys.stderr, flush=True)
        _failures.reap_children_at_exit(children)
