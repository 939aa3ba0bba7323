"""A subclass of Lightning's ``DDPStrategy`` behaves as its parent where users and Lightning's own tests look.

In process, no rank started (``torch.distributed.init_process_group`` is replaced where a
test only watches how it is called):

* LightningCLI/jsonargparse fills in every default of ``DistributedDataParallel``'s signature:
  the reserved arguments at their defaults (``output_device=None``, ...) are accepted, real
  values still refused (every public class parsed from a YAML ``class_path`` without ``init_args``,
  which starts a process: tests/dist/strategies/test_lightning_parity.py);
* a backend name is accepted at construction and checked at setup, so a backend registered
  after the strategy was built works (an unknown one: ``tests/unit/repo/test_reliability_input.py``);
* ``init_process_group`` receives exactly what stock ``DDPStrategy`` passes (no ``store=``),
  while rank 0's rendezvous server listens on the loopback interface only during the call;
* nothing is left in ``os.environ`` that stock ``DDPStrategy`` does not leave;
* every strategy name mirrors Lightning's (``ddp_tuned_find_unused_parameters_true``, ...) and
  resolves through ``Trainer(strategy=NAME)`` with its preset.

The 2-rank LightningCLI fits are in ``tests/dist/strategies/test_lightning_cli.py``.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

import lightning_mgpu
from lightning_mgpu import TunedDDPStrategy
from lightning_mgpu.strategies.parts.options import TUNED_STRATEGY_NAMES, ddp_default
from tests.conftest import destroy_default_group
from tests.helpers import strategies

clean_process = strategies.clean_process  # a fixture, shared with tests/dist/strategies/test_lightning_parity.py

jsonargparse = pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse[signatures] (the dev extra)")


# ----------------------------------------------------------------------------- DDP's defaults, as jsonargparse fills them


def test_every_ddp_default_as_jsonargparse_fills_it_is_accepted() -> None:
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(DistributedDataParallel.__init__).parameters.items()
        if name not in ("self", "module", "bucket_cap_mb") and parameter.default is not inspect.Parameter.empty
    }
    assert {"output_device", "device_ids", "bucket_cap_mb_list"} <= set(defaults)
    strategy = TunedDDPStrategy(**defaults)
    passed = strategy.user_ddp_kwargs
    # the reserved ones at their defaults mean "not given": the strategy sets them itself
    assert not {"output_device", "device_ids", "bucket_cap_mb_list"} & set(passed)
    assert passed["find_unused_parameters"] is False and passed["dim"] == 0


@pytest.mark.parametrize(
    ("name", "value"),
    [("output_device", 0), ("device_ids", [0]), ("bucket_cap_mb_list", [1, 25]), ("module", torch.nn.Linear(1, 1))],
)
def test_a_reserved_ddp_argument_with_a_real_value_is_still_refused(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"does not accept {name}="):
        TunedDDPStrategy(**{name: value})


def test_a_flag_whose_ddp_default_is_none_accepts_none_and_refuses_other_non_bools() -> None:
    # DDP's broadcast_buffers defaults to None ("DDP decides") in torch 2.13-2.15 but to True in 2.11,
    # where None is refused as for any other flag: the check follows the installed DDP's own signature.
    if ddp_default("broadcast_buffers") is None:
        TunedDDPStrategy(broadcast_buffers=None)
        with pytest.raises(ValueError, match=r"broadcast_buffers must be True, False or None, got 'yes'"):
            TunedDDPStrategy(broadcast_buffers="yes")
    else:
        with pytest.raises(ValueError, match=r"broadcast_buffers must be True or False, got None"):
            TunedDDPStrategy(broadcast_buffers=None)
    with pytest.raises(ValueError, match=r"static_graph must be True or False, got None"):
        TunedDDPStrategy(static_graph=None)


# ----------------------------------------------------------------------------- the process-group backend


def test_a_backend_registered_after_construction_is_used(
    monkeypatch: pytest.MonkeyPatch, clean_process: dict[str, str]
) -> None:
    name = "lightning_mgpu_later"
    strategy = TunedDDPStrategy(process_group_backend=name)  # not known to torch yet
    # register_backend appends to Backend.backend_list: a copy keeps the name out of later tests
    monkeypatch.setattr(torch.distributed.Backend, "backend_list", list(torch.distributed.Backend.backend_list))
    torch.distributed.Backend.register_backend(name, lambda *args: None, devices=["cpu"])
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
    trainer.strategy.connect(BoringModel())
    with mock.patch("torch.distributed.init_process_group") as init:
        trainer.strategy.setup_environment()
    assert init.call_args.args == (name,)


# ----------------------------------------------------------------------------- init_process_group, as Lightning calls it


def _listening_on(port: int) -> list[str]:
    """Local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, state = fields[1], fields[3]
            host, hex_port = address.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(host)
    return found


def _setup_with_init_replaced(strategy: Any) -> tuple[Any, dict[str, Any]]:
    """``setup_environment`` with ``init_process_group`` replaced; the call it got, and what was listening then."""
    seen: dict[str, Any] = {}

    def fake_init(*args: Any, **kwargs: Any) -> None:
        port = int(os.environ["MASTER_PORT"])
        seen["listening"] = _listening_on(port)
        seen["gloo_interface"] = os.environ.get("GLOO_SOCKET_IFNAME")

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
    trainer.strategy.connect(BoringModel())
    with mock.patch("torch.distributed.init_process_group", side_effect=fake_init) as init:
        trainer.strategy.setup_environment()
    return init.call_args, seen


def test_init_process_group_gets_exactly_what_stock_ddp_passes(clean_process: dict[str, str]) -> None:
    timeout = timedelta(seconds=42)
    stock_call, _ = _setup_with_init_replaced(DDPStrategy(timeout=timeout))
    stock_environment = set(os.environ) - set(clean_process)
    for key in stock_environment:
        os.environ.pop(key)
    tuned_call, seen = _setup_with_init_replaced(TunedDDPStrategy(timeout=timeout))
    assert tuned_call == stock_call, "no store= or anything else stock DDPStrategy does not pass"
    assert "store" not in tuned_call.kwargs and tuned_call.kwargs["timeout"] == timeout
    # while torch's rendezvous runs, rank 0's server is already there, on loopback only
    # (torch's own env:// store shares it: a multi-tenant server on MASTER_PORT)
    assert seen["listening"] and all(
        host in ("0100007F", "00000000000000000000000001000000") for host in seen["listening"]
    )
    assert seen["gloo_interface"] is not None
    # no group was created (init was replaced): nothing of ours stays in the environment
    assert set(os.environ) - set(clean_process) <= stock_environment
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def test_a_real_one_rank_fit_listens_on_loopback_only_and_leaves_no_variable(
    tmp_path: Path, clean_process: dict[str, str]
) -> None:
    seen: dict[str, Any] = {}
    real_init = torch.distributed.init_process_group

    def watched_init(*args: Any, **kwargs: Any) -> None:
        seen["gloo_interface_at_init"] = os.environ.get("GLOO_SOCKET_IFNAME")
        real_init(*args, **kwargs)

    class Watch(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            seen["listening"] = _listening_on(int(os.environ["MASTER_PORT"]))
            seen["gloo_interface"] = os.environ.get("GLOO_SOCKET_IFNAME")

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=TunedDDPStrategy(),
        max_steps=2,
        logger=False,
        callbacks=[Watch()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with mock.patch("torch.distributed.init_process_group", side_effect=watched_init):
        trainer.fit(BoringModel())
    assert torch.distributed.is_initialized()  # a real group (Lightning keeps it after fit)
    assert seen["listening"] == ["0100007F"], "the rendezvous server listens on 127.0.0.1 only"
    assert seen["gloo_interface_at_init"] is not None  # gloo read it when the group was made...
    assert seen["gloo_interface"] is None  # ...and it was removed as soon as the call returned
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def _configure_without_teardown(strategy: Any) -> L.Trainer:
    """What Lightning's own ``test_ddp_configure_ddp`` does: ``setup_environment()`` and ``setup()`` with a real
    one-rank process group, and no teardown."""
    from lightning.pytorch.trainer.states import TrainerFn

    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, strategy=strategy, logger=False)
    trainer.state.fn = TrainerFn.FITTING
    trainer.strategy.connect(BoringModel())
    trainer.lightning_module.trainer = trainer
    trainer.strategy.setup_environment()
    trainer.strategy.setup(trainer)
    return trainer


def test_setup_environment_and_setup_without_teardown_leave_nothing_stock_ddp_does_not_leave(
    clean_process: dict[str, str],
) -> None:
    """Lightning's test suite fails a test that leaves a variable in ``os.environ`` it does not list:
    ``GLOO_SOCKET_IFNAME`` stayed after ``setup_environment()`` + ``setup()`` when no teardown followed."""
    from torch.nn.parallel import DistributedDataParallel

    stock = _configure_without_teardown(DDPStrategy())
    assert isinstance(stock.model, DistributedDataParallel)
    stock_environment = set(os.environ) - set(clean_process)
    destroy_default_group()
    for key in stock_environment:
        os.environ.pop(key)
    tuned = _configure_without_teardown(TunedDDPStrategy())
    assert isinstance(tuned.model, DistributedDataParallel)
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    assert set(os.environ) - set(clean_process) <= stock_environment


@pytest.mark.parametrize("strategy_class", [DDPStrategy, TunedDDPStrategy])
def test_a_checkpoint_io_plugin_is_the_strategys_checkpoint_io(strategy_class: type) -> None:
    """Lightning's ``test_accelerator_specific_checkpoint_io``: the plugin object itself, not a wrapper or a copy
    (``tests/unit/strategies/test_checkpoint_integrity.py``: it still writes atomically)."""
    from lightning.pytorch.plugins import TorchCheckpointIO

    ckpt_plugin = TorchCheckpointIO()
    trainer = L.Trainer(accelerator="cpu", strategy=strategy_class(), plugins=[ckpt_plugin], logger=False)
    assert trainer.strategy.checkpoint_io is ckpt_plugin


# ----------------------------------------------------------------------------- strategy names


def test_every_lightning_ddp_name_has_a_tuned_twin() -> None:
    for name in [n for n in StrategyRegistry.available_strategies() if StrategyRegistry[n]["strategy"] is DDPStrategy]:
        twin = name.replace("ddp", "ddp_tuned", 1)
        assert twin in StrategyRegistry and StrategyRegistry[twin]["strategy"] is TunedDDPStrategy, twin
        popen = {"start_method": "popen"}  # the default, written out in Lightning's "ddp" entry
        assert {**popen, **StrategyRegistry[twin]["init_params"]} == {**popen, **StrategyRegistry[name]["init_params"]}


def test_the_package_lists_exactly_the_names_it_registers() -> None:
    registered = [n for n in StrategyRegistry.available_strategies() if n.startswith(("ddp_tuned", "hybrid"))]
    assert list(lightning_mgpu.STRATEGY_NAMES) == [name for name, _, _ in TUNED_STRATEGY_NAMES] + ["hybrid"]
    assert sorted(registered) == sorted(lightning_mgpu.STRATEGY_NAMES)
    # the names DESIGN.md promises
    assert {"ddp_tuned", "ddp_tuned_spawn", "ddp_tuned_fp16", "ddp_tuned_powersgd", "hybrid"} <= set(registered)


@pytest.mark.parametrize(
    ("name", "description", "preset"), TUNED_STRATEGY_NAMES, ids=[n for n, _, _ in TUNED_STRATEGY_NAMES]
)
def test_each_name_builds_its_preset_through_the_trainer(name: str, description: str, preset: dict[str, Any]) -> None:
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False, enable_checkpointing=False)
    strategy = trainer.strategy
    assert isinstance(strategy, TunedDDPStrategy)
    assert strategy.start_method == preset.get("start_method", "popen")
    assert strategy.compression == preset.get("compression")
    assert strategy.auto is (preset.get("bucket_cap_mb") == "auto")
    expected = (
        {"find_unused_parameters": preset["find_unused_parameters"]} if "find_unused_parameters" in preset else {}
    )
    assert strategy.user_ddp_kwargs == expected


def test_the_strategies_command_lists_every_name(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from lightning_mgpu import cli

    assert cli.main(["strategies", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["name"] for row in rows] == list(lightning_mgpu.STRATEGY_NAMES)
    auto = next(row for row in rows if row["name"] == "ddp_tuned_auto")
    assert auto["options"] == {"bucket_cap_mb": "auto"}


def test_port_helper_sees_a_listening_socket() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert _listening_on(sock.getsockname()[1]) == ["0100007F"]
