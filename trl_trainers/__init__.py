"""trl_trainers: TRL-compatible trainers that TRL no longer ships (PPO), built to run under ``hf_placement``.

``PPOConfig``/``PPOTrainer`` keep TRL 1.12's ``trl.experimental.ppo`` interface, so a TRL PPO script changes only its
import line. The PPO mathematics lives in :mod:`trl_trainers.ppo_math` as pure tensor functions.
"""

from . import ppo_math
from .ppo_config import PPOConfig
from .ppo_trainer import Experience, OnlineTrainerState, PolicyAndValueWrapper, PPOTrainer, Rollout

__all__ = [
    "Experience",
    "OnlineTrainerState",
    "PPOConfig",
    "PPOTrainer",
    "PolicyAndValueWrapper",
    "Rollout",
    "ppo_math",
]
