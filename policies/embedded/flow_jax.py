"""``reach-flow`` on JAX: the sampler of :mod:`.flow` (one definition for both backends) under
``jax.jit``, batched with prefixes (importing this module imports jax).

The whole draw (every Euler step, the inpainting and the vector-Jacobian guidance by
``jax.vjp``) is one compiled function per batch size. It always runs the steering: rows without
a prefix carry weight 0, for which the steering is exactly zero, so one compiled function serves
batches with, without and with mixed prefixes, and a row's answer is the one torch gives
(``tests/policies/test_rtc_flow.py`` holds them within 1e-4).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..jax_backend import JaxPolicy
from ..numpy_backend import batch_size_of
from ..prefix import PrefixBatch
from .flow import FlowOps, FlowSettings, FlowWeights, flow_fingerprint_settings, flow_inputs, flow_sample
from .tasks import REACH_ACCEL_FIELD, reach_spec

__all__ = ["FlowJaxPolicy", "JAX_FLOW_OPS"]


def _vjp(f: Callable[[Any], Any], x: Any) -> tuple[Any, Callable[[Any], Any]]:
    out, pullback = jax.vjp(f, x)
    return out, lambda cotangent: pullback(cotangent)[0]


JAX_FLOW_OPS = FlowOps(asarray=jnp.asarray, silu=jax.nn.silu, broadcast_rows=lambda v, b: jnp.broadcast_to(v, (b, v.shape[0])),
                       vjp=_vjp)


class FlowJaxPolicy(JaxPolicy):
    """The flow-matching reach policy on JAX (CPU, GPU or TPU).

    Args:
        weights: the parameters (the file torch's :class:`~.flow.FlowPolicy` reads).
        device: ``None`` (jax's default), ``"cpu"``, ``"cuda:0"``...
        settings: guidance and noise (:class:`~.flow.FlowSettings`).
        name: the policy's name.
        batch_sizes: the compiled batch sizes.
    """

    accepts_prefix = True

    def __init__(self, weights: FlowWeights, *, device: str | None = "cpu", settings: FlowSettings | None = None,
                 name: str = "reach-flow-jax", batch_sizes: tuple[int, ...] = (1, 2, 4, 8)) -> None:
        self.weights = weights
        self.settings = settings or FlowSettings()
        steps, adim, scale, cap = weights.steps, weights.action_dim, weights.scale, self.settings.max_guidance

        def apply_fn(params: Mapping[str, Any], inputs: Mapping[str, Any]) -> Any:
            return flow_sample(JAX_FLOW_OPS, params["net"], inputs, params["noise"], steps=steps, action_dim=adim,
                               scale=scale, max_guidance=cap, guided=True)

        params = {"net": weights.params(), "noise": self.settings.noise(weights)}
        super().__init__(name, apply_fn, params, reach_spec(horizon=weights.horizon), batch_sizes=batch_sizes, device=device,
                         settings={"flow": flow_fingerprint_settings(weights, self.settings)}, preprocess=self._plain_inputs)

    def _plain_inputs(self, obs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        return flow_inputs(self.weights, np.asarray(obs["state"], dtype=np.float32), None, self.settings.decay_steps,
                           obs.get(REACH_ACCEL_FIELD))

    def infer_batch_with_prefix(self, obs: Mapping[str, Any], prefix: PrefixBatch,
                                states: Any) -> tuple[np.ndarray, Any]:
        arrays = flow_inputs(self.weights, np.asarray(obs["state"], dtype=np.float32), prefix, self.settings.decay_steps,
                             obs.get(REACH_ACCEL_FIELD))
        return self.infer_arrays(arrays, batch_size_of(obs)), states
