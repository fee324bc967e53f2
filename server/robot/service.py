"""The robot request class: observations in, timestamped action chunks out.

One :class:`ModelRunner` per served policy (admission, batcher, lanes) on the shared
:class:`~chunkline.server.core.serving.ServingCore`. This module loads and times the policies,
resolves which model a request is for and its deadline, admits validated observations through the
core's gate, and counts every outcome with the core's accounting. The WebSocket sessions call it;
it never imports them.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from chunkline.policies.base import Policy, example_observation, stack_observations
from chunkline.policies.prefix import ActionPrefix
from chunkline.policies.registry import load_policy
from chunkline.server.core.admission import ServiceTimeModel, resolve_deadline
from chunkline.server.core.serving import ServingCore
from chunkline.server.core.tenants import TenantInfo
from chunkline.server.errors import Refusal
from chunkline.server.robot.config import PolicyConfig
from chunkline.server.robot.field_decode import FieldDecoder
from chunkline.server.robot.runner import InferenceResult, ModelRunner, WorkItem

__all__ = ["RobotActions", "result_timing", "measure_service"]

log = logging.getLogger("chunkline.server")

#: The request class's name, as tenants' ``classes`` and the ledger's ``cls`` column spell it.
CLASS_NAME = "policy"


def measure_service(policy: Policy, sizes: tuple[int, ...], budget_s: float = 1.0) -> dict[int, float]:
    """Median time of a forward pass per batch size, to seed admission before real traffic.

    Up to three passes per size within ``budget_s``; a slow policy gets a single pass at batch 1
    (admission then extrapolates proportionally, the cautious direction)."""
    rng = np.random.default_rng(0)
    out: dict[int, float] = {}
    spent = 0.0
    for size in sizes:
        batch = stack_observations(policy.spec, [example_observation(policy.spec, rng) for _ in range(size)])
        times: list[float] = []
        while len(times) < 3 and (not times or spent < budget_s):
            t = time.perf_counter()
            policy.infer_batch(batch)
            times.append(time.perf_counter() - t)
            spent += times[-1]
        out[size] = float(np.median(times))
        if spent >= budget_s:
            break
    return out


def _out_of_memory(exc: BaseException) -> bool:
    # torch.cuda.OutOfMemoryError, jax's RESOURCE_EXHAUSTED and plain MemoryError, without importing either framework
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower() \
        or "RESOURCE_EXHAUSTED" in str(exc)


def measure_service_guarded(policy: Policy, sizes: tuple[int, ...], on_size: Callable[[int, float], None] | None = None,
                            budget_s: float = 1.0) -> tuple[dict[int, float], int]:
    """:func:`measure_service` one size at a time, smallest first, stopping at the first size that
    runs out of memory.

    Returns:
        the times per size measured, and the largest size known to fit (the size before the one
        that ran out; ``sys.maxsize`` when none did).
    """
    out: dict[int, float] = {}
    for size in sizes:
        try:
            out.update(measure_service(policy, (size,), budget_s))
        except Exception as exc:
            if not out or not _out_of_memory(exc):
                raise  # batch 1 must run, and any other failure is a broken policy
            _release_device_memory()
            return out, max(out)
        if on_size is not None:
            on_size(size, out[size])
    return out, sys.maxsize


def _log_size(name: str, size: int, seconds: float) -> None:
    log.info("%s: batch %d takes %.2f ms", name, size, seconds * 1000)


def _release_device_memory() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def result_timing(result: InferenceResult, decode_s: float, image_decode_s: float | None = None) -> dict[str, float]:
    """The stage times (ms) a chunk reply carries and the ledger records; ``decode_ms`` includes
    ``image_decode_ms``, the compressed fields' share (present only when some arrived compressed)."""
    timing = {
        "decode_ms": round(decode_s * 1000.0, 4),
        "queue_ms": round(result.queue_s * 1000.0, 4),
        "batch_wait_ms": round(result.batch_wait_s * 1000.0, 4),
        "infer_ms": round(result.infer_s * 1000.0, 4),
        "batch_size": float(result.batch_size),
    }
    if image_decode_s is not None:
        timing["image_decode_ms"] = round(image_decode_s * 1000.0, 4)
    return timing


class RobotActions:
    """The robot request class (``policy`` in tenants' ``classes`` and the ledger).

    Args:
        core: the shared serving core.
        policies: the policies to serve; the first is the default model.
        load: ``load(config) -> Policy``; :func:`~chunkline.policies.registry.load_policy` by default.
    """

    name = CLASS_NAME

    def __init__(self, core: ServingCore, policies: list[PolicyConfig],
                 load: Callable[[PolicyConfig], Policy] | None = None) -> None:
        if not policies:
            raise ValueError("the robot class needs at least one policy")
        self.core = core
        self.configs = {pc.model_name: pc for pc in policies}
        self.default_name = policies[0].model_name
        self.runners: dict[str, ModelRunner] = {}
        #: compressed observation fields: the checks and the decode pool (off the event loop)
        self.fields = FieldDecoder()
        self._load_one = load or (lambda pc: load_policy(pc.ref, device=pc.device, backend=pc.backend, args=pc.args, spec=pc.spec))

    # ------------------------------------------------------------------ life cycle

    def _load(self) -> dict[str, tuple[Policy, dict[int, float]]]:
        """Worker thread: load, warm and time every policy (nothing here may touch the loop).

        Batch 1 is warmed and timed first; the other ``warm_batch_sizes`` follow, and a size
        that runs out of device memory stops them and caps the policy's batch size below it.
        Sizes not timed here are learnt from the first batches of that size (admission
        extrapolates proportionally from batch 1 until then: the cautious direction)."""
        loaded = {}
        for name, pc in self.configs.items():
            t = time.perf_counter()
            log.info("loading %s (%s) on %s ...", name, pc.ref, pc.device)
            policy = self._load_one(pc)
            log.info("loaded %s in %.2f s; warming up at batch 1 ...", name, time.perf_counter() - t)
            policy.warmup()
            gc.collect()  # not during the timing below: a collection pause would seed admission badly
            sizes = tuple(s for s in pc.warm_batch_sizes if s <= pc.max_batch_size)
            service, fits = measure_service_guarded(policy, sizes, on_size=functools.partial(_log_size, name))
            if fits < pc.max_batch_size:
                log.warning("%s: batch %d does not fit in device memory; serving at most %d robots per batch", name, fits + 1, fits)
                self.configs[name] = pc = pc.model_copy(update={"max_batch_size": fits})
            log.info("ready: %s (%s) in %.2f s, fingerprint %s, service time %s", name, pc.ref, time.perf_counter() - t,
                     policy.fingerprint, {k: f"{v * 1000:.2f} ms" for k, v in service.items()})
            loaded[name] = (policy, service)
        return loaded

    async def start(self) -> None:
        loaded = await asyncio.get_running_loop().run_in_executor(None, self._load)
        for name, (policy, service) in loaded.items():
            pc = self.configs[name]
            self.runners[name] = ModelRunner(
                name, policy, quotas=self.core.quotas, admission=pc.admission_config(), batching=pc.batch_policy(),
                service=ServiceTimeModel(initial=service),
                on_batch=functools.partial(self._on_batch, name),
                hang_timeout=pc.hang_timeout_s,
            )
            self.core.metrics.set_service_times(name, self.runners[name].core.service.snapshot())

    def _on_batch(self, model: str, size: int, seconds: float) -> None:
        self.core.metrics.observe_batch(model, size)

    async def stop(self) -> None:
        for runner in self.runners.values():
            await runner.stop()
            runner.policy.close()
        self.fields.close()

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
            name: {"service_s": r.core.service.snapshot(), "max_batch_size": self.configs[name].max_batch_size,
                   "lanes": self.configs[name].lanes, "fingerprint": r.policy.fingerprint,
                   "queued": r.queued, "running": r.running, "healthy": r.healthy}
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
        return {name: r.policy.metadata() for name, r in self.runners.items() if tenant.may_use(name, CLASS_NAME)}

    def runner_for(self, tenant: TenantInfo, model: str | None) -> ModelRunner | None:
        """The runner of ``model`` (the default one for ``None``), or ``None`` when it does not
        exist or the tenant may not use it: both are answered ``unknown_model``."""
        runner = self.runners.get(model or self.default_name)
        if runner is None or not tenant.may_use(runner.name, CLASS_NAME):
            return None
        return runner

    def deadline_for(self, runner: ModelRunner, tenant: TenantInfo, deadline_ms: float | None, received: float) -> float:
        """The absolute deadline: the request's budget, else the tenant's, the config's, the policy's."""
        configured = self.configs[runner.name].default_deadline_ms
        return resolve_deadline(received, deadline_ms, tenant=tenant,
                                policy_default_ms=configured if configured is not None else runner.policy.spec.default_deadline_ms)

    def precheck(self, runner: ModelRunner, tenant: TenantInfo, session: str, deadline: float) -> Refusal | None:
        """The refusal :meth:`submit` would give now whatever the observation holds, else ``None``."""
        return runner.precheck(tenant=tenant, session=session, deadline=deadline)

    def submit(self, runner: ModelRunner, obs: dict[str, Any], tenant: TenantInfo, session: str, deadline: float,
               prefix: ActionPrefix | None = None) -> WorkItem:
        """Admission for one validated observation (and the robot's prefix, if it sent one).

        Raises:
            Refusal: from the core's gate (draining, forbidden, ledger) or from admission.
        """
        self.core.gate(tenant, CLASS_NAME, runner.name)
        return runner.submit(obs, tenant=tenant, session=session, deadline=deadline, prefix=prefix)

    def record(self, runner: ModelRunner, tenant: TenantInfo, session: str, outcome: str,
               timing_ms: dict[str, float], item: WorkItem | None) -> None:
        """Count one request's outcome and, if it was admitted, write its one ledger row."""
        if item is None:
            self.core.accounting.refused(CLASS_NAME, runner.name, tenant.name, outcome, timing_ms=timing_ms)
            return
        self.core.accounting.finished(
            CLASS_NAME, runner.name, tenant.name, outcome, timing_ms, session=session,
            request_id=self.core.request_id(session), fingerprint=runner.policy.fingerprint,
            chunks=1 if outcome in ("ok", "late") else 0,
        )
