"""recipes/image_classifier, in-process: the sampler the Lightning script relies on deals the plain loop's order out
over the ranks. The runs of the scripts themselves (1 and 2 processes): tests/dist/recipes/test_image_classifier.py.
"""

from __future__ import annotations

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import DataLoader, RandomSampler, TensorDataset


def test_wrapped_random_sampler_deals_the_plain_order_out_over_ranks_every_epoch() -> None:
    """What train_lightning.py relies on: rank r reads positions r, r+2, ... of the plain loop's order."""
    dataset = TensorDataset(torch.arange(40))
    batch = 8
    plain_order = RandomSampler(dataset, generator=torch.Generator().manual_seed(3))
    plain_loader = DataLoader(dataset, batch_size=batch, sampler=plain_order)
    rank_samplers = [
        DistributedSamplerWrapper(
            RandomSampler(dataset, generator=torch.Generator().manual_seed(3)), num_replicas=2, rank=rank, shuffle=False
        )
        for rank in range(2)
    ]
    rank_loaders = [DataLoader(dataset, batch_size=batch // 2, sampler=sampler) for sampler in rank_samplers]
    first_batches = []
    for epoch in range(3):
        for sampler in rank_samplers:
            sampler.set_epoch(epoch)  # as Lightning does; must not change the order
        plain_batches = [b[0].tolist() for b in plain_loader]
        rank_batches = [[b[0].tolist() for b in loader] for loader in rank_loaders]
        assert len(rank_batches[0]) == len(rank_batches[1]) == len(plain_batches) == 5
        for step, expected in enumerate(plain_batches):
            dealt = [None] * batch
            dealt[0::2], dealt[1::2] = rank_batches[0][step], rank_batches[1][step]
            assert dealt == expected, f"epoch {epoch}, step {step}"
        first_batches.append(plain_batches[0])
    assert len({tuple(b) for b in first_batches}) == 3, "the order should change from epoch to epoch"
