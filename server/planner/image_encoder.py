"""Camera images encoded for the upstream planner in worker processes at background CPU priority,
fair between tenants.

Invariant: the server's process does none of the encoding, so neither the GIL nor the CPU
scheduler lets it delay the event loop: a worker process runs at background priority, so any
normal thread that wakes takes its core at once, in a scheduling group of its own, so its CPU is
not charged to the server's. A job is queued on a :class:`FairPool` (bounded,
per-tenant round robin); its pool thread copies the pixels into its own shared mapping (the GIL
released while numpy copies) and waits; the worker writes the PNG's base64 text into a fresh
mapping and answers its name and length; the pool thread maps it and unlinks the name. Only
names, shapes and lengths we made cross the pipe; nothing from the network is ever unpickled. The
upload reads the text a piece at a time (:class:`SharedText`) while it streams.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Iterable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from chunkline.server.core.background import to_background
from chunkline.server.core.fair_pool import DEFAULT_CPU_THREADS, DEFAULT_JOBS_PER_TENANT, FairPool
from chunkline.server.planner.errors import PlannerFailed
from chunkline.server.planner.request_body import DataUrl, base64_pieces, png_pieces

__all__ = ["ImageEncoder", "SharedText", "die_with_parent", "encode_shared", "own_cpu_group", "worker_init"]


class SharedText:
    """A data URL's base64 text in a shared mapping whose name is already unlinked: read a piece at
    a time (each read a copy, so no view outlives it and :meth:`close` always succeeds)."""

    def __init__(self, shm: SharedMemory, length: int) -> None:
        self._shm = shm
        self._length = length

    def __len__(self) -> int:
        return self._length

    def read(self, start: int, end: int) -> bytes:
        buf = self._shm.buf
        assert buf is not None, "read after close"
        return buf[start:min(end, self._length)].tobytes()

    def close(self) -> None:
        self._shm.close()


def worker_init() -> None:
    """A worker process's initializer: it dies with the server (:func:`die_with_parent`), runs at
    background priority (:mod:`chunkline.server.core.background`) in a scheduling group of its own
    (:func:`own_cpu_group`), and leaves Ctrl-C to the server (which stops its workers itself)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    own_cpu_group()
    to_background()


def die_with_parent() -> None:
    """Linux: have the kernel kill this process when the one that spawned it dies (a server
    killed with SIGKILL stops no workers itself), and exit at once if it has died already (this
    process was then handed to another parent before the request was made). The signal comes
    when the spawning thread ends: an encoder's pool threads, which live as long as the encoder."""
    parent = multiprocessing.parent_process()
    if sys.platform != "linux" or parent is None:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):  # no prctl here: the worker outlives a killed server
        return
    if os.getppid() != parent.pid:
        os._exit(1)


_PR_SET_PDEATHSIG = 1


def own_cpu_group() -> None:
    """Move this process to a session of its own and, where Linux groups tasks by session
    (autogroup), give that group the lowest weight (nice 19). ``SCHED_IDLE`` only orders the
    tasks of one group: in the server's group, a worker's encoding would still be charged to the
    server's share of a contended core, and other groups' tasks would then run ahead of the
    server's event loop (and of anything sharing its group) for as long as it encodes."""
    try:
        os.setsid()
    except OSError:  # already a session leader
        pass
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("19")
    except OSError:  # no autogroup here (not Linux, or disabled): the scheduling policy alone
        pass


@dataclasses.dataclass(frozen=True, slots=True)
class _Encoded:
    """What a worker answers: the name of the mapping holding the text, and the text's length."""

    name: str
    length: int


def encode_shared(name: str, height: int, width: int) -> _Encoded:
    """In a worker: the ``[height, width, 3]`` pixels at the start of mapping ``name`` as a PNG's
    base64 text, in a fresh mapping of its own (which the caller unlinks)."""
    shm = SharedMemory(name)
    try:
        png = png_pieces(np.ndarray((height, width, 3), np.uint8, buffer=shm.buf))
    finally:
        _close(shm)
    length = 4 * math.ceil(sum(len(p) for p in png) / 3)
    out = SharedMemory(create=True, size=max(1, length))
    try:
        buf, at = out.buf, 0
        assert buf is not None
        for piece in base64_pieces(png):
            buf[at:at + len(piece)] = piece
            at += len(piece)
        assert at == length
        return _Encoded(out.name, length)
    finally:
        _close(out)


def _close(shm: SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:  # an error's traceback still holds a view: the mapping goes with it
        pass


class ImageEncoder:
    """Images to PNG data URLs (see the module docstring).

    Args:
        processes: worker processes (and the pool threads that feed them).
        max_pending_per_tenant: images one tenant may have queued or encoding.
    """

    def __init__(self, processes: int = DEFAULT_CPU_THREADS, max_pending_per_tenant: int = DEFAULT_JOBS_PER_TENANT) -> None:
        self._pool = FairPool(processes, max_pending_per_tenant)  # its threads copy the pixels and wait
        self._unmapper: ThreadPoolExecutor | None = None
        self._processes = processes
        self._workers: Executor | None = None  # started at the first image
        self._local = threading.local()  # each pool thread's input mapping, reused: its pages fault in once
        self._inputs: list[SharedMemory] = []
        self._lock = threading.Lock()

    async def data_url(self, tenant: str, image: np.ndarray) -> DataUrl:
        """``image`` (``[H, W, 3]`` uint8) as a data URL, for :meth:`discard` once it is sent.

        Raises:
            Refusal: ``overloaded`` when ``tenant`` has its bound of images queued or encoding.
        """
        return DataUrl(await self._pool.run(tenant, self._encode, image))

    def _encode(self, image: np.ndarray) -> SharedText:
        """On a pool thread: the pixels into this thread's mapping, the worker's answer mapped."""
        height, width, _ = image.shape
        shm = self._input(image.nbytes)
        np.ndarray(image.shape, np.uint8, buffer=shm.buf)[...] = image
        workers = self._executor()
        try:
            encoded = workers.submit(encode_shared, shm.name, height, width).result()
        except BrokenProcessPool:  # a worker died (killed, out of memory): the next image starts new ones
            with self._lock:
                if self._workers is workers:
                    self._workers = None
            raise PlannerFailed("the image encoder's worker process died") from None
        out = SharedMemory(encoded.name)
        out.unlink()
        return SharedText(out, encoded.length)

    def discard(self, urls: Iterable[DataUrl]) -> None:
        """Let the texts of ``urls`` go, unmapped on a thread of the encoder's (unmapping megabytes
        would hold the event loop for a millisecond or more)."""
        with self._lock:
            if self._unmapper is None:
                self._unmapper = ThreadPoolExecutor(1, thread_name_prefix="chunkline-unmap")
            for url in urls:
                self._unmapper.submit(url.close)

    def _executor(self) -> Executor:
        with self._lock:
            if self._workers is None:
                self._workers = ProcessPoolExecutor(self._processes, multiprocessing.get_context("spawn"), initializer=worker_init)
            return self._workers

    def _input(self, nbytes: int) -> SharedMemory:
        shm: SharedMemory | None = getattr(self._local, "shm", None)
        if shm is not None and shm.size >= nbytes:
            return shm
        fresh = SharedMemory(create=True, size=nbytes)
        with self._lock:
            self._inputs.append(fresh)
            if shm is not None:
                self._inputs.remove(shm)
                _release(shm)
        self._local.shm = fresh
        return fresh

    def close(self) -> None:
        self._pool.close()
        with self._lock:
            if self._workers is not None:
                self._workers.shutdown(wait=False, cancel_futures=True)
            if self._unmapper is not None:
                self._unmapper.shutdown(wait=False)
            for shm in self._inputs:
                _release(shm)
            self._inputs.clear()


def _release(shm: SharedMemory) -> None:
    _close(shm)
    try:
        shm.unlink()
    except FileNotFoundError:
        pass
