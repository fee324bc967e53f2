"""The robot request class: observations in, timestamped action chunks out.

One :class:`ModelRunner` per served policy (admission, batcher, lanes) on the shared
:class:`~chunkline.server.core.serving.ServingCore`. This module loads and times the policies,
resolves which model a request is for and its deadline, validates and admits observations through
the core's gate, and counts every outcome with the core's accounting. It is all the sessions see
of the class (a runner is an opaque handle to them); it never imports them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from chunkline.client.timing import ms
from chunkline.client.wire.errors import ErrorCode
from chunkline.client.wire.protocol import Infer
from chunkline.policies.base import ObservationError, Policy, flatten_observation, validate_observation
from chunkline.policies.prefix import ActionPrefix, PrefixError
from chunkline.policies.registry import load_policy
from chunkline.server.core.admission import ServiceTimeModel, resolve_deadline
from chunkline.server.core.serving import ServingCore
from chunkline.server.core.tenants import TenantInfo, TenantRegistry
from chunkline.server.errors import Refusal
from chunkline.server.robot.config import PolicyConfig
from chunkline.server.robot.cpu_threads import ThreadChoice, policy_threads, set_torch_threads, torch_thread_count, torch_thread_setter
from chunkline.server.robot.field_decode import DecodeLimits, FieldDecoder, encoded_fields
from chunkline.server.robot.fleet import FleetSelector, FleetStrategy, RobotPolicies, Urgency, WeightError
from chunkline.server.robot.peek import Skipped, peek_map
from chunkline.server.robot.runner import InferenceResult, ModelRunner, WorkItem
from chunkline.server.robot.sizing import BatchSizing
from chunkline.server.robot.timing import TimingOutcome, measure_service_guarded

__all__ = ["RobotActions", "own_name_aliases", "StartAborted", "ChunkFields", "ModelRunner", "WorkItem", "InferenceResult", "result_timing",
           "observation_map", "encoded_fields", "peek_map", "Skipped"]

log = logging.getLogger("chunkline.server")

#: The request class's name, as tenants' ``classes`` and the ledger's ``cls`` column spell it.
CLASS_NAME = "policy"


class StartAborted(Exception):
    """The server began draining while the policies were loading: start-up stops at the next step."""


def _log_size(name: str, outcome: TimingOutcome) -> None:
    memory = "" if outcome.memory is None else f" (peak {outcome.memory.peak / 2**20:.0f} MiB)"
    log.info("%s: batch %d takes %.2f ms%s", name, outcome.size, outcome.seconds * 1000, memory)


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkFields:
    """What every chunk of one served model says of it (constant while it is served)."""

    name: str
    dt: float
    action_offset: float
    validity: float
    fingerprint: str


@dataclasses.dataclass(slots=True)
class _Loaded:
    """A policy loaded, warmed and timed at start-up, and its timings by batch size."""

    policy: Policy
    timed: list[TimingOutcome]


def observation_map(raw_obs: Any) -> dict[str, Any]:
    """A decoded observation as the flat map policy specs name (nested maps' keys joined with
    ``/``). Raises Refusal: it is not a map."""
    if not isinstance(raw_obs, dict):
        raise Refusal(ErrorCode.INVALID_OBSERVATION, "the observation must be a map")
    return flatten_observation(raw_obs)


def _prefix_of(request: Infer, policy: Policy) -> ActionPrefix | None:
    """The request's prefix, checked against the policy, for a policy that uses one (others
    never see it, so a prefix they could not use is not a reason to refuse). Raises Refusal."""
    if request.prefix is None or not policy.accepts_prefix:
        return None
    spec = policy.spec
    try:
        return ActionPrefix.from_wire(request.prefix, t0=request.obs_time, dt=spec.dt, action_dim=spec.action_dim,
                                      horizon=spec.horizon, delay_steps=request.prefix_delay)
    except PrefixError as exc:
        raise Refusal(ErrorCode.INVALID_MESSAGE, str(exc)) from None


def result_timing(result: InferenceResult, decode_s: float, image_decode_s: float | None = None) -> dict[str, float]:
    """The stage times (ms) a chunk reply carries and the ledger records; ``decode_ms`` includes
    ``image_decode_ms``, the compressed fields' share (present only when some arrived compressed)."""
    timing = {
        "decode_ms": ms(decode_s),
        "queue_ms": ms(result.queue_s),
        "batch_wait_ms": ms(result.batch_wait_s),
        "infer_ms": ms(result.infer_s),
        "batch_size": float(result.batch_size),
        "backlog": float(result.backlog),
    }
    if image_decode_s is not None:
        timing["image_decode_ms"] = ms(image_decode_s)
    return timing


def own_name_aliases(own_names: Mapping[str, str]) -> dict[str, str]:
    """Each served policy's own name (``Policy.name``) -> the name it is served under, where the two
    differ: the served name is known before loading (tenants' lists and the cluster's directory
    need it), the policy's own name only after. An own name that is another policy's served name,
    or that two policies share, stays unserved: a name never means two policies."""
    owners: dict[str, list[str]] = {}
    for served, own in own_names.items():
        owners.setdefault(own, []).append(served)
    return {own: served[0] for own, served in owners.items() if len(served) == 1 and own not in own_names}


def _replace(runner: ModelRunner, old: WorkItem, item: WorkItem) -> WorkItem:
    """``item`` in queued ``old``'s place (same id), ``old`` answered ``superseded``; raises
    ``replace_missed`` (``old`` started or ended: its answer stands) or a quota's refusal."""
    pool = runner.pool
    now = item.enqueued_at
    pool.expire(now)  # overdue work answered first: an expired ``old`` is missed, not replaced
    if old.started is not None or old.future.done():
        raise Refusal(ErrorCode.REPLACE_MISSED, "the request it replaces is no longer queued")
    decision = pool.admission.replace(old.id, old.session, item.deadline, item, now)
    if isinstance(decision, Refusal):
        raise Refusal(decision.code, decision.message, decision.retry_after_ms)
    item.deadline = decision.request.deadline
    pool.jobs[old.id] = item
    old.future.set_exception(Refusal(ErrorCode.SUPERSEDED, "replaced by a newer request of this session"))
    listener, old.on_answered = old.on_answered, None
    if listener is not None:
        listener()
    pool.kick()
    return item


class RobotActions:
    """The robot request class (``policy`` in tenants' ``classes`` and the ledger).

    Args:
        core: the shared serving core.
        policies: the policies to serve; the first is the default model.
        load: ``load(config) -> Policy``; :func:`~chunkline.policies.registry.load_policy` by default.
        decode_limits: what compressed fields may decode into (per request, per tenant).
    """

    name = CLASS_NAME

    def __init__(self, core: ServingCore, policies: list[PolicyConfig],
                 load: Callable[[PolicyConfig], Policy] | None = None, decode_limits: DecodeLimits | None = None) -> None:
        if not policies:
            raise ValueError("the robot class needs at least one policy")
        self.core = core
        self.configs = {pc.model_name: pc for pc in policies}
        self.default_name = policies[0].model_name
        #: a policy's own name -> the name it is served under, once loaded (see :func:`own_name_aliases`)
        self.aliases: dict[str, str] = {}
        self.runners: dict[str, ModelRunner] = {}
        #: compressed observation fields: the checks and the decode pool (off the event loop)
        self.fields = FieldDecoder(core.cpu_pool, decode_limits)
        #: what each runner's chunks say of its model (one entry per runner, from its start)
        self.chunk_fields: dict[ModelRunner, ChunkFields] = {}
        self._load_one = load or (lambda pc: load_policy(pc.ref, device=pc.device, backend=pc.backend, args=pc.args, spec=pc.spec))
        self._robot_policies: tuple[TenantRegistry | None, RobotPolicies] = (None, RobotPolicies({}, {}))
        #: CPU policies' torch intra-op threads per lane (policies on other devices: absent)
        self.torch_threads: dict[str, ThreadChoice] = policy_threads(policies)
        #: torch's own count, read before a CPU policy's was set (``None``: nothing was set)
        self._torch_default: int | None = None

    # ------------------------------------------------------------------ life cycle

    def _load(self) -> dict[str, _Loaded]:
        """Worker thread: load, warm and time every policy (nothing here may touch the loop).

        Batch 1 is warmed and timed first, then any other ``warm_batch_sizes``; a size that runs
        out of device memory stops them and caps the policy's batch size below it. The sizes not
        timed here are timed once serving, in quiet spells (``background_timing``), or learnt
        from the first batches of that size (see :mod:`.sizing`)."""
        loaded: dict[str, _Loaded] = {}
        try:
            for name, pc in self.configs.items():
                self._abort_if_draining()
                loaded[name] = self._load_and_time(name, pc)
            self._abort_if_draining()
        except BaseException:
            for one in loaded.values():
                one.policy.close()
            raise
        return loaded

    def _abort_if_draining(self) -> None:
        # Read from the loading thread: a drain that began meanwhile stops start-up between steps.
        if self.core.draining:
            raise StartAborted("draining: start-up stopped")

    def _timed(self, name: str, outcome: TimingOutcome) -> None:
        _log_size(name, outcome)
        self._abort_if_draining()

    def _load_and_time(self, name: str, pc: PolicyConfig) -> _Loaded:
        t = time.perf_counter()
        log.info("loading %s (%s) on %s ...", name, pc.ref, pc.device)
        policy = self._load_one(pc)
        try:
            self._abort_if_draining()
            log.info("loaded %s in %.2f s; warming up at batch 1 ...", name, time.perf_counter() - t)
            self._set_loader_threads(name)
            policy.warmup()
            self._abort_if_draining()
            gc.collect()  # not during the timing below: a collection pause would seed admission badly
            sizes = tuple(s for s in pc.warm_batch_sizes if s <= pc.max_batch_size)
            timed, fits = measure_service_guarded(policy, sizes, on_size=functools.partial(self._timed, name))
            self._abort_if_draining()
        except BaseException:
            policy.close()
            raise
        if fits < pc.max_batch_size:
            log.warning("%s: batch %d does not fit in device memory; serving at most %d robots per batch", name, fits + 1, fits)
            self.configs[name] = pc = pc.model_copy(update={"max_batch_size": fits})
        left = "" if not pc.background_timing or timed[-1].size >= pc.max_batch_size else \
            f"; batches up to {pc.max_batch_size} timed in quiet spells"
        with self.core.drain_lock:
            if self.core.draining:
                policy.close()
                raise StartAborted("draining: start-up stopped")
            log.info("ready: %s (%s) in %.2f s, fingerprint %s, service time %s%s", name, pc.ref, time.perf_counter() - t,
                     policy.fingerprint, {o.size: f"{o.seconds * 1000:.2f} ms" for o in timed}, left)
        return _Loaded(policy, timed)

    def _thread_count(self, name: str) -> int | None:
        """torch's threads on a policy's lanes: a CPU policy's own; others torch's own count once a
        CPU policy's was set (threads started later would take it); ``None``: leave them be."""
        threads = self.torch_threads.get(name)
        return self._torch_default if threads is None else threads.count

    def _set_loader_threads(self, name: str) -> None:
        """Loading thread, before warm-up: as many torch threads as the policy's lanes will run."""
        threads = self.torch_threads.get(name)
        if threads is not None and self._torch_default is None:
            self._torch_default = torch_thread_count()
        count = self._thread_count(name)
        if count is not None and set_torch_threads(count) and threads is not None:
            log.info("%s: %s", name, threads.describe())

    async def start(self) -> None:
        loaded = await asyncio.get_running_loop().run_in_executor(None, self._load)
        for name, one in loaded.items():
            policy, timed = one.policy, one.timed
            pc = self.configs[name]
            sizing = BatchSizing(pc.max_batch_size, (o.size for o in timed), background=pc.background_timing)
            for o in timed:
                if o.memory is not None:
                    sizing.record_timing(o.size, o.memory)  # the memory guard, before any larger batch
            self.runners[name] = runner = ModelRunner(
                name, policy, quotas=self.core.quotas, admission=pc.admission_config(), batching=pc.batch_policy(),
                service=ServiceTimeModel(initial={o.size: o.seconds for o in timed}),
                on_batch=functools.partial(self._on_batch, name),
                hang_timeout=pc.hang_timeout_s, sizing=sizing,
                selector=FleetSelector(FleetStrategy(pc.fleet_config()), self._tenant_weight) if pc.batch_strategy == "fleet" else None,
                lane_init=None if (count := self._thread_count(name)) is None else torch_thread_setter(count),
            )
            spec = policy.spec
            self.chunk_fields[runner] = ChunkFields(name, spec.dt, spec.action_offset, spec.validity, policy.fingerprint)
            runner.start_background_timing()
            self.core.metrics.set_service_times(name, runner.core.service.snapshot())
        self.aliases = own_name_aliases({name: r.policy.name for name, r in self.runners.items()})
        for alias, name in self.aliases.items():
            log.info("%s is served as %r too (the policy's own name)", name, alias)

    def _tenant_weight(self, name: str) -> float:
        tenant = self.core.quotas.registry.get(name)  # the registry in force (a reload swaps it)
        return tenant.weight if tenant is not None else 1.0

    def _on_batch(self, model: str, size: int, seconds: float) -> None:
        self.core.metrics.observe_batch(model, size)

    async def stop(self) -> None:
        for runner in self.runners.values():
            await runner.stop()
            runner.policy.close()

    @property
    def in_flight(self) -> int:
        return sum(r.queued + r.running for r in self.runners.values())

    @property
    def healthy(self) -> bool:
        return all(r.healthy for r in self.runners.values())

    def release_session(self, session: str) -> None:
        for runner in self.runners.values():
            runner.release_session(session)

    def stats(self) -> dict[str, Any]:
        return {
            name: {"service_s": r.core.service.snapshot(), "max_batch_size": r.max_batch_size,
                   "batch_sizes_timed": sorted(r.sizing.timed) if r.sizing is not None else None,
                   "lanes": self.configs[name].lanes, "fingerprint": r.policy.fingerprint,
                   "torch_threads": None if (t := self.torch_threads.get(name)) is None else t.count,
                   "queued": r.queued, "running": r.running, "healthy": r.healthy,
                   "aliases": sorted(a for a, n in self.aliases.items() if n == name)}
            for name, r in self.runners.items()
        }

    def refresh_gauges(self) -> None:
        """Gauges of state, refreshed when the metrics are scraped."""
        for name, runner in self.runners.items():
            self.core.metrics.set_queue(name, runner.queued, runner.running)
            self.core.metrics.set_service_times(name, runner.core.service.snapshot())

    # ------------------------------------------------------------------ requests

    @property
    def default(self) -> ModelRunner:
        return self.runners[self.default_name]

    def models_for(self, tenant: TenantInfo) -> Mapping[str, dict[str, Any]]:
        """The models a tenant may use and their metadata (tenants never see each other's models)."""
        models = {name: r.policy.metadata() for name, r in self.runners.items() if self._may_use(tenant, name)}
        models.update({alias: models[name] for alias, name in self.aliases.items() if name in models})
        return models

    def _may_use(self, tenant: TenantInfo, name: str) -> bool:
        """Whether the tenant's model list names the policy served as ``name``, by either name."""
        return tenant.may_use(name, CLASS_NAME) or any(tenant.may_use(a, CLASS_NAME) for a, n in self.aliases.items() if n == name)

    def runner_for(self, tenant: TenantInfo, model: str | None) -> ModelRunner | None:
        """The runner of ``model`` (the default one for ``None``), or ``None`` when it does not
        exist or the tenant may not use it: both are answered ``unknown_model``."""
        name = model or self.default_name
        runner = self.runners.get(self.aliases.get(name, name))
        if runner is None or not self._may_use(tenant, runner.name):
            return None
        return runner

    def deadline_for(self, runner: ModelRunner, tenant: TenantInfo, deadline_ms: float | None, received: float) -> float:
        """The absolute deadline: the request's budget, else the tenant's, the config's, the policy's."""
        configured = self.configs[runner.name].default_deadline_ms
        return resolve_deadline(received, deadline_ms, tenant=tenant,
                                policy_default_ms=configured if configured is not None else runner.policy.spec.default_deadline_ms)

    @property
    def refusing(self) -> bool:
        """Whether a model's latest admission decision was a refusal (peeking may pay)."""
        for runner in self.runners.values():
            if runner.refusing:
                return True
        return False

    def metadata(self, runner: ModelRunner) -> dict[str, Any]:
        """The model's metadata (what an openpi client is sent first)."""
        return runner.policy.metadata()

    def agree_encodings(self, offered: str | None) -> list[str]:
        """The array encodings a session uses: raw, and the compressed ones both ends speak."""
        return self.fields.agree(offered)

    def decode_fields(self, runner: ModelRunner, agreed: frozenset[str], obs: dict[str, Any],
                      compressed: Mapping[str, Any], tenant: TenantInfo) -> Awaitable[float]:
        """Check an observation's compressed fields against the model's spec and the session's
        encodings, then decode them on the pool in the tenant's turn; resolves to the decode time
        (s). Raises Refusal."""
        return self.fields.decode(obs, self.fields.check(runner.policy.spec, agreed, compressed), tenant.name)

    def sent_early(self, runner: ModelRunner, session: str) -> None:
        """``session`` sent a request inside its retry window: it loses its place in the retry line."""
        runner.sent_early(session)

    def cancel(self, runner: ModelRunner, item: WorkItem) -> None:
        """Withdraw an admitted request (client cancel or disconnect); it is answered ``cancelled``."""
        runner.cancel(item)

    def admit(self, runner: ModelRunner, flat_obs: dict[str, Any], tenant: TenantInfo, session: str, received: float,
              request: Infer | None = None, robot_weight: float | Refusal = 1.0, replaces: WorkItem | None = None) -> WorkItem:
        """Admission for one observation (an :func:`observation_map`), validated against the
        policy's spec, with a native request's prefix, deadline and urgency (clamped to its
        tenant's bounds) and the session's robot weight (:meth:`session_weight`) for the fleet
        strategy (:mod:`chunkline.server.robot.fleet`). With ``replaces`` (a queued request of
        the same session, ``Infer.replaces``) it takes that one's place, and that one is answered
        ``superseded``; if that one is no longer queued this one is refused ``replace_missed``.

        Raises:
            Refusal: the observation or the prefix is invalid, the session's weight was refused or
                the urgency is out of bounds (``invalid_message``); or from the core's gate
                (draining, forbidden, ledger) or from admission.
        """
        policy = runner.policy
        try:
            obs = validate_observation(policy.spec, flat_obs)
        except ObservationError as exc:
            raise Refusal(ErrorCode.INVALID_OBSERVATION, str(exc)) from None
        prefix: ActionPrefix | None = None
        urgency: Urgency | None = None
        if request is None:
            deadline = self.deadline_for(runner, tenant, None, received)
        else:
            deadline = self.deadline_for(runner, tenant, request.deadline_ms, received)
            prefix = _prefix_of(request, policy)
        if isinstance(robot_weight, Refusal):
            raise Refusal(robot_weight.code, robot_weight.message)
        if request is not None and request.urgency is not None:
            urgency = self.robot_policies.urgency_for(tenant.name, request.urgency.wire())
        self.core.gate(tenant, CLASS_NAME, runner.name)
        if replaces is not None:
            return _replace(runner, replaces, WorkItem(
                obs=obs, tenant=tenant.name, session=session, deadline=deadline, enqueued_at=runner.pool.clock(),
                future=asyncio.get_running_loop().create_future(), id=replaces.id, prefix=prefix, urgency=urgency,
                robot_weight=robot_weight, queued_since=replaces.enqueued_at if replaces.queued_since is None else replaces.queued_since))
        return runner.submit(obs, tenant=tenant, session=session, deadline=deadline, prefix=prefix, urgency=urgency,
                             robot_weight=robot_weight)

    def precheck(self, runner: ModelRunner, tenant: TenantInfo, session: str, deadline: float) -> Refusal | None:
        """The refusal :meth:`submit` would give now whatever the observation holds, else ``None``."""
        return runner.precheck(tenant=tenant, session=session, deadline=deadline)

    @property
    def robot_policies(self) -> RobotPolicies:
        """The robots' weights and urgency bounds of the tenants file in force (rebuilt when a
        reload swaps the registry; the defaults when it was not read from a file)."""
        registry = self.core.quotas.registry
        built_from, policies = self._robot_policies
        if registry is not built_from:
            policies = RobotPolicies({}, {}) if registry.file is None else RobotPolicies.from_file(registry.file)
            self._robot_policies = (registry, policies)
        return policies

    def session_weight(self, tenant: TenantInfo, key_id: str | None, requested: str | None) -> float | Refusal:
        """The service weight of a session's robot: ``requested`` (the handshake's
        :data:`~chunkline.client.wire.protocol.ROBOT_WEIGHT_HEADER`, if sent), else its key's, bounded
        by its tenant's ``robots`` policy; a request that is not a weight gives the
        :class:`~chunkline.server.robot.fleet.WeightError` each of its ``infer`` is answered with."""
        try:
            wish: object = None
            if requested is not None:
                try:
                    wish = float(requested)
                except ValueError:
                    raise WeightError(f"{requested[:40]!r} is not a number") from None
            return self.robot_policies.weight_for(tenant.name, key_id, wish)
        except WeightError as exc:
            return exc

    def record(self, runner: ModelRunner, tenant: TenantInfo, session: str, outcome: str,
               timing_ms: dict[str, float], item: WorkItem | None) -> None:
        """Count one request's outcome and, if it was admitted, write its one ledger row."""
        if item is None or outcome == ErrorCode.SUPERSEDED.value:  # a superseded request is not billed: its place's answer is
            self.core.accounting.refused(CLASS_NAME, runner.name, tenant.name, outcome, timing_ms=timing_ms)
            return
        self.core.accounting.finished(
            CLASS_NAME, runner.name, tenant.name, outcome, timing_ms, session=session,
            request_id=self.core.request_id(session), fingerprint=runner.policy.fingerprint,
            chunks=1 if outcome in ("ok", "late") else 0,
        )
