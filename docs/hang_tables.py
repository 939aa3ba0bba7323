"""The hang watch's real reports, one per scenario, read from ``bench/results/hang_reports.json``.

The reports are recorded by the scenario tests (``MGPU_RECORD_HANG_REPORTS=1 pytest
tests/dist/watch/test_hang_scenarios.py``), which also fail when the code now reports a scenario
differently from the recorded report (:func:`masked` equal, numbers aside): so the page shows what
the code prints. One function per block, as :mod:`docs.bench_tables`.
"""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = ["LOG_DIR", "RACY_RANK_LINES", "RECORDED", "SCENARIOS", "blocks", "masked", "normalized", "report"]

REPO = Path(__file__).resolve().parents[1]
RECORDED = REPO / "bench" / "results" / "hang_reports.json"
SCENARIOS = ("barrier", "sync_dist", "uneven", "sleep", "validation", "sigkill", "loader")
"""The scenarios the page shows (2 ranks each; the tests run more)."""
RACY_RANK_LINES = {"sigkill": 0}
"""Scenario: the rank whose place in the report depends on a race (after rank 1's SIGKILL, rank 0 is still in its
collective when its watch sees rank 1's process gone first, or already failing when the collective's error came
first): :func:`masked` leaves its lines, and what the diagnosis says of it, out of the comparison."""


LOG_DIR = "LOG_DIR"
"""What the docs show for the run's log directory (a temporary directory of the test that recorded it)."""


def normalized(text: str, *, root: str = str(REPO), log_dir: Optional[str] = None) -> str:
    """A report as the docs show it: files relative to the repository or to ``site-packages``, the run's log
    directory (``log_dir``) as :data:`LOG_DIR`."""
    if log_dir is not None:
        text = text.replace(log_dir.rstrip("/"), LOG_DIR)
    text = text.replace(root.rstrip("/") + "/", "")
    return re.sub(r"(?<![\w/])/\S*/site-packages/", "", text)


def masked(text: str, *, racy_rank: Optional[int] = None) -> str:
    """What must not change between two runs of a scenario: the report without its title line (which ranks had
    idled the full timeout when it was judged depends on a second's timing), without the lines of ``racy_rank``
    (see :data:`RACY_RANK_LINES`), every number, the host's name, and its line breaks."""
    body = normalized(text).split("\n", 1)[-1]
    if racy_rank is not None:  # its line and the indented ones under it, up to the next rank or the diagnosis
        body = re.sub(rf"^  rank {racy_rank}: .*\n(?:    .*\n)*", "", body, flags=re.MULTILINE)
        body = " ".join(body.split()).replace(f"; rank {racy_rank} waits for it in vain.", ".")  # the summary's word
    body = re.sub(r"\(pid \d+ on [^)]*\)", "(pid N on HOST)", body)  # a dead rank's process, on the machine it ran
    return " ".join(re.sub(r"\d+", "N", body).split())


def load() -> dict[str, Any]:
    result: dict[str, Any] = json.loads(RECORDED.read_text())
    return result


def report(scenario: str) -> str:
    """One scenario's recorded report, as a code block, and what made it."""
    recorded = load()
    entry = recorded["reports"][scenario]
    return (
        f"```text\n{entry['text']}\n```\n\n"
        f"`tests/scripts/hang_fit.py --scenario {scenario}` on 2 gloo ranks, `hang_timeout={recorded['hang_timeout']}`; "
        f"recorded by `{recorded['recorded_by']}`."
    )


def blocks() -> dict[str, Callable[[], str]]:
    """``hang-report-SCENARIO`` for each scenario of :data:`SCENARIOS`."""
    return {f"hang-report-{name.replace('_', '-')}": partial(report, name) for name in SCENARIOS}
