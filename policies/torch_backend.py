"""A policy backed by a ``torch.nn.Module`` (importing this module imports torch)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from chunkline.client.wire.fingerprint import weights_digest

from .base import Policy, PolicySpec, make_fingerprint
from .exceptions import PolicyLoadError, PolicyOutputError
from .numpy_backend import batch_size_of
from .outputs import check_actions

__all__ = ["TorchPolicy", "TORCH_PRECISIONS", "state_dict_digest"]

#: precision names accepted by :class:`TorchPolicy` and the dtype the module runs in.
TORCH_PRECISIONS: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class _StateBytes(Mapping[str, np.ndarray]):
    """A state dict seen as numpy byte arrays, converted one tensor at a time on access so a
    GPU-resident model is never copied to the host all at once."""

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self._state = state

    def __getitem__(self, key: str) -> np.ndarray:
        t = self._state[key].detach().to("cpu").contiguous()
        # bfloat16 has no numpy dtype: hash raw bytes and fold dtype and shape into the name
        # (see __iter__), so equal bytes of another dtype or shape never collide.
        return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


def state_dict_digest(module: torch.nn.Module) -> str:
    """:func:`~chunkline.client.wire.fingerprint.weights_digest` of a module's state dict (parameters and
    buffers), dtype- and shape-aware, computed without materialising a host copy of the model.

    Args:
        module: the module, on any device.
    """
    state = module.state_dict()
    keyed = {f"{name}|{t.dtype}|{tuple(t.shape)}": t for name, t in state.items()}
    return weights_digest(_StateBytes(keyed))


class TorchPolicy(Policy):
    """Serve a torch module: batched forward under ``torch.inference_mode()``.

    The module's ``forward`` receives one dict: array fields as tensors ``[B, *shape]`` on
    ``device`` (float fields in ``precision``, integer and bool fields unchanged, e.g. uint8
    images) and text fields as lists of ``B`` strings. It returns ``[B, H, A]``; the policy
    hands back float32 numpy.

    Args:
        name: the policy's name.
        module: the network; moved to ``device`` and ``precision``, put in eval mode.
        spec: what the policy accepts and returns.
        device: a torch device string (``"cpu"``, ``"cuda:0"``, ...).
        precision: one of :data:`TORCH_PRECISIONS`.
        settings: anything else that changes behaviour, added to the fingerprint.

    Raises:
        PolicyLoadError: unknown precision, or the device is unavailable.
    """

    def __init__(
        self,
        name: str,
        module: torch.nn.Module,
        spec: PolicySpec,
        *,
        device: str = "cpu",
        precision: str = "float32",
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        if precision not in TORCH_PRECISIONS:
            raise PolicyLoadError(f"unknown precision {precision!r}; choose one of {sorted(TORCH_PRECISIONS)}")
        try:
            self._device = torch.device(device)
            # .to(dtype=...) converts floating parameters and buffers only; integer buffers stay.
            module = module.to(device=self._device, dtype=TORCH_PRECISIONS[precision])
        except (RuntimeError, AssertionError, ValueError) as exc:  # no such device / not compiled with CUDA
            raise PolicyLoadError(f"cannot place policy {name!r} on {device!r}: {exc}") from exc
        module.eval()
        module.requires_grad_(False)
        self.name = name
        self.spec = spec
        self._module = module
        self._dtype = TORCH_PRECISIONS[precision]
        numerics: dict[str, Any] = {"float32_matmul_precision": torch.get_float32_matmul_precision()}
        if self._device.type == "cuda":
            numerics["cuda_matmul_tf32"] = torch.backends.cuda.matmul.allow_tf32
            numerics["cudnn_tf32"] = torch.backends.cudnn.allow_tf32
        self._fingerprint = make_fingerprint(
            weights=state_dict_digest(module),
            backend="torch",
            versions={"torch": torch.__version__, "numpy": np.__version__},
            precision=precision,
            device=str(self._device),
            spec=spec,
            settings={"user": dict(settings or {}), "torch": numerics},
        )

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def module(self) -> torch.nn.Module:
        """The module as served (on its device, in its precision)."""
        return self._module

    @property
    def device(self) -> torch.device:
        return self._device

    def _to_tensor(self, arr: np.ndarray) -> torch.Tensor:
        # torch cannot mark a tensor read-only, so a read-only view of a network buffer is
        # copied once (never written through, never a warning); negative strides cannot be
        # wrapped at all. Writable arrays are wrapped without a copy.
        if not arr.flags.writeable or any(s < 0 for s in arr.strides) or not arr.dtype.isnative:
            arr = np.array(arr, dtype=arr.dtype.newbyteorder("="))
        t = torch.from_numpy(arr)
        if t.is_floating_point():
            return t.to(device=self._device, dtype=self._dtype, non_blocking=True)
        return t.to(device=self._device, non_blocking=True)

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        batch = batch_size_of(obs)
        with torch.inference_mode():
            inputs = {k: self._to_tensor(v) if isinstance(v, np.ndarray) else list(v) for k, v in obs.items()}
            out = self._module(inputs)
            if not isinstance(out, torch.Tensor):
                raise PolicyOutputError(f"module returned {type(out).__name__}, expected a tensor")
            if not out.is_floating_point():
                raise PolicyOutputError(f"policy output has dtype {out.dtype}, expected a float dtype")
            host = out.detach().to(device="cpu", dtype=torch.float32)
        return check_actions(self.spec, batch, host.numpy())

    def close(self) -> None:
        """Drop the module and return cached device memory."""
        self._module = torch.nn.Identity()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
