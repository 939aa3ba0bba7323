"""``CommProfiler(whatif=...)``: the "what would help" block at the end of a profiled fit.

In process: the option's checks; real one-rank fits (a gloo group of one, DDP's hook really
there) whose block is printed after the summary and written to ``comm_profile.json`` with the
gradients of every bucket; a profile that cannot be replayed, or a replay that fails, gives one
line, never an exception; ``whatif=False`` adds nothing; W&B gets the block as a table (a
stand-in ``wandb`` module: the GPU machine has none installed).
"""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import CommProfiler, TunedDDPStrategy
from lightning_mgpu.callbacks.comm_profiler import advice, report
from lightning_mgpu.strategies.parts.ddp_model import BucketInfo
from lightning_mgpu.whatif import PRESETS
from tests.scripts.models import MLPRegressor
from tests.helpers.whatif import mlp_profile

STEPS = 6


def _fit(root: Path, strategy: Any, profiler: CommProfiler) -> L.Trainer:
    torch.manual_seed(0)
    x = torch.randn(8 * STEPS, 32)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=STEPS,
        callbacks=[profiler],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    model = MLPRegressor(in_features=32, width=32, depth=1, out_features=1, lr=0.01, record_losses=False)
    trainer.fit(model, DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=8))
    return trainer


def _profiler(tmp_path: Path, **kwargs: Any) -> CommProfiler:
    return CommProfiler(warmup_steps=1, every_n_steps=50, profile_every=None, export_dir=tmp_path / "export", **kwargs)


# ------------------------------------------------------------------ the option


@pytest.mark.parametrize(
    ("value", "kept"),
    [(None, False), (False, False), (True, True), ("10GbE", "10gbe"), (" ib-hdr ", "ib-hdr"), (2.5, 2.5), (10, 10.0)],
)
def test_whatif_accepts_off_on_a_preset_or_a_rate(value: Any, kept: Any) -> None:
    got = CommProfiler(whatif=value).whatif
    assert got == kept and type(got) is type(kept)


def test_whatif_is_on_by_default_and_takes_a_link() -> None:
    assert CommProfiler().whatif is True
    assert CommProfiler(whatif=PRESETS["1gbe"]).whatif is PRESETS["1gbe"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("fddi", r"CommProfiler: whatif must be True, False, a link preset \(loopback, 1gbe, 10gbe"),
        ("", "CommProfiler: whatif must be True, False, a link preset"),
        (0, "CommProfiler: whatif must be a link rate in Gbit/s > 0, got 0"),
        (-2.5, "CommProfiler: whatif must be a link rate in Gbit/s > 0, got -2.5"),
        (math.nan, "CommProfiler: whatif must be a link rate in Gbit/s, got nan"),
        (math.inf, "CommProfiler: whatif must be a link rate in Gbit/s, got inf"),
        (["10gbe"], r"whatif must be True, False/None, a link preset name .* got \['10gbe'\] \(list\)"),
    ],
)
def test_a_bad_whatif_is_refused_at_construction(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CommProfiler(whatif=value)


# ------------------------------------------------------------------ real fits


def test_a_profiled_fit_prints_the_block_and_writes_it_with_every_buckets_gradients(
    tmp_path: Path, one_rank: None, capsys: pytest.CaptureFixture[str]
) -> None:
    profiler = _profiler(tmp_path, whatif="1gbe")
    trainer = _fit(tmp_path, TunedDDPStrategy(bucket_cap_mb=0.002), profiler)
    out = capsys.readouterr().out
    written = json.loads((tmp_path / "export" / "comm_profile.json").read_text())
    block = written["what_would_help"]
    assert block == profiler.advice
    # a one-rank profile over a named link: what two ranks over it would do
    assert block["title"] == "what would help (2 rank(s) over 1gbe, replayed from this profile):"
    names = [lever["name"] for lever in block["levers"]]
    assert "fp16/bf16 compression" in names and names[-1] == "4 nodes instead of 2"
    assert all(lever["step_ms"] > 0 and lever["sentence"].startswith(lever["name"]) for lever in block["levers"])
    # printed after the summary, every line of it
    lines = [block["title"], *(f"  {lever['sentence']}" for lever in block["levers"])]
    lines += [f"  ({note})" for note in block["notes"]]
    assert "\n".join(lines) in out
    assert out.index("CommProfiler: 1 rank(s), gloo on cpu") < out.index(block["title"])
    # each bucket lists its gradients (from the layout DDP built), adding up to the bytes recorded
    buckets = written["buckets"]
    assert len(buckets) > 1
    parameters = dict(trainer.lightning_module.named_parameters())
    listed = [p["name"] for b in buckets for p in b["params"]]
    assert sorted(listed) == sorted(parameters)
    for bucket in buckets:
        assert len(bucket["params"]) == bucket["num_params"]
        assert sum(4 * math.prod(p["shape"]) for p in bucket["params"]) == bucket["bytes"]
        assert all(
            p["dtype"] == "float32" and p["shape"] == list(parameters[p["name"]].shape) for p in bucket["params"]
        )
    assert not any("does not list the gradients" in note for note in block["notes"])


def test_whatif_false_adds_nothing(tmp_path: Path, one_rank: None, capsys: pytest.CaptureFixture[str]) -> None:
    profiler = _profiler(tmp_path, whatif=False)
    _fit(tmp_path, TunedDDPStrategy(), profiler)
    out = capsys.readouterr().out
    written = json.loads((tmp_path / "export" / "comm_profile.json").read_text())
    assert "CommProfiler: 1 rank(s)" in out and profiler.summary is not None
    assert "what would help" not in out
    assert "what_would_help" not in written and profiler.advice is None


def test_a_failing_replay_is_one_line_and_the_fit_ends_normally(
    tmp_path: Path, one_rank: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(advice, "what_would_help", broken)
    profiler = _profiler(tmp_path)  # whatif=True, the default
    trainer = _fit(tmp_path, DDPStrategy(), profiler)
    assert trainer.global_step == STEPS and profiler.summary is not None
    line = "what would help: not available (ZeroDivisionError: float division by zero)"
    assert line + "\n" in capsys.readouterr().out
    written = json.loads((tmp_path / "export" / "comm_profile.json").read_text())
    assert written["what_would_help"] == {
        "title": "what would help: not available",
        "levers": [],
        "notes": ["ZeroDivisionError: float division by zero"],
    }
    # stock DDP offers no bucket_layout: the buckets are written without their gradients
    assert written["buckets"] and not any("params" in bucket for bucket in written["buckets"])


# ------------------------------------------------------------------ the block without a fit


def test_a_profile_that_cannot_be_replayed_gives_one_line_with_the_reason() -> None:
    broken = advice.block_lines(advice.advise({"world_size": 2}, True))
    assert len(broken) == 1 and broken[0].startswith("what would help: nothing to replay (profile: no 'summary'")
    unmeasured = mlp_profile()
    unmeasured["buckets"], unmeasured["summary"]["measures_comm"] = [], False  # FSDP2: no DDP bucket seen
    (line,) = advice.block_lines(advice.advise(unmeasured, True))
    assert line.startswith("what would help: nothing to replay (profile: no gradient buckets were recorded")
    (one_rank,) = advice.block_lines(advice.advise(mlp_profile(world_size=1), True))
    assert one_rank == (
        "what would help: one rank was profiled; name a link to predict more ranks "
        "(lightning-mgpu whatif comm_profile.json --world-size 2 --link 10gbe)"
    )


def test_the_block_on_a_two_rank_profile_ranks_the_levers() -> None:
    found = advice.advise(mlp_profile(), True)
    lines = advice.block_lines(found)
    assert lines == found.lines and lines[0].startswith("what would help (2 rank(s) over as profiled")
    assert any(line.startswith("  fp16/bf16 compression saves") for line in lines)
    over = advice.advise(mlp_profile(), 2.5)
    assert over.title.startswith("what would help (2 rank(s) over 2.5 Gbit/s")  # one node per profiled rank
    assert json.loads(json.dumps(found.as_dict()))["levers"]


def test_bucket_gradients_are_listed_only_where_the_layout_holds_the_recorded_bytes() -> None:
    parameters = {"a": torch.zeros(4, 3), "b": torch.zeros(3), "c": torch.zeros(2, dtype=torch.float16)}
    layout = [BucketInfo(0, 60, 2, ("b", "a")), BucketInfo(1, 4, 1, ("c",))]
    recorded = [{"bytes": 60, "num_params": 2}, {"bytes": 4, "num_params": 1}]
    assert advice.bucket_gradients(layout, parameters, recorded) == [
        [{"name": "b", "shape": [3], "dtype": "float32"}, {"name": "a", "shape": [4, 3], "dtype": "float32"}],
        [{"name": "c", "shape": [2], "dtype": "float16"}],
    ]
    assert advice.bucket_gradients(None, parameters, recorded) is None
    assert advice.bucket_gradients(layout[:1], parameters, recorded) is None  # another number of buckets
    assert advice.bucket_gradients(layout, parameters, [{"bytes": 64, "num_params": 2}, recorded[1]]) is None
    assert advice.bucket_gradients(layout, parameters, [{"bytes": 60, "num_params": 3}, recorded[1]]) is None
    assert advice.bucket_gradients(layout, {"a": parameters["a"], "c": parameters["c"]}, recorded) is None
    complex_params = {**parameters, "c": torch.zeros(1, dtype=torch.complex64)}
    assert advice.bucket_gradients(layout, complex_params, recorded) is None  # a dtype the replay cannot size
    wrong_sum = [BucketInfo(0, 60, 2, ("b", "b")), layout[1]]  # the layout's own bytes do not add up
    assert advice.bucket_gradients(wrong_sum, parameters, [{"bytes": 60, "num_params": 2}, recorded[1]]) is None


# ------------------------------------------------------------------ W&B


class _Table:
    def __init__(self, columns: list[Any], data: list[list[Any]]) -> None:
        self.columns, self.data = columns, data


class _FakeWandbLogger(WandbLogger):
    def __init__(self) -> None:  # no wandb run: only what log_to_wandb uses
        self.logged: list[dict[str, Any]] = []

    @property
    def experiment(self) -> Any:
        return types.SimpleNamespace(log=self.logged.append)


def test_wandb_gets_the_block_as_a_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(Table=_Table, Image=None))
    logger = _FakeWandbLogger()
    trainer: Any = types.SimpleNamespace(loggers=[logger])
    profile = mlp_profile()
    for bucket in profile["buckets"]:  # the bucket table's other columns
        bucket.update(dict.fromkeys(set(report.BUCKET_COLUMNS) - set(bucket), 0.0))
    profile["what_would_help"] = found = advice.advise(profile, True).as_dict()
    report.log_to_wandb(trainer, profile, None)
    (payload,) = logger.logged
    table = payload["comm/what_would_help"]
    assert table.columns == ["lever", "saves_pct", "step_ms", "note"]
    assert table.data[0] == ["scenario", None, None, found["title"]]
    levers = table.data[1 : 1 + len(found["levers"])]
    assert [row[0] for row in levers] == [lever["name"] for lever in found["levers"]]
    assert all(
        row[1] == lever["saving_pct"] and row[3] == lever["sentence"] for row, lever in zip(levers, found["levers"])
    )
    assert table.data[1 + len(found["levers"]) :] == [["note", None, None, note] for note in found["notes"]]
    assert isinstance(payload["comm/buckets"], _Table)
    del profile["what_would_help"]  # whatif=False: the bucket table only
    report.log_to_wandb(trainer, profile, None)
    assert set(logger.logged[-1]) == {"comm/buckets"}
