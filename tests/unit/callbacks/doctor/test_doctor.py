"""DistributedDoctor without processes: arguments, the rules' checks on gathered data, state, one-rank fits."""

from __future__ import annotations

import io
import math
import pickle
import re
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    TensorDataset,
)

from lightning_mgpu.callbacks.doctor import findings, probes, rules
from lightning_mgpu.callbacks.doctor.rules import (
    batchnorm,
    data_wait,
    dataparallel,
    first_batches,
    parameter_use,
    params_diverged,
    random_state,
    reentrant_checkpoint,
    uneven_batches,
    unsynced_logging,
    unused_devices,
)
from lightning_mgpu.callbacks.doctor import (
    RULE_IDS,
    RULES,
    DistributedDoctor,
    DistributedDoctorError,
    DistributedDoctorWarning,
)

# The rules the issue names, under their stable ids.
ISSUE_RULES = {
    "unused-devices",
    "dataparallel-wrapped",
    "data-not-sharded",
    "sampler-epoch-not-set",
    "params-diverged",
    "uneven-batches",
    "batchnorm-without-sync",
    "unused-parameters",
    "find-unused-wasted",
    "unsynced-logging",
    "same-random-state",
    "dataloader-starving",
}


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"strict": "yes"}, "strict"),
        ({"strict": 1}, "strict"),
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"every_n_steps": True}, "every_n_steps"),
        ({"every_n_steps": 2.5}, "every_n_steps"),
        ({"every_n_steps": -3}, "every_n_steps"),
        ({"data_wait_threshold": 0}, "data_wait_threshold"),
        ({"data_wait_threshold": 1.0}, "data_wait_threshold"),
        ({"data_wait_threshold": "0.2"}, "data_wait_threshold"),
        ({"data_wait_threshold": float("nan")}, "data_wait_threshold"),
        ({"batchnorm_min_batch": 0}, "batchnorm_min_batch"),
        ({"disable": ["no-such-rule"]}, "disable"),
        ({"disable": 5}, "disable"),
        ({"disable": [None]}, "disable"),
        ({"stop_on_fatal": "no"}, "stop_on_fatal"),
        ({"strict": True, "stop_on_fatal": False}, "strict"),
        ({"check_timeout": 0}, "check_timeout"),
        ({"check_timeout": "60"}, "check_timeout"),
        ({"check_timeout": float("inf")}, "check_timeout"),
    ],
)
def test_bad_arguments_give_one_clear_error_naming_the_argument(kwargs: dict[str, Any], names: str) -> None:
    with pytest.raises(ValueError, match=rf"DistributedDoctor: {names}\b") as info:
        DistributedDoctor(**kwargs)
    assert "\n" not in str(info.value)


def test_unknown_rule_id_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError) as info:
        DistributedDoctor(disable=["data-not-shardd"])
    message = str(info.value)
    assert "'data-not-shardd'" in message
    for rule_id in RULE_IDS:
        assert rule_id in message


def test_disable_takes_ids_or_a_single_id() -> None:
    assert DistributedDoctor(disable=["data-not-sharded", "params-diverged"]).disabled == {
        "data-not-sharded",
        "params-diverged",
    }
    assert DistributedDoctor(disable="uneven-batches").disabled == {"uneven-batches"}
    doctor = DistributedDoctor(disable=("unsynced-logging",))
    assert not doctor.enabled("unsynced-logging") and doctor.enabled("uneven-batches")


def test_every_rule_is_documented_with_a_stable_id() -> None:
    assert ISSUE_RULES <= set(RULE_IDS)
    for rule_id, rule in RULES.items():
        assert re.fullmatch(r"[a-z]+(-[a-z]+)+", rule_id), rule_id
        assert rule.id == rule_id
        for text in (rule.catches, rule.detection, rule.cost, rule.fix):
            assert len(text) > 10
    assert [row[0] for row in rules.table_rows()] == list(RULE_IDS)


# ----------------------------------------------------------------------------- findings and the error


def test_finding_says_what_why_and_how_and_the_error_names_the_rules() -> None:
    finding = findings.Finding("params-diverged", seen="SEEN", why="WHY", fix="FIX", step=7)
    text = finding.format()
    assert text.startswith("[params-diverged] at step 7: SEEN") and "why: WHY" in text and "fix: FIX" in text
    assert findings.Finding.from_dict(finding.as_dict()) == finding
    error = DistributedDoctorError([finding, findings.Finding("uneven-batches", "a", "b", "c")])
    assert error.rules == ["params-diverged", "uneven-batches"]
    assert "stopped the run on every rank: params-diverged, uneven-batches" in str(error)
    assert isinstance(error, RuntimeError)
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error) and copy.rules == error.rules


def test_a_fatal_stop_names_the_fatal_rules_and_how_to_only_warn() -> None:
    fatal = findings.Finding("unused-parameters", "no grad", "w", "f")
    other = findings.Finding("params-diverged", "differ", "w", "f", severity=None)
    error = DistributedDoctorError([fatal, other], strict=False, fatal=["unused-parameters"])
    first_line = str(error).splitlines()[0]
    assert first_line == (
        "DistributedDoctor stopped the run on every rank: unused-parameters (fatal: the run would crash or hang); "
        "also found: params-diverged"
    )
    assert "DistributedDoctor(stop_on_fatal=False) only warns" in str(error) and error.rules == [
        "unused-parameters",
        "params-diverged",
    ]
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error) and copy.fatal == ["unused-parameters"]
    # A finding's own severity (not its rule's) survives the exchange and the checkpoint.
    wrong = findings.Finding("unused-parameters", "never trained", "w", "f", severity="wrong")
    assert findings.Finding.from_dict(wrong.as_dict()) == wrong
    assert findings.Finding.from_dict({k: v for k, v in fatal.as_dict().items() if k != "severity"}) == fatal


def test_local_findings_merge_into_one_per_rule_naming_the_ranks() -> None:
    a = findings.Finding("batchnorm-without-sync", "small batch", "w", "f").as_dict()
    b = findings.Finding("unused-parameters", "no grad", "w", "f").as_dict()
    merged = {f.rule: f for f in findings.merge_local([[a], [a, b], []])}
    assert merged["batchnorm-without-sync"].ranks == [0, 1]
    assert merged["batchnorm-without-sync"].seen.endswith("(on ranks 0, 1)")
    assert merged["unused-parameters"].seen.endswith("(on rank 1)")
    assert findings.merge_local([[a], [a]])[0].seen.endswith("(on every rank)")


# ----------------------------------------------------------------------------- fingerprints


def test_fingerprint_tells_batches_apart_and_gives_no_verdict_on_opaque_objects() -> None:
    x = torch.arange(12.0).reshape(3, 4)
    assert probes.fingerprint((x, {"b": 1, "a": "s"})) == probes.fingerprint((x.clone(), {"a": "s", "b": 1}))
    assert probes.fingerprint(x) != probes.fingerprint(x + 1)
    assert probes.fingerprint(x) != probes.fingerprint(x.reshape(4, 3))  # shape counts
    assert probes.fingerprint(x.bfloat16()) not in (None, probes.fingerprint(x))  # the dtype counts too
    assert probes.fingerprint(torch.empty(0)) not in (None, probes.fingerprint(torch.empty(0, 2)))
    assert probes.fingerprint([object(), object()]) is None
    big = torch.zeros(1 << 20)
    changed = big.clone()
    changed[0] = 1.0
    assert probes.fingerprint(big, max_bytes=1024) != probes.fingerprint(changed, max_bytes=1024)


# ----------------------------------------------------------------------------- the checks over gathered data


def test_data_not_sharded_names_the_ranks_and_the_rank_zero_sampler() -> None:
    assert first_batches.check_data_not_sharded(["a", "b"], [], 0) is None
    assert first_batches.check_data_not_sharded([None, None], [], 0) is None
    finding = first_batches.check_data_not_sharded(["a", "b", "a", "c"], [], 3)
    assert finding is not None and "ranks 0, 2 read identical first batches in epoch 3" in finding.seen
    rank0 = {
        "description": "DistributedSampler(shuffle=True)",
        "distributed": {"path": "loader.sampler", "rank": 0, "num_replicas": 2},
    }
    finding = first_batches.check_data_not_sharded(["a", "a"], [rank0, rank0], 0)
    assert finding is not None and "DistributedSampler(num_replicas=2, rank=0)" in finding.seen
    assert "rank=trainer.global_rank" in finding.fix
    plain = {"description": "SequentialSampler", "distributed": None, "lightning_sampler": False}
    finding = first_batches.check_data_not_sharded(["a", "a"], [plain, plain], 0)
    assert finding is not None and "use_distributed_sampler=False" in finding.seen


def test_epoch_order_fires_for_a_shuffling_sampler_only() -> None:
    shuffling = {
        "description": "NestedSampler",
        "fixed_order": False,
        "distributed": {"path": "loader.sampler.base", "shuffle": True, "epoch": 0},
    }
    finding = first_batches.check_epoch_order(["a", "b"], ["a", "b"], [shuffling] * 2, 1)
    assert finding is not None and finding.rule == "sampler-epoch-not-set"
    assert "loader.sampler.base" in finding.fix and "set_epoch(self.current_epoch)" in finding.fix
    assert first_batches.check_epoch_order(["a", "b"], ["c", "d"], [shuffling] * 2, 1) is None
    fixed = {"description": "SequentialSampler", "fixed_order": True}
    assert first_batches.check_epoch_order(["a", "b"], ["a", "b"], [fixed] * 2, 1) is None


def test_uneven_batches_predicts_the_hang_and_suggests_the_limit() -> None:
    finding = uneven_batches.check_batch_counts([8.0, 9.0], 0)
    assert finding is not None and "rank 0: 8, rank 1: 9" in finding.seen
    assert "limit_train_batches=8" in finding.fix and "hangs" in finding.why
    assert uneven_batches.check_batch_counts([8.0, 8.0], 0) is None
    assert uneven_batches.check_batch_counts([math.inf, 8.0], 0) is None  # an iterable of unknown length: no verdict
    assert finding.severity is None  # the rule's: fatal
    # A fit that ends (max_steps) before the shortest rank runs out does not hang: a warning for longer runs.
    short_fit = uneven_batches.check_batch_counts([8.0, 9.0], 0, batches_left=8)
    assert short_fit is not None and short_fit.severity == "wrong" and "after 8 more batch(es)" in short_fit.seen
    assert uneven_batches.check_batch_counts([8.0, 9.0], 0, batches_left=9).severity is None  # type: ignore[union-attr]


def _bitsums(tensors: list[torch.Tensor]) -> list[int]:
    return [int(probes.bitsum(t)) for t in tensors]


def test_divergence_from_a_bucket_ddp_never_reduced_is_put_down_to_the_unused_parameters() -> None:
    """Issue 28 (5): a BERT whose pooler gets no gradient under find_unused_parameters=False diverges in every
    tensor of the pooler's bucket; the finding must say why, with the fix that works."""
    sums, names = [[1, 2, 3], [1, 5, 7]], ["encoder.w", "encoder.b", "pooler.dense.weight"]
    plain = params_diverged.check_params(sums, names, buffers_checked=False)
    assert plain is not None and plain.fix == RULES["params-diverged"].fix
    explained = params_diverged.check_params(sums, names, False, unreduced=["pooler.dense.weight", "pooler.dense.bias"])
    assert explained is not None and explained.rule == "params-diverged"
    assert "2 tensor(s) differ" in explained.seen
    assert "follow from unused-parameters" in explained.seen and "pooler.dense.weight, pooler.dense.bias" in (
        explained.seen
    )
    assert explained.fix.endswith(RULES["unused-parameters"].fix) and "load weights" not in explained.fix
    assert "never averaged" in explained.why


def test_unused_parameters_under_find_unused_true_is_not_fatal() -> None:
    never = parameter_use.check_param_usage([[4, 0], [4, 0]], [4, 4], ["w", "extra.w"], find_unused=True)
    assert never is not None and never.rule == "unused-parameters" and never.severity == "wrong"
    assert RULES["unused-parameters"].severity == "fatal"  # the find_unused_parameters=False kind
    assert parameter_use.unused_needed_finding(["w"]).severity is None


def test_reentrant_checkpoints_are_found_in_the_graph_however_checkpoint_was_called() -> None:
    from functools import partial

    from torch.utils.checkpoint import checkpoint, checkpoint_sequential

    torch.manual_seed(0)
    a, b, c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
    x = torch.randn(2, 4)
    wrapped = partial(checkpoint, use_reentrant=True)  # e.g. Hugging Face's _gradient_checkpointing_func
    two = c(wrapped(b, wrapped(a, x.requires_grad_())))
    assert reentrant_checkpoint.reentrant_checkpoints(two.sum()) == 2
    assert reentrant_checkpoint.reentrant_checkpoints({"loss": two.sum(), "aux": [two]}) == 2
    seq = checkpoint_sequential(nn.Sequential(a, nn.Tanh(), b), 2, x, use_reentrant=True)
    assert reentrant_checkpoint.reentrant_checkpoints(seq) >= 1
    assert reentrant_checkpoint.reentrant_checkpoints(c(checkpoint(b, a(x), use_reentrant=False)).sum()) == 0
    assert reentrant_checkpoint.reentrant_checkpoints(c(b(a(x))).sum()) == 0
    assert reentrant_checkpoint.reentrant_checkpoints(torch.ones(1)) == 0  # no graph


def test_param_checksums_are_exact_and_independent_of_the_reduction_order() -> None:
    torch.manual_seed(0)
    weights = [torch.randn(1000, 1000) * 0.02, torch.randn(10).bfloat16(), torch.randn(3, dtype=torch.float64)]
    assert (
        params_diverged.check_params(
            [_bitsums([w.clone() for w in weights]), _bitsums(weights)], ["w", "b", "d"], False
        )
        is None
    )
    # a non-contiguous view of the same values: same checksum
    assert _bitsums([weights[0].t().contiguous().t()]) == _bitsums([weights[0]])
    for index in range(3):  # one ulp anywhere shows
        edited = [w.clone() for w in weights]
        flat = edited[index].view(-1)
        flat[len(flat) // 2] = torch.nextafter(flat[len(flat) // 2], torch.tensor(10.0, dtype=flat.dtype))
        finding = params_diverged.check_params([_bitsums(weights), _bitsums(edited)], ["w", "b", "d"], False)
        assert finding is not None and f"differ between rank 0 and rank(s) 1: {'wbd'[index]}" in finding.seen
    assert _bitsums([torch.empty(0)]) == [0]


def test_unsynced_metrics_compare_only_keys_every_rank_logged() -> None:
    finding = unsynced_logging.check_unsynced_metrics(
        [{"training_step.loss": 1.0, "x.acc": 0.5}, {"training_step.loss": 2.0}]
    )
    assert finding is not None and "loss (1, 2 on ranks 0..1)" in finding.seen and "sync_dist=True" in finding.fix
    assert unsynced_logging.check_unsynced_metrics([{"a.loss": 1.0}, {"a.loss": 1.0}]) is None
    assert unsynced_logging.check_unsynced_metrics([{"a.loss": 1.0}]) is None


def test_random_state_needs_augmentation_and_identical_states() -> None:
    aug = {"augments": True, "how": "dataset[0] changes with the global random seed", "workers": 0}
    finding = random_state.check_random_state([aug, aug], ["s", "s"])
    assert finding is not None and "global random states" in finding.seen and "global_rank" in finding.fix
    assert random_state.check_random_state([aug, aug], ["s", "t"]) is None
    assert random_state.check_random_state([{"augments": False}] * 2, ["s", "s"]) is None
    workers = {"augments": True, "how": "the dataset has .transform", "workers": 4, "rank_aware_workers": False}
    finding = random_state.check_random_state([workers] * 2, ["base-seed:1", "base-seed:1"])
    assert finding is not None and "workers=True" in finding.fix
    assert random_state.check_random_state([{**workers, "rank_aware_workers": True}] * 2, ["b", "b"]) is None


def test_data_wait_share_and_the_num_workers_hint() -> None:
    slow = {"fetch_s": 0.8, "iteration_s": 1.0, "batches": 10}
    fast = {"fetch_s": 0.01, "iteration_s": 1.0, "batches": 10}
    loader = {"num_workers": 0, "cpus": 16, "local_world_size": 2, "cuda": True}
    finding = data_wait.check_data_wait([fast, slow], 0.25, [loader, loader])
    assert finding is not None and "rank 1 spent 80%" in finding.seen
    assert "num_workers=7" in finding.fix and "pin_memory=True" in finding.fix
    assert data_wait.check_data_wait([fast, fast], 0.25, [loader] * 2) is None
    assert data_wait.check_data_wait([{**slow, "batches": 2}] * 2, 0.25, [loader] * 2) is None  # too few to judge
    workers = {**loader, "num_workers": 4}
    finding = data_wait.check_data_wait([slow], 0.25, [workers])
    assert finding is not None and "the 4 workers per rank do not keep up" in finding.fix


def test_parameter_use_never_always_or_dynamic() -> None:
    names = ["a", "b"]
    never = parameter_use.check_param_usage([[5, 0], [5, 0]], [5, 5], names, True)
    assert never is not None and never.rule == "unused-parameters" and "b" in never.seen
    wasted = parameter_use.check_param_usage([[5, 5], [5, 5]], [5, 5], names, True)
    assert wasted is not None and wasted.rule == "find-unused-wasted"
    assert parameter_use.check_param_usage([[5, 2], [5, 5]], [5, 5], names, True) is None  # a dynamic graph needs it
    assert parameter_use.check_param_usage([[3, 0]], [3], names, True) is None  # too few batches to judge
    needed = parameter_use.unused_needed_finding(["head.weight"])
    assert "head.weight" in needed.seen and "find_unused_parameters=True" in needed.fix
    # Lightning rewrites any exception message that contains DDP's own error text: keep clear of it.
    assert "Expected to have finished reduction" not in needed.format()


def test_batchnorm_and_devices_and_dataparallel() -> None:
    small = batchnorm.check_batchnorm(["bn"], 8, 16)
    assert small is not None and small.rule == "batchnorm-without-sync" and "batch of 8 (< 16)" in small.seen
    assert batchnorm.check_batchnorm(["bn"], 16, 16) is None and batchnorm.check_batchnorm([], 2, 16) is None
    node = {"node": "n1", "type": "cuda", "used": 4, "cuda_visible": 8}
    finding = unused_devices.check_unused_devices([node] * 4 + [{**node, "node": "n2", "used": 8}] * 8)
    assert finding is not None and finding.seen == "n1: 8 GPUs visible, the run uses 4"
    assert unused_devices.check_unused_devices([{"node": "n", "type": "cpu", "used": 2, "cuda_visible": 0}] * 2) is None
    assert dataparallel.check_dataparallel([]) is None
    wrapped = dataparallel.check_dataparallel(["DataParallel at 'net'"])
    assert wrapped is not None and wrapped.rule == "dataparallel-wrapped" and "DataParallel at 'net'" in wrapped.seen


# ----------------------------------------------------------------------------- samplers and the augmentation probe


def test_sampler_description_finds_the_order_and_the_distributed_sampler() -> None:
    data = TensorDataset(torch.arange(32.0))
    trainer: Any = type("T", (), {"_accelerator_connector": type("C", (), {"use_distributed_sampler": False})()})()

    def describe(loader: DataLoader) -> dict[str, Any]:
        return first_batches.describe_sampler(loader, trainer)

    assert describe(DataLoader(data, batch_size=4))["fixed_order"] is True
    assert describe(DataLoader(data, batch_size=4, shuffle=True))["fixed_order"] is False
    fixed = describe(DataLoader(data, batch_size=4, sampler=DistributedSampler(data, 2, 1, shuffle=False)))
    assert fixed["fixed_order"] is True and fixed["distributed"]["rank"] == 1
    seeded = DistributedSamplerWrapper(
        RandomSampler(data, generator=torch.Generator()), num_replicas=2, rank=0, shuffle=False
    )
    assert describe(DataLoader(data, batch_size=4, sampler=seeded))["fixed_order"] is False

    class Holder(BatchSampler):  # a custom batch sampler that keeps the DistributedSampler to itself
        def __init__(self) -> None:
            self.inner = DistributedSampler(data, 2, 0, shuffle=True)

        def __iter__(self) -> Any:
            return iter([list(range(4))])

        def __len__(self) -> int:
            return 1

    info = describe(DataLoader(data, batch_sampler=Holder()))
    assert info["path"] == "loader.batch_sampler" and info["distributed"]["path"] == "loader.batch_sampler.inner"
    assert info["fixed_order"] is False


class _Noisy(Dataset):
    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.randn(3, generator=self.generator)


def test_augmentation_probe_restores_the_random_state() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    info = random_state.probe_augmentation(DataLoader(_Noisy()))
    assert info["augments"] is True and torch.equal(torch.get_rng_state(), before)
    assert random_state.probe_augmentation(DataLoader(TensorDataset(torch.zeros(4))))["augments"] is False
    # randomness from a private generator: the global seed does not drive it, no verdict
    assert random_state.probe_augmentation(DataLoader(_Noisy(torch.Generator())))["augments"] is False

    class WithTransform(TensorDataset):
        transform = staticmethod(lambda x: x)

    workers = random_state.probe_augmentation(DataLoader(WithTransform(torch.zeros(4)), num_workers=2))
    assert workers == {"augments": True, "how": "the dataset has .transform", "workers": 2, "rank_aware_workers": False}


# ----------------------------------------------------------------------------- state


def test_state_survives_a_weights_only_checkpoint_round_trip() -> None:
    doctor = DistributedDoctor()
    doctor.batches_seen, doctor.checks = 37, 9
    doctor.findings = [findings.Finding("unsynced-logging", "s", "w", "f", step=3)]
    doctor.watch(first_batches.FirstBatches).epoch_digests = {4: ["a", None], 5: ["b", "c"]}
    use = doctor.watch(parameter_use.ParameterUse)
    use.use_counts, use.use_batches = [[3, 0], [3, 1]], [3, 3]
    buffer = io.BytesIO()
    torch.save(doctor.state_dict(), buffer)
    buffer.seek(0)
    restored = DistributedDoctor()
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.state_dict() == doctor.state_dict()
    digests = [d.watch(first_batches.FirstBatches).epoch_digests for d in (restored, doctor)]
    assert restored.findings == doctor.findings and digests[0] == digests[1] == {4: ["a", None], 5: ["b", "c"]}
    assert restored.watch(parameter_use.ParameterUse).use_counts == [[3, 0], [3, 1]]
    with pytest.warns(UserWarning, match="state version"):
        DistributedDoctor().load_state_dict({"version": 99})


# ----------------------------------------------------------------------------- one process, in this process


class _Wrapped(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.DataParallel(nn.Linear(4, 1))

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8)


def _fit(doctor: DistributedDoctor, steps: int = 6) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=[doctor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_Wrapped())
    return trainer


@pytest.mark.usefixtures("no_gpu_visible")  # asserts CPU behaviour, also on a GPU machine
def test_one_process_fit_reports_local_rules_and_can_fit_again() -> None:
    doctor = DistributedDoctor(check_every_n_batches=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(doctor)
    assert [f.rule for f in doctor.findings] == ["dataparallel-wrapped"]
    messages = [str(w.message) for w in caught if issubclass(w.category, DistributedDoctorWarning)]
    assert len(messages) == 1 and "[dataparallel-wrapped]" in messages[0] and "fix:" in messages[0]
    # Everything it hooked into Lightning is gone after the fit.
    assert "_on_before_fetch" not in vars(trainer.fit_loop.epoch_loop)
    assert not doctor.watch(parameter_use.ParameterUse).hooks
    # The same callback on a second fit starts afresh (and reports again).
    with pytest.warns(DistributedDoctorWarning, match="dataparallel-wrapped"):
        _fit(doctor)
    assert [f.rule for f in doctor.findings] == ["dataparallel-wrapped"] and doctor.batches_seen == 6


@pytest.mark.usefixtures("no_gpu_visible")  # asserts CPU behaviour, also on a GPU machine
def test_strict_raises_and_disable_silences() -> None:
    with pytest.raises(DistributedDoctorError, match="dataparallel-wrapped") as info:
        _fit(DistributedDoctor(strict=True))
    assert info.value.rules == ["dataparallel-wrapped"]
    doctor = DistributedDoctor(strict=True, disable=["dataparallel-wrapped"])
    _fit(doctor)
    assert doctor.findings == []


# ----------------------------------------------------------------------------- one rank under DDP, in this process


class _Checkpointed(L.LightningModule):
    """Its last layer runs under a reentrant checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(4, 8), nn.Linear(8, 1)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        out: torch.Tensor = checkpoint(self.last, self.first(batch[0]), use_reentrant=True)
        return out.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)


@pytest.fixture
def one_ddp_rank(clean_process: None, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK"):
        monkeypatch.delenv(key, raising=False)


def _fit_checkpointed(doctor: DistributedDoctor, **ddp: Any) -> None:
    from lightning_mgpu import TunedDDPStrategy

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=TunedDDPStrategy(find_unused_parameters=True, **ddp),
        max_steps=2,
        callbacks=[doctor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_Checkpointed())


@pytest.mark.usefixtures("one_ddp_rank")
def test_reentrant_checkpoint_under_find_unused_stops_the_run_before_ddps_first_backward() -> None:
    """Issue 28 (4): torch.utils.checkpoint(use_reentrant=True) with find_unused_parameters=True."""
    with pytest.raises(DistributedDoctorError) as info:
        _fit_checkpointed(DistributedDoctor())
    assert info.value.rules == ["reentrant-checkpoint"] and info.value.findings[0].step == 0
    assert "static_graph=True" in str(info.value) and "use_reentrant=False" in str(info.value)


@pytest.mark.usefixtures("one_ddp_rank")
def test_reentrant_checkpoint_only_warned_is_followed_by_the_failure_it_predicts() -> None:
    with pytest.warns(DistributedDoctorWarning, match=r"\[reentrant-checkpoint\] at step 0"):
        with pytest.raises(RuntimeError, match="Expected to mark a variable ready only once"):
            _fit_checkpointed(DistributedDoctor(stop_on_fatal=False))


@pytest.mark.usefixtures("no_gpu_visible")  # asserts CPU behaviour, also on a GPU machine
@pytest.mark.usefixtures("one_ddp_rank")
def test_reentrant_checkpoint_with_the_fix_trains_without_a_finding() -> None:
    doctor = DistributedDoctor(strict=True)
    _fit_checkpointed(doctor, static_graph=True)
    assert doctor.findings == [] and doctor.batches_seen == 2
