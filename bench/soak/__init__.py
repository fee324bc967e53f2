"""Soak: many robot sessions for a long time, with faults, against a real server.

``chunkline bench soak`` (default 10 minutes) starts ``chunkline serve`` on
:func:`fault_policy`, then drives robot sessions at their control rate. Each robot opens a
session, sends observations, injects faults now and then (invalid observations and messages,
garbage frames, unknown models, unmeetable deadlines, policy exceptions and hangs, cancels,
duplicate ids, bursts, abrupt disconnects, oversize and text frames) and rotates to a new session
after a while. Half of the robots reach the server through the closed-loop benchmark's fault
layer (:class:`chunkline.bench.faultproxy.FaultProxy`), which a :class:`FaultPlan` steers:
lossy periods (delay, jitter, stalls like lost segments), partitions (blackhole outages) and
resets of every connection.

Every request is booked on the client side (:class:`SessionBook`); at the end the server is
drained with SIGTERM and its usage ledger is reconciled with the books, session by session.
The report (:class:`SoakReport`) says: requests, refusals, lost (sent on a session that stayed
up and never answered) and duplicated answers (both must be 0), errors outside the documented
set, ledger mismatches, and the server's memory and file-descriptor slopes.

Beside the robots, text users (``text_streams``) stream ``generate`` completions from the
embedded text model (``chunkline serve --text-model``) on native sessions, cancel them
mid-stream, reuse ids, ask for unknown models, send invalid requests and disconnect; their
streams are booked the same way (every token in order, exactly one ``done`` or error). On a
server without text support the soak runs robots only and says so in ``notes``.

The pure parts (:class:`FaultPolicy`'s markers, :class:`FaultPlan`, :class:`SessionBook`,
:func:`reconcile`, :func:`slope`) take times as arguments; the robots are thin asyncio shells
around them.

The package, by responsibility: :mod:`.policy` (the fault policy), :mod:`.faults` (the network
fault plan), :mod:`.books` (the client's books and the ledger reconciliation), :mod:`.config`,
:mod:`.workload` (robots and text users), :mod:`.report` (the findings), :mod:`.run` (the server,
the drive, the resource sampling through :mod:`chunkline.bench.resources`), :mod:`.heap` (heap
snapshots and resident memory by mapping), :mod:`.cli`.
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
