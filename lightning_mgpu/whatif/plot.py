"""The scaling curve of a ``--world-size`` sweep as a PNG (matplotlib imported when called)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence, Union

from lightning_mgpu.whatif.model import Prediction


def plot_scaling(predictions: Sequence[Prediction], path: Union[str, os.PathLike[str]], *, title: str) -> Path:
    """Speed-up over one device against world size (ideal line dashed), and the step's parts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [p.world_size for p in predictions]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(sizes, [p.speedup for p in predictions], "o-", label="predicted")
    left.plot(sizes, sizes, "--", color="grey", label="ideal (linear)")
    left.set_xscale("log", base=2)
    left.set_yscale("log", base=2)
    left.set_xlabel("ranks")
    left.set_ylabel("speed-up over one device (throughput)")
    left.legend()
    left.grid(True, which="both", alpha=0.3)
    compute = [p.forward_ms + p.backward_compute_ms + p.optimizer_ms + p.other_ms for p in predictions]
    exposed = [p.exposed_comm_ms for p in predictions]
    labels = [str(n) for n in sizes]
    right.bar(labels, compute, label="compute, optimizer, other")
    right.bar(labels, exposed, bottom=compute, label="exposed communication")
    right.set_xlabel("ranks")
    right.set_ylabel("predicted step (ms)")
    right.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=120)
    plt.close(fig)
    return target


__all__ = ["plot_scaling"]
