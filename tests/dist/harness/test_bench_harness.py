"""The benchmarks' launcher (bench/harness/launch.py) for real; the rest of the harness: tests/unit/harness/.

The launcher is what every benchmark starts its ranks with: a launch that passes its timeout
or has a failing node must end every rank it started (whole process groups, not only
torchrun) and stop the benchmark with the end of the output, never leave ranks behind.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from bench.harness import launch


SLEEPER = """
import os, sys, time
from pathlib import Path
Path(sys.argv[1], f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
if sys.argv[2] == "fail" and os.environ["RANK"] == "1":
    while not Path(sys.argv[1], "rank0.pid").exists():  # give up only once rank 0 is up: that is what is tested
        time.sleep(0.05)
    print("rank 1 gives up", flush=True)
    sys.exit(3)
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as stat:  # a zombie not yet reaped by its (killed) parent has ended too
        return stat.read().split(") ")[-1].startswith("Z")


def _pids(where: Path) -> list[int]:
    return [int(path.read_text()) for path in sorted(where.glob("rank*.pid"))]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["timeout", "fail"])
def test_a_launch_past_its_timeout_or_with_a_failed_rank_ends_every_rank(tmp_path: Path, how: str) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    started = time.monotonic()
    runs = launch.run(
        [str(script), str(tmp_path), how], nproc_per_node=2, timeout=25 if how == "timeout" else 60, log_dir=tmp_path
    )
    assert time.monotonic() - started < 55
    assert len(_pids(tmp_path)) == 2, runs[0].output  # both ranks had started
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in _pids(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in _pids(tmp_path)), "a rank outlived its launch"
    with pytest.raises(launch.LaunchFailed) as failed:
        launch.check(runs, "sleepers", timeout=25)
    message = str(failed.value)
    if how == "timeout":
        assert runs[0].timed_out and "sleepers: launch timed out after 25 s" in message
    else:
        assert not runs[0].timed_out and "sleepers: launch failed" in message and "exit code 1" in message
        assert "rank 1 gives up" in runs[0].output
