"""antdt_callbacks: AntDT straggler mitigation (arXiv 2404.09679) for Hugging Face Trainer.

A stateful dynamic data-sharding service (its own process, SQLite-backed), a Monitor and a Controller (DD and ND
policies) inside it, and the worker-side Agent as a `TrainerCallback`, plus the small Trainer mixin that the
service-fed dataloader needs. See ``python -m antdt_callbacks --help``.
"""

from .agent import EXIT_RESTART, AntDTAgent
from .client import ShardingClient
from .config import AgentConfig, ControllerConfig, JobConfig, MonitorConfig, ServeConfig
from .controller import Plan, controller_step, equal_split, proportional_split, restart_saving_s
from .dataset import BatchMeta, ServiceIterableDataset
from .elastic import init_distributed
from .errors import (
    AntDTError,
    BadRequestError,
    FencedError,
    NotFoundError,
    PayloadTooLargeError,
    ServiceError,
    ServiceUnavailableError,
    StaleIncarnationError,
    UnauthorizedError,
    UnknownWorkerError,
)
from .launch import ServiceProcess, launch_service
from .server import ShardingService
from .trainer import AntDTTrainer, AntDTTrainerMixin, WeightedHookState, weighted_allreduce_hook

__all__ = [
    "EXIT_RESTART",
    "AgentConfig",
    "AntDTAgent",
    "AntDTError",
    "AntDTTrainer",
    "AntDTTrainerMixin",
    "BadRequestError",
    "BatchMeta",
    "ControllerConfig",
    "FencedError",
    "JobConfig",
    "MonitorConfig",
    "NotFoundError",
    "PayloadTooLargeError",
    "Plan",
    "ServeConfig",
    "ServiceError",
    "ServiceIterableDataset",
    "ServiceProcess",
    "ServiceUnavailableError",
    "ShardingClient",
    "ShardingService",
    "StaleIncarnationError",
    "UnauthorizedError",
    "UnknownWorkerError",
    "WeightedHookState",
    "controller_step",
    "equal_split",
    "init_distributed",
    "launch_service",
    "proportional_split",
    "restart_saving_s",
    "weighted_allreduce_hook",
]
