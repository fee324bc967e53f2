"""Serve a LeRobot ``PreTrainedPolicy`` checkpoint directory (``--policy lerobot:PATH``), read offline.

Robots send the checkpoint's input features under LeRobot's names (``observation.state``, each
``observation.images.<camera>`` a uint8 frame of any size, resized as LeRobot's async inference
does) and an optional ``task``; they get ``n_action_steps`` actions ``1 / fps`` apart. With
``dataset=PATH`` or ``state_names=``/``action_names=`` the motor names are published and covered by
the fingerprint. Processor steps must be LeRobot's registered ones (:mod:`.lerobot_steps`), checked
before LeRobot reads the files. With ``rtc=true`` the robot's prefix becomes LeRobot's
``inference_delay`` and ``prev_chunk_left_over`` (one call per group of equal delays, under
``torch.no_grad``). A batch takes one pre-processing, one forward and one post-processing call;
Diffusion Policy keeps per-session state; ACT's temporal ensembling is refused (the broker merges
chunks instead). Importing this module imports torch; LeRobot when a checkpoint is loaded."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._identity import package_versions
from .base import ArraySpec, FieldSpec, Policy, PolicySpec, TextSpec, make_fingerprint
from .exceptions import PolicyLoadError, PolicyOutputError
from .lerobot_steps import check_processor_files, registered_step_names
from .numpy_backend import batch_size_of
from .outputs import check_actions
from .prefix import PrefixBatch

__all__ = ["LeRobotPolicy", "load_lerobot", "checkpoint_digest", "dataset_feature_names", "TASK_FIELD"]

#: the optional language instruction field (LeRobot's name for it).
TASK_FIELD = "task"


def checkpoint_digest(path: Path) -> str:
    """SHA-256 over every file of a checkpoint directory (names and bytes, in name order): the
    weights, the config and the normalisation statistics of the processors."""
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(file.relative_to(path)).encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _name_list(value: Any) -> list[str] | None:
    """A feature's ``names`` from ``info.json``: a list, or (older datasets) ``{"motors": [...]}``;
    ``None`` for what names no vector entries (cameras' ``["height", "width", "channels"]`` are
    filtered by the caller)."""
    if isinstance(value, list) and all(isinstance(n, str) for n in value):
        return list(value)
    if isinstance(value, dict):
        flat = [n for part in value.values() if isinstance(part, list) for n in part]
        return flat if flat and all(isinstance(n, str) for n in flat) else None
    return None


def dataset_feature_names(dataset: str | os.PathLike[str]) -> dict[str, list[str]]:
    """The ``names`` of every non-camera feature of a LeRobot dataset folder (``meta/info.json``).

    Raises:
        PolicyLoadError: no such file, or not the JSON LeRobot writes.
    """
    info = Path(dataset).expanduser() / "meta" / "info.json"
    try:
        features = json.loads(info.read_text())["features"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PolicyLoadError(f"cannot read the feature names of the dataset {str(dataset)!r} ({info}): "
                              f"{type(exc).__name__}: {exc}") from exc
    out: dict[str, list[str]] = {}
    for key, feature in features.items():
        if not isinstance(feature, dict) or feature.get("dtype") in ("image", "video"):
            continue
        names = _name_list(feature.get("names"))
        if names is not None:
            out[key] = names
    return out


def _split_names(value: str | Sequence[str]) -> list[str]:
    items = value.split(",") if isinstance(value, str) else list(value)
    return [str(n).strip() for n in items if str(n).strip()]


def _motor_names(config: Any, dataset: str | None, state_names: str | Sequence[str] | None,
                 action_names: str | Sequence[str] | None) -> dict[str, list[str]]:
    """The names of the checkpoint's vector inputs and of its action, checked against their widths."""
    found = dataset_feature_names(dataset) if dataset is not None else {}
    if state_names is not None:
        found["observation.state"] = _split_names(state_names)
    if action_names is not None:
        found["action"] = _split_names(action_names)
    widths = {k: int(f.shape[0]) for k, f in config.input_features.items() if k not in config.image_features}
    widths["action"] = int(config.output_features["action"].shape[0])
    names: dict[str, list[str]] = {}
    for key, width in widths.items():
        if key not in found:
            continue
        if len(found[key]) != width or len(set(found[key])) != width:
            raise PolicyLoadError(f"{key} has {width} entries but {len(found[key])} names were given "
                                  f"({', '.join(found[key])}); give one distinct name per entry")
        names[key] = found[key]
    if (dataset is not None or state_names is not None or action_names is not None) and "action" not in names:
        raise PolicyLoadError("motor names given but none for the action: add action_names=... (or a dataset whose "
                              "meta/info.json names them)")
    return names


def _feature_spec(key: str, feature: Any) -> FieldSpec:
    kind = getattr(feature.type, "name", str(feature.type))
    if kind == "VISUAL":
        return ArraySpec(shape=(None, None, int(feature.shape[0])), dtype="uint8")
    return ArraySpec(shape=tuple(int(d) for d in feature.shape), dtype="float32")


class _Session:
    """One robot's state for a policy with observation history (Diffusion Policy)."""

    def __init__(self, n_obs_steps: int, seed: int) -> None:
        self.history: collections.deque[dict[str, torch.Tensor]] = collections.deque(maxlen=n_obs_steps)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)


class LeRobotPolicy(Policy):
    """A loaded LeRobot policy with its pre- and post-processors.

    Args:
        path: the checkpoint directory.
        device: a torch device string.
        fps: the control rate the policy was trained at (actions per second).
        seed: the seed of each session's noise generator (diffusion sampling).
        name: the policy's name (default: the checkpoint's policy type).
        dataset: the LeRobot dataset folder the policy was trained on, for its motor names.
        state_names: the state's motor names, in order (comma-separated or a list); overrides the dataset's.
        action_names: the action's motor names, likewise.
        rtc: pass the robot's prefix to LeRobot's real-time chunking (pi0, pi05, SmolVLA).

    Raises:
        PolicyLoadError: no such directory, LeRobot missing, no ``fps``, a checkpoint that cannot
            be read, a processor step outside LeRobot's registry (:class:`UnregisteredProcessorStep`),
            an unsupported setting (temporal ensembling), motor names that do not match the
            checkpoint's widths, or ``rtc`` for a policy type without real-time chunking.
    """

    def __init__(self, path: str, *, device: str = "cpu", fps: float | None = None, seed: int = 0, name: str | None = None,
                 dataset: str | None = None, state_names: str | Sequence[str] | None = None,
                 action_names: str | Sequence[str] | None = None, rtc: bool = False) -> None:
        ckpt = Path(path).expanduser()
        if not (ckpt / "config.json").is_file():
            raise PolicyLoadError(f"no LeRobot checkpoint at {str(ckpt)!r} (no config.json): give the folder save_pretrained wrote")
        if fps is None or not (float(fps) > 0):
            raise PolicyLoadError("a LeRobot checkpoint does not record its control rate: give it, e.g. --policy-arg fps=30")
        # Before LeRobot reads anything: a step must name a registered class, never a class path.
        check_processor_files(ckpt)
        try:
            from lerobot.configs.policies import PreTrainedConfig
            from lerobot.policies.factory import get_policy_class, make_pre_post_processors
        except ImportError as exc:
            raise PolicyLoadError(f"serving a LeRobot checkpoint needs lerobot (pip install 'chunkline[lerobot]'): {exc}") from exc
        try:
            # Policy types from installed plugins (lerobot_policy_* packages) register on import,
            # as LeRobot's own scripts have them do.
            from lerobot.utils.import_utils import register_third_party_plugins

            register_third_party_plugins()
            config = PreTrainedConfig.from_pretrained(str(ckpt), local_files_only=True)
            config.device = device
            if getattr(config, "temporal_ensemble_coeff", None) is not None:
                raise PolicyLoadError("ACT temporal ensembling runs inside one robot's loop; serve chunks without it "
                                      "(the broker merges overlapping chunks)")
            if rtc:
                _enable_rtc(config)
            self._policy = get_policy_class(config.type).from_pretrained(str(ckpt), config=config, local_files_only=True)
            check_processor_files(ckpt, registered_step_names())
            overrides = {"device_processor": {"device": device}}
            self._pre, self._post = make_pre_post_processors(config, pretrained_path=str(ckpt), preprocessor_overrides=overrides)
        except PolicyLoadError:
            raise
        except Exception as exc:  # LeRobot raises many kinds for a bad checkpoint; name it
            raise PolicyLoadError(f"cannot load the LeRobot checkpoint {str(ckpt)!r}: {type(exc).__name__}: {exc}") from exc
        self._policy.eval()
        self._config = config
        rtc_config = getattr(config, "rtc_config", None)
        self.accepts_prefix = bool(rtc_config is not None and rtc_config.enabled)
        self._action_normaliser: Any = _action_normaliser(self._pre) if self.accepts_prefix else None
        self._device = torch.device(device)
        self._seed = int(seed)
        self._images = list(config.image_features)
        self._stateful_diffusion = config.type == "diffusion"
        self.stateful = self._stateful_diffusion
        observation: dict[str, FieldSpec] = {k: _feature_spec(k, f) for k, f in config.input_features.items()}
        observation[TASK_FIELD] = TextSpec(required=False)
        action = config.output_features["action"]
        self.name = name or f"lerobot-{config.type}"
        self.spec = PolicySpec(observation=observation, action_dim=int(action.shape[0]), horizon=int(config.n_action_steps),
                               dt=1.0 / float(fps))
        self.names = _motor_names(config, dataset, state_names, action_names)
        versions = {"torch": torch.__version__, "numpy": np.__version__, **package_versions(["lerobot", "torchvision", "diffusers"])}
        self._fingerprint = make_fingerprint(weights=checkpoint_digest(ckpt), backend="lerobot", versions=versions,
                                             precision=str(next(self._policy.parameters()).dtype), device=str(self._device),
                                             spec=self.spec, settings={"seed": self._seed, "type": config.type, "names": self.names,
                                                                       "rtc": repr(rtc_config) if self.accepts_prefix else None})

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def metadata(self) -> dict[str, Any]:
        meta = super().metadata()
        if self.names:
            meta["names"] = {k: list(v) for k, v in self.names.items()}
        return meta

    @property
    def lerobot_policy(self) -> Any:
        """The LeRobot ``PreTrainedPolicy`` as served."""
        return self._policy

    def _frames(self, key: str, frames: np.ndarray) -> torch.Tensor:
        """``[B, H, W, 3]`` uint8 to ``[B, 3, h, w]`` float32 in ``[0, 1]`` at the checkpoint's size."""
        t = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
        size = tuple(int(d) for d in self._config.input_features[key].shape[1:])
        if tuple(t.shape[2:]) != size:
            t = torch.nn.functional.interpolate(t, size=size, mode="bilinear", align_corners=False)
        return (t.type(torch.float32) / 255).contiguous()

    def _prepared(self, obs: Mapping[str, Any]) -> dict[str, Any]:
        batch: dict[str, Any] = {}
        for key, field in self.spec.observation.items():
            if key == TASK_FIELD or key not in obs:
                continue
            if key in self._images:
                batch[key] = self._frames(key, obs[key])
            else:
                assert isinstance(field, ArraySpec)
                batch[key] = torch.from_numpy(np.array(obs[key], dtype=np.float32))
        batch[TASK_FIELD] = list(obs.get(TASK_FIELD) or [""] * batch_size_of(obs))
        return self._pre(batch)

    def new_session_state(self) -> Any:
        return _Session(int(getattr(self._config, "n_obs_steps", 1)), self._seed) if self._stateful_diffusion else None

    def _diffusion(self, batch: dict[str, Any], states: Sequence[_Session]) -> torch.Tensor:
        from lerobot.utils.constants import OBS_IMAGES

        model = self._policy.diffusion
        keys: list[str] = [k for k in ("observation.state", "observation.environment_state") if k in batch]
        for i, state in enumerate(states):
            item: dict[str, torch.Tensor] = {k: batch[k][i] for k in keys}
            if self._images:
                item[OBS_IMAGES] = torch.stack([batch[k][i] for k in self._images], dim=0)
            if not state.history:  # the first observation fills the history, as LeRobot's queues do
                state.history.extend([item] * (state.history.maxlen or 1))
            else:
                state.history.append(item)
        stacked = {k: torch.stack([torch.stack([h[k] for h in s.history]) for s in states]) for k in states[0].history[0]}
        # One generator per robot: its noise does not depend on who else is in the batch.
        generators = [s.generator for s in states]
        noise = torch.stack([torch.randn((model.config.horizon, model.config.action_feature.shape[0]), generator=g) for g in generators])
        global_cond = model._prepare_global_conditioning(stacked)  # LeRobot's own conditioning, per robot
        sample = model.conditional_sample(len(states), global_cond=global_cond, generator=generators, noise=noise.to(self._device))
        start = model.config.n_obs_steps - 1
        return sample[:, start:start + model.config.n_action_steps]

    def infer_batch_with_state(self, obs: Mapping[str, Any], states: Sequence[Any]) -> tuple[np.ndarray, list[Any]]:
        return self._run(obs, states, None)

    def infer_batch_with_prefix(self, obs: Mapping[str, Any], prefix: PrefixBatch,
                                states: Sequence[Any] | None) -> tuple[np.ndarray, list[Any] | None]:
        actions, new_states = self._run(obs, states if states is not None else [None] * batch_size_of(obs), prefix)
        return actions, new_states if states is not None else None

    def _run(self, obs: Mapping[str, Any], states: Sequence[Any], prefix: PrefixBatch | None) -> tuple[np.ndarray, list[Any]]:
        size = batch_size_of(obs)
        # Real-time chunking's guidance takes a gradient through the denoiser: no inference mode.
        with torch.no_grad() if self.accepts_prefix else torch.inference_mode():
            batch = self._prepared(obs)
            if self._stateful_diffusion:
                actions = self._diffusion(batch, states)
            elif prefix is not None and prefix.any:
                actions = self._with_prefix(batch, prefix)
            else:
                actions = self._policy.predict_action_chunk(batch)[:, : self.spec.horizon]
            out = self._post(actions)
        if not isinstance(out, torch.Tensor):
            raise PolicyOutputError(f"the post-processor returned {type(out).__name__}, expected a tensor")
        return check_actions(self.spec, size, out.detach().to("cpu", torch.float32).numpy()), list(states)

    def _with_prefix(self, batch: dict[str, Any], prefix: PrefixBatch) -> torch.Tensor:
        """One ``predict_action_chunk`` per group of robots with the same frozen rows and prefix
        length (LeRobot takes one ``inference_delay`` per call), in the batch's order again."""
        groups: dict[tuple[int, int], list[int]] = {}
        for b in range(len(prefix.delay)):
            given = np.flatnonzero(prefix.mask[b])
            rows = int(given[-1]) + 1 if given.size else 0  # the chunk's rows 0..rows-1 carry the prefix
            groups.setdefault((int(prefix.delay[b]), rows), []).append(b)
        normalised = self._normalise_actions(prefix.actions)
        out: list[torch.Tensor | None] = [None] * len(prefix.delay)
        for (delay, rows), members in groups.items():
            index = torch.tensor(members, device=self._device)
            part = {k: v.index_select(0, index) if isinstance(v, torch.Tensor) and v.shape[:1] == (len(out),) else
                    [v[i] for i in members] if isinstance(v, list) and len(v) == len(out) else v for k, v in batch.items()}
            kwargs: dict[str, Any] = {}
            if rows:
                kwargs = {"inference_delay": delay, "prev_chunk_left_over": normalised.index_select(0, index)[:, :rows]}
            chunk = self._policy.predict_action_chunk(part, **kwargs)[:, : self.spec.horizon]
            for i, b in enumerate(members):
                out[b] = chunk[i]
        return torch.stack([t for t in out if t is not None])

    def _normalise_actions(self, actions: np.ndarray) -> torch.Tensor:
        """Robot-space actions ``[B, H, A]`` to the model's space, with the checkpoint's own normaliser."""
        from lerobot.processor import TransitionKey, create_transition

        tensor = torch.as_tensor(np.array(actions, dtype=np.float32), device=self._device)
        normalised: torch.Tensor = self._action_normaliser(create_transition(action=tensor))[TransitionKey.ACTION]
        return normalised

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        states = [self.new_session_state() for _ in range(batch_size_of(obs))]
        return self.infer_batch_with_state(obs, states)[0]

    def close(self) -> None:
        self._policy = None
        if self._device.type == "cuda":
            torch.cuda.empty_cache()


def _enable_rtc(config: Any) -> None:
    """Turn on the checkpoint's real-time chunking (before the policy is built, so that it builds
    its ``RTCProcessor``)."""
    if not hasattr(config, "rtc_config"):
        raise PolicyLoadError(f"rtc: LeRobot's {config.type} policy has no real-time chunking (pi0, pi05 and smolvla do)")
    from lerobot.policies.rtc.configuration_rtc import RTCConfig

    current = config.rtc_config
    config.rtc_config = RTCConfig(enabled=True) if current is None else dataclasses.replace(current, enabled=True)


def _action_normaliser(pre: Any) -> Any:
    """The pre-processor's normaliser step that knows the action's statistics."""
    from lerobot.processor import NormalizerProcessorStep

    for step in getattr(pre, "steps", []):
        if isinstance(step, NormalizerProcessorStep) and "action" in step.features:
            return step
    raise PolicyLoadError("rtc: the checkpoint's pre-processor has no action normaliser, so a robot's prefix cannot "
                          "be brought to the model's action space")


def load_lerobot(path: str, *, device: str = "cpu", fps: float | None = None, seed: int = 0, name: str | None = None,
                 dataset: str | None = None, state_names: str | Sequence[str] | None = None,
                 action_names: str | Sequence[str] | None = None, rtc: bool = False) -> LeRobotPolicy:
    """``lerobot:PATH`` (``~`` expanded; relative paths from the current directory)."""
    return LeRobotPolicy(os.path.expanduser(path), device=device, fps=fps, seed=seed, name=name, dataset=dataset,
                         state_names=state_names, action_names=action_names, rtc=rtc)
