"""DistributedDoctor's typed check protocol without a Trainer: snapshots in, findings out; the ledger that
merges each check's reports; the renamed check interval; probes that cannot see say "not checked"."""

from __future__ import annotations

import logging
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
from lightning_mgpu.callbacks.doctor import (
    RULES,
    DistributedDoctor,
    DistributedDoctorWarning,
    checks,
    ledger,
    probes,
    protocol,
    rules,
)
from lightning_mgpu.callbacks.doctor.findings import Finding
from lightning_mgpu.callbacks.doctor.protocol import (
    FirstBatches,
    ParamUsage,
    RankReport,
    SetupInfo,
    Snapshot,
    UsageReport,
)

SHUFFLING = {
    "description": "NestedSampler",
    "fixed_order": False,
    "distributed": {"path": "loader.sampler.base", "rank": 0, "num_replicas": 2, "shuffle": True, "epoch": 0},
}


def _setup(node: str = "n", *, augments: bool = False, workers: int = 0) -> SetupInfo:
    return SetupInfo(
        devices={"node": node, "type": "cpu", "used": 2, "cuda_visible": 0},
        wrapped=[],
        loader={"num_workers": workers, "cpus": 8, "local_world_size": 2, "cuda": False},
        augment={"augments": augments, "how": "the dataset has .transform", "workers": workers},
        batchnorm=[],
    )


# ----------------------------------------------------------------------------- the catalogue and the checks


def test_every_rule_has_a_severity_and_is_judged_by_a_check_or_on_each_rank() -> None:
    for rule in RULES.values():
        assert rule.severity in rules.SEVERITIES, rule.id
    covered = {rule_id for check in checks.CHECKS for rule_id in check.rules} | checks.LOCAL_RULES
    assert covered == set(RULES)
    for check in checks.CHECKS:
        assert set(check.rules) <= set(RULES)
        assert list(check.run(Snapshot(world_size=2, epoch=0))) in ([], [None]), check.rules  # nothing to judge


def test_an_empty_snapshot_has_no_findings_on_any_number_of_ranks() -> None:
    for world in (1, 2, 8):
        assert checks.evaluate(Snapshot(world_size=world, epoch=0)) == []


def test_a_snapshot_of_shared_batches_and_a_repeated_order_fires_both_rules_in_order() -> None:
    snapshot = Snapshot(
        world_size=2,
        epoch=1,
        samplers=[SHUFFLING, SHUFFLING],  # type: ignore[list-item]
        first_batches=[FirstBatches(1, ["a", "a"], previous=["a", "a"])],
    )
    found = checks.evaluate(snapshot)
    assert [f.rule for f in found] == ["data-not-sharded", "sampler-epoch-not-set"]
    assert "all 2 ranks read identical first batches in epoch 1" in found[0].seen
    assert [f.rule for f in checks.evaluate(snapshot, disabled={"data-not-sharded"})] == ["sampler-epoch-not-set"]
    assert checks.evaluate(snapshot, disabled={"data-not-sharded", "sampler-epoch-not-set"}) == []


def test_an_unknown_sampler_order_gives_no_verdict_on_the_epoch_order() -> None:
    unknown = {**SHUFFLING, "order_unknown": True}
    assert checks.check_epoch_order(["a", "b"], ["a", "b"], [unknown, unknown], 1) is None
    repeated = checks.check_epoch_order(["a", "b"], ["a", "b"], [SHUFFLING, SHUFFLING], 1)
    assert repeated is not None and repeated.rule == "sampler-epoch-not-set"
    assert repeated.seen.startswith("epoch 1 starts with the same batch as epoch 0 on ranks 0")


def test_local_findings_come_first_merged_then_the_checks_in_their_order() -> None:
    local = Finding("batchnorm-without-sync", "small", "w", "f")
    snapshot = Snapshot(
        world_size=2,
        epoch=0,
        local_findings=[[local], [local]],
        setups=[_setup(), _setup()],
        batch_counts=[8.0, 9.0],
        param_sums=[[1, 2], [1, 3]],
        tensor_names=["w", "b"],
        metrics=[{"step.loss": 1.0}, {"step.loss": 2.0}],
        timings=[{"fetch_s": 0.9, "iteration_s": 1.0, "batches": 10}] * 2,
        usage=ParamUsage(counts=[[5, 5], [5, 5]], batches=[5, 5], names=["w", "b"], find_unused=True),
    )
    found = checks.evaluate(snapshot)
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
    snapshot = Snapshot(
        world_size=1,
        epoch=0,
        setups=[_setup()],
        param_sums=[[1]],
        tensor_names=["w"],
        metrics=[{"a.loss": 1.0}],
        random_states=["s"],
        augment=[{"augments": True, "workers": 0}],
        timings=[{"fetch_s": 0.9, "iteration_s": 1.0, "batches": 10}],
        loaders=[_setup().loader],
    )
    assert [f.rule for f in checks.evaluate(snapshot)] == ["dataloader-starving"]


# ----------------------------------------------------------------------------- the ledger


def _reports(**fields: Any) -> list[RankReport]:
    return [RankReport(**{k: v[rank] for k, v in fields.items()}) for rank in range(2)]


def _absorb(book: ledger.Ledger, reports: list[RankReport], epoch: int = 0) -> Snapshot:
    return book.absorb(
        reports,
        epoch=epoch,
        tensor_names=["w"],
        buffers_checked=False,
        param_names=["w"],
        find_unused=True,
        data_wait_threshold=0.25,
    )


def test_ledger_keeps_the_setup_samplers_and_the_last_two_epochs_of_first_batches() -> None:
    book = ledger.Ledger()
    snapshot = _absorb(book, _reports(setup=[_setup("a"), _setup("b")], sampler=[SHUFFLING, SHUFFLING]))
    assert (
        book.setup_sent and snapshot.setups is not None and [s.devices["node"] for s in snapshot.setups] == ["a", "b"]
    )
    assert book.checks == 1 and snapshot.samplers == [SHUFFLING, SHUFFLING]
    for epoch in range(4):
        snapshot = _absorb(book, _reports(digests=[{epoch: "x"}, {epoch: "y"}]), epoch)
        assert snapshot.setups is None and snapshot.samplers == [SHUFFLING, SHUFFLING]  # the setup is sent once
        (arrived,) = snapshot.first_batches
        assert arrived.epoch == epoch and arrived.previous == (["x", "y"] if epoch else None)
    assert sorted(book.epoch_digests) == [2, 3]


def test_ledger_stops_checks_past_the_shortest_rank_even_with_the_rule_disabled() -> None:
    book = ledger.Ledger()
    snapshot = _absorb(book, _reports(batches=[8.0, 9.0]))
    assert book.epoch_batch_limit == 8.0
    assert checks.evaluate(snapshot, disabled={"uneven-batches"}) == []
    _absorb(book, _reports(batches=[9.0, 9.0]))
    assert book.epoch_batch_limit is None


def test_once_batch_counts_differ_checks_are_made_only_within_the_shortest_ranks_batches() -> None:
    """Issue 28 (2): past the shortest rank's last batch, a check would wait for ranks that are elsewhere."""
    book = ledger.Ledger()
    assert book.may_check(0) and book.may_check(0, 11)
    _absorb(book, _reports(batches=[10.0, 9.0]), epoch=1)
    assert book.out_of_step_epoch == 1 and book.epoch_batch_limit == 9.0
    assert book.may_check(1, 7) and not book.may_check(1, 8)  # after batch 8, rank 1 has left the epoch
    assert book.may_check(1, 8, during=True) and not book.may_check(1, 9, during=True)
    for epoch in (1, 2):
        assert not book.may_check(epoch)  # epoch ends, validation ends, epoch starts, the end of training
    assert not book.may_check(2, 0)
    book.reset()  # a new fit
    assert book.may_check(0)
    # The fit ends (max_steps) before the shortest rank's last batch: the ranks never fall out of step.
    ends_first = [RankReport(batches=count, batches_left=9.0) for count in (10.0, 9.0)]
    snapshot = _absorb(book, ends_first)
    assert book.may_check(0) and book.may_check(0, 20) and book.out_of_step_epoch is None
    (finding,) = checks.evaluate(snapshot)
    assert finding.rule == "uneven-batches" and finding.severity == "wrong"


def test_parameters_without_a_gradient_are_kept_for_the_divergence_they_cause() -> None:
    book = ledger.Ledger()
    snapshot = _absorb(book, _reports(missing_grads=[["pooler.w", "pooler.b"], ["pooler.w"]]))
    assert snapshot.unreduced == ["pooler.w", "pooler.b"]
    later = _absorb(book, _reports(param_sums=[[1], [2]]))
    assert later.unreduced == ["pooler.w", "pooler.b"]
    (finding,) = checks.evaluate(later)
    assert finding.rule == "params-diverged" and "follow from unused-parameters" in finding.seen


def test_ledger_sums_parameter_use_over_the_window_and_judges_it_when_it_closes() -> None:
    book = ledger.Ledger()
    open_window = _absorb(book, _reports(usage=[UsageReport([2], 2, False), UsageReport([1], 2, False)]))
    assert open_window.usage is None and book.use_counts == [[2], [1]]
    closed = _absorb(book, _reports(usage=[UsageReport([2], 2, True), UsageReport([2], 2, True)]))
    assert closed.usage is not None and closed.usage.counts == [[4], [3]] and closed.usage.batches == [4, 4]


def test_ledger_records_each_rule_once_with_its_step_and_checks_its_state_version() -> None:
    book = ledger.Ledger()
    first = book.record([Finding("uneven-batches", "s", "w", "f")], step=3)
    assert first[0].step == 3 and book.record([Finding("uneven-batches", "s", "w", "f")], step=9) == []
    assert book.state_dict()["version"] == ledger.STATE_VERSION
    assert ledger.Ledger().load_state_dict({"version": ledger.STATE_VERSION + 1}) is False


def test_a_rank_report_pickles_for_the_exchange() -> None:
    import pickle

    report = RankReport(
        local_findings=[Finding("a-b", "s", "w", "f")],
        digests={0: "x"},
        setup=_setup(),
        usage=UsageReport([1], 1, True),
        random_state_sent=True,
    )
    assert pickle.loads(pickle.dumps(report)) == report
    assert protocol.RankReport().setup is None  # every field optional: not part of this check


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
    info = probes.describe_sampler(DataLoader(data, sampler=wrapper), trainer)
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


def test_a_rule_that_cannot_be_checked_is_named_not_passed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(probes, "time_train_fetches", lambda trainer, on_fetch: None)
    monkeypatch.setattr(probes, "epoch_metrics_logged_without_sync", lambda trainer: None)
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
