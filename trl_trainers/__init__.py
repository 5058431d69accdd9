"""trl_trainers: TRL-compatible trainers that TRL no longer ships (PPO), built to run under ``hf_placement``.

``PPOConfig``/``PPOTrainer`` keep TRL 1.12's ``trl.experimental.ppo`` interface, so a TRL PPO script changes only its
import line. The PPO mathematics lives in :mod:`trl_trainers.ppo_math` as pure tensor functions; the phases of one
iteration (generation, scoring, experience, training) in `PPOPhases`; where they run in `trl_trainers.placement`;
which engine trains policy + value model is read from the launch (`launch_engine_from_env`): DDP's result, DeepSpeed
ZeRO-0..3 and FSDP2 from an accelerate config, or the PaRO engine from a PaRO config.
"""

from . import ppo_math
from .accelerate_backends import DeepSpeedBackend, FSDP2Backend
from .batch_layout import BatchLayout, compute_batch_layout
from .launch_engine import LaunchEngine, launch_engine_from_env
from .ppo_config import PPOConfig
from .ppo_phases import Experience, PolicyAndValueWrapper, PPOModels, PPOPhases, Rollout
from .ppo_trainer import OnlineTrainerState, PPOTrainer
from .training_backend import ReplicatedBackend, TrainingBackend

__all__ = [
    "BatchLayout",
    "DeepSpeedBackend",
    "Experience",
    "FSDP2Backend",
    "LaunchEngine",
    "OnlineTrainerState",
    "PPOConfig",
    "PPOModels",
    "PPOPhases",
    "PPOTrainer",
    "PolicyAndValueWrapper",
    "ReplicatedBackend",
    "Rollout",
    "TrainingBackend",
    "compute_batch_layout",
    "launch_engine_from_env",
    "ppo_math",
]
