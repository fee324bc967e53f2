"""A TCP fault proxy on loopback: one-way delay and jitter (never reordering), a bandwidth cap,
stalls that mimic a lost segment's retransmission, and outages (``blackhole`` or ``reset``),
per direction.

The kernels here have no ``netem``, so this is the fault layer of the closed-loop benchmark's
real-time mode. The delivery schedule is a sans-I/O core (:mod:`.schedule`: times in, times out),
which the discrete-event simulation uses too, so both modes run the same scenarios; :mod:`.relay`
is the proxy process, :mod:`.control` the parent's side (:class:`FaultProxy`). The proxy listens
and connects on loopback only, ends by itself after ``--max-seconds``, and every loop is bounded."""

from __future__ import annotations

from .control import FaultProxy
from .errors import FaultProxyError
from .relay import ProxyServer, check_loopback, main
from .schedule import OUTAGE_MODES, RTO_MIN_S, Direction, LinkFaults, Outage, Scenario, retransmit_arrival

__all__ = [
    "OUTAGE_MODES",
    "RTO_MIN_S",
    "FaultProxyError",
    "LinkFaults",
    "Outage",
    "Scenario",
    "Direction",
    "retransmit_arrival",
    "check_loopback",
    "ProxyServer",
    "FaultProxy",
    "main",
]
