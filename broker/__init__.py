"""Robot-side broker: the action timeline on the robot clock, merging, prefetch, the control loop.

Runs on the robot (numpy, the standard library, and :mod:`chunkline.client` for the shells).
The core (:class:`Broker`) is sans-I/O; :class:`SyncBrokerLoop` / :class:`AsyncBrokerLoop`
drive it with a client at a fixed rate (:class:`SyncRunner` / :class:`AsyncRunner`),
:class:`TickRecorder` keeps a per-tick record, and
:class:`~chunkline.broker.openpi_compat.ActionChunkBroker` is a drop-in for openpi's.
"""

from .chunk import ActionChunk
from .config import BrokerConfig, MergeMode
from .core import Broker, BrokerStats, Command, RequestIntent
from .exceptions import BrokerClosed, BrokerConfigError, BrokerError, ChunkError, FirstChunkTimeout
from .fixed_rate import AsyncRunner, JitterStats, RateScheduler, SyncRunner, TickInfo
from .latency import LatencyWindow
from .openpi_compat import ActionChunkBroker
from .record import TickRecorder, load_jsonl, load_npz
from .shells import AsyncBrokerLoop, RequestWorker, SyncBrokerLoop
from .timeline import MergeOutcome, Timeline, TimelineAction

__all__ = [
    "ActionChunk",
    "ActionChunkBroker",
    "AsyncBrokerLoop",
    "AsyncRunner",
    "Broker",
    "BrokerClosed",
    "BrokerConfig",
    "BrokerConfigError",
    "BrokerError",
    "BrokerStats",
    "ChunkError",
    "Command",
    "FirstChunkTimeout",
    "JitterStats",
    "LatencyWindow",
    "MergeMode",
    "MergeOutcome",
    "RateScheduler",
    "RequestIntent",
    "RequestWorker",
    "SyncBrokerLoop",
    "SyncRunner",
    "TickInfo",
    "TickRecorder",
    "Timeline",
    "TimelineAction",
    "load_jsonl",
    "load_npz",
]
