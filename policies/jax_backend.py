"""A policy backed by a JAX function, compiled once per batch-size bucket (importing this
module imports jax)."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from chunkline.client.wire.fingerprint import weights_digest

from .base import Policy, PolicySpec, example_observation, make_fingerprint, stack_observations
from .exceptions import PolicyLoadError, PolicyOutputError
from .numpy_backend import batch_size_of
from .outputs import check_actions

__all__ = ["JaxPolicy", "resolve_jax_device", "params_digest", "arrays_only"]

Preprocess = Callable[[Mapping[str, Any]], Mapping[str, np.ndarray]]


def resolve_jax_device(device: str | jax.Device | None) -> jax.Device:
    """Turn ``None`` (the default device), ``"cpu"``, ``"cuda:1"``, ``"gpu:0"``, ``"tpu"`` or a
    ``jax.Device`` into a device.

    Args:
        device: what the caller asked for.

    Raises:
        PolicyLoadError: no such platform or index.
    """
    if device is None:
        return jax.devices()[0]
    if isinstance(device, jax.Device):
        return device
    kind, _, index = str(device).partition(":")
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(kind.lower(), kind.lower())
    try:
        devices = jax.devices(platform)
        i = int(index or 0)
    except (RuntimeError, ValueError) as exc:
        raise PolicyLoadError(f"jax has no device {device!r}: {exc}") from exc
    if not 0 <= i < len(devices):
        raise PolicyLoadError(f"jax has {len(devices)} {platform} device(s), not index {i}")
    return devices[i]


def params_digest(params: Any) -> str:
    """:func:`~chunkline.client.wire.fingerprint.weights_digest` over a parameter pytree's leaves, named by
    their tree paths.

    Args:
        params: any pytree of arrays.
    """
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    return weights_digest({jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves})


def arrays_only(obs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The default host-side preprocess: keep array fields, drop text (strings cannot enter a
    jitted function; give :class:`JaxPolicy` a ``preprocess`` that encodes them instead).

    Args:
        obs: a stacked batch.
    """
    return {k: v for k, v in obs.items() if isinstance(v, np.ndarray)}


def _pad(arr: np.ndarray, size: int) -> np.ndarray:
    if len(arr) == size:
        return arr
    # Zero rows: every row of the embedded models is independent of the others, so padding
    # never changes a real row's result (a model that mixes rows must not be bucketed).
    out = np.zeros((size, *arr.shape[1:]), dtype=arr.dtype)
    out[: len(arr)] = arr
    return out


class JaxPolicy(Policy):
    """Serve ``apply_fn(params, inputs) -> [B, H, A]`` under ``jax.jit``, bucketed by batch size.

    JAX compiles once per input shape, so a batch is padded up to the smallest size in
    ``batch_sizes`` that holds it, and a batch above the largest size is split into pieces of
    at most that size (dispatched back to back, gathered at the end). :meth:`warmup` compiles
    and runs every size, so no request pays a compile.

    Args:
        name: the policy's name.
        apply_fn: a pure function of the parameters and a dict of ``[B, ...]`` arrays.
        params: a pytree of arrays, placed on ``device`` once.
        spec: what the policy accepts and returns.
        batch_sizes: the compiled batch sizes.
        device: ``None`` (jax's default), a string such as ``"cpu"`` or ``"cuda:0"``, or a
            ``jax.Device``.
        settings: anything else that changes behaviour, added to the fingerprint.
        preprocess: host-side function from the stacked batch to the arrays ``apply_fn``
            reads (encode text fields here); defaults to :func:`arrays_only`.

    Raises:
        PolicyLoadError: empty or non-positive ``batch_sizes``, or no such device.
    """

    def __init__(
        self,
        name: str,
        apply_fn: Callable[[Any, Mapping[str, Any]], Any],
        params: Any,
        spec: PolicySpec,
        *,
        batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32),
        device: str | jax.Device | None = None,
        settings: Mapping[str, Any] | None = None,
        preprocess: Preprocess | None = None,
    ) -> None:
        sizes = sorted({int(b) for b in batch_sizes})
        if not sizes or sizes[0] < 1:
            raise PolicyLoadError(f"batch_sizes must be positive integers, got {list(batch_sizes)}")
        self.name = name
        self.spec = spec
        self._sizes = sizes
        self._device = resolve_jax_device(device)
        self._params = jax.device_put(params, self._device)
        self._preprocess: Preprocess = preprocess or arrays_only
        self._traces = 0
        self._lock = threading.Lock()

        def traced(p: Any, inputs: Mapping[str, Any]) -> Any:
            # Python side effects run only while jax traces, i.e. once per new input shape:
            # this counts compiles exactly.
            with self._lock:
                self._traces += 1
            return apply_fn(p, inputs)

        self._jitted = jax.jit(traced)
        leaf_dtypes = sorted({np.dtype(x.dtype).name for x in jax.tree_util.tree_leaves(params)})
        jax_config: Any = jax.config  # its options are attributes its type stubs do not list
        self._fingerprint = make_fingerprint(
            weights=params_digest(params),
            backend="jax",
            versions={"jax": jax.__version__, "jaxlib": _jaxlib_version(), "numpy": np.__version__},
            precision="+".join(leaf_dtypes) or "none",
            device=f"{self._device.platform}:{self._device.id}",
            spec=spec,
            settings={
                "user": dict(settings or {}),
                "batch_sizes": sizes,
                "jax": {
                    "default_matmul_precision": str(jax_config.jax_default_matmul_precision),
                    "enable_x64": bool(jax_config.jax_enable_x64),
                },
            },
        )

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """The compiled batch sizes, ascending."""
        return tuple(self._sizes)

    @property
    def compile_count(self) -> int:
        """How many times the function has been traced (one per compiled input shape)."""
        return self._traces

    @property
    def device(self) -> jax.Device:
        return self._device

    def bucket(self, n: int) -> int:
        """The compiled size a piece of ``n`` rows runs at (``n`` at most the largest size)."""
        return self._sizes[bisect.bisect_left(self._sizes, n)]

    def _dispatch(self, arrays: Mapping[str, np.ndarray], start: int, n: int) -> Any:
        size = self.bucket(n)
        piece = {k: _pad(v[start : start + n], size) for k, v in arrays.items()}
        out = self._jitted(self._params, jax.device_put(piece, self._device))
        if not isinstance(out, jax.Array):
            raise PolicyOutputError(f"apply_fn returned {type(out).__name__}, expected an array")
        if not jax.numpy.issubdtype(out.dtype, jax.numpy.floating):  # bfloat16 included
            raise PolicyOutputError(f"policy output has dtype {out.dtype}, expected a float dtype")
        if out.ndim < 1 or out.shape[0] != size:
            raise PolicyOutputError(f"policy output has shape {list(out.shape)}, expected [{size}, ...]")
        return out

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        return self.infer_arrays(self._preprocess(obs), batch_size_of(obs))

    def infer_arrays(self, arrays: Mapping[str, np.ndarray], batch: int) -> np.ndarray:
        """Run the compiled function on host arrays already in ``apply_fn``'s form (what
        ``preprocess`` returns, plus whatever a subclass adds: a prefix's rows and mask), bucketed
        and split like :meth:`infer_batch`.

        Args:
            arrays: ``[batch, ...]`` arrays by name.
            batch: the rows every array must have.

        Raises:
            PolicyOutputError: an array without ``batch`` rows, or a bad output.
        """
        arrays = dict(arrays)
        for k, v in arrays.items():
            if not isinstance(v, np.ndarray) or len(v) != batch:
                raise PolicyOutputError(f"input field {k!r} is not an array of {batch} rows (from preprocess?)")
        largest = self._sizes[-1]
        pieces = [(start, min(largest, batch - start)) for start in range(0, batch, largest)]
        # Dispatch every piece before reading any back: jax runs them asynchronously.
        outs = [(n, self._dispatch(arrays, start, n)) for start, n in pieces]
        host = [np.asarray(out)[:n] for n, out in outs]
        actions = host[0] if len(host) == 1 else np.concatenate(host)
        return check_actions(self.spec, batch, actions)

    def warmup(self) -> None:
        """Compile and run every batch size once on a zero observation."""
        item = example_observation(self.spec)
        for size in self._sizes:
            obs = stack_observations(self.spec, [item] * size)
            arrays = dict(self._preprocess(obs))
            self._dispatch(arrays, 0, size).block_until_ready()

    def close(self) -> None:
        """Drop the device copy of the parameters."""
        self._params = None


def _jaxlib_version() -> str:
    try:
        import jaxlib

        return str(getattr(jaxlib, "__version__", "unknown"))
    except ImportError:  # pragma: no cover - jax always ships jaxlib
        return "absent"
