"""Serve any object with openpi's policy interface: ``infer(obs: dict) -> dict``.

openpi's policies (``openpi.policies.policy.Policy``) take one unbatched observation and
return ``{"actions": [H, A], ...}``; they may expose a ``metadata`` dict. The adapter calls
``infer`` once per item of a batch, so batching buys nothing for these policies, but they
get the rest of the server (sessions, deadlines, broker-friendly chunks) unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._identity import callable_identity, digest_of, package_versions
from .base import Policy, PolicySpec, TextSpec, make_fingerprint
from .exceptions import PolicyLoadError, PolicyOutputError
from .numpy_backend import batch_size_of
from .outputs import check_chunk

__all__ = ["OpenPIPolicy", "unflatten"]


def unflatten(obs: Mapping[str, Any], sep: str = "/") -> dict[str, Any]:
    """``{"images/cam_high": x}`` to ``{"images": {"cam_high": x}}`` (openpi's ALOHA layout).

    Args:
        obs: a flat observation.
        sep: the separator of nested names.
    """
    out: dict[str, Any] = {}
    for key, value in obs.items():
        node = out
        *parents, leaf = key.split(sep)
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


class OpenPIPolicy(Policy):
    """Adapt an openpi-style policy object.

    Args:
        obj: anything with ``infer(obs: dict) -> dict`` whose result holds ``"actions"`` of
            shape ``[spec.horizon, spec.action_dim]``; an optional ``metadata`` attribute (a
            dict) enters the fingerprint and the metadata clients see.
        spec: what the policy accepts and returns (openpi objects do not declare it).
        name: the policy's name.
        digest: a content digest of the policy (e.g. of its checkpoint). Without it the
            fingerprint is built from the object's class, module and metadata, which cannot
            tell two checkpoints of one class apart: pass a digest in production.
        nest: hand ``infer`` nested dicts (``images/cam_high`` becomes
            ``obs["images"]["cam_high"]``), as openpi's ALOHA policies expect. Leave it off for
            flat layouts such as DROID's ``observation/exterior_image_1_left``.
        settings: anything else that changes behaviour, added to the fingerprint.

    Raises:
        PolicyLoadError: ``obj`` has no callable ``infer``.
    """

    def __init__(
        self,
        obj: Any,
        spec: PolicySpec,
        *,
        name: str = "openpi",
        digest: str | None = None,
        nest: bool = False,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        if not callable(getattr(obj, "infer", None)):
            raise PolicyLoadError(f"{type(obj).__name__} has no callable infer(obs) method")
        self.name = name
        self.spec = spec
        self._obj = obj
        self._nest = nest
        meta = getattr(obj, "metadata", None)
        self._meta: dict[str, Any] = dict(meta) if isinstance(meta, Mapping) else {}
        versions = {"numpy": np.__version__, **package_versions(["openpi", "openpi-client"])}
        top = (type(obj).__module__ or "").partition(".")[0]
        if top and top != "builtins":
            # the version of the package defining the object, if it declares one
            versions[top] = str(getattr(sys.modules.get(top), "__version__", "unknown"))
        self._fingerprint = make_fingerprint(
            weights=digest or digest_of({"class": callable_identity(type(obj)), "metadata": self._meta}),
            backend="openpi",
            versions=versions,
            precision=str(self._meta.get("precision", "unknown")),
            device=str(self._meta.get("device", "unknown")),
            spec=spec,
            settings={"user": dict(settings or {}), "nest": nest},
        )

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def metadata(self) -> dict[str, Any]:
        # The object's own metadata first, then ours: name, fingerprint and spec always win.
        return {**self._meta, **super().metadata()}

    def _item(self, obs: Mapping[str, Any], i: int) -> dict[str, Any]:
        item: dict[str, Any] = {}
        for key, value in obs.items():
            field = self.spec.observation.get(key)
            v = value[i]
            if isinstance(field, TextSpec) and v == "" and not field.required:
                continue  # absent prompt: let the policy apply its default prompt
            item[key] = v
        return unflatten(item) if self._nest else item

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        batch = batch_size_of(obs)
        out = np.empty((batch, self.spec.horizon, self.spec.action_dim), np.float32)
        for i in range(batch):
            result = self._obj.infer(self._item(obs, i))
            if not isinstance(result, Mapping) or "actions" not in result:
                raise PolicyOutputError("infer() must return a dict with an 'actions' entry")
            out[i] = check_chunk(self.spec, result["actions"])
        return out
