"""Background CPU priority, for bulk work that no robot waits on turn by turn: image decode and
encode, plan uploads, unmapping.

Invariant: on Linux such a thread (or process) runs ``SCHED_IDLE``, so the scheduler gives its
core to a normal thread the moment one wakes (the event loop, a lane, a robot's client on the
same machine) instead of letting it finish its time slice first, which under a merely lower
priority still costs a waking thread milliseconds. The price: on a machine whose cores are all
busy with normal work it gets a very small share. Where the policy is refused the thread runs
:data:`FALLBACK_NICE` nicer instead.
"""

from __future__ import annotations

import os
import sys
import threading

__all__ = ["FALLBACK_NICE", "to_background"]

#: how much nicer than before a thread runs where ``SCHED_IDLE`` is refused
FALLBACK_NICE = 10


def to_background() -> None:
    """Move the calling thread to background priority (Linux: each thread has its own; a
    process's first thread calling it moves the threads it starts after)."""
    if sys.platform != "linux":
        return
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # pid 0: this thread
        return
    except OSError:
        pass
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + FALLBACK_NICE)
    except OSError:
        pass
