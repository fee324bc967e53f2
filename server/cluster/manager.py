"""The fleet manager: the directory robots dial, and the control loop over the replicas.

The **directory** authenticates a robot's WebSocket handshake, reserves the session against the
tenant's fleet-wide quota, places it on a replica with room for its rate and deadline and answers
``307`` to that replica with a placement token; clients follow the redirect themselves, so the
robot path is a direct WebSocket. A robot whose replica goes away reconnects to the directory.
The **control loop** reads every replica each ``poll_interval_s`` and feeds the sans-I/O cores
(placement, fleet quota, autoscaler, rollout); every decision is theirs, this module only moves
state between them and the replicas."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http
import json
import logging
import secrets
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from chunkline.server.cluster.autoscale import Autoscaler
from chunkline.server.cluster.config import FleetConfig
from chunkline.server.cluster.fleetquota import FleetQuota
from chunkline.server.cluster.launch import Launcher, ReplicaHandle
from chunkline.server.cluster.placement import Placement, PlacementDecision, ReplicaState, SessionRequest, capacity_rps
from chunkline.server.cluster.rollout import Done, DrainReplica, Promote, RolledBack, Rollout, SetCanaryShare, StartReplica, VersionStats
from chunkline.server.cluster.tokens import PlacementSigner
from chunkline.server.core.auth import Authenticator, NoAuth
from chunkline.server.core.ledger import FleetLedgerStore, LedgerRow
from chunkline.server.core.tenants import TenantLimits, load_registry
from chunkline.server.entrypoints.cli_errors import error_line

__all__ = ["FleetManager", "replica_state_from_stats"]

log = logging.getLogger("chunkline.cluster")

# Outcomes counted as deadline misses and as errors when versions are compared.
_MISSES = ("late", "deadline_exceeded", "deadline_unmeetable")  # a refused request is a missed action too
_ERRORS = ("policy_failed", "internal")
_NOT_REQUESTS = ("cancelled",)


def _response(status: int, body: dict[str, Any] | str, extra: list[tuple[str, str]] | None = None) -> Response:
    st = http.HTTPStatus(status)
    payload = (json.dumps(body) if isinstance(body, dict) else body + "\n").encode()
    ctype = "application/json" if isinstance(body, dict) else "text/plain; charset=utf-8"
    headers = Headers([("Content-Type", ctype), ("Content-Length", str(len(payload)))])
    for k, v in extra or []:
        headers[k] = v
    return Response(st.value, st.phrase, headers, payload)


def replica_state_from_stats(stats: dict[str, Any], previous: dict[str, Any] | None, canary: bool) -> ReplicaState:
    """Turn a replica's :meth:`ChunklineServer.stats` report into the placement core's view.

    The request rate and the deadline-miss rate are differences between this report and the
    previous one of the same incarnation; the service curve is each batch size's mean plus two
    deviations (the cautious planning estimate admission uses too).
    """
    runners = stats["runners"]
    first = next(iter(runners.values()))
    service = {int(b): float(m) + 2.0 * float(d) for b, (m, d) in first["service_s"].items()}
    outcomes: dict[str, int] = stats["outcomes"]
    total = sum(v for k, v in outcomes.items() if k not in _NOT_REQUESTS)
    misses = sum(outcomes.get(k, 0) for k in _MISSES)
    rate = miss_rate = 0.0
    if previous is not None and previous.get("incarnation") == stats.get("incarnation"):
        dt = max(1e-3, float(stats["at"]) - float(previous["at"]))
        before = previous["outcomes"]
        d_total = total - sum(v for k, v in before.items() if k not in _NOT_REQUESTS)
        d_miss = misses - sum(before.get(k, 0) for k in _MISSES)
        rate = max(0.0, d_total / dt)
        miss_rate = d_miss / d_total if d_total > 0 else 0.0
    waits = sorted(stats.get("queue_ms", []))
    p99 = waits[min(len(waits) - 1, int(0.99 * len(waits)))] / 1000.0 if waits else 0.0
    return ReplicaState(
        name=stats["name"], uri=stats["uri"], fingerprint=str(first["fingerprint"]), service_s=service,
        max_batch_size=int(first["max_batch_size"]), lanes=int(first["lanes"]),
        sessions=sum(int(v) for v in stats["sessions"].values()), load_rps=rate, queue_wait_p99_s=p99,
        deadline_miss_rate=miss_rate, ready=bool(stats["ready"]), draining=bool(stats["draining"]),
        canary=canary, updated=time.monotonic(), models=frozenset(runners),
        aliases={str(a): name for name, r in runners.items() for a in r.get("aliases", ())},
    )


@dataclasses.dataclass
class _Replica:
    handle: ReplicaHandle
    version: str
    started_at: float
    uri: str | None = None
    ready: bool = False
    draining: bool = False
    last_stats: dict[str, Any] | None = None
    last_ok: float = 0.0
    baseline: dict[str, int] = dataclasses.field(default_factory=dict)  # outcomes when a rollout began


class FleetManager:
    """Directory + control loop of one fleet. Runs on an asyncio loop (a Ray actor's, or any).

    Its attributes are the fleet's directory (replicas, sessions, placements, quotas) and its
    control loop's state (autoscaling, roll-out, ledger); the control loop reads all of them each
    pass.

    Args:
        config: the fleet configuration.
        tenants_text: the tenants file's contents (``None`` with ``server.no_auth``).
        launcher: starts replicas (:class:`~.launch.RayLauncher` or :class:`~.launch.ThreadLauncher`).
        ledger_write: how replicas send ledger batches to :meth:`write_ledger` (through Ray, or a
            direct call); ``None`` when the fleet keeps no ledger.
    """

    def __init__(self, config: FleetConfig, tenants_text: str | None, launcher: Launcher,
                 ledger_write: Callable[[str, int, list[LedgerRow]], Any] | None = None) -> None:
        self.config = config
        self.tenants_text = tenants_text
        self.launcher = launcher
        self._tmp = tempfile.TemporaryDirectory(prefix="chunkline-fleet-")
        if tenants_text is not None:
            path = Path(self._tmp.name) / "tenants.toml"
            path.write_text(tenants_text)
            path.chmod(0o600)
            self.auth: Authenticator | NoAuth = Authenticator(load_registry(path), time.monotonic)
        else:
            self.auth = NoAuth()
        self.secret = secrets.token_bytes(32)
        self.signer = PlacementSigner(self.secret, ttl_s=config.placement_ttl_s)
        self.placement = Placement(stale_after_s=max(2.0, config.replica_timeout_s), session_rate_hz=config.default_rate_hz)
        self.quota = FleetQuota(self._limits_of)
        self.autoscaler = Autoscaler(config.autoscale) if config.autoscale is not None else None
        self.ledger: FleetLedgerStore | None = FleetLedgerStore(config.ledger) if config.ledger is not None else None
        self._ledger_lock = threading.Lock()
        self._ledger_write = ledger_write if self.ledger is not None else None
        self.versions: dict[str, dict[str, Any]] = {"v1": config.server.model_dump(mode="json")}
        self.current_version = "v1"
        self.stable_version = "v1"  # during a rollout: replicas of any other version are canaries
        self.rollout: Rollout | None = None
        self.rollout_result: str | None = None
        self._new_version: str | None = None
        self.replicas: dict[str, _Replica] = {}
        self.desired = config.replicas
        self._serial = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._directory: Server | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self.events: list[dict[str, Any]] = []  # what happened, for status and tests (bounded)
        self.placements = 0

    # ------------------------------------------------------------------ helpers

    def _limits_of(self, tenant: str) -> TenantLimits:
        info = self.auth.registry.get(tenant)
        return info.limits if info is not None else TenantLimits()

    def _event(self, kind: str, **fields: Any) -> None:
        self.events.append({"t": time.time(), "event": kind, **fields})
        del self.events[:-500]
        log.info("fleet: %s %s", kind, fields)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @property
    def uri(self) -> str:
        assert self._directory is not None
        port = next(iter(self._directory.sockets)).getsockname()[1]
        return f"ws://{self.config.directory_host}:{port}"

    def _live(self) -> list[_Replica]:
        return [r for r in self.replicas.values() if not r.draining]

    # ------------------------------------------------------------------ life cycle

    async def start(self, wait_ready: bool = True) -> str:
        """Listen as the directory, start the replicas; return the directory's URI once the
        initial replicas are ready (``wait_ready``)."""
        self._directory = await serve(
            self._no_session, self.config.directory_host, self.config.directory_port,
            process_request=self._process_request, server_header=None,
        )
        starts = [self._start_replica(self.current_version) for _ in range(self.config.replicas)]
        if wait_ready:
            await asyncio.gather(*starts)
        else:
            for s in starts:
                self._spawn(s)
        self._loop_task = asyncio.get_running_loop().create_task(self._control_loop())
        self._event("up", uri=self.uri, replicas=len(self.replicas))
        return self.uri

    async def stop(self) -> None:
        """Stop the loop and the directory, drain and kill every replica, close the ledger."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if self._directory is not None:
            self._directory.close()
            await self._directory.wait_closed()
        await asyncio.gather(*(self._remove(name, drain=True) for name in list(self.replicas)), return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()
        if self.ledger is not None:
            with self._ledger_lock:
                self.ledger.close()
        self._tmp.cleanup()

    async def _start_replica(self, version: str) -> str | None:
        self._serial += 1
        name = f"r{self._serial}"
        handle = self.launcher.launch(name, version, self.versions[version], self.tenants_text, self.secret,
                                      self._ledger_write)
        rec = _Replica(handle, version, time.monotonic())
        self.replicas[name] = rec
        self._event("replica_starting", replica=name, version=version)
        try:
            info = await handle.start()
        except Exception as exc:
            self._event("replica_failed", replica=name, version=version, error=error_line(exc))
            self.replicas.pop(name, None)
            with contextlib.suppress(Exception):
                await handle.kill()
            if self.rollout is not None:
                self.rollout.replica_failed(name, time.monotonic())
            return None
        rec.uri = info["uri"]
        rec.ready = True
        rec.last_ok = time.monotonic()
        self._event("replica_ready", replica=name, version=version, uri=rec.uri)
        if self.rollout is not None:
            self.rollout.replica_started(name, version, time.monotonic())
        await self._poll_one(name, rec)
        return name

    @staticmethod
    async def _kill_quietly(handle: ReplicaHandle) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(handle.kill(), 30.0)

    async def _remove(self, name: str, drain: bool) -> None:
        rec = self.replicas.get(name)
        if rec is None:
            return
        rec.draining = True
        self.placement.remove(name)
        if drain:
            self._event("replica_draining", replica=name)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(rec.handle.drain(self.config.drain_grace_s), self.config.drain_grace_s + 30.0)
        with contextlib.suppress(Exception):
            await rec.handle.kill()
        self.replicas.pop(name, None)
        self.quota.forget_replica(name)
        self._event("replica_removed", replica=name)
        if self.rollout is not None:
            self.rollout.replica_removed(name, time.monotonic())

    # ------------------------------------------------------------------ control loop

    async def _poll_one(self, name: str, rec: _Replica) -> None:
        try:
            stats = await asyncio.wait_for(rec.handle.state(), self.config.replica_timeout_s)
        except Exception as exc:
            # No new sessions there while it does not answer; it is back in on its next report.
            self.placement.remove(name)
            if time.monotonic() - rec.last_ok > self.config.replica_timeout_s and not rec.draining:
                self._event("replica_lost", replica=name, error=error_line(exc))
                self.placement.remove(name)
                self.quota.forget_replica(name)
                self.replicas.pop(name, None)
                if self.rollout is not None:
                    self.rollout.replica_failed(name, time.monotonic())
                self._spawn(self._kill_quietly(rec.handle))  # make sure it is gone; never block the tick on it
            return
        now = time.monotonic()
        rec.last_ok = now
        canary = self.rollout is not None and rec.version != self.stable_version
        state = replica_state_from_stats(stats, rec.last_stats, canary)
        if rec.draining:
            state = dataclasses.replace(state, draining=True)
        rec.last_stats = stats
        if not rec.draining:
            self.placement.update(state)
        self.quota.report(name, {k: int(v) for k, v in stats["sessions"].items()}, now,
                          confirmed=stats.get("placed_sessions", ()))

    async def _control_loop(self) -> None:
        while True:
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad tick must not stop the fleet's supervision
                log.exception("fleet control loop tick failed")
            await asyncio.sleep(self.config.poll_interval_s)

    async def _tick(self) -> None:
        ready = [(n, r) for n, r in self.replicas.items() if r.ready]
        await asyncio.gather(*(self._poll_one(n, r) for n, r in ready))
        now = time.monotonic()
        leases = self.quota.leases(now)
        for name, rec in list(self.replicas.items()):
            if rec.ready and not rec.draining:
                self._spawn(self._push_leases(rec, leases.get(name, {})))
        if self.rollout is not None:
            self._drive_rollout(now)
            return
        if self.autoscaler is not None:
            decision = self.autoscaler.observe(self._states(), now)
            if decision.desired != self.desired:
                self._event("scale", desired=decision.desired, reason=str(decision.reason.value))
                self.desired = decision.desired
            if decision.drain is not None and len(self._live()) > self.desired and decision.drain in self.replicas:
                self._spawn(self._remove(decision.drain, drain=True))
        missing = self.desired - len(self._live())
        for _ in range(max(0, missing)):
            self._spawn(self._start_replica(self.current_version))

    async def _push_leases(self, rec: _Replica, leases: dict[str, TenantLimits]) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(rec.handle.set_leases(leases), self.config.replica_timeout_s)

    def _states(self) -> list[ReplicaState]:
        """Every replica as the autoscaler sees it: reported state, or a warming placeholder."""
        out = []
        now = time.monotonic()
        for name, rec in self.replicas.items():
            state = self.placement.replicas.get(name)
            if state is None:
                state = ReplicaState(name=name, uri=rec.uri or "", fingerprint="", models=frozenset(), service_s={},
                                     ready=False, updated=now)
            out.append(dataclasses.replace(state, draining=rec.draining))
        return out

    # ------------------------------------------------------------------ rolling update

    async def start_rollout(self, server: dict[str, Any]) -> str:
        """Begin replacing the replicas with ones running ``server`` (a server config); returns the
        new version's label. Progress: :meth:`status` (``rollout``)."""
        if self.rollout is not None:
            raise RuntimeError("a rollout is already in progress")
        label = f"v{len(self.versions) + 1}"
        current = self.versions[self.current_version]
        server = dict(server)
        if "policies" in server:
            # A new ref for the same model: keep its batching settings and the name robots ask for.
            old = current["policies"]
            server["policies"] = [
                {**(old[i] if i < len(old) else {}), "name": (old[i].get("name") or old[i]["ref"]) if i < len(old) else None, **p}
                for i, p in enumerate(server["policies"])
            ]
        fields = {**current, **server}
        from chunkline.server.config import ServerConfig

        self.versions[label] = ServerConfig.model_validate(fields).model_dump(mode="json")
        self._new_version = label
        for rec in self.replicas.values():
            rec.baseline = dict(rec.last_stats["outcomes"]) if rec.last_stats else {}
        old = [n for n, r in self.replicas.items() if r.version == self.current_version and not r.draining]
        self.rollout = Rollout(self.current_version, label, old, self.config.rollout)
        self.rollout_result = None
        self._event("rollout_started", old=self.current_version, new=label)
        return label

    def _version_stats(self) -> dict[str, VersionStats]:
        acc: dict[str, list[int]] = {}
        for rec in self.replicas.values():
            if rec.last_stats is None:
                continue
            now_counts = rec.last_stats["outcomes"]
            delta = {k: now_counts.get(k, 0) - rec.baseline.get(k, 0) for k in now_counts}
            a = acc.setdefault(rec.version, [0, 0, 0])
            a[0] += sum(v for k, v in delta.items() if k not in _NOT_REQUESTS)
            a[1] += sum(delta.get(k, 0) for k in _ERRORS)
            a[2] += sum(delta.get(k, 0) for k in _MISSES)
        return {v: VersionStats(requests=a[0], errors=a[1], deadline_misses=a[2]) for v, a in acc.items()}

    def _drive_rollout(self, now: float) -> None:
        assert self.rollout is not None
        deadline_s = self._default_deadline_ms(self.config.server.policies[0].model_name) / 1000.0
        for name, state in self.placement.replicas.items():
            rec = self.replicas.get(name)
            if rec is not None and rec.version == self._new_version and capacity_rps(state, deadline_s) <= 0.0:
                # Placement would never route it a session, so traffic could never judge it.
                self.rollout.abort(f"the new version cannot meet a {deadline_s * 1e3:g} ms deadline "
                                   f"(measured service {min(state.service_s.values(), default=float('nan')) * 1e3:.1f} ms)")
        for action in self.rollout.next_actions(now, self._version_stats()):
            if isinstance(action, StartReplica):
                self._spawn(self._start_replica(action.fingerprint))
            elif isinstance(action, DrainReplica):
                self._spawn(self._remove(action.name, drain=True))
            elif isinstance(action, SetCanaryShare):
                self.placement.set_canary_share(action.share)
            elif isinstance(action, Promote):
                self.stable_version = action.fingerprint
            elif isinstance(action, Done):
                self._event("rollout_done", version=self.stable_version)
                self.current_version = self.stable_version
                self.rollout_result = "done"
            elif isinstance(action, RolledBack):
                self._event("rollout_rolled_back", version=self._new_version, reason=action.reason)
                self.rollout_result = f"rolled back: {action.reason}"
        if self.rollout_result is not None and not any(not r.ready for r in self.replicas.values()):
            # finished, and no start of the retired version is still on its way
            self.rollout = None
            self._new_version = None
            self.placement.set_canary_share(0.0)
            self.desired = len(self._live())

    # ------------------------------------------------------------------ directory

    @staticmethod
    async def _no_session(ws: ServerConnection) -> None:
        await ws.close(1011, "the directory only redirects")  # unreachable: every handshake is answered before

    def _process_request(self, connection: ServerConnection, request: Request) -> Response:
        split = urllib.parse.urlsplit(request.path)
        if split.path == "/healthz":
            return _response(200, "ok")
        if split.path == "/readyz":
            ok = any(r.ready and not r.draining for r in self.replicas.values())
            return _response(200 if ok else 503, "ready" if ok else "no replica ready")
        peer = str(connection.remote_address[0]) if connection.remote_address else "?"
        result = self.auth.authenticate_headers(request.headers.get_all("Authorization"), peer)
        if not result.ok:
            return _response(result.http_status, result.message, result.headers())
        assert result.tenant is not None
        if split.path == "/v1/fleet":
            return _response(200, self.public_status())
        if request.headers.get("Upgrade", "").lower() != "websocket":
            return _response(404, "not found")
        query = urllib.parse.parse_qs(split.query, max_num_fields=8)
        asked = query.get("model", [self.config.server.policies[0].model_name])[0]
        model = self._served_name(asked)
        if not (result.tenant.may_use(model, "policy") or result.tenant.may_use(asked, "policy")):
            return _response(403, f"forbidden: tenant may not use model {asked!r}")
        try:
            rate = float(query.get("rate_hz", [self.config.default_rate_hz])[0])
            deadline_ms = float(query.get("deadline_ms", [self._default_deadline_ms(model)])[0])
        except ValueError:
            return _response(400, "rate_hz and deadline_ms must be numbers")
        if not (0 < rate <= 10_000 and 0 < deadline_ms <= 600_000):
            return _response(400, "rate_hz or deadline_ms out of range")
        now = time.monotonic()
        cap = result.tenant.limits.max_sessions
        if cap is not None and self.quota.sessions(result.tenant.name, now) >= cap:
            return _response(429, f"quota_exceeded: tenant has {cap} sessions open fleet-wide, its limit",
                             [("Retry-After", "1")])
        decision = self.placement.place(SessionRequest(tenant=result.tenant.name, model=model, rate_hz=rate,
                                                       deadline_s=deadline_ms / 1000.0), now)
        if not isinstance(decision, PlacementDecision):
            retry = max(1, round((decision.retry_after_ms or 1000.0) / 1000.0))
            return _response(503, f"{decision.reason}: {decision.message}", [("Retry-After", str(retry))])
        token, claims = self.signer.issue(result.tenant.name, decision.replica, model, time.time())
        refusal = self.quota.try_open(result.tenant.name, decision.replica, claims.session, now)
        if refusal is not None:
            self.placement.cancel(decision)
            return _response(429, f"quota_exceeded: {refusal.message}", [("Retry-After", "1")])
        self.placements += 1
        location = f"{decision.uri}/?placement={urllib.parse.quote(token, safe='')}"
        return _response(307, "placed", [("Location", location), ("Cache-Control", "no-store")])

    def _served_name(self, model: str) -> str:
        """The name ``model`` is served under: itself, or, for a policy's own name that a replica
        reports as an alias, the served name it stands for."""
        for state in self.placement.replicas.values():
            if model not in state.models and model in state.aliases:
                return state.aliases[model]
        return model

    def _default_deadline_ms(self, model: str) -> float:
        for pc in self.config.server.policies:
            if pc.model_name == model and pc.default_deadline_ms is not None:
                return pc.default_deadline_ms
        return 100.0

    # ------------------------------------------------------------------ ledger

    def write_ledger(self, source: str, offset: int, rows: list[LedgerRow]) -> int:
        """A replica's ledger batch (see :meth:`FleetLedgerStore.write_from`); thread-safe."""
        if self.ledger is None:
            return 0
        with self._ledger_lock:
            return self.ledger.write_from(source, offset, rows)

    # ------------------------------------------------------------------ status

    def public_status(self) -> dict[str, Any]:
        """Replicas, versions and load (no tenant names: any authenticated tenant may read it)."""
        reps = []
        for name, rec in sorted(self.replicas.items()):
            st = self.placement.replicas.get(name)
            reps.append({"name": name, "version": rec.version, "uri": rec.uri, "ready": rec.ready, "draining": rec.draining,
                         "sessions": st.sessions if st else 0, "load_rps": round(st.load_rps, 2) if st else 0.0,
                         "fingerprint": st.fingerprint if st else None})
        return {"replicas": reps, "desired": self.desired, "version": self.current_version,
                "rollout": None if self.rollout is None else {"new": self._new_version, "phase": self.rollout.phase.value},
                "rollout_result": self.rollout_result, "placements": self.placements}

    def status(self) -> dict[str, Any]:
        """Operator view: :meth:`public_status` plus recent events."""
        return {**self.public_status(), "uri": self.uri, "events": self.events[-50:]}
