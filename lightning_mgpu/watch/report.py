"""The hang report: one screen of text (every rank's place, the likely cause, the fix) and the same as JSON.

The JSON (``hang_report.json`` in the run's log directory) is the data: every rank's state and main-thread
stack, the verdict and the diagnosis; the text is made from it, for the console and the loggers.
"""

from __future__ import annotations

import json
import os
import time
import signal as _signal
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_mgpu.watch.diagnosis import Diagnosis, known_caller, ranks_text
from lightning_mgpu.watch.state import RankState
from lightning_mgpu.watch.verdict import Verdict

__all__ = ["REPORT_FILE", "REPORT_VERSION", "build", "send_to_loggers", "signal_name", "text", "write"]

REPORT_FILE = "hang_report.json"
REPORT_VERSION = 1
MARK = "[lightning_mgpu]"
_WIDTH = 110


def signal_name(signum: int) -> str:
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def build(
    states: Sequence[RankState],
    verdict: Verdict,
    diagnosis: Diagnosis,
    *,
    reporter: int,
    hang_timeout: float,
    exit_code: Optional[int],
    signum: Optional[int] = None,
    failure: bool = False,
    log_dir: Optional[str] = None,
) -> dict[str, Any]:
    """The report as data; ``failure``: made after a collective failed (a rank left), not by the watch's timeout;
    ``log_dir``: where :func:`write` will put it (the text says so)."""
    report: dict[str, Any] = {
        "version": REPORT_VERSION,
        "kind": "failure" if failure else "hang",
        "time": round(time.time(), 3),
        "hang_timeout_s": hang_timeout,
        "reported_by": reporter,
        "signal": None if signum is None else signal_name(signum),
        "exit_code": exit_code,
        "path": str(Path(log_dir) / REPORT_FILE) if log_dir else None,
        "verdict": verdict.as_dict(),
        "diagnosis": diagnosis.as_dict(),
        "ranks": [state.as_dict(with_stack=True) for state in sorted(states, key=lambda s: s.rank)],
    }
    report["text"] = text(report)
    return report


def _rank_lines(state: dict[str, Any]) -> list[str]:
    rank = RankState.from_dict(state)
    if rank.missing:
        return [f"  rank {rank.rank}: no heartbeat"]
    what = rank.waiting_in
    status = "gone" if rank.gone else (f"silent for {rank.silent_s:.0f} s" if rank.silent_s >= 5 else "")
    head = f"  rank {rank.rank}: {rank.doing}"
    if what is not None:
        waited = rank.collective.get("for_s") if rank.collective else None
        head += f"; waits in {what}" + (f" for {waited:.0f} s" if waited else "")
    elif rank.idle_s >= 1:
        head += f"; no progress for {rank.idle_s:.0f} s"
    if status:
        head += f" [{status}]"
    if rank.failure:
        head += f" [failed: {rank.failure}]"
    lines = [head]
    frame = rank.site if rank.in_hook or not rank.watching or what is None else None
    if frame is not None:
        code = frame.code
        lines.append(f"      at {frame.where()} in {frame.function}" + (f": {code}" if code else ""))
    elif rank.collective is not None and rank.caller is not None:
        known = known_caller(rank.caller.function)
        lines.append(
            f"      called from {rank.caller.where()} in {rank.caller.function}" + (f" ({known})" if known else "")
        )
    return lines


def text(report: dict[str, Any]) -> str:
    """The console text of a report made by :func:`build`."""
    verdict, diagnosis = report["verdict"], report["diagnosis"]
    timeout = verdict["timeout_s"]
    if report["kind"] == "failure":
        title = f"{MARK} A RANK LEFT THE JOB (seen by rank {report['reported_by']})"
    else:
        blocked = ranks_text(verdict["blocked"]) if verdict["blocked"] else "no rank"
        title = f"{MARK} HANG: no progress for {timeout:g} s on {blocked}"
        if report["signal"]:
            title += f" after {report['signal']}"
        title += f" (hang_timeout={report['hang_timeout_s']:g} s); reported by rank {report['reported_by']}"
    lines = [title]
    for state in report["ranks"]:
        lines += _rank_lines(state)
    lines.append(_wrap(f"Likely cause ({diagnosis['cause']}): {diagnosis['summary']}"))
    lines.append(_wrap(f"Fix: {diagnosis['fix']}"))
    tail = f"Every rank's stack: {report['path'] or REPORT_FILE + ' (not written: no log directory)'}."
    if report["exit_code"] is not None:
        tail += f" Every rank now exits with status {report['exit_code']}."
    lines.append(tail)
    return "\n".join(lines)


def _wrap(paragraph: str, indent: str = "  ") -> str:
    import textwrap

    return textwrap.fill(paragraph, width=_WIDTH, subsequent_indent=indent, break_on_hyphens=False)


def write(report: dict[str, Any], directory: Optional[str]) -> Optional[str]:
    """``report`` as ``DIRECTORY/hang_report.json`` (made if missing); its path, or None if it could not be written."""
    if not directory:
        return None
    path = Path(directory) / REPORT_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(report, indent=1, default=str) + "\n")
        os.replace(temporary, path)
    except OSError:
        return None
    return str(path)


LOGGER_KEY = "lightning_mgpu/hang_report"


def send_to_loggers(loggers: Sequence[Any], report: dict[str, Any]) -> list[str]:
    """The report's text to every logger that takes text (W&B's ``log_text``, TensorBoard's ``add_text``, MLflow's
    ``log_text``), each flushed; the names of the loggers it went to. Loggers are duck-typed (no Lightning import)."""
    sent = []
    body = report["text"]
    for logger in loggers:
        experiment: Any = getattr(logger, "experiment", None)
        if callable(getattr(logger, "log_text", None)):  # WandbLogger
            logger.log_text(key=LOGGER_KEY, columns=["report"], data=[[body]])
        elif callable(getattr(experiment, "add_text", None)):  # TensorBoard's SummaryWriter
            experiment.add_text(LOGGER_KEY, "    " + body.replace("\n", "\n    "))
            if callable(getattr(experiment, "flush", None)):
                experiment.flush()
        elif callable(getattr(experiment, "log_text", None)) and getattr(logger, "run_id", None):  # MLflow
            experiment.log_text(logger.run_id, body, "hang_report.txt")
        else:
            continue
        finish = getattr(experiment, "finish", None)  # a W&B run: mark it failed, flushed before the process ends
        if callable(finish):
            finish(exit_code=report.get("exit_code") or 1)
        elif callable(getattr(logger, "save", None)):
            logger.save()
        sent.append(type(logger).__name__)
    return sent
