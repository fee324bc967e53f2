"""A TCP fault proxy: a separate process relaying a byte stream between a client and a server on
loopback, with network faults injected per direction.

The kernels here have no ``netem`` (``tc`` answers "Specified qdisc kind is unknown"), so this
is the fault layer between the robot process and the server process in the closed-loop
benchmark's real-time mode. Faults, per direction (``up``: client to server, ``down``: back):

* **one-way delay** and **jitter** (each read's delay drawn uniformly in ``delay +- jitter``;
  bytes are never reordered: a read is delivered no earlier than the one before it);
* **bandwidth cap** (bytes are serialised at the given rate, queueing behind each other);
* **stalls** that mimic a lost segment and its retransmission (at random times, Poisson at
  ``stall_rate_hz``, bytes in transit wait ``stall_s``, and everything behind them too, as
  TCP's in-order delivery makes them);
* **outages**, both directions at once: ``blackhole`` (nothing gets through; what was in
  transit or sent during the outage arrives at the first TCP retransmission after it ends,
  retransmissions backing off from 200 ms, doubling) or ``reset`` (every connection is reset
  at the start, new ones are refused until the end).

The delivery schedule is a sans-I/O core (:class:`Direction`, :class:`Scenario`: times in, times
out, no sockets, no clock); the discrete-event simulation of :mod:`chunkline.bench.closedloop`
uses the same core, so both modes run the same scenarios. The asyncio shell
(:class:`ProxyServer`) relays real sockets and takes commands on a control port (JSON lines:
``set``, ``outage``, ``stats``, ``quit``); :class:`FaultProxy` starts it as a child process.

Safety: the proxy listens on loopback only and connects only to loopback addresses; it ends by
itself after ``--max-seconds``; every loop is bounded by a connection, a deadline or both.

The package: :mod:`.schedule` (the sans-I/O core), :mod:`.relay` (the proxy process and its
command line), :mod:`.control` (:class:`FaultProxy`, the parent's side).

Run: ``python -m chunkline.bench.faultproxy --target-port 8000 --delay-ms 50 --port-file p``.
"""

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
