"""The package under a real scheduler (issue 31 items 2, 3 and 6): 2 nodes of the SLURM lab, jobs side by side.

* every configuration of ``tests/scripts/netlab_fit.py`` that matters across nodes (``ddp_tuned``, fp16
  compression, ``bucket_cap_mb="auto"``, ``CommProfiler``, ``DistributedDoctor``, ``hybrid`` with one
  replica per node x 2 CPU devices) as one ``srun`` job of 2 nodes x 1 task, where Lightning picks
  ``SLURMEnvironment`` itself, ends on exactly the parameters and losses of the same script under
  ``torchrun`` on one machine (2 ranks: gloo's sum is a + b whatever the transport);
* ``lightning-mgpu doctor`` started on every rank by ``srun`` (2 nodes x 2 tasks) and by ``torchrun``
  on every node (one ``srun`` task per node) prints one report, from rank 0, covering both nodes,
  with an all_reduce across them;
* the cluster recipes (``recipes/cluster/*.sbatch``), their CPU variant (the GPU request removed,
  one CPU per task) submitted as they are: 1 node x 2 tasks, 2 nodes x 1 task, and torchrun on 2
  nodes; all three train the same char_lm run to the same losses.

Preemption under the scheduler: tests/dist/cluster/test_slurm_preemption.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.labs.slurm import Cluster, Job
from tests.conftest import RECIPES, SCRIPTS, TORCHRUN_2, run_python
from tests.dist.cluster.conftest import json_reports

pytestmark = [pytest.mark.multiprocess]

CONFIGS = ("ddp_tuned", "fp16", "auto", "profiler", "doctor", "hybrid")
TEMPLATES = {
    "one_node": ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"],
    "multi_node": ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1"],
    "torchrun_multi_node": ["--nodes=2", "--cpus-per-task=1"],
}
CHAR_LM = ["--max-chars", "3000", "--epochs", "1", "--width", "32", "--layers", "1", "--sample-chars", "10"]


def cpu_variant(template: Path) -> str:
    """A template without its GPU request: what this CPU cluster can run."""
    return "".join(line for line in template.read_text().splitlines(True) if not line.startswith("#SBATCH --gpus"))


@pytest.fixture(scope="module")
def runs(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every job submitted at once; the torchrun reference runs here meanwhile."""
    root = tmp_path_factory.mktemp("slurm_training")
    fit = [sys.executable, str(SCRIPTS / "netlab_fit.py"), "--configs", ",".join(CONFIGS)]
    doctor = ["-m", "lightning_mgpu.cli", "doctor", "--json"]
    jobs: dict[str, Job] = {
        "fit": cluster.srun_job([*fit, "--out-dir", str(root / "srun")], nodes=2, workdir=root / "srun", name="fit"),
        "doctor_srun": cluster.srun_job([sys.executable, *doctor], nodes=2, tasks_per_node=2, workdir=root / "dr"),
        "doctor_torchrun": cluster.srun_job(cluster.torchrun(doctor, nproc_per_node=1), nodes=2, workdir=root / "dt"),
    }
    env = {
        "PYTHON": sys.executable,
        "TRAIN_SCRIPT": str(RECIPES / "char_lm" / "train_lightning.py"),
        "GPUS_PER_NODE": "1",
    }
    for name, options in TEMPLATES.items():
        out = root / name
        args = [*CHAR_LM, "--accelerator", "cpu", "--out-dir", str(out / "logs"), "--record", str(out / "record.pt")]
        template = cpu_variant(RECIPES / "cluster" / f"{name}.sbatch")
        jobs[name] = cluster.submit(template, options, args=args, workdir=out, env=env, name=name)
    loopback = root / "torchrun"
    run_python([*TORCHRUN_2, *fit[1:], "--out-dir", str(loopback)], cwd=root, timeout=240)
    done = {name: job.wait(timeout=240) for name, job in jobs.items()}
    return {"root": root, "done": done, "cluster": cluster}


def _fit(root: Path, launcher: str, config: str) -> dict[str, Any]:
    record: dict[str, Any] = json.loads((root / launcher / f"{config}.json").read_text())
    return record


@pytest.mark.timeout(400)
@pytest.mark.parametrize("config", CONFIGS)
def test_under_srun_equals_torchrun(runs: dict[str, Any], config: str) -> None:
    assert runs["done"]["fit"].ok, runs["done"]["fit"].output[-4000:]
    srun, torchrun = _fit(runs["root"], "srun", config), _fit(runs["root"], "torchrun", config)
    assert (srun["num_nodes"], srun["world_size"]) == (2, 2) and (torchrun["num_nodes"], torchrun["world_size"]) == (
        1,
        2,
    )
    assert srun["global_step"] == torchrun["global_step"] > 0 and srun["ranks_agree"] and torchrun["ranks_agree"]
    assert srun["params"] == torchrun["params"], f"{config}: srun across 2 nodes ended elsewhere than torchrun"
    assert srun["losses"] == torchrun["losses"]
    if config == "fp16":
        assert "fp16" in srun["comm_hook"] and srun["comm_hook"] == torchrun["comm_hook"]
    if config == "auto":
        assert srun["tuning"]["status"] == "done" and len(srun["tuning"]["candidates"]) >= 2
    if config == "doctor":  # the data is deliberately not sharded: the ranks' batch hashes crossed nodes
        assert srun["findings"] == torchrun["findings"] == ["data-not-sharded"]
    if config == "hybrid":
        assert srun["plan"] == torchrun["plan"] == [2, 2]
    if config == "profiler":
        profile = json.loads((runs["root"] / "srun" / "profile" / "comm_profile.json").read_text())
        assert profile["world_size"] == 2 and profile["summary"]["bytes_per_step"] > 0


@pytest.mark.timeout(400)
@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_doctor_checks_every_node_in_one_report(runs: dict[str, Any], launcher: str) -> None:
    done = runs["done"][f"doctor_{launcher}"]
    assert done.ok, done.output[-4000:]
    reports = json_reports(done.output)
    assert len(reports) == 1, f"one report expected, {len(reports)} printed:\n{done.output[-4000:]}"
    report = reports[0]
    cluster: Cluster = runs["cluster"]
    ranks = {"srun": [[0, 1], [2, 3]], "torchrun": [[0], [1]]}[launcher]
    assert report["world"]["launcher"] == launcher
    assert [n["hostname"] for n in report["world"]["nodes"]] == cluster.hostnames
    assert [n["ranks"] for n in report["world"]["nodes"]] == ranks
    checks = {check["name"]: check for check in report["checks"]}
    assert report["status"] != "fail", [c for c in report["checks"] if c["status"] == "fail"]
    world = checks["gloo all_reduce (world)"]
    assert world["status"] == "ok" and world["value"].startswith(f"{sum(map(len, ranks))} ranks on 2 node(s)")
    assert checks["nodes"]["status"] == "ok"
    assert set(checks["torch"]["details"]["per_node"]) == {
        f"{host} (node {i})" for i, host in enumerate(cluster.hostnames)
    }
    assert "all_reduce" not in checks  # the loopback check is replaced by the world's, not run on every node


@pytest.mark.timeout(400)
def test_the_cluster_recipes_run_as_submitted(runs: dict[str, Any]) -> None:
    records = {}
    for name in TEMPLATES:
        done = runs["done"][name]
        assert done.ok, f"{name}:\n{done.output[-4000:]}"
        records[name] = torch.load(runs["root"] / name / "record.pt", weights_only=True)
        assert records[name]["world_size"] == 2
    first = records["one_node"]
    for name, record in records.items():  # the same global batch and data on every layout: the same run
        assert record["losses"] == pytest.approx(first["losses"], abs=1e-5), name
        assert record["val_loss"] == pytest.approx(first["val_loss"], abs=1e-5), name
