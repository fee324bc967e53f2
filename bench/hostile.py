"""A bystander tenant's robot round trip while another tenant attacks the server's shared work.

``python -m chunkline.bench.hostile --attack A`` serves two tenants; the bystander's robot sends
ALOHA-sized observations at 50 Hz while idle and attack blocks alternate, the attacker in a
process of its own (:mod:`.hostile_attacks`: ``decode``, ``raw``, ``plan``, ``fds``, and two
controls that load the server's CPUs at background priority and send it nothing). Per condition
it prints the round trip's median and p99 with their ratios and a bootstrap interval, the
slowest requests' time in the server's stages, and the server's CPU, reads and memory.
``--server-path`` runs another checkout's server as the baseline; ``--attacker-cpus 1
--server-cpus 0`` adds a placement with the attacker (and the fake upstream, other machines in
production) on CPUs of their own, alternating with the shared one."""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import os
import resource
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from chunkline.bench.hostile_attacks import (
    CONTROLS,
    FLOODS,
    OPENED,
    background_load,
    fake_upstream,
    fd_flood,
    serve_fake_upstream,
)
from chunkline.bench.hostile_figures import SERVER_STAGES, Answered, ServerUse, report, write_trace
from chunkline.policies.base import ArraySpec, PolicySpec
from chunkline.policies.numpy_backend import NumpyPolicy

if TYPE_CHECKING:
    from chunkline.bench.serverproc import CpuTimes

__all__ = ["Placement", "any_size_camera", "cpu_list", "main", "pin", "placements"]

PERIOD_S = 0.02


def any_size_camera() -> NumpyPolicy:
    """A camera of any size (raw or JPEG) and a state; answers zeros (``module:factory``)."""
    spec = PolicySpec(observation={"cam": ArraySpec((None, None, 3), "uint8", encodings=("raw", "jpeg")),
                                   "state": ArraySpec((2,), "float32")}, action_dim=2, horizon=4, dt=0.1)
    return NumpyPolicy("any-size-camera", lambda obs: np.zeros((len(obs["state"]), 4, 2), np.float32), spec)


def _aloha_obs() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    cameras = ("images/cam_high", "images/cam_left_wrist", "images/cam_right_wrist")
    obs: dict[str, Any] = {cam: rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for cam in cameras}
    obs["state"] = rng.standard_normal(14).astype(np.float32)
    return obs


def _camera_obs() -> dict[str, Any]:
    """One 480x640 camera-like frame (gradients and a little noise) and a state."""
    y, x = np.mgrid[0:480, 0:640]
    noise = np.random.default_rng(3).integers(-6, 7, (480, 640, 3))
    frame = np.clip(np.stack([x * 255 // 640, y * 255 // 480, (x + y) * 255 // 1120], -1) + noise, 0, 255)
    return {"cam": frame.astype(np.uint8), "state": np.zeros(2, np.float32)}


async def _robot(uri: str, key: str, seconds: float, failures: collections.Counter[str] | None = None,
                 answered: list[Answered] | None = None, jpeg: bool = False) -> list[float]:
    """Round trips (ms) of a 50 Hz robot for ``seconds``; a request or connection that fails
    (1 s without an answer included) counts as 1 000 ms, and its kind in ``failures``. ``answered``
    gets each answered request (:class:`Answered`); the round trip's rest is the transport and both
    loops. ``jpeg``: the robot sends one 480x640 camera frame as JPEG (decoded on the server's
    pool) instead of ALOHA's raw cameras."""
    from chunkline.client import AsyncClient
    from chunkline.client.compression import Compression

    obs, model = (_camera_obs(), "camera") if jpeg else (_aloha_obs(), None)
    compression = Compression("jpeg", 90) if jpeg else None
    out: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            client = AsyncClient(uri, api_key=key, compression=compression)
            await asyncio.wait_for(client.ensure_connected(), 5)
            async with client:
                tick = time.monotonic()
                while time.monotonic() < end:
                    sent_at, started = time.monotonic(), time.perf_counter()
                    chunk = await asyncio.wait_for(client.infer(obs, deadline_ms=1000, model=model), 1)
                    out.append((time.perf_counter() - started) * 1000)
                    if answered is not None:
                        answered.append(Answered(sent_at, out[-1], {k: chunk.timing.get(k, 0.0) for k in SERVER_STAGES}))
                    tick += PERIOD_S
                    await asyncio.sleep(max(0.0, tick - time.monotonic()))
        except Exception as exc:  # the attack may take the port down: that is what is measured
            out.append(1000.0)
            if failures is not None:
                failures[f"{type(exc).__name__} {getattr(exc, 'code', '')}".strip()] += 1
            await asyncio.sleep(PERIOD_S)
    return out


# ------------------------------------------------------------------------------ the run




def _opened_between(output: list[str], start: float, end: float) -> int:
    """Connections the fds attacker opened between ``start`` and ``end`` (from its ``opened`` lines)."""
    counts = [(float(t), int(n)) for word, t, n in (line.split() for line in output if line.startswith(OPENED))
              if word == OPENED]
    before = max((n for t, n in counts if t <= start), default=0)
    return max((n for t, n in counts if t <= end), default=before) - before


def _wait_under_way(proc: subprocess.Popen[str], onset_s: float) -> Callable[[], list[str]]:
    """Until the attacker says it is under way (60 s at most), then ``onset_s`` more: the block
    measures the attack itself, not the attacker's start-up on a busy machine. Its output is read
    all along (a full pipe would stall it); the function returned gives every line once it has
    exited."""
    import threading

    assert proc.stdout is not None
    stdout = proc.stdout
    lines: list[str] = []
    said = threading.Event()

    def read() -> None:
        for line in stdout:
            lines.append(line)
            said.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    said.wait(60.0)
    time.sleep(onset_s)

    def output() -> list[str]:
        reader.join()
        return lines

    return output


# ------------------------------------------------------------------------------ placement


def cpu_list(text: str) -> frozenset[int]:
    """CPUs as ``taskset`` lists them: ``0``, ``0,2``, ``0-3``."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return frozenset(cpus)


def pin(pid: int, cpus: frozenset[int], children: bool = False) -> None:
    """Every thread of process ``pid`` onto ``cpus`` (threads it starts later inherit them), and
    with ``children`` those of its child processes too (a server's worker processes)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that just ended
            pass
    for kid in _children(pid) if children else []:
        try:
            pin(kid, cpus, children)
        except FileNotFoundError:  # a child that just ended
            pass


def _children(pid: int) -> list[int]:
    """The child processes of process ``pid`` (Linux)."""
    kids: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(kid) for kid in f.read().split()]
        except FileNotFoundError:  # a thread that just ended
            pass
    return kids


def _tree_cpu(pid: int) -> CpuTimes | None:
    """The CPU of process ``pid`` and of its child processes (a server's worker processes)."""
    from chunkline.bench.serverproc import CpuTimes, cpu_times

    own = cpu_times(pid)
    if own is None:
        return None
    kids = [cpu_times(kid) for kid in _children(pid)]
    return CpuTimes(own.total + sum(k.total for k in kids if k is not None), own.main)


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """Which CPUs each party runs on: ``None`` for a party on every CPU."""

    name: str
    server: frozenset[int] | None = None
    bystander: frozenset[int] | None = None
    attacker: frozenset[int] | None = None

    def describe(self, every: frozenset[int]) -> str:
        def on(cpus: frozenset[int] | None) -> str:
            return ",".join(map(str, sorted(cpus if cpus is not None else every)))
        return f"{self.name}: server on CPUs {on(self.server)}, bystander on {on(self.bystander)}, " \
               f"attacker and fake upstream on {on(self.attacker)}"


def placements(args: argparse.Namespace) -> list[Placement]:
    """The shared placement, and the separated one when ``--attacker-cpus`` is given."""
    out = [Placement("shared")]
    if args.attacker_cpus:
        server = cpu_list(args.server_cpus) if args.server_cpus else None
        bystander = cpu_list(args.bystander_cpus) if args.bystander_cpus else server
        out.append(Placement("separate", server, bystander, cpu_list(args.attacker_cpus)))
    return out


def _settle(pid: int, quiet_cores: float = 0.15, most_s: float = 20.0) -> None:
    """Until the server's CPU falls under ``quiet_cores`` over half a second (``most_s`` at most):
    work an attack left queued (a plan's image encode, say) must not run into the next idle block."""
    end = time.monotonic() + most_s
    while time.monotonic() < end:
        before = _tree_cpu(pid)
        time.sleep(0.5)
        after = _tree_cpu(pid)
        if before is None or after is None or (after - before).total < 0.5 * quiet_cores:
            return


def _read_bytes(pid: int) -> int:
    """Bytes process ``pid`` has read so far, sockets included (``rchar``; 0 where unreadable)."""
    try:
        with open(f"/proc/{pid}/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    except (OSError, StopIteration, ValueError):
        return 0


def _softirq_s(cpus: frozenset[int]) -> float:
    """Seconds ``cpus`` have spent in software interrupts so far (Linux; 0 where unreadable): on
    loopback, TCP's processing of every party's traffic runs there, preempting whatever runs."""
    try:
        with open("/proc/stat") as f:
            rows = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
        return sum(int(row[7]) for row in rows if int(row[0][3:]) in cpus) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (0 where unreadable)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration, ValueError):
        return 0.0


class _RssPeak:
    """The peak of process ``pid``'s resident memory, sampled every ``period_s`` on a thread until :meth:`stop`."""

    def __init__(self, pid: int, period_s: float = 0.2) -> None:
        self.pid, self.period_s, self.peak = pid, period_s, _rss_mib(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.period_s):
            self.peak = max(self.peak, _rss_mib(self.pid))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss_mib(self.pid))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chunkline.bench.hostile", description=__doc__.splitlines()[0])
    parser.add_argument("--attack", choices=[*FLOODS, "fds", *CONTROLS], required=True)
    parser.add_argument("--seconds", type=float, default=10.0, help="per condition block")
    parser.add_argument("--rounds", type=int, default=2, help="idle then attack blocks, this many times")
    parser.add_argument("--onset-s", type=float, default=2.0,
                        help="seconds between the attacker's first requests sent (or connections open) and the block")
    parser.add_argument("--attacker-nice", type=int, default=0,
                        help="run the attacking client at this niceness (it shares the machine's cores with the server)")
    parser.add_argument("--bystander", choices=["aloha", "jpeg"], default="aloha",
                        help="the bystander robot's observation: ALOHA's three raw 224x224 cameras, or one 480x640 JPEG "
                        "camera (decoded on the server's pool, in its tenant's turn)")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--connections", type=int, default=1100, help="fds attack: connections held")
    parser.add_argument("--nofile", type=int, default=1024, help="fds attack: the server's open-files limit")
    parser.add_argument("--extra", nargs="*", default=[], help="more server config lines (key = value)")
    parser.add_argument("--server-log", type=Path, help="keep the server's log here")
    parser.add_argument("--trace", type=Path, help="write every answered request here (tab-separated: placement, "
                        "condition, sent at on CLOCK_MONOTONIC, round trip ms, server stages ms) and each block's "
                        "start and end, to line up with a trace such as `perf sched record -k CLOCK_MONOTONIC`")
    parser.add_argument("--server-path", help="PYTHONPATH of the server (another checkout's packages, for a baseline)")
    parser.add_argument("--attacker-cpus", help="also measure with the attacker and the fake upstream on these CPUs "
                        "(e.g. 1), alternating with every party on every CPU")
    parser.add_argument("--server-cpus", help="with --attacker-cpus: the server's CPUs (default: every CPU)")
    parser.add_argument("--bystander-cpus", help="with --attacker-cpus: the bystander robot's CPUs (default: the server's)")
    parser.add_argument("--pin", help=argparse.SUPPRESS)
    parser.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--upstream", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.pin:
        os.sched_setaffinity(0, cpu_list(args.pin))
    if args.upstream:
        serve_fake_upstream()
        return 0
    if args.child is not None:
        if args.attack in FLOODS:
            asyncio.run(FLOODS[args.attack](args.child[0], args.child[1], args.sessions, args.in_flight))
        elif args.attack in CONTROLS:
            background_load(copy=args.attack == "control-copy")
        else:
            fd_flood(int(args.child[0]), args.connections)
        return 0

    from chunkline.bench.serverproc import ServerProcess
    from chunkline.server.core.tenants import add_key

    folder = Path(tempfile.mkdtemp(prefix="chunkline-hostile-"))
    tenants = folder / "tenants.toml"
    keys = {name: add_key(tenants, name, create_tenant=True)[0] for name in ("fleet", "mallory")}
    config = folder / "server.toml"
    extra = "\n".join(args.extra)
    upstream_port, upstream = fake_upstream()
    planner = textwrap.dedent(f"""
        [[planners]]
        name = "vlm"
        backend = "upstream"
        upstream_url = "http://127.0.0.1:{upstream_port}/v1"
        default_deadline_ms = 30000
    """)
    config.write_text(textwrap.dedent(f"""
        tenants = "{tenants}"
        http_port = 0
        ledger = "{folder / 'ledger.db'}"
        {extra}

        [[policies]]
        ref = "noop"

        [[policies]]
        ref = "chunkline.bench.hostile:any_size_camera"
        name = "camera"

        [[text]]
        name = "tiny"
    """) + planner)
    prefix: list[str] = []
    if args.attack == "fds":
        prefix = ["prlimit", f"--nofile={args.nofile}:{max(args.nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1])}", "--"]
    where = placements(args)
    every = frozenset(os.sched_getaffinity(0))
    blocks = [(p.name, c) for p in where for c in ("idle", "attack")]
    samples: dict[tuple[str, str], list[float]] = {b: [] for b in blocks}
    failures: dict[tuple[str, str], collections.Counter[str]] = {b: collections.Counter() for b in blocks}
    answered: dict[tuple[str, str], list[Answered]] = {b: [] for b in blocks}
    use: dict[tuple[str, str], ServerUse] = {b: ServerUse() for b in blocks}
    opened: dict[tuple[str, str], list[float]] = {b: [] for b in blocks}  # fds: connections the attacker opened per second
    spans: list[tuple[str, str, float, float]] = []  # each block's placement, condition, start and end
    env = {"PYTHONPATH": args.server_path} if args.server_path else None
    nice = ["nice", "-n", str(args.attacker_nice)] if args.attacker_nice else []
    try:
        with ServerProcess(["--config", str(config)], prefix=prefix, env=env, log_path=args.server_log) as server:
            assert server.proc is not None
            asyncio.run(_robot(server.uri, keys["fleet"], 2.0, jpeg=args.bystander == "jpeg"))  # warm-up
            for _ in range(args.rounds):
                for placement in where:
                    pin(server.proc.pid, placement.server or every, children=True)
                    pin(upstream.pid, placement.attacker or every)
                    pin(os.getpid(), placement.bystander or every)
                    for condition in ("idle", "attack"):
                        block = (placement.name, condition)
                        proc = None
                        if condition == "attack":
                            target = [str(server.http_port)] if args.attack == "fds" else [server.uri, keys["mallory"]]
                            on = placement.server if args.attack in CONTROLS else placement.attacker
                            pinned = ["--pin", ",".join(map(str, sorted(on)))] if on else []
                            proc = subprocess.Popen([*nice, sys.executable, "-m", "chunkline.bench.hostile", "--attack", args.attack,
                                                     "--sessions", str(args.sessions), "--in-flight", str(args.in_flight),
                                                     "--connections", str(args.connections), *pinned, "--child", *target],
                                                    stdout=subprocess.PIPE, text=True)
                            output = _wait_under_way(proc, args.onset_s)
                        before, read, started = _tree_cpu(server.proc.pid), _read_bytes(server.proc.pid), time.monotonic()
                        softirq = _softirq_s(placement.server or every)
                        peak = _RssPeak(server.proc.pid)
                        try:
                            samples[block] += asyncio.run(_robot(server.uri, keys["fleet"], args.seconds, failures[block],
                                                                 answered[block], args.bystander == "jpeg"))
                        finally:
                            use[block].rss_peak.append(peak.stop())
                            ended = time.monotonic()
                            spans.append((*block, started, ended))
                            if proc is not None:
                                proc.kill()
                                proc.wait()
                                opened[block].append(_opened_between(output(), started, ended) / (ended - started))
                                _settle(server.proc.pid)
                                use[block].rss_after.append(_rss_mib(server.proc.pid))
                        after, elapsed = _tree_cpu(server.proc.pid), time.monotonic() - started
                        if before is not None and after is not None:
                            use[block].cpu.append((after - before).total / elapsed)
                            use[block].loop_cpu.append((after - before).main / elapsed)
                        use[block].softirq.append((_softirq_s(placement.server or every) - softirq) / elapsed)
                        use[block].read.append((_read_bytes(server.proc.pid) - read) / elapsed)
            pin(os.getpid(), every)
    finally:
        upstream.kill()
        upstream.wait()
    if args.trace:
        write_trace(args.trace, answered, spans)
    for placement in where:
        report(args, placement.describe(every), {c: samples[placement.name, c] for c in ("idle", "attack")},
                {c: answered[placement.name, c] for c in ("idle", "attack")},
                {c: failures[placement.name, c] for c in ("idle", "attack")},
                {c: use[placement.name, c] for c in ("idle", "attack")}, opened[placement.name, "attack"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
