"""``DistributedDoctor``: a callback that catches the classic multi-GPU mistakes while the run trains.

One job per module; imports go downwards in this list:

- :mod:`.callback`: the Lightning hooks (feed the probes, exchange, warn or raise);
- :mod:`.exchange`: how the ranks meet before a check's collective (bounded, never waiting on a rank that left);
- :mod:`.probes`, :mod:`.parameters`: what is measured on the trainer, the model, the loaders;
- :mod:`.ledger`: what the ranks agreed on, merged check by check into a snapshot (checkpointed);
- :mod:`.checks`: pure checks over a snapshot (tested without a Trainer);
- :mod:`.protocol`: the typed data a check exchanges and judges;
- :mod:`.rules`: the rule catalogue (:data:`RULES`);
- :mod:`.findings`: a finding, and the error/warning raised.
"""

from lightning_mgpu.callbacks.doctor.callback import DistributedDoctor
from lightning_mgpu.callbacks.doctor.findings import (
    DistributedDoctorError,
    DistributedDoctorOutOfStep,
    DistributedDoctorWarning,
    Finding,
)
from lightning_mgpu.callbacks.doctor.rules import RULE_IDS, RULES, Rule

__all__ = [
    "RULES",
    "RULE_IDS",
    "DistributedDoctor",
    "DistributedDoctorError",
    "DistributedDoctorOutOfStep",
    "DistributedDoctorWarning",
    "Finding",
    "Rule",
]
