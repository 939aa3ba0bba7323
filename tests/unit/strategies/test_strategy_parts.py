"""The strategy's parts, in-process: hook composition, re-wrapping, launchers, options, checkpoint state.

No process is started: a one-rank gloo group over an in-memory store stands in for the
process group where DDP needs one, and fakes stand in for hooks, buckets and launchers.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu import TunedDDPStrategy
from lightning_mgpu._compat.lightning import MultiProcessingLauncher, SubprocessScriptLauncher
from lightning_mgpu.comm.compression import PrescaledAllreduce
from lightning_mgpu.comm.hook_chain import CommHookHost, HookChain
from lightning_mgpu.strategies.parts import launchers
from lightning_mgpu.strategies.parts.ddp_model import DDPModel
from lightning_mgpu.strategies.parts.options import bucket_kwargs, check_options
from lightning_mgpu.tuning.buckets import first_cap


# ----------------------------------------------------------------------------- hook chain


def _tagging(tag: str, calls: list[str]) -> Any:
    """A wrapper that records, when its hook runs, that it ran (outermost first)."""

    def wrapper(hook: Any) -> Any:
        def wrapped(state: Any, bucket: Any) -> Any:
            calls.append(tag)
            return hook(state, bucket)

        wrapped.__name__ = f"{tag}_{getattr(hook, '__name__', 'hook')}"
        return wrapped

    return wrapper


def _build(chain: HookChain, **overrides: Any) -> Any:
    kwargs: dict[str, Any] = dict(
        hook=None,
        state=None,
        user_wrapper=None,
        world_size=2,
        backend="gloo",
        named_parameters=lambda: [],
        on_new_powersgd_keeper=lambda keeper: None,
        python_hook_anyway=False,
    )
    kwargs.update(overrides)
    return chain.build(**kwargs)


def test_no_hook_and_no_wrapper_keeps_ddps_builtin_allreduce() -> None:
    assert _build(HookChain()) is None


def test_a_wrapper_alone_gets_the_prescaled_allreduce() -> None:
    chain = HookChain()
    chain.add(lambda hook: hook, pausable=True)
    hook, state = _build(chain)
    assert isinstance(hook, PrescaledAllreduce) and state is None
    assert chain.prescaler is hook and hook.world_size == 2


def test_composition_order_user_hook_then_user_wrapper_then_callback_wrappers() -> None:
    calls: list[str] = []
    chain = HookChain()
    chain.add(_tagging("inner_cb", calls), pausable=False)
    chain.add(_tagging("outer_cb", calls), pausable=False)

    def user_hook(state: Any, bucket: Any) -> str:
        calls.append("user_hook")
        return "future"

    hook, state = _build(chain, hook=user_hook, state="S", user_wrapper=_tagging("user_wrapper", calls))
    assert state == "S"
    assert hook("S", object()) == "future"
    # the callbacks' wrappers outermost (added last = outermost), then the user's wrapper, then the reduction
    assert calls == ["outer_cb", "inner_cb", "user_wrapper", "user_hook"]
    assert chain.prescaler is None


def test_a_user_wrapper_without_a_hook_wraps_torchs_allreduce() -> None:
    seen: list[Any] = []
    hook, _ = _build(HookChain(), user_wrapper=lambda h: seen.append(h) or h)
    assert seen == [default_hooks.allreduce_hook] and hook is default_hooks.allreduce_hook


def test_pausable_wrappers_are_gated_when_a_python_hook_stays() -> None:
    calls: list[str] = []
    chain = HookChain()
    chain.add(_tagging("timer", calls), pausable=True)
    hook, _ = _build(chain, hook=lambda s, b: calls.append("fp16") or "f", python_hook_anyway=True)
    assert hook.__name__.startswith("timer_")  # DDP logs the wrapped hook's name
    hook(None, object())
    chain.wrappers_on = False
    hook(None, object())
    assert calls == ["timer", "fp16", "fp16"]


def test_pausable_wrappers_leave_the_chain_when_off_and_nothing_else_needs_python() -> None:
    chain = HookChain()
    chain.add(_tagging("timer", []), pausable=True)
    chain.wrappers_on = False
    assert _build(chain) is None  # DDP's built-in all-reduce while the profiler is out
    assert chain.needs_python_hook(base_hook=None, user_wrapper=None) is False
    chain.add(_tagging("user", []), pausable=False)
    assert chain.needs_python_hook(base_hook=None, user_wrapper=None) is True


def test_powersgd_gets_its_layout_keeper_once_and_one_bucket_at_a_time_on_gloo(one_rank_group: None) -> None:
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    params = [("w", torch.zeros(4, 4, requires_grad=True))]
    made: list[Any] = []
    chain = HookChain()
    for _ in range(2):  # a re-wrap builds the chain again: the keeper (PowerSGD's memory) is kept
        hook, got_state = _build(
            chain,
            hook=powerSGD_hook.powerSGD_hook,
            state=state,
            named_parameters=lambda: params,
            on_new_powersgd_keeper=made.append,
        )  # fmt: skip  (keyword arguments of one call)
        assert got_state is state and hook.__name__ == "powerSGD_hook"
    assert len(made) == 1 and chain.powersgd_keeper is made[0] and made[0].state is state
    nccl_hook, _ = _build(HookChain(), hook=powerSGD_hook.batched_powerSGD_hook, state=state, backend="nccl")
    assert nccl_hook is powerSGD_hook.batched_powerSGD_hook  # no keeper for the batched variant, no serialising on NCCL


def test_clear_forgets_the_fits_wrappers_but_keeps_powersgd_memory() -> None:
    chain = HookChain()
    chain.add(lambda h: h, pausable=True)
    chain.wrappers_on = False
    keeper = object()
    chain.powersgd_keeper = keeper  # type: ignore[assignment]
    chain.clear()
    assert chain.wrappers == [] and chain.wrappers_on and chain.prescaler is None and chain.powersgd_keeper is keeper


def test_prescaled_allreduce_sums_a_prescaled_bucket_and_averages_a_raw_one(one_rank_group: None) -> None:
    prescaler = PrescaledAllreduce(world_size=2)

    class Bucket:
        def __init__(self) -> None:
            self.data = torch.full((4,), 8.0)

        def buffer(self) -> torch.Tensor:
            return self.data

        def index(self) -> int:
            return 0

    raw = Bucket()
    prescaler(None, raw).wait()  # type: ignore[arg-type]
    assert torch.equal(raw.data, torch.full((4,), 4.0))  # divided by n: the loss was not prescaled
    prescaled = Bucket()
    with prescaler.prescaled_backward():
        prescaler(None, prescaled).wait()  # type: ignore[arg-type]
    assert torch.equal(prescaled.data, torch.full((4,), 8.0))  # the loss carried the 1/n: only summed


@pytest.mark.parametrize("static_graph", [False, True])
def test_a_prescaled_backward_is_not_divided_again_when_ddp_delays_its_buckets(
    one_rank_group: None, static_graph: bool
) -> None:
    """With ``static_graph=True`` a DDP wrapper's first backward launches every bucket from an end-of-backward
    callback (DDP learns the graph first): the prescaled flag must still hold there (issue 28: gradients x0.5)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    plain = torch.autograd.grad(module(x).sum(), list(module.parameters()))
    model = DistributedDataParallel(module, static_graph=static_graph)
    prescaler = PrescaledAllreduce(world_size=2)  # one rank pretending to be one of two: the sum is the own share
    model.register_comm_hook(state=None, hook=prescaler)
    for _ in range(2):  # the first backward (delayed under a static graph), then an ordinary one
        module.zero_grad()
        loss = model(x).sum()
        prescaler.prescale(loss)
        loss.backward()
        for param, expected in zip(module.parameters(), plain):
            assert param.grad is not None
            torch.testing.assert_close(param.grad, expected / 2, rtol=0, atol=0)  # prescaled once, summed
    assert not prescaler._prescaled  # cleared once the backward (and DDP's delayed reduction) ended


def test_the_strategies_are_comm_hook_hosts() -> None:
    from lightning_mgpu import HybridParallelStrategy

    assert isinstance(TunedDDPStrategy(), CommHookHost)
    assert isinstance(HybridParallelStrategy(), CommHookHost)
    assert TunedDDPStrategy(compression="fp16").wire_ratio == 0.5
    assert TunedDDPStrategy(compression="powersgd").wire_ratio is None
    assert TunedDDPStrategy().wire_ratio == 1.0 and not TunedDDPStrategy(bucket_cap_mb="auto").tuning_active


# ----------------------------------------------------------------------------- re-wrap


def test_replace_ddp_wrapper_carries_hooks_and_detaches_the_old_reducer(one_rank_group: None) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    old = DistributedDataParallel(module)
    forwards: list[int] = []
    handle = old.register_forward_hook(lambda *_: forwards.append(1))
    new = DDPModel.rebuild(old, lambda: DistributedDataParallel(module, init_sync=False, bucket_cap_mb=1))
    assert new is not old and new.module is module
    assert "reducer" not in old.__dict__  # the old buckets are freed at once
    new(torch.randn(2, 4)).sum().backward()
    assert forwards == [1] and all(p.grad is not None for p in module.parameters())
    handle.remove()  # a handle taken on the old wrapper removes the hook from the new one
    new(torch.randn(2, 4))
    assert forwards == [1]


# ----------------------------------------------------------------------------- launchers


class _Checked:
    start_method = "spawn"

    def __init__(self) -> None:
        self.checked: list[Any] = []

    def check_model(self, model: Any) -> None:
        self.checked.append(model)

    def launcher_results(self) -> dict[str, Any]:
        return {"bucket_cap_mb": 4.0}

    def adopt_launcher_results(self, results: dict[str, Any]) -> None:
        self.adopted = results


def test_checked_launcher_replaces_lightnings_two_launchers_and_keeps_others() -> None:
    strategy = _Checked()
    environment = mock.Mock()
    script = SubprocessScriptLauncher(environment, 2, 1)
    ours = launchers.checked_launcher(strategy, script)
    assert isinstance(ours, launchers.CheckedSubprocessScriptLauncher)
    assert (ours.cluster_environment, ours.num_processes, ours.num_nodes) == (environment, 2, 1)
    spawn = MultiProcessingLauncher(mock.Mock(), start_method="spawn")
    assert isinstance(launchers.checked_launcher(strategy, spawn), launchers.TunedMultiProcessingLauncher)
    other = object()
    assert launchers.checked_launcher(strategy, other) is other


def test_the_model_is_checked_in_the_launching_process_only() -> None:
    import lightning.pytorch as pl

    strategy = _Checked()
    model = pl.LightningModule()
    environment = mock.Mock(creates_processes_externally=True)  # torchrun: this process is one rank
    launcher = launchers.CheckedSubprocessScriptLauncher(strategy, environment, 2, 1)
    with mock.patch.object(SubprocessScriptLauncher, "launch", return_value="ran") as parent:
        assert launcher.launch(lambda: None, model) == "ran"
    assert strategy.checked == [] and parent.called
    environment.creates_processes_externally = False  # `python train.py`: this process starts the others
    with mock.patch.object(SubprocessScriptLauncher, "launch", return_value="ran"):
        launcher.launch(lambda: None, model)
    assert strategy.checked == [model]


def test_spawn_results_travel_home() -> None:
    strategy = _Checked()
    launcher = launchers.TunedMultiProcessingLauncher(strategy, start_method="spawn")
    trainer = mock.Mock(strategy=strategy)
    with mock.patch.object(MultiProcessingLauncher, "get_extra_results", return_value={}):
        extra = launcher.get_extra_results(trainer)
    assert extra == {launchers.LAUNCHER_RESULTS_KEY: {"bucket_cap_mb": 4.0}}
    with mock.patch.object(MultiProcessingLauncher, "update_main_process_results"):
        launcher.update_main_process_results(trainer, extra)
    assert strategy.adopted == {"bucket_cap_mb": 4.0}


def test_the_strategy_installs_the_checked_launcher() -> None:
    strategy = TunedDDPStrategy(start_method="spawn")
    strategy.cluster_environment = mock.Mock()
    strategy.configure_launcher()
    assert isinstance(strategy.launcher, launchers.TunedMultiProcessingLauncher)


# ----------------------------------------------------------------------------- options


def _options(**given: Any) -> Any:
    base: dict[str, Any] = dict(
        bucket_cap_mb=None,
        first_bucket_cap_mb=None,
        compression=None,
        powersgd_rank=1,
        powersgd_start_iter=10,
        tune_steps=None,
        tune_candidates=None,
        tune_rounds=2,
        ddp_comm_hook=None,
        ddp_comm_wrapper=None,
        model_averaging_period=None,
        process_group_backend=None,
        timeout=None,
        start_method="popen",
        ddp_kwargs={},
    )  # fmt: skip  (one argument set, kept together)
    base.update(given)
    return check_options(**base)


def test_options_normalise_sizes_and_build_tuning_settings_for_auto() -> None:
    assert _options(bucket_cap_mb=8).bucket_cap_mb == 8.0
    auto = _options(bucket_cap_mb="auto", tune_rounds=3)
    assert auto.bucket_cap_mb is None and auto.tuning is not None and auto.tuning.rounds == 3
    with pytest.raises(ValueError, match="tune_rounds=3 applies only to bucket_cap_mb='auto'"):
        _options(tune_rounds=3)
    with pytest.raises(ValueError, match="must not exceed bucket_cap_mb"):
        _options(bucket_cap_mb=2, first_bucket_cap_mb=4)


def test_bucket_kwargs_keep_the_small_first_bucket() -> None:
    assert bucket_kwargs(cap=None, given_first=None) == {}
    assert bucket_kwargs(cap=50.0, given_first=None) == {"bucket_cap_mb_list": [1.0, 50.0]}
    assert bucket_kwargs(cap=0.5, given_first=None) == {"bucket_cap_mb_list": [0.5, 0.5]}
    assert first_cap(64.0, given_cap=None, given_first=4.0) == 4.0


# ----------------------------------------------------------------------------- static graph and accumulation


def _accumulated_fit(strategy: Any, root: Any, *, profiler: bool = False) -> list[torch.Tensor]:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_mgpu import CommProfiler

    torch.manual_seed(0)
    x, y = torch.randn(36, 4), torch.randn(36, 1)
    model = _regressor()
    callbacks = [CommProfiler(warmup_steps=1, profile_steps=1, profile_every=4, whatif=False)] if profiler else []
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=4,
        accumulate_grad_batches=3,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=3))
    return model.grads


def _regressor() -> Any:
    import lightning as L

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
            self.grads: list[torch.Tensor] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.grads.append(torch.cat([p.grad.reshape(-1) for p in self.parameters()]).clone())

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Regressor()


def test_static_graph_with_accumulation_trains_as_without_it(
    clean_process: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """torch's DDP refuses a static graph's first backward under ``no_sync`` (an internal assert: stock
    Lightning crashes with ``accumulate_grad_batches > 1``): ours synchronises it and averages the same."""
    for key in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK"):
        monkeypatch.delenv(key, raising=False)
    dynamic = _accumulated_fit(TunedDDPStrategy(), tmp_path)
    static = _accumulated_fit(TunedDDPStrategy(static_graph=True), tmp_path, profiler=True)  # re-wrapped too
    assert len(static) == len(dynamic) == 4
    for a, b in zip(static, dynamic):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
