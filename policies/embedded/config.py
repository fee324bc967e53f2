"""Architecture configs of the embedded policies and the parameter shapes they imply.

Parameter names and layouts are shared by the numpy, torch and JAX implementations
(linear weights are stored ``[in, out]``), so one set of weights drives all three.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

from pydantic import ConfigDict, TypeAdapter, ValidationError

from ..base import PolicySpec
from ..exceptions import PolicyConfigError as ConfigError
from .spec import ACTION_DIM, ALOHA_CAMERAS, DT, HORIZON, IMAGE_SIZE, STATE_DIM, aloha_spec

__all__ = ["LOADTEST_MAX_STEP", "LoadtestConfig", "ComputeConfig", "EmbeddedConfig", "config_from_dict", "config_to_dict"]

_STRICT = ConfigDict(extra="forbid")


#: the most the ``loadtest`` policy's actions move per action (0.5 per second at 50 Hz): a chunk is a
#: smooth path that starts where the observed ``state`` is, so the robot-side safety layer can hand
#: over to it (a jump far from the current position is refused as out of reach).
LOADTEST_MAX_STEP = 0.01


@dataclasses.dataclass(frozen=True)
class _AlohaShaped:
    """What both embedded architectures read and answer: ALOHA's cameras, state and actions, the
    images subsampled by ``image_stride``."""

    horizon: int = HORIZON
    action_dim: int = ACTION_DIM
    state_dim: int = STATE_DIM
    dt: float = DT
    cameras: tuple[str, ...] = ALOHA_CAMERAS
    image_size: int = IMAGE_SIZE
    image_stride: int = 4

    def _check_common(self, positive: tuple[str, ...]) -> None:
        if self.image_size % self.image_stride:
            raise ConfigError(f"image_size {self.image_size} is not a multiple of image_stride {self.image_stride}")
        for name in ("horizon", "action_dim", "state_dim", "image_size", "image_stride", *positive):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive")
        if not self.cameras:
            raise ConfigError("at least one camera is needed")

    def spec(self) -> PolicySpec:
        """The policy's spec."""
        return aloha_spec(cameras=self.cameras, image_size=self.image_size, state_dim=self.state_dim,
                          action_dim=self.action_dim, horizon=self.horizon, dt=self.dt)


@dataclasses.dataclass(frozen=True)
class LoadtestConfig(_AlohaShaped):
    """The weight-bound ``loadtest`` policy: an MLP action head over a few tokens.

    Images are subsampled by ``image_stride`` and average-pooled to ``pool_grid x pool_grid x 3``
    (cheap: a few thousand pixels per image), concatenated with ``state`` and a hashed
    bag-of-words of the prompt, projected to ``tokens`` tokens of ``width``, run through
    ``blocks`` pre-LayerNorm residual MLP blocks (hidden ``expansion * width``), and read out
    by a linear head to ``horizon * action_dim`` tanh-bounded steps of at most
    :data:`LOADTEST_MAX_STEP`: action ``k`` is the observed ``state`` (its first ``action_dim``
    entries, zero-padded) plus the first ``k + 1`` steps, a smooth path from where the robot is.

    Args:
        horizon: ``H``. action_dim: ``A``. state_dim: width of ``state``. dt: seconds per action.
        cameras: camera names. image_size: image side. image_stride: pixel subsampling step.
        pool_grid: side of the pooled image grid. prompt_dim: hashed prompt features.
        tokens: tokens per observation (1 to 4). width: token width. blocks: residual blocks.
        expansion: MLP hidden width over ``width``.
    """

    kind: ClassVar[str] = "loadtest"
    __pydantic_config__ = _STRICT

    pool_grid: int = 8
    prompt_dim: int = 32
    tokens: int = 1
    width: int = 1024
    blocks: int = 3
    expansion: int = 4

    def __post_init__(self) -> None:
        self._check_common(("prompt_dim", "width"))
        if (self.image_size // self.image_stride) % self.pool_grid:
            raise ConfigError("image_size / image_stride must be a multiple of pool_grid")
        if not 1 <= self.tokens <= 16:
            raise ConfigError("tokens must be between 1 and 16")
        if self.blocks < 0 or self.expansion < 1:
            raise ConfigError("blocks must be >= 0 and expansion >= 1")

    @property
    def pool(self) -> int:
        """Pixels (after subsampling) averaged into one pooled cell, per side."""
        return self.image_size // self.image_stride // self.pool_grid

    @property
    def features(self) -> int:
        """Width of the concatenated input feature vector."""
        return len(self.cameras) * self.pool_grid**2 * 3 + self.state_dim + self.prompt_dim

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's name and shape, in creation order."""
        w, h = self.width, self.width * self.expansion
        shapes: dict[str, tuple[int, ...]] = {"in.w": (self.features, w), "in.b": (w,), "tok": (self.tokens, w)}
        for i in range(self.blocks):
            shapes |= {f"blocks.{i}.ln.g": (w,), f"blocks.{i}.ln.b": (w,), f"blocks.{i}.fc1.w": (w, h),
                       f"blocks.{i}.fc1.b": (h,), f"blocks.{i}.fc2.w": (h, w), f"blocks.{i}.fc2.b": (w,)}
        shapes |= {"out_ln.g": (w,), "out_ln.b": (w,), "head.w": (self.tokens * w, self.horizon * self.action_dim),
                   "head.b": (self.horizon * self.action_dim,)}
        return shapes


@dataclasses.dataclass(frozen=True)
class ComputeConfig(_AlohaShaped):
    """The compute-bound ``loadtest-compute`` policy: a small transformer over ~64 tokens.

    Each image is subsampled by ``image_stride`` and cut into ``patch_grid x patch_grid``
    patches (linearly embedded); ``state`` and the hashed prompt are one token each; one
    learned query token per action dimension reads out that dimension's ``horizon`` actions.
    ALOHA: 3 x 16 patches + 2 + 14 queries = 64 tokens of ``width`` 256 through ``layers`` 4.

    Args:
        horizon: ``H``. action_dim: ``A`` (also the number of query tokens). state_dim: width of
        ``state``. dt: seconds per action. cameras: camera names. image_size: image side.
        image_stride: pixel subsampling step. patch_grid: patches per image side.
        prompt_dim: hashed prompt features. width: token width. layers: transformer layers.
        heads: attention heads. expansion: MLP hidden width over ``width``.
    """

    kind: ClassVar[str] = "loadtest-compute"
    __pydantic_config__ = _STRICT

    patch_grid: int = 4
    prompt_dim: int = 32
    width: int = 256
    layers: int = 4
    heads: int = 4
    expansion: int = 4

    def __post_init__(self) -> None:
        self._check_common(("prompt_dim", "width"))
        if (self.image_size // self.image_stride) % self.patch_grid:
            raise ConfigError("image_size / image_stride must be a multiple of patch_grid")
        if self.heads < 1 or self.width % self.heads:
            raise ConfigError("width must be a multiple of heads")
        if self.layers < 0 or self.expansion < 1:
            raise ConfigError("layers must be >= 0 and expansion >= 1")

    @property
    def patch(self) -> int:
        """Patch side in (subsampled) pixels."""
        return self.image_size // self.image_stride // self.patch_grid

    @property
    def patches(self) -> int:
        """Image tokens over all cameras."""
        return len(self.cameras) * self.patch_grid**2

    @property
    def seq_len(self) -> int:
        """Tokens per observation: patches, state, prompt, one query per action dimension."""
        return self.patches + 2 + self.action_dim

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's name and shape, in creation order."""
        d, h = self.width, self.width * self.expansion
        shapes: dict[str, tuple[int, ...]] = {
            "patch.w": (self.patch * self.patch * 3, d), "patch.b": (d,),
            "state.w": (self.state_dim, d), "state.b": (d,),
            "prompt.w": (self.prompt_dim, d), "prompt.b": (d,),
            "queries": (self.action_dim, d), "pos": (self.seq_len, d),
        }
        for i in range(self.layers):
            p = f"layers.{i}."
            shapes |= {p + "ln1.g": (d,), p + "ln1.b": (d,), p + "qkv.w": (d, 3 * d), p + "qkv.b": (3 * d,),
                       p + "proj.w": (d, d), p + "proj.b": (d,), p + "ln2.g": (d,), p + "ln2.b": (d,),
                       p + "fc1.w": (d, h), p + "fc1.b": (h,), p + "fc2.w": (h, d), p + "fc2.b": (d,)}
        shapes |= {"out_ln.g": (d,), "out_ln.b": (d,), "head.w": (d, self.horizon), "head.b": (self.horizon,)}
        return shapes


EmbeddedConfig = LoadtestConfig | ComputeConfig

_KINDS: dict[str, type[LoadtestConfig] | type[ComputeConfig]] = {
    LoadtestConfig.kind: LoadtestConfig,
    ComputeConfig.kind: ComputeConfig,
}


def config_to_dict(config: EmbeddedConfig) -> dict[str, Any]:
    """A JSON-ready dict: ``{"kind": ..., **fields}``.

    Args:
        config: the config.
    """
    fields = dataclasses.asdict(config)
    fields["cameras"] = list(fields["cameras"])
    return {"kind": config.kind, **fields}


def config_from_dict(doc: Any) -> EmbeddedConfig:
    """Validate an untrusted config dict (as read from a weights file's JSON) into a config.

    Validation is strict (no ``"3"`` for ``3``) and refuses unknown fields.

    Args:
        doc: the output of :func:`config_to_dict`, possibly tampered with.

    Raises:
        PolicyConfigError: unknown kind, unknown or mistyped field, inconsistent architecture.
    """
    if not isinstance(doc, dict) or doc.get("kind") not in _KINDS:
        raise ConfigError(f"config kind must be one of {sorted(_KINDS)}")
    cls = _KINDS[doc["kind"]]
    fields = {k: v for k, v in doc.items() if k != "kind"}
    try:
        # JSON mode: strict types, yet a JSON array is a valid tuple and a dict a valid dataclass.
        return TypeAdapter(cls).validate_json(json.dumps(fields), strict=True)
    except ValidationError as exc:  # wraps the dataclass's own ConfigError too
        raise ConfigError(f"invalid {doc['kind']} config: {_first_error(exc)}") from None


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(p) for p in err["loc"]) or "config"
    return f"{where}: {err['msg']}"
