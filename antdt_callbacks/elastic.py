"""Process-group start-up that survives ``torchrun --max-restarts`` group restarts.

Why: torchrun's agent keeps one TCPStore across restarts of the worker group, and the default group's gloo
rendezvous keys do not change between attempts, so a restarted rank can read the *dead* attempt's peer addresses
and hang in ``connectFullMesh`` (observed with torch 2.13, ``--standalone``, gloo). Prefixing the store with the
restart count gives every attempt its own keys. Call `init_distributed` before building ``TrainingArguments``;
Accelerate then adopts the initialised group.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

__all__ = ["init_distributed"]


def init_distributed(backend: str = "gloo", timeout_s: float = 600.0) -> bool:
    """Initialise the default process group from torchrun's environment with an attempt-scoped store.

    Returns ``False`` (and does nothing) outside a multi-process launch or when a group already exists."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or dist.is_initialized():
        return False
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be positive: collectives without a timeout can hang forever.")
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    timeout = datetime.timedelta(seconds=timeout_s)
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                         is_master=False if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else rank == 0,
                         timeout=timeout)
    store = dist.PrefixStore(f"antdt/attempt_{attempt}", base)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return True
