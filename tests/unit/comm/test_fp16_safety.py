"""``compression="fp16"`` never produces a silent NaN or a silent zero (issue 17 item 2).

torch's ``fp16_compress_hook`` casts to float16 *before* dividing by the world size: a gradient
above 65504 becomes inf (NaN parameters after the optimizer, exit 0, no warning), one below
~6e-8 becomes 0 (training stops moving). ``ScaledFp16Allreduce`` divides first and scales each
bucket by the power of two that maps its largest magnitude over all ranks to 2**15: no partial
sum can overflow and small values keep their bits. Gradients that are inf/NaN already, and values
still too small after scaling, are reported (``end_step``, ``TunedDDPStrategy.compression_stats``).

In-process on a one-rank gloo group here; the 2-rank fit and the group teardown run are in
tests/dist/comm/test_fp16_safety.py.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import TunedDDPStrategy
from lightning_mgpu.comm.compression import ScaledFp16Allreduce, resolve_compression
from tests.scripts.group_teardown import Bucket


# In-process fits leave Lightning's process group and launcher variables behind: conftest undoes them.
pytestmark = pytest.mark.usefixtures("clean_process")


def reduce(hook: Any, values: list[float]) -> torch.Tensor:
    bucket = Bucket(torch.tensor(values, dtype=torch.float32))
    return hook(None, bucket).wait()  # type: ignore[no-any-return]


def test_large_and_tiny_gradients_survive_where_torchs_hook_makes_inf_and_zero(one_rank_group: None) -> None:
    large, tiny = [1.0e5, -3.0e5, 0.0, 1.0], [2.5e-9, -7.0e-10, 1.0e-12]
    torchs_large, torchs_tiny = (
        reduce(default_hooks.fp16_compress_hook, large),
        reduce(default_hooks.fp16_compress_hook, tiny),
    )
    assert torch.isinf(torchs_large[:2]).all() and (torchs_tiny == 0).all()  # the defect
    hook = ScaledFp16Allreduce()
    ours_large, ours_tiny = reduce(hook, large), reduce(hook, tiny)
    # float16's 11 significant bits, for every value within float16's range of its bucket's peak
    torch.testing.assert_close(ours_large, torch.tensor(large), rtol=2**-11, atol=0)
    torch.testing.assert_close(ours_tiny, torch.tensor(tiny), rtol=2**-11, atol=0)
    assert hook.end_step() is None  # nothing to report: both buckets went through whole
    assert hook.stats["steps"] == 1 and hook.stats["nonfinite_steps"] == 0 and hook.stats["peak"] == 3.0e5
    assert hook.stats["underflow_checks"] == 1 and hook.stats["underflowed"] == 0 and hook.stats["nonzero_checked"] == 6


def test_inf_or_nan_gradients_are_reported_not_hidden(one_rank_group: None) -> None:
    hook = ScaledFp16Allreduce()
    out = reduce(hook, [1.0, math.nan, 3.0e4])
    assert out[0] == 1.0 and math.isnan(out[1]) and out[2] == pytest.approx(3.0e4, rel=2**-11)  # sent unscaled, as is
    message = hook.end_step()
    assert message is not None and "inf or NaN" in message and "1 of 1 bucket" in message
    assert hook.stats["nonfinite_steps"] == 1 and math.isnan(hook.stats["peak"])
    said = [message]
    for _ in range(7):  # 8 such steps: said at the 1st, 2nd, 4th and 8th
        reduce(hook, [math.inf, 1.0])
        said.append(hook.end_step())
    assert [m is not None for m in said] == [True, True, False, True, False, False, False, True]
    assert hook.stats["nonfinite_steps"] == 8


def _ddp_steps(hook: ScaledFp16Allreduce, factors: list[float]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One-rank DDP with the hook, one backward per factor (the loss times it): (reduced, float32) gradients."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, hook)  # type: ignore[arg-type]  # the instance is the hook
    out = []
    for step, factor in enumerate(factors):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        for net in (ddp, reference):
            net.zero_grad(set_to_none=True)
            (net(x).square().mean() * factor).backward()
        flat = lambda net: torch.cat([p.grad.reshape(-1) for p in net.parameters()])  # noqa: E731
        out.append((flat(model), flat(reference)))
        hook.end_step()
    return out


def test_a_carried_over_scale_needs_no_exchange_and_falls_back_to_float32_when_gradients_jump(
    one_rank_group: None,
) -> None:
    hook = ScaledFp16Allreduce()
    # step 4: gradients 10,000x larger than the carried scale allows; step 7: 100,000x smaller
    factors = [1.0, 1.0, 2.0, 0.5, 1.0e4, 1.0, 1.0, 1.0e-5, 1.0]
    steps = _ddp_steps(hook, factors)
    # one bucket: its scale is exchanged at the first step and at the steps after the fallbacks, carried over otherwise
    assert hook.stats["fallbacks"] == 2
    assert hook.stats["exchanged_buckets"] == 3, hook.stats
    for step, (got, want) in enumerate(steps):
        if step in (4, 7):  # summed in float32: exact
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        else:  # float16's 11 bits, relative to the bucket's largest gradient (4 more bits of headroom when carried)
            torch.testing.assert_close(got, want, rtol=0, atol=float(want.abs().max()) * 2**-10)
            assert not torch.equal(got, want)  # it did go through float16
    assert hook.stats["nonfinite_steps"] == 0


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_carried_over_scale_still_reports_inf_or_nan_gradients(one_rank_group: None, bad: float) -> None:
    hook = ScaledFp16Allreduce()
    steps = _ddp_steps(hook, [1.0, 1.0, 1.0, bad])
    assert hook.stats["fallbacks"] == 1 and hook.stats["nonfinite_steps"] == 1
    assert not torch.isfinite(steps[-1][0]).all()  # the model's own inf/NaN reaches the gradients, as uncompressed


def test_an_all_zero_bucket_keeps_its_scale_and_sends_zeros(one_rank_group: None) -> None:
    hook = ScaledFp16Allreduce()
    steps = _ddp_steps(hook, [0.0, 0.0, 0.0, 1.0e-3])
    assert all((got == 0).all() for got, _ in steps[:3])
    # no exchange after the first, and the scale kept for zeros (2**15 at most) carries the first real gradients
    assert hook.stats["exchanged_buckets"] == 1 and hook.stats["fallbacks"] == 0
    got, want = steps[-1]
    torch.testing.assert_close(got, want, rtol=0, atol=float(want.abs().max()) * 2**-10)
    assert float(want.abs().max()) > 0


def test_underflow_is_counted_and_said(one_rank_group: None) -> None:
    hook = ScaledFp16Allreduce(underflow_every=2)
    values = [1.0] * 100 + [1.0e-20] * 5  # 1e-20 is 2**66 below the peak: below float16 even scaled
    assert hook.counting_underflow
    out = reduce(hook, values)
    assert (out[100:] == 0).all()
    message = hook.end_step()
    assert message is not None and "5 of 105 nonzero" in message and "bf16" in message
    assert (
        hook.stats["underflowed"] == 5 and hook.stats["nonzero_checked"] == 105 and hook.stats["underflow_checks"] == 1
    )
    assert not hook.counting_underflow  # step 2 is not counted (underflow_every=2)
    reduce(hook, values)
    assert hook.end_step() is None and hook.stats["underflow_checks"] == 1


def test_compression_fp16_uses_the_safe_hook_and_bf16_needs_none() -> None:
    spec = resolve_compression("fp16", backend="gloo", powersgd_rank=1, powersgd_start_iter=10)
    assert spec is not None and isinstance(spec.hook, ScaledFp16Allreduce) and spec.wire_dtype == torch.float16
    # bfloat16 has float32's exponent range: 3e38 and 1e-37 cast without overflow or underflow
    extremes = torch.tensor([3.0e38, 1.0e-37, -2.0e-30])
    assert torch.isfinite(extremes.to(torch.bfloat16)).all() and (extremes.to(torch.bfloat16) != 0).all()


class Huge(L.LightningModule):
    """A loss scaled by 1e7: gradients far above float16's 65504. Adam does not care (scale-invariant)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 16)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return 1e7 * nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        return DataLoader(
            TensorDataset(torch.randn(32, 16, generator=generator), torch.randn(32, 16, generator=generator)),
            batch_size=8,
        )


def test_a_fit_with_huge_gradients_stays_finite_and_reports_its_peak(tmp_path: Path) -> None:
    strategy = TunedDDPStrategy(compression="fp16")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    model = Huge()
    trainer.fit(model)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    stats = strategy.compression_stats
    assert stats is not None and stats["steps"] == 4 and stats["nonfinite_steps"] == 0 and stats["peak"] > 65504
    assert TunedDDPStrategy(compression="bf16").compression_stats is None


def test_buckets_numbered_alike_keep_their_own_scales(one_rank_group: None) -> None:
    """In a static graph's first backward DDP launches every bucket at its end and torch numbers them all 0: a
    scale kept per bucket number was overwritten by whichever bucket finished last (differently on each rank: a
    collective mismatch on the next step, issue 28). Kept per bucket (its parameters), each bucket carries its own."""
    params = [nn.Parameter(torch.zeros(3)) for _ in range(4)]
    first = Bucket(torch.linspace(-3.0, 5.0, 64), index=0, parameters=params[:2])
    second = Bucket(torch.linspace(-0.01, 0.02, 64), index=0, parameters=params[2:])  # same size, other members
    hook = ScaledFp16Allreduce()

    def backward_launching(buckets: list[Bucket]) -> None:  # the hooks run inside a backward, as DDP runs them
        class Launch(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
                return t.clone()

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
                for bucket in buckets:
                    hook(None, bucket.fresh()).wait()  # type: ignore[arg-type]
                return grad

        Launch.apply(torch.ones(1, requires_grad=True)).sum().backward()

    backward_launching([first, second])
    assert hook.stats["exchanged_buckets"] == 2  # the first step exchanges each scale
    backward_launching([first, second])
    assert hook.stats["exchanged_buckets"] == 2  # then each bucket carries its own: no exchange


class ExchangedOnCpu(ScaledFp16Allreduce):
    """The hook's CUDA path (the scale exchanged with a MAX all-reduce, no carried-over scale), run on CPU buffers."""

    def __call__(self, process_group: Any, bucket: Any) -> Any:
        group = process_group if process_group is not None else torch.distributed.group.WORLD
        return self._exchanged(group, torch.distributed.get_world_size(group), bucket)


def test_the_gpu_path_keeps_large_and_tiny_gradients_and_reports_inf_and_nan(one_rank_group: None) -> None:
    """The path every CUDA bucket takes; until the first GPU run it had run nowhere (CPU buckets carry their scale)."""
    hook = ExchangedOnCpu()
    large, tiny = [1.0e5, -3.0e5, 0.0, 1.0], [2.5e-9, -7.0e-10, 1.0e-12]
    torch.testing.assert_close(reduce(hook, large), torch.tensor(large), rtol=2**-11, atol=0)
    torch.testing.assert_close(reduce(hook, tiny), torch.tensor(tiny), rtol=2**-11, atol=0)
    assert hook.end_step() is None and hook.stats["peak"] == 3.0e5 and hook.stats["exchanged_buckets"] == 2
    assert hook.stats["underflowed"] == 0 and hook.stats["nonzero_checked"] == 6
    assert (reduce(hook, [0.0, 0.0]) == 0).all() and hook.end_step() is None  # a zero bucket: the largest scale
    for bad in (math.nan, math.inf, -math.inf):
        out = reduce(hook, [1.0, bad, 3.0e4])  # sent unscaled, as is: the model's own inf/NaN, reported
        assert out[0] == 1.0 and out[2] == pytest.approx(3.0e4, rel=2**-11)
        assert math.isnan(out[1]) if math.isnan(bad) else out[1] == bad
        message = hook.end_step()
        assert hook.stats["nonfinite_steps"] and math.isnan(hook.stats["peak"])
    assert message is None and hook.stats["nonfinite_steps"] == 3  # said at the 1st and 2nd such step, not the 3rd


def test_the_gpu_path_rounds_each_gradient_once_to_float16_at_its_buckets_scale(one_rank_group: None) -> None:
    """Exactly ``fp16(g * s) / s`` with ``s = 2**(15 - ceil(log2(peak)))``: the result the scaled cast defines (one
    pass now, where it was a scale in place, a cast, a copy back and a divide), at magnitudes across float32's range."""
    generator = torch.Generator().manual_seed(0)
    hook = ExchangedOnCpu()
    for magnitude in (1.0e-30, 1.0e-7, 1.0, 6.0e4, 1.0e30):
        values = torch.randn(4097, generator=generator) * magnitude
        values[7] = 0.0
        scale = 2.0 ** (15 - math.ceil(math.log2(float(values.abs().max()))))
        expected = (values * scale).to(torch.float16).to(torch.float32) / scale
        assert torch.equal(reduce(hook, values.tolist()), expected), magnitude
        hook.end_step()
