"""DistributedDoctor on 2 CPU ranks over gloo: every rule provoked, silent on correct runs, strict stops all ranks.

Mistakes are grouped into few launches (tests/scripts/doctor_fit.py) to keep the suite fast:

* ``shared``: 8 mistakes at once (unsynced logging and the sampler order stay correct there);
* ``sampler``: a DistributedSampler Lightning cannot reach, unsynced epoch metrics, a layer that
  never trains; checkpointed every epoch, and resumed from epoch 0 (``resumed``);
* three strict runs (Lightning's launcher and torchrun) that must stop on both ranks at the
  same check, naming the rule, before the hang or crash they predict;
* the default settings stopping every rank at a fatal finding: uneven batches (under ``ddp_tuned``
  and stock ``ddp``), a reentrant checkpoint; and, told only to warn, the doctor staying out of the
  way of the failure it predicted; ranks out of step on data of unknown length waiting for each
  other no longer than ``check_timeout``;
* a Hugging Face BERT whose pooler is unused: the divergence it causes is put down to it;
* a correct run with every check active (strict), and the three recipes with ``--doctor``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from lightning_mgpu.callbacks.doctor import RULE_IDS
from tests.conftest import RECIPES, SCRIPTS, TORCHRUN_2, run_python

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

TIMEOUT_S = 120
SHARED_MISTAKES = "shared-data,dataparallel,fake-gpus,batchnorm,augment,slow-data,diverge,find-unused-wasted"
SHARED_RULES = {
    "data-not-sharded",
    "dataparallel-wrapped",
    "unused-devices",
    "batchnorm-without-sync",
    "same-random-state",
    "dataloader-starving",
    "params-diverged",
    "find-unused-wasted",
}
SAMPLER_MISTAKES = "nested-sampler,unsynced-log,never-used"
SAMPLER_RULES = {"sampler-epoch-not-set", "unsynced-logging", "unused-parameters"}


class Run:
    """One launch: its exit code, output and what each rank wrote."""

    def __init__(self, proc: subprocess.CompletedProcess[str], out_dir: Path) -> None:
        self.returncode = proc.returncode
        self.output = proc.stdout + proc.stderr
        self.ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
        self.out_dir = out_dir

    @property
    def rules(self) -> list[str]:
        return [f["rule"] for f in self.ranks[0]["findings"]]

    def finding(self, rule: str) -> dict[str, Any]:
        return next(f for f in self.ranks[0]["findings"] if f["rule"] == rule)


def launch(out_dir: Path, *flags: str, torchrun: bool = False, check: bool = True) -> Run:
    launcher = TORCHRUN_2 if torchrun else ()
    args = [*launcher, str(SCRIPTS / "doctor_fit.py"), "--out-dir", str(out_dir), *flags]
    proc = run_python(args, cwd=out_dir.parent, timeout=TIMEOUT_S, check=check)
    return Run(proc, out_dir)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("shared") / "out"
    return launch(out, "--mistakes", SHARED_MISTAKES, "--batch-size", "8", "--check-every-n-batches", "8")


@pytest.fixture(scope="module")
def sampler(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("sampler") / "out"
    return launch(out, "--mistakes", SAMPLER_MISTAKES, "--validate", "--save-every-epoch")


@pytest.fixture(scope="module")
def resumed(sampler: Run, tmp_path_factory: pytest.TempPathFactory) -> Run:
    (checkpoint,) = (sampler.out_dir / "ckpt").glob("epoch=0-*.ckpt")
    out = tmp_path_factory.mktemp("resumed") / "out"
    return launch(out, "--mistakes", SAMPLER_MISTAKES, "--validate", "--resume", str(checkpoint))


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("clean") / "out"
    return launch(out, "--fixed", "--strict", "--validate", "--samples", "512", "--batch-size", "32")


def strict_failure(out_dir: Path, *flags: str, torchrun: bool = False) -> Run:
    run = launch(out_dir, "--strict", *flags, torchrun=torchrun, check=False)
    assert run.returncode != 0, run.output
    return run


# ----------------------------------------------------------------------------- provoked, non-strict


def test_shared_run_reports_each_of_its_mistakes(shared: Run) -> None:
    assert shared.returncode == 0 and all(r["completed"] for r in shared.ranks)
    assert set(shared.rules) == SHARED_RULES, shared.output
    for rule in SHARED_RULES:
        assert f"DistributedDoctor [{rule}]" in shared.output  # a warning from rank 0
        finding = shared.finding(rule)
        assert finding["seen"] and finding["why"] and finding["fix"], finding
    # Every rank reached the same verdicts from the same gathered data.
    assert shared.ranks[0]["findings"] == shared.ranks[1]["findings"]
    assert shared.ranks[0]["state"] == shared.ranks[1]["state"]
    assert f"8 rule(s) fired: {', '.join(sorted(SHARED_RULES))}" in shared.output


def test_shared_run_messages_say_what_was_seen(shared: Run) -> None:
    seen = {rule: shared.finding(rule)["seen"] for rule in SHARED_RULES}
    assert "all 2 ranks read identical first batches in epoch 0" in seen["data-not-sharded"]
    assert "use_distributed_sampler=False" in seen["data-not-sharded"]
    assert "DataParallel at 'net'" in seen["dataparallel-wrapped"]
    assert "4 GPU(s) visible, but the run trains on cpu" in seen["unused-devices"]
    assert "per-device batch of 8 (< 16)" in seen["batchnorm-without-sync"]
    assert "dataset[0] changes with the global random seed" in seen["same-random-state"]
    assert "waiting for the next batch" in seen["dataloader-starving"]
    assert "num_workers=" in shared.finding("dataloader-starving")["fix"]
    assert "differ between rank 0 and rank(s) 1: net.module.0.weight" in seen["params-diverged"]
    # rank 1 edits the weight after step 3; the next check is at batch 8
    assert shared.finding("params-diverged")["step"] == 8
    assert "every parameter got a gradient in all of the first 8 batches" in seen["find-unused-wasted"]


def test_sampler_run_reports_order_logging_and_dead_parameters(sampler: Run) -> None:
    assert sampler.returncode == 0
    assert set(sampler.rules) == SAMPLER_RULES, sampler.output
    order = sampler.finding("sampler-epoch-not-set")
    assert "epoch 1 starts with the same batch as epoch 0 on ranks 0, 1" in order["seen"]
    assert "DistributedSampler at loader.sampler.base still at epoch 0" in order["seen"]
    assert "self.trainer.train_dataloader.sampler.base.set_epoch(self.current_epoch)" in order["fix"]
    assert "train_loss" in sampler.finding("unsynced-logging")["seen"]
    assert sampler.finding("unsynced-logging")["step"] == 1  # at the first check
    assert "extra.weight, extra.bias" in sampler.finding("unused-parameters")["seen"]
    # Sharded data: the ranks read different batches, no data-not-sharded.
    digests = sampler.ranks[0]["state"]["epoch_digests"]["0"]
    assert len(set(digests)) == 2


def test_resume_continues_exactly_where_the_checkpoint_left_off(sampler: Run, resumed: Run) -> None:
    """Killed after epoch 0 and resumed: the same checks, findings (and steps) as the run that went on."""
    assert resumed.returncode == 0
    assert resumed.ranks[0]["state"] == sampler.ranks[0]["state"]
    assert resumed.ranks[1]["state"] == sampler.ranks[1]["state"]
    # What was reported before the checkpoint is not reported again; what comes after is. The layer that
    # never trains is judged over 8 batches, 4 of them before the checkpoint: their counts were kept.
    assert sampler.finding("unsynced-logging")["step"] <= 4 < sampler.finding("unused-parameters")["step"]
    assert "DistributedDoctor [unsynced-logging]" not in resumed.output
    assert "DistributedDoctor [sampler-epoch-not-set]" in resumed.output
    assert "in the first 8 batches: extra.weight, extra.bias" in resumed.output
    assert resumed.ranks[0]["state"]["use_batches"] == [8, 8]


# ----------------------------------------------------------------------------- strict: every rank stops together


def test_strict_uneven_batches_stops_both_ranks_before_the_first_step(tmp_path: Path) -> None:
    run = strict_failure(tmp_path / "out", "--mistakes", "uneven")
    for rank in run.ranks:
        assert rank["error_rules"] == ["uneven-batches"] and rank["error_step"] == 0 and not rank["completed"]
    assert "DistributedDoctorError: DistributedDoctor(strict=True) stopped the run on every rank: uneven-batches" in (
        run.output
    )
    assert "rank 0: 8, rank 1: 9" in run.ranks[0]["error"]


def test_strict_under_torchrun_stops_before_ddp_fails_on_rank_zero_samplers(tmp_path: Path) -> None:
    """The seeds' classic: DistributedSampler(rank=0) everywhere, and a layer DDP waits for in vain."""
    run = strict_failure(tmp_path / "out", "--mistakes", "unused-needed,rank0-sampler", torchrun=True)
    for rank in run.ranks:
        assert {"unused-parameters", "data-not-sharded"} <= set(rank["error_rules"]), rank
        assert rank["error_step"] == 1  # after the first step, before the second (where DDP would fail)
    assert "rank=0) at loader.sampler" in run.ranks[0]["error"]
    assert "Expected to have finished reduction" not in run.output  # DDP never got there


def test_strict_params_diverged_stops_both_ranks_at_the_same_check(tmp_path: Path) -> None:
    run = strict_failure(tmp_path / "out", "--mistakes", "diverge", "--check-every-n-batches", "2")
    for rank in run.ranks:
        assert rank["error_rules"] == ["params-diverged"] and rank["error_step"] == 4
    assert run.output.count("DistributedDoctorError: DistributedDoctor(strict=True)") >= 2  # raised on both ranks


# ----------------------------------------------------------------------------- default settings: fatal stops every rank

FATAL_STOP = "DistributedDoctor stopped the run on every rank: "


@pytest.mark.parametrize("strategy", ["ddp_tuned", "ddp"])
def test_uneven_batches_stop_every_rank_by_default_within_a_minute(strategy: str, tmp_path: Path) -> None:
    """Issue 28 (2): rank 1 one batch short, DistributedDoctor() with its defaults. It used to warn, then hang
    in its own epoch-start collective until the collective timeout (30 minutes)."""
    run = launch(tmp_path / "out", "--mistakes", "short-rank", "--strategy", strategy, check=False)
    assert run.returncode != 0, run.output
    for rank in run.ranks:  # each rank stopped itself (and re-raised: a non-zero exit) at the same check
        assert rank["error_rules"] == ["uneven-batches"] and rank["error_step"] == 0 and not rank["completed"], rank
        assert rank["fit_s"] < 60, rank["fit_s"]
    assert "rank 0: 8, rank 1: 7" in run.ranks[1]["error"] and "limit_train_batches=7" in run.ranks[1]["error"]
    assert FATAL_STOP + "uneven-batches (fatal: the run would crash or hang)" in run.output


def test_uneven_batches_only_warned_go_on_into_ddps_failure_with_no_doctor_collective_in_the_way(
    tmp_path: Path,
) -> None:
    """stop_on_fatal=False: the doctor warns, then makes no check the ranks cannot all reach. The run fails
    as it does without the doctor (rank 1 ends its fit early; rank 0's next all-reduce finds it gone)."""
    run = launch(tmp_path / "out", "--mistakes", "short-rank,unsynced-log", "--warn-fatal", check=False)
    assert run.returncode != 0, run.output
    assert "DistributedDoctor [uneven-batches] at step 0" in run.output
    shorter, longer = run.ranks[1], run.ranks[0]
    assert shorter["completed"] and shorter["global_step"] == 14  # 2 epochs of 7 batches, no doctor wait
    assert not longer["completed"] and longer["error_type"] == "RuntimeError", longer.get("traceback")  # DDP's own
    assert "Connection closed by peer" in longer["error"] and "DistributedDoctor" not in longer["error"]


def test_ranks_out_of_step_on_data_of_unknown_length_wait_for_each_other_no_longer_than_check_timeout(
    tmp_path: Path,
) -> None:
    """A stream (no length) one batch shorter on rank 1: nothing to compare in advance. Rank 1 reaches the end
    of its epoch while rank 0 is still in its next step (held in a collective that waits for rank 1): rank 1
    waits check_timeout at the epoch-end check, then stops naming rank 0 and where it was last seen."""
    run = launch(tmp_path / "out", "--mistakes", "short-iterable", "--check-timeout", "5", check=False)
    assert run.returncode != 0, run.output
    waiting, held = run.ranks[1], run.ranks[0]
    assert waiting["error_type"] == "DistributedDoctorOutOfStep", waiting
    assert waiting["error"].startswith(
        "DistributedDoctor: rank 0 did not reach check 4 (the end of epoch 0) within 5 s"
    )
    assert "rank 0 was last at check 3 (after batch 3 of epoch 0)" in waiting["error"]
    assert 5 <= waiting["fit_s"] < 60
    assert held["error_type"] == "RuntimeError" and not held["completed"]  # freed by rank 1's exit


def test_reentrant_checkpoint_stops_both_ranks_before_the_first_backward(tmp_path: Path) -> None:
    """Issue 28 (4): checkpoint(use_reentrant=True) with find_unused_parameters=True used to end in torch's
    raw "Expected to mark a variable ready only once" on both ranks."""
    run = launch(tmp_path / "out", "--mistakes", "reentrant", check=False)
    assert run.returncode != 0, run.output
    for rank in run.ranks:
        assert rank["error_rules"] == ["reentrant-checkpoint"] and rank["error_step"] == 0, rank
    assert "1 reentrant checkpoint region(s)" in run.ranks[0]["error"]
    assert FATAL_STOP + "reentrant-checkpoint" in run.output
    assert "Expected to mark a variable ready only once" not in run.output  # DDP never got there


def test_bert_whose_pooler_is_unused_diverges_because_of_it_and_is_told_so(tmp_path: Path) -> None:
    """Issue 28 (5): a Hugging Face BertModel (tiny config) whose pooler the loss never uses, under stock DDP
    (find_unused_parameters=False). Its parameters diverge across ranks because DDP never all-reduced the
    pooler's bucket: params-diverged used to blame rank-dependent code ("load weights on every rank")."""
    run = launch(tmp_path / "out", "--model", "bert", "--strategy", "ddp", check=False)
    unused, diverged = run.finding("unused-parameters"), run.finding("params-diverged")
    assert "bert.pooler.dense.weight, bert.pooler.dense.bias" in unused["seen"]
    assert "follow from unused-parameters" in diverged["seen"] and "bert.pooler.dense.weight" in diverged["seen"]
    assert "load weights" not in diverged["fix"] and "find_unused_parameters=True" in diverged["fix"]
    assert unused["step"] == diverged["step"] == 1
    for rank in run.ranks:  # the unused pooler is fatal (DDP fails at the next step): both ranks stop together
        assert rank["error_rules"] == ["unused-parameters", "params-diverged"] and rank["error_step"] == 1, rank
    assert FATAL_STOP + "unused-parameters (fatal: the run would crash or hang); also found: params-diverged" in (
        run.output
    )


# ----------------------------------------------------------------------------- silent on correct runs


def test_correct_run_is_silent_under_strict(clean: Run) -> None:
    """BatchNorm at batch 32, augmentation with per-rank seeds, a graph that needs find_unused_parameters,
    synced logging, Lightning's distributed sampler: every check runs and none fires."""
    assert clean.returncode == 0, clean.output
    assert all(r["completed"] and r["findings"] == [] for r in clean.ranks)
    assert "DistributedDoctor:" in clean.output and "no problems found" in clean.output
    assert clean.ranks[0]["state"]["checks"] >= 8 and clean.ranks[0]["state"]["batches_seen"] == 16


@pytest.mark.parametrize(
    ("recipe", "flags"),
    [
        ("regression", ["--num-samples", "256", "--epochs", "2", "--batch-size", "16"]),
        ("image_classifier", ["--train-size", "256", "--val-size", "128", "--epochs", "2", "--batch-size", "32"]),
        ("char_lm", ["--max-chars", "2200", "--epochs", "2", "--batch-size", "16", "--sample-chars", "20"]),
    ],
)
def test_recipes_run_clean_under_the_strict_doctor(recipe: str, flags: list[str], tmp_path: Path) -> None:
    script = str(RECIPES / recipe / "train_lightning.py")
    proc = run_python(
        [script, *flags, "--devices", "2", "--doctor", "--out-dir", str(tmp_path / "runs")],
        cwd=tmp_path,
        timeout=TIMEOUT_S,
    )
    output = proc.stdout + proc.stderr
    assert "on 2 rank(s): no problems found" in output, output
    assert "DistributedDoctor [" not in output


def test_every_rule_is_provoked_by_a_launch_here() -> None:
    provoked = SHARED_RULES | SAMPLER_RULES | {"uneven-batches", "reentrant-checkpoint"}
    assert provoked == set(RULE_IDS)
