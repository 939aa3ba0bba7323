"""``DistributedDoctor``, the callback: catches the classic multi-GPU mistakes while a run trains.
(The machine check before a run is ``lightning-mgpu doctor``: :mod:`lightning_mgpu.envcheck`.)

``lightning-mgpu doctor --rules`` lists this callback's rules.

One job per module; imports go downwards in this list:

- :mod:`.callback`: the Lightning hooks (call every rule's watch, exchange, warn or raise);
- :mod:`.rules`: one module per rule: its catalogue entry, what it observes on a rank, its check
  over what the ranks gathered; and the registry (:data:`RULES`, :data:`~.rules.WATCHES`);
- :mod:`.exchange`: how the ranks meet before a check's collective (bounded, never waiting on a rank that left);
- :mod:`.probes`: what several rules observe (the model's parameters and their checksums, the train loader,
  a batch's hash);
- :mod:`.rule`: what a rule is (:class:`Rule`, its :class:`~.rule.Watch`) and the data a check exchanges;
- :mod:`.findings`: a finding, and the error/warning raised.
"""

from lightning_mgpu.callbacks.doctor.callback import DistributedDoctor
from lightning_mgpu.callbacks.doctor.findings import (
    DistributedDoctorError,
    DistributedDoctorOutOfStep,
    DistributedDoctorWarning,
    Finding,
)
from lightning_mgpu.callbacks.doctor.rule import Rule
from lightning_mgpu.callbacks.doctor.rules import RULE_IDS, RULES

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
