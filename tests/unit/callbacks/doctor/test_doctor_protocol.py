"""DistributedDoctor's rules without a Trainer: gathered reports in, findings out; what the ranks agree on
check by check; the renamed check interval; probes that cannot see say "not checked"."""

from __future__ import annotations

import logging
import math
import sys
import types
import warnings
from typing import Any

import lightning as L
import pytest
import lightning_utilities.core.rank_zero
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch import nn
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

from lightning_mgpu._compat import lightning as compat
from lightning_mgpu.callbacks.doctor import RULES, DistributedDoctor, DistributedDoctorWarning
from lightning_mgpu.callbacks.doctor.callback import STATE_VERSION
from lightning_mgpu.callbacks.doctor.findings import Finding
from lightning_mgpu.callbacks.doctor.probes import DDPOptions
from lightning_mgpu.callbacks.doctor.rule import SEVERITIES, RankReport, Rule
from lightning_mgpu.callbacks.doctor.rules import WATCHES, data_wait, first_batches, unsynced_logging
from lightning_mgpu.callbacks.doctor.rules.first_batches import FirstBatches
from lightning_mgpu.callbacks.doctor.rules.parameter_use import ParameterUse, UseReport
from lightning_mgpu.callbacks.doctor.rules.params_diverged import ParamsDiverged
from lightning_mgpu.callbacks.doctor.rules.uneven_batches import UnevenBatches
from lightning_mgpu.callbacks.doctor.rules.unused_devices import UnusedDevices

SHUFFLING = {
    "description": "NestedSampler",
    "fixed_order": False,
    "distributed": {"path": "loader.sampler.base", "rank": 0, "num_replicas": 2, "shuffle": True, "epoch": 0},
}


def _setups(node: str = "n", *, augments: bool = False, workers: int = 0) -> dict[str, Any]:
    """What every watch of one rank saw at fit start, by watch."""
    return {
        "UnusedDevices": {"node": node, "type": "cpu", "used": 2, "cuda_visible": 0},
        "DataParallelWrapped": [],
        "SameRandomState": {"augments": augments, "how": "the dataset has .transform", "workers": workers},
        "DataWait": {"num_workers": workers, "cpus": 8, "local_world_size": 2, "cuda": False},
    }


def _gathered(doctor: DistributedDoctor, world: int = 2, **sent: list[Any]) -> list[RankReport]:
    """Every rank's report at a check: what a fresh rank sends where nothing happened (an epoch end), but
    for ``sent`` (watch name, or ``local_findings``/``setups`` -> its value on each rank)."""
    idle = {
        type(watch).__name__: watch.report(types.SimpleNamespace(world_size=world), "epoch_end")
        for watch in doctor.watches
    }
    assert idle["FirstBatches"] == ({}, None) and idle["ParameterUse"] == UseReport()
    reports = [RankReport(payloads=dict(idle)) for _ in range(world)]
    for name, values in sent.items():
        for report, value in zip(reports, values):
            if name in ("local_findings", "setups"):
                setattr(report, name, value)
            else:
                report.payloads[name] = value
    return reports


def _judge(doctor: DistributedDoctor, epoch: int = 0, world: int = 2, **sent: list[Any]) -> list[str]:
    return [f.rule for f in doctor.judge(_gathered(doctor, world, **sent), epoch)]


def _ddp_doctor(*names: str, **kwargs: Any) -> DistributedDoctor:
    """A doctor whose parameter watch sees parameters ``names`` under DDP(find_unused_parameters=True)."""
    doctor = DistributedDoctor(**kwargs)
    doctor.parameter_watch.ddp = DDPOptions(find_unused=True, static_graph=False, broadcast_buffers=True)
    doctor.parameter_watch.param_names = list(names)
    return doctor


# ----------------------------------------------------------------------------- the rules and their watches


def test_each_rule_lives_in_one_module_with_its_watch_and_a_severity() -> None:
    owners: dict[str, type] = {}
    for watch in WATCHES:
        module = sys.modules[watch.__module__]
        defined = [value for value in vars(module).values() if isinstance(value, Rule)]
        assert set(watch.rules) == set(defined), watch  # the rule(s) and the watch that judges them, together
        for rule in watch.rules:
            assert rule.severity in SEVERITIES and owners.setdefault(rule.id, watch) is watch, rule.id
    assert set(owners) == set(RULES) and len(WATCHES) == len({w.__module__ for w in WATCHES})


def test_a_check_where_nothing_happened_has_no_findings_on_any_number_of_ranks() -> None:
    for world in (1, 2, 8):
        doctor = DistributedDoctor()
        assert _judge(doctor, world=world) == [] and doctor.checks == 1
        assert _judge(doctor, world=world, setups=[_setups()] * world) == []


def test_shared_batches_and_a_repeated_order_fire_both_rules_in_order() -> None:
    def judged(**kwargs: Any) -> list[Finding]:
        doctor = DistributedDoctor(**kwargs)
        doctor.watch(FirstBatches).epoch_digests = {0: ["a", "a"]}
        return doctor.judge(_gathered(doctor, FirstBatches=[({1: "a"}, SHUFFLING)] * 2), 1)

    found = judged()
    assert [f.rule for f in found] == ["data-not-sharded", "sampler-epoch-not-set"]
    assert "all 2 ranks read identical first batches in epoch 1" in found[0].seen
    assert [f.rule for f in judged(disable=["data-not-sharded"])] == ["sampler-epoch-not-set"]
    assert judged(disable=["data-not-sharded", "sampler-epoch-not-set"]) == []


def test_an_unknown_sampler_order_gives_no_verdict_on_the_epoch_order() -> None:
    unknown = {**SHUFFLING, "order_unknown": True}
    assert first_batches.check_epoch_order(["a", "b"], ["a", "b"], [unknown, unknown], 1) is None
    repeated = first_batches.check_epoch_order(["a", "b"], ["a", "b"], [SHUFFLING, SHUFFLING], 1)
    assert repeated is not None and repeated.rule == "sampler-epoch-not-set"
    assert repeated.seen.startswith("epoch 1 starts with the same batch as epoch 0 on ranks 0")


def test_local_findings_come_first_merged_then_each_watch_in_its_order() -> None:
    local = Finding("batchnorm-without-sync", "small", "w", "f")
    doctor = _ddp_doctor("w", "b")
    found = doctor.judge(
        _gathered(
            doctor,
            local_findings=[[local], [local]],
            setups=[_setups(), _setups()],
            UnevenBatches=[(8.0, math.inf), (9.0, math.inf)],
            ParamsDiverged=[[1, 2], [1, 3]],
            UnsyncedLogging=[{"step.loss": 1.0}, {"step.loss": 2.0}],
            DataWait=[{"fetch_s": 0.9, "iteration_s": 1.0, "batches": 10}] * 2,
            ParameterUse=[UseReport([5, 5], 5, True)] * 2,
        ),
        0,
    )
    assert [f.rule for f in found] == [
        "batchnorm-without-sync",
        "uneven-batches",
        "params-diverged",
        "unsynced-logging",
        "dataloader-starving",
        "find-unused-wasted",
    ]
    assert found[0].seen.endswith("(on every rank)") and local.ranks == []  # the inputs are left unchanged


def test_one_rank_judges_only_what_needs_no_comparison() -> None:
    doctor = _ddp_doctor("w")
    setup = _setups()
    setup["SameRandomState"] = {"augments": True, "workers": 0}
    sent = _judge(
        doctor,
        world=1,
        setups=[setup],
        ParamsDiverged=[[1]],
        UnsyncedLogging=[{"a.loss": 1.0}],
        SameRandomState=[("s",)],
        DataWait=[{"fetch_s": 0.9, "iteration_s": 1.0, "batches": 10}],
    )
    assert sent == ["dataloader-starving"]


# ----------------------------------------------------------------------------- what the ranks agree on


def test_setups_go_once_and_the_watches_keep_samplers_and_the_last_two_epochs_of_first_batches() -> None:
    doctor = DistributedDoctor()
    _judge(doctor, setups=[_setups("a"), _setups("b")], FirstBatches=[({}, SHUFFLING)] * 2)
    assert doctor._setups_sent and [s["node"] for s in doctor.watch(UnusedDevices).setups] == ["a", "b"]
    watch = doctor.watch(FirstBatches)
    assert doctor.checks == 1 and watch.samplers == [SHUFFLING, SHUFFLING]
    for epoch in range(4):
        _judge(doctor, epoch, FirstBatches=[({epoch: "x"}, None), ({epoch: "y"}, None)])
        assert watch.samplers == [SHUFFLING, SHUFFLING]  # as of the latest epoch start
        assert watch.epoch_digests[epoch] == ["x", "y"] and (epoch - 1 in watch.epoch_digests) == (epoch > 0)
    assert sorted(watch.epoch_digests) == [2, 3] and doctor.state_dict()["epoch_digests"] == {
        "2": ["x", "y"],
        "3": ["x", "y"],
    }


def test_checks_stop_past_the_shortest_rank_even_with_the_rule_disabled() -> None:
    doctor = DistributedDoctor(disable=["uneven-batches"])
    assert _judge(doctor, UnevenBatches=[(8.0, math.inf), (9.0, math.inf)]) == []
    assert doctor.watch(UnevenBatches).epoch_batch_limit == 8.0
    _judge(doctor, UnevenBatches=[(9.0, math.inf), (9.0, math.inf)])
    assert doctor.watch(UnevenBatches).epoch_batch_limit is None


def test_once_batch_counts_differ_checks_are_made_only_within_the_shortest_ranks_batches() -> None:
    """Issue 28 (2): past the shortest rank's last batch, a check would wait for ranks that are elsewhere."""
    doctor = DistributedDoctor()
    watch = doctor.watch(UnevenBatches)
    assert watch.may_check(0) and watch.may_check(0, 11)
    _judge(doctor, 1, UnevenBatches=[(10.0, math.inf), (9.0, math.inf)])
    assert watch.out_of_step_epoch == 1 and watch.epoch_batch_limit == 9.0
    assert watch.may_check(1, 7) and not watch.may_check(1, 8)  # after batch 8, rank 1 has left the epoch
    assert watch.may_check(1, 8, during=True) and not watch.may_check(1, 9, during=True)
    for epoch in (1, 2):
        assert not watch.may_check(epoch)  # epoch ends, validation ends, epoch starts, the end of training
    assert not watch.may_check(2, 0)
    assert watch.out_of_step() == "no check after epoch 1's batch 9: the ranks ran different numbers of batches"
    watch.reset()  # a new fit
    assert watch.may_check(0) and watch.out_of_step() is None
    # The fit ends (max_steps) before the shortest rank's last batch: the ranks never fall out of step.
    found = doctor.judge(_gathered(doctor, UnevenBatches=[(10.0, 9.0), (9.0, 9.0)]), 0)
    assert watch.may_check(0) and watch.may_check(0, 20) and watch.out_of_step_epoch is None
    (finding,) = found
    assert finding.rule == "uneven-batches" and finding.severity == "wrong"


def test_parameters_without_a_gradient_are_kept_for_the_divergence_they_cause() -> None:
    doctor = _ddp_doctor("w")
    missing = [UseReport(missing_grads=["pooler.w", "pooler.b"]), UseReport(missing_grads=["pooler.w"])]
    assert _judge(doctor, ParameterUse=missing) == []
    assert doctor.watch(ParamsDiverged).unreduced == ["pooler.w", "pooler.b"]
    (finding,) = doctor.judge(_gathered(doctor, ParamsDiverged=[[1], [2]]), 0)
    assert doctor.watch(ParamsDiverged).unreduced == ["pooler.w", "pooler.b"]
    assert finding.rule == "params-diverged" and "follow from unused-parameters" in finding.seen


def test_parameter_use_is_summed_over_the_window_and_judged_when_it_closes() -> None:
    doctor = _ddp_doctor("w", "extra")
    opened = [UseReport([2, 0], 2, False), UseReport([1, 0], 2, False)]
    assert _judge(doctor, ParameterUse=opened) == []
    watch = doctor.watch(ParameterUse)
    assert watch.use_counts == [[2, 0], [1, 0]]
    closed = [UseReport([2, 0], 2, True)] * 2
    assert _judge(doctor, ParameterUse=closed) == ["unused-parameters"]  # "extra" never got a gradient
    assert watch.use_counts == [[4, 0], [3, 0]] and watch.use_batches == [4, 4]


def test_each_rule_is_recorded_once_with_its_step_and_the_state_carries_its_version() -> None:
    doctor = DistributedDoctor(stop_on_fatal=False)
    with pytest.warns(DistributedDoctorWarning, match=r"\[uneven-batches\]"):
        doctor._report(types.SimpleNamespace(global_step=3), [Finding("uneven-batches", "s", "w", "f")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported already: not again
        doctor._report(types.SimpleNamespace(global_step=9), [Finding("uneven-batches", "s", "w", "f")])
    assert [(f.rule, f.step) for f in doctor.findings] == [("uneven-batches", 3)]
    assert doctor.state_dict()["version"] == STATE_VERSION and doctor.state_dict()["reported"] == ["uneven-batches"]
    with pytest.warns(UserWarning, match="state version"):
        doctor.load_state_dict({"version": STATE_VERSION + 1})
    assert doctor.findings[0].step == 3  # nothing loaded


def test_a_rank_report_pickles_for_the_exchange() -> None:
    import pickle

    report = RankReport(
        local_findings=[Finding("a-b", "s", "w", "f")],
        setups=_setups(),
        payloads={"FirstBatches": ({0: "x"}, SHUFFLING), "ParameterUse": UseReport([1], 1, True, ["w"])},
    )
    assert pickle.loads(pickle.dumps(report)) == report
    assert RankReport().setups is None and RankReport().payloads == {}  # nothing but what is part of this check


# ----------------------------------------------------------------------------- the check interval's name


def test_check_every_n_batches_and_its_deprecated_old_name() -> None:
    assert DistributedDoctor(check_every_n_batches=7).check_every_n_batches == 7
    assert DistributedDoctor(False, 9).check_every_n_batches == 9  # still the second positional argument
    with pytest.warns(DeprecationWarning, match=r"check_every_n_batches=5") as caught:
        doctor = DistributedDoctor(every_n_steps=5)
    assert doctor.check_every_n_batches == 5 and caught[0].filename == __file__  # points at the caller
    with pytest.warns(DeprecationWarning):
        assert DistributedDoctor(check_every_n_batches=5, every_n_steps=5).check_every_n_batches == 5
    with pytest.raises(ValueError, match=r"DistributedDoctor: every_n_steps is the old name of check_every_n_batches"):
        DistributedDoctor(check_every_n_batches=5, every_n_steps=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation for the new name
        DistributedDoctor(check_every_n_batches=3)


@pytest.mark.parametrize("value", [0, -1, True, 2.5, "4", None])
def test_a_bad_check_interval_names_the_argument(value: Any) -> None:
    with pytest.raises(ValueError, match=r"DistributedDoctor: check_every_n_batches\b"):
        DistributedDoctor(check_every_n_batches=value)


# ----------------------------------------------------------------------------- probes that cannot see


def test_fetch_timing_reports_each_fetch_undoes_itself_and_says_when_it_cannot() -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    loop = trainer.fit_loop.epoch_loop
    seen: list[float] = []
    undo = compat.time_train_fetches(trainer, seen.append)
    assert undo is not None
    loop._on_before_fetch()
    loop._on_after_fetch()
    assert len(seen) == 1 and seen[0] >= 0
    undo()
    assert "_on_before_fetch" not in vars(loop) and "_on_after_fetch" not in vars(loop)
    bare = types.SimpleNamespace(fit_loop=types.SimpleNamespace(epoch_loop=object()))
    assert compat.time_train_fetches(bare, seen.append) is None


def test_metric_values_and_the_sampler_inside_lightnings_wrapper_say_when_they_cannot_see() -> None:
    assert compat.epoch_metrics_logged_without_sync(object()) is None  # no such attribute on this "Trainer"
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    assert compat.epoch_metrics_logged_without_sync(trainer) == {}  # no loop running: nothing logged
    assert compat.trainer_uses_distributed_sampler(trainer) is True
    assert compat.trainer_uses_distributed_sampler(object()) is None
    data = TensorDataset(torch.arange(8.0))
    wrapper = DistributedSamplerWrapper(SequentialSampler(data), num_replicas=2, rank=0, shuffle=False)
    assert isinstance(compat.sampler_wrapped_for_distribution(wrapper), SequentialSampler)
    assert compat.sampler_wrapped_for_distribution(SequentialSampler(data)) is None
    vars(wrapper.dataset).pop("_sampler")  # a Lightning that keeps it elsewhere
    with pytest.raises(LookupError):
        compat.sampler_wrapped_for_distribution(wrapper)
    info = first_batches.describe_sampler(DataLoader(data, sampler=wrapper), trainer)
    assert info["order_unknown"] is True and info["fixed_order"] is False


class _Plain(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8)


@pytest.mark.usefixtures("no_gpu_visible")  # asserts CPU behaviour, also on a GPU machine
def test_a_rule_that_cannot_be_checked_is_named_not_passed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(data_wait, "time_train_fetches", lambda trainer, on_fetch: None)
    monkeypatch.setattr(unsynced_logging, "epoch_metrics_logged_without_sync", lambda trainer: None)
    doctor = DistributedDoctor(check_every_n_batches=2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        callbacks=[doctor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # rank_zero_info writes to whichever logger the last-imported of lightning.fabric / lightning.pytorch
    # installed, and lightning.pytorch's may not propagate to the root logger caplog listens on: the
    # summary is caught on the logger that writes it, whatever the import order in this process.
    writer = lightning_utilities.core.rank_zero.log
    writer.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=writer.name), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(_Plain())
    finally:
        writer.removeHandler(caplog.handler)
    assert doctor.not_checked == {"dataloader-starving", "unsynced-logging"} and doctor.findings == []
    messages = [str(w.message) for w in caught if not issubclass(w.category, DistributedDoctorWarning)]
    assert any("dataloader-starving is not checked in this run" in m for m in messages), messages
    summary = [r.getMessage() for r in caplog.records if "DistributedDoctor:" in r.getMessage()]
    assert summary and "not checked in this run: dataloader-starving, unsynced-logging" in summary[-1]
    # A disabled rule is not "not checked": it was switched off.
    quiet = DistributedDoctor(disable=["dataloader-starving", "unsynced-logging"])
    L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        callbacks=[quiet],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(_Plain())
    assert quiet.not_checked == set()
