"""The SLURM lab for the tests in this folder: one cluster per test module (``cluster``), always torn down.

A test here needs root and Debian's ``slurm-wlm`` and ``munge`` (CI installs them: ``.ci/run``); it is skipped,
saying why, only where the lab cannot be built at all (:func:`bench.labs.slurm.lab_unavailable`). A cluster that
fails to come up where it can be built is a failure, not a skip.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest

from bench.labs.slurm import Cluster, lab_unavailable


def cluster_or_skip(**kwargs: Any) -> Cluster:
    reason = lab_unavailable()
    if reason is not None:
        pytest.skip(f"the SLURM lab cannot be built here: {reason}")
    return Cluster(**kwargs).build()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    built = cluster_or_skip()
    try:
        yield built
    finally:
        built.teardown()


def json_reports(output: str) -> list[dict[str, Any]]:
    """Every JSON object printed (indented) in a job's output, in order."""
    decoder, found, index = json.JSONDecoder(), [], 0
    while (start := output.find("{\n", index)) != -1:
        try:
            report, index = decoder.raw_decode(output, start)
            found.append(report)
        except ValueError:
            index = start + 1
    return found
