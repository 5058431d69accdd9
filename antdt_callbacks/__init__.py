"""antdt_callbacks: AntDT straggler mitigation (arXiv 2404.09679) for Hugging Face Trainer.

A stateful dynamic data-sharding service (its own process, SQLite-backed) with a Monitor and a Controller (DD and ND
policies) inside it, and on every worker the Agent as a `TrainerCallback`, plus the small Trainer mixin that the
service-fed dataloader needs. ``python -m antdt_callbacks --help`` runs the service.

Exports are resolved lazily (PEP 562) so that the service process starts without importing torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "agent": ["EXIT_RESTART", "AntDTAgent"],
    "client": ["ShardingClient"],
    "config": ["AgentConfig", "ControllerConfig", "JobConfig", "MonitorConfig", "ServeConfig"],
    "controller": ["Plan", "controller_step", "equal_split", "evict_saving_s", "proportional_split",
                   "restart_saving_s"],
    "dataset": ["BatchMeta", "ServiceIterableDataset"],
    "elastic": ["EXIT_EVICTED", "init_distributed", "node_id"],
    "errors": ["AntDTError", "BadRequestError", "FencedError", "NotFoundError", "PayloadTooLargeError",
               "RefusedError", "ServiceError", "ServiceUnavailableError", "StaleIncarnationError", "UnauthorizedError",
               "UnknownWorkerError"],
    "launch": ["ServiceProcess", "launch_service"],
    "server": ["ShardingService"],
    "trainer": ["AntDTTrainer", "AntDTTrainerMixin", "WeightedHookState", "weighted_allreduce_hook"],
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'antdt_callbacks' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover - static analysers see the eager imports
    from .agent import EXIT_RESTART, AntDTAgent  # noqa: F401
    from .client import ShardingClient  # noqa: F401
    from .config import AgentConfig, ControllerConfig, JobConfig, MonitorConfig, ServeConfig  # noqa: F401
    from .controller import (  # noqa: F401
        Plan,
        controller_step,
        equal_split,
        evict_saving_s,
        proportional_split,
        restart_saving_s,
    )
    from .dataset import BatchMeta, ServiceIterableDataset  # noqa: F401
    from .elastic import EXIT_EVICTED, init_distributed, node_id  # noqa: F401
    from .errors import (  # noqa: F401
        AntDTError,
        BadRequestError,
        FencedError,
        NotFoundError,
        PayloadTooLargeError,
        RefusedError,
        ServiceError,
        ServiceUnavailableError,
        StaleIncarnationError,
        UnauthorizedError,
        UnknownWorkerError,
    )
    from .launch import ServiceProcess, launch_service  # noqa: F401
    from .server import ShardingService  # noqa: F401
    from .trainer import AntDTTrainer, AntDTTrainerMixin, WeightedHookState, weighted_allreduce_hook  # noqa: F401
