"""Build the flow policy on a backend: torch (:class:`.flow.FlowPolicy`) or JAX
(:class:`.flow_jax.FlowJaxPolicy`), from one weights file (a module of its own: the JAX policy
builds on :mod:`.flow`, so the choice between them lives above both)."""

from __future__ import annotations

from ..base import Policy
from ..exceptions import PolicyLoadError
from .flow import FlowPolicy, FlowSettings, load_flow

__all__ = ["build_reach_flow"]


def build_reach_flow(*, backend: str = "torch", device: str = "cpu", path: str | None = None, name: str = "reach-flow",
                     settings: FlowSettings | None = None) -> Policy:
    """The shipped flow policy on ``torch`` or ``jax`` (the same weights file, equal outputs).

    Raises:
        PolicyLoadError: another backend, one not installed, or a bad weights file.
    """
    weights = load_flow(path)
    if backend == "torch":
        try:
            import torch  # noqa: F401 - checked here so a missing torch is a load error
        except ImportError as exc:
            raise PolicyLoadError(f"backend 'torch' is not installed: {exc}") from exc
        return FlowPolicy(weights, device=device, settings=settings, name=name)
    if backend == "jax":
        try:
            from .flow_jax import FlowJaxPolicy
        except ImportError as exc:
            raise PolicyLoadError(f"backend 'jax' is not installed: {exc}") from exc
        return FlowJaxPolicy(weights, device=device, settings=settings, name=name)
    raise PolicyLoadError(f"the flow policy runs on torch or jax, not {backend!r} (it differentiates through its network)")
