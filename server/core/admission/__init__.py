"""Admission and scheduling for one model (sans-I/O): refuse early, queue by deadline, share fairly.

- :mod:`.decisions`: what admission decides (:class:`Admitted`, a returned
  :class:`~chunkline.server.errors.Refusal`, :class:`Dropped`), the request it judges, deadlines.
- :mod:`.service_time`: how long a batch takes per batch size (:class:`ServiceTimeModel`).
- :mod:`.config`: a model's admission settings.
- :mod:`.flows`: the controller's queue structures; :mod:`.queue_book`: the queue state and its changes.
- :mod:`.selection`: which queued requests form the next batch (:class:`BatchSelector`, :class:`EdfSelector`).
- :mod:`.promises`: the queued requests' promised completions, per priority level, for the
  check that admitting one more breaks none (:class:`~.promises.Promises`).
- :mod:`.controller`: the per-model queue and its rules (:class:`AdmissionController`).
- :mod:`.retry_line`: when refused sessions may come back, one after another (:class:`RetryLine`).
- :mod:`.retry_holds`: one session's retry windows, as the door enforces them (:class:`RetryHolds`).
"""

from chunkline.server.core.admission.config import AdmissionConfig
from chunkline.server.core.admission.controller import AdmissionController
from chunkline.server.core.admission.decisions import (
    MAX_DEADLINE_MS,
    REFUSAL_CODES,
    Admitted,
    CancelOutcome,
    Dropped,
    DuplicateRequest,
    Request,
    UnknownRequest,
    resolve_deadline,
)
from chunkline.server.core.admission.retry_holds import Held, RetryHolds
from chunkline.server.core.admission.retry_line import RetryLine
from chunkline.server.core.admission.selection import BatchSelector, EdfSelector, QueueView, WaitingSelector
from chunkline.server.core.admission.service_time import ServiceTimeModel
from chunkline.server.core.quotas import Cost, PolicyCost, TextCost

__all__ = [
    "Request",
    "Admitted",
    "Dropped",
    "CancelOutcome",
    "AdmissionConfig",
    "AdmissionController",
    "ServiceTimeModel",
    "BatchSelector",
    "EdfSelector",
    "QueueView",
    "WaitingSelector",
    "RetryLine",
    "RetryHolds",
    "Held",
    "UnknownRequest",
    "DuplicateRequest",
    "resolve_deadline",
    "Cost",
    "PolicyCost",
    "TextCost",
    "REFUSAL_CODES",
    "MAX_DEADLINE_MS",
]
