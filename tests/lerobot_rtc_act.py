"""A small real LeRobot policy with real-time chunking, for the tests (pi0 and SmolVLA weights are
not available offline): LeRobot's ACT, then a few flow-matching Euler steps towards ACT's chunk
through LeRobot's own ``RTCProcessor.denoise_step`` -- the call pi0, pi05 and SmolVLA make, with
the same ``inference_delay`` / ``prev_chunk_left_over`` / ``execution_horizon`` arguments.

Registered as a LeRobot plugin policy type (``rtc_act``): ``get_policy_class`` finds
``RTCACTPolicy`` beside ``RTCACTConfig`` in this module, so a checkpoint saved from it loads
through ``lerobot:PATH`` like any other. Importing this module imports lerobot.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from lerobot.configs.policies import PreTrainedConfig
from lerobot.policies.act.configuration_act import ACTConfig
from lerobot.policies.act.modeling_act import ACTPolicy
from lerobot.policies.rtc.configuration_rtc import RTCConfig
from lerobot.policies.rtc.modeling_rtc import RTCProcessor

from chunkline.bench import lerobot_models

STEPS = 5


@PreTrainedConfig.register_subclass("rtc_act")
@dataclasses.dataclass
class RTCACTConfig(ACTConfig):
    rtc_config: RTCConfig | None = None


class RTCACTPolicy(ACTPolicy):
    config_class = RTCACTConfig
    name = "rtc_act"

    def __init__(self, config: RTCACTConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.init_rtc_processor()
        #: the RTC arguments of every call (the tests check what reached the model)
        self.calls: list[dict[str, Any]] = []

    def init_rtc_processor(self) -> None:
        self.rtc_processor = RTCProcessor(self.config.rtc_config) if self.config.rtc_config is not None else None

    def predict_action_chunk(self, batch: dict[str, torch.Tensor], **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        self.calls.append(dict(kwargs))
        target = super().predict_action_chunk(batch)
        x = torch.zeros_like(target)  # the noise: zeros, so a chunk depends on its observation and prefix only
        dt = -1.0 / STEPS
        for step in range(STEPS):
            time = 1.0 + step * dt

            def denoise(x_t: torch.Tensor, time: float = time) -> torch.Tensor:
                return 0.5 * (x_t - target) / time

            rtc = self.config.rtc_config
            if self.rtc_processor is not None and rtc is not None and rtc.enabled:
                v = self.rtc_processor.denoise_step(x_t=x, prev_chunk_left_over=kwargs.get("prev_chunk_left_over"),
                                                    inference_delay=kwargs.get("inference_delay"), time=time,
                                                    original_denoise_step_partial=denoise,
                                                    execution_horizon=kwargs.get("execution_horizon"))
            else:
                v = denoise(x)
            x = x + dt * v
        return x


def build_rtc_act(folder: Path, *, chunk_size: int = 10, seed: int = 0, rtc: RTCConfig | None = None) -> Path:
    """A random ``rtc_act`` checkpoint (ACT's small size), saved as LeRobot saves any policy."""
    inputs, outputs = lerobot_models._features()
    config = RTCACTConfig(input_features=inputs, output_features=outputs, chunk_size=chunk_size, n_action_steps=chunk_size,
                          dim_model=64, n_heads=4, dim_feedforward=128, n_encoder_layers=1, n_decoder_layers=1, latent_dim=16,
                          pretrained_backbone_weights=None, device="cpu", push_to_hub=False, rtc_config=rtc)
    torch.manual_seed(seed)
    return lerobot_models._save(RTCACTPolicy(config), config, folder)
