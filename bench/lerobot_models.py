"""Random-initialised LeRobot checkpoints (small for the tests, real sizes for ``chunkline bench policies``),
built with LeRobot's own config classes and saved
the way a trained policy is (``save_pretrained`` of the policy and of its pre/post-processors), so
the tests read them exactly as a user's checkpoint. Nothing is downloaded (no pretrained backbone).

Also LeRobot's own pipeline for one observation (the reference chunkline must match): the frame
preparation of its async inference, its pre-processor, the policy and its post-processor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_DIM = 6
ACTION_DIM = 6
CAMERA = "observation.images.front"
#: the checkpoint's camera size (C, H, W); robots send frames of another size, resized on the server.
IMAGE_SHAPE = (3, 48, 64)


def _features(image_shape: tuple[int, int, int] = IMAGE_SHAPE) -> tuple[dict[str, Any], dict[str, Any]]:
    from lerobot.configs.types import FeatureType, PolicyFeature

    inputs = {"observation.state": PolicyFeature(type=FeatureType.STATE, shape=(STATE_DIM,)),
              CAMERA: PolicyFeature(type=FeatureType.VISUAL, shape=image_shape)}
    return inputs, {"action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION_DIM,))}


def _stats() -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return {
        "observation.state": {"mean": torch.randn(STATE_DIM, generator=g), "std": torch.rand(STATE_DIM, generator=g) + 0.5,
                              "min": -torch.ones(STATE_DIM) * 3, "max": torch.ones(STATE_DIM) * 3},
        "action": {"mean": torch.randn(ACTION_DIM, generator=g), "std": torch.rand(ACTION_DIM, generator=g) + 0.5,
                   "min": -torch.ones(ACTION_DIM) * 2, "max": torch.ones(ACTION_DIM) * 2},
        CAMERA: {"mean": torch.full((3, 1, 1), 0.45), "std": torch.full((3, 1, 1), 0.25),
                 "min": torch.zeros((3, 1, 1)), "max": torch.ones((3, 1, 1))},
    }


def _save(policy: Any, config: Any, folder: Path) -> Path:
    from lerobot.policies.factory import make_pre_post_processors

    pre, post = make_pre_post_processors(config, dataset_stats=_stats())
    policy.save_pretrained(folder)
    pre.save_pretrained(folder)
    post.save_pretrained(folder)
    return folder


def build_act(folder: Path, *, chunk_size: int = 10, dim_model: int = 64, layers: int = 1, dim_feedforward: int = 128, seed: int = 0,
              image_shape: tuple[int, int, int] = IMAGE_SHAPE) -> Path:
    """A random ACT (ResNet-18 backbone, no pretrained weights) saved under ``folder``."""
    from lerobot.policies.act.configuration_act import ACTConfig
    from lerobot.policies.act.modeling_act import ACTPolicy

    inputs, outputs = _features(image_shape)
    config = ACTConfig(input_features=inputs, output_features=outputs, chunk_size=chunk_size, n_action_steps=chunk_size,
                       dim_model=dim_model, n_heads=4, dim_feedforward=dim_feedforward, n_encoder_layers=layers,
                       n_decoder_layers=1, latent_dim=16, pretrained_backbone_weights=None, device="cpu", push_to_hub=False)
    torch.manual_seed(seed)
    return _save(ACTPolicy(config), config, folder)


def build_diffusion(folder: Path, *, steps: int = 10, down_dims: tuple[int, ...] = (32, 64), seed: int = 0,
                    image_shape: tuple[int, int, int] = IMAGE_SHAPE, step_embed_dim: int = 32) -> Path:
    """A random Diffusion Policy (DDPM, ``steps`` denoising steps, two observations of history)."""
    from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig
    from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy

    inputs, outputs = _features(image_shape)
    config = DiffusionConfig(input_features=inputs, output_features=outputs, n_obs_steps=2, horizon=16,
                             n_action_steps=8, down_dims=down_dims, diffusion_step_embed_dim=step_embed_dim, crop_shape=None,
                             spatial_softmax_num_keypoints=16,
                             num_inference_steps=steps, noise_scheduler_type="DDPM", num_train_timesteps=max(100, steps),
                             pretrained_backbone_weights=None, use_group_norm=True, device="cpu",
                             push_to_hub=False)
    torch.manual_seed(seed)
    return _save(DiffusionPolicy(config), config, folder)


def robot_observation(seed: int, frame_hw: tuple[int, int] = (96, 128)) -> dict[str, Any]:
    """What a robot sends: float state, a uint8 ``H x W x 3`` camera frame of its own size."""
    rng = np.random.default_rng(seed)
    return {"observation.state": rng.standard_normal(STATE_DIM).astype(np.float32),
            CAMERA: rng.integers(0, 256, (*frame_hw, 3), dtype=np.uint8)}


def lerobot_reference(folder: Path, observations: list[dict[str, Any]], seed: int = 0) -> np.ndarray:
    """LeRobot's own pipeline, one robot, one observation after another (a fresh policy, as a
    fresh robot session): its async inference's frame preparation, the pre-processor,
    ``select_action`` (which fills the policy's own queues and draws its noise from the global
    generator, seeded as chunkline seeds a session's), the post-processor. Returns the chunk of
    each observation ``[N, H, A]``."""
    from lerobot.async_inference.helpers import prepare_image, resize_robot_observation_image
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import get_policy_class, make_pre_post_processors
    from lerobot.utils.constants import ACTION

    config = PreTrainedConfig.from_pretrained(str(folder), local_files_only=True)
    policy = get_policy_class(config.type).from_pretrained(str(folder), config=config, local_files_only=True)
    policy.eval()
    pre, post = make_pre_post_processors(config, pretrained_path=str(folder))
    torch.manual_seed(seed)
    chunks = []
    with torch.inference_mode():
        for obs in observations:
            frame = resize_robot_observation_image(torch.tensor(obs[CAMERA]), config.input_features[CAMERA].shape)
            batch = pre({"observation.state": torch.tensor(obs["observation.state"]).unsqueeze(0),
                         CAMERA: prepare_image(frame).unsqueeze(0), "task": ""})
            if config.type == "diffusion":
                policy._queues[ACTION].clear()  # a new chunk for every observation, as a server answers each
                first = policy.select_action(batch)
                actions = torch.stack([first, *policy._queues[ACTION]], dim=1)
            else:
                actions = policy.predict_action_chunk(batch)[:, : config.n_action_steps]
            chunks.append(post(actions)[0].numpy())
    return np.stack(chunks)
