"""Soak: many robot and text sessions for a long time, with faults, against a real server.

``chunkline bench soak`` starts ``chunkline serve`` on :func:`fault_policy` and drives robots at
their control rate, injecting faults (bad messages and observations, policy exceptions and hangs,
cancels, duplicate ids, disconnects), half of them through the fault proxy (:class:`FaultPlan`:
lossy periods, partitions, resets), beside text users streaming ``generate`` completions.
Invariants checked: every request answered exactly once on a session that stayed up (lost and
duplicated both 0); the usage ledger reconciles with the client's books session by session; fds
return to their start; memory stops growing. The pure parts (:class:`FaultPlan`,
:class:`SessionBook`, :func:`reconcile`, :func:`slope`) take times as arguments; the workload is
a thin asyncio shell. Modules: :mod:`.policy`, :mod:`.faults`, :mod:`.books`, :mod:`.config`,
:mod:`.workload`, :mod:`.report`, :mod:`.run`, :mod:`.heap`, :mod:`.cli`.
"""

from __future__ import annotations

from chunkline.bench.resources import ResourceSample, read_process
from chunkline.bench.stats import slope

from .books import ADMITTED_ERRORS, Reconciliation, SessionBook, read_ledger, reconcile
from .cli import main
from .config import SoakConfig
from .faults import FaultEvent, FaultPlan, apply_fault
from .policy import FAULT_POLICY_REF, MARK_HANG, MARK_RAISE, SOAK_SPEC, FaultPolicy, fault_policy
from .report import SoakReport
from .run import run_soak

__all__ = [
    "SOAK_SPEC",
    "FAULT_POLICY_REF",
    "MARK_RAISE",
    "MARK_HANG",
    "FaultPolicy",
    "fault_policy",
    "FaultEvent",
    "FaultPlan",
    "apply_fault",
    "ResourceSample",
    "read_process",
    "slope",
    "ADMITTED_ERRORS",
    "SessionBook",
    "Reconciliation",
    "reconcile",
    "read_ledger",
    "SoakConfig",
    "SoakReport",
    "run_soak",
    "main",
]
