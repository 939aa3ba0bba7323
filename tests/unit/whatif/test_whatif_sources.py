"""``bench/whatif_sources.py``'s decomposition (issue 31 item 5), in-process: each input's error against the measured
2-node step, and how many points each effect took off it, adding up to the nominal rate's error."""

from __future__ import annotations

import pytest

from bench.whatif_sources import INPUTS, decompose


def test_each_effect_is_the_change_in_error_it_brings_and_together_they_make_the_nominal_error() -> None:
    row = {
        "measured_ms": 200.0,
        "predicted_ms": {"nominal": 160.0, "achieved": 168.0, "bench_comm": 170.0, "shared_profile": 174.0},
    }
    result = decompose(row)
    assert set(result["error_pct"]) == set(INPUTS)
    assert result["error_pct"]["nominal"] == pytest.approx(-20.0)
    assert result["points"] == pytest.approx(
        {
            "tcp_below_nominal": 4.0,
            "link_curve": 1.0,
            "compute_beside_compute": 2.0,
            "left_transfer_beside_backward": 13.0,
        }
    )
    assert sum(result["points"].values()) == pytest.approx(-result["error_pct"]["nominal"])
