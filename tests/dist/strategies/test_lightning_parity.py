"""A subclass of Lightning's ``DDPStrategy`` behaves as its parent where users and Lightning's own tests look:
every public class parses from a LightningCLI YAML ``class_path`` without ``init_args`` (jsonargparse fills in
every default of ``DistributedDataParallel``'s signature), with ``init_args``, and by a registered name.

Parsing a config starts a process (below). The in-process parity checks: tests/unit/strategies/test_lightning_parity.py;
the 2-rank LightningCLI fits: tests/dist/strategies/test_lightning_cli.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_mgpu import CommProfiler, DistributedDoctor, HybridParallelStrategy, TunedDDPStrategy
from tests.helpers import strategies

clean_process = strategies.clean_process  # a fixture, shared with tests/unit/strategies/test_lightning_parity.py

jsonargparse = pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse[signatures] (the dev extra)")


# jsonargparse resolves stub types through typeshed_client, which asks a child interpreter for its
# sys.path: parsing a LightningCLI config starts a process, so these tests are in the multiprocess lane.

YAML_CLASSES = {
    "strategy": ["lightning_mgpu.TunedDDPStrategy", "lightning_mgpu.HybridParallelStrategy"],
    "callbacks": ["lightning_mgpu.CommProfiler", "lightning_mgpu.DistributedDoctor"],
}


def _parse_cli(tmp_path: Path, config: str, *extra: str) -> Any:
    from lightning.pytorch.cli import LightningCLI

    path = tmp_path / "config.yaml"
    path.write_text(config)
    return LightningCLI(
        BoringModel,
        run=False,
        save_config_callback=None,
        args=["--config", str(path), *extra],
        trainer_defaults={"logger": False, "enable_checkpointing": False, "enable_progress_bar": False},
    )


@pytest.mark.parametrize("class_path", YAML_CLASSES["strategy"])
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_strategy_from_yaml_without_init_args_builds(
    tmp_path: Path, class_path: str, clean_process: dict[str, str]
) -> None:
    config = f"trainer:\n  accelerator: cpu\n  devices: 2\n  strategy:\n    class_path: {class_path}\n"
    cli = _parse_cli(tmp_path, config)
    assert type(cli.trainer.strategy).__name__ == class_path.rsplit(".", 1)[-1]
    # the same instance stock defaults would give: DDP's own defaults, nothing reserved passed on
    assert not {"output_device", "device_ids", "bucket_cap_mb_list"} & set(cli.trainer.strategy.user_ddp_kwargs)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_init_args_and_the_callbacks_from_yaml_reach_the_objects(tmp_path: Path, clean_process: dict[str, str]) -> None:
    config = """\
trainer:
  accelerator: cpu
  devices: 2
  strategy:
    class_path: lightning_mgpu.TunedDDPStrategy
    init_args:
      bucket_cap_mb: 5
      compression: fp16
      find_unused_parameters: true
  callbacks:
    - class_path: lightning_mgpu.CommProfiler
      init_args:
        warmup_steps: 2
        profile_every: null
    - class_path: lightning_mgpu.DistributedDoctor
      init_args:
        strict: true
        disable: [batchnorm-without-sync]
"""
    cli = _parse_cli(tmp_path, config)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, TunedDDPStrategy)
    assert strategy.bucket_cap_mb == 5 and strategy.compression == "fp16"
    assert strategy.user_ddp_kwargs["find_unused_parameters"] is True
    profiler = next(c for c in cli.trainer.callbacks if isinstance(c, CommProfiler))
    doctor = next(c for c in cli.trainer.callbacks if isinstance(c, DistributedDoctor))
    assert profiler.schedule.warmup_steps == 2 and profiler.schedule.profile_every is None
    assert doctor.strict is True and "batchnorm-without-sync" in str(doctor.disabled)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_hybrid_init_args_from_yaml(tmp_path: Path, clean_process: dict[str, str]) -> None:
    config = """\
trainer:
  accelerator: cpu
  devices: 4
  strategy:
    class_path: lightning_mgpu.HybridParallelStrategy
    init_args:
      devices_per_replica: 2
      balance: [2, 3]
      microbatches: 4
      schedule: 1f1b
      split_points: null
"""
    cli = _parse_cli(tmp_path, config)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, HybridParallelStrategy)
    assert strategy.devices_per_replica == 2 and strategy.microbatches == 4


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_registered_name_on_the_command_line_and_a_class_path_flag_both_work(
    tmp_path: Path, clean_process: dict[str, str]
) -> None:
    config = "trainer:\n  accelerator: cpu\n  devices: 2\n"
    by_name = _parse_cli(tmp_path, config, "--trainer.strategy", "ddp_tuned_find_unused_parameters_true")
    assert isinstance(by_name.trainer.strategy, TunedDDPStrategy)
    assert by_name.trainer.strategy.user_ddp_kwargs == {"find_unused_parameters": True}
    by_class = _parse_cli(tmp_path, config, "--trainer.strategy.class_path", "lightning_mgpu.TunedDDPStrategy")
    assert isinstance(by_class.trainer.strategy, TunedDDPStrategy)
