"""Process-group start-up that survives ``torchrun --max-restarts`` group restarts.

Why: torchrun's agent keeps one TCPStore across restarts of the worker group, and the default group's gloo
rendezvous keys do not change between attempts, so a restarted rank can read the *dead* attempt's peer addresses
and hang in ``connectFullMesh`` (observed with torch 2.13, ``--standalone``, gloo). Prefixing the store with the
restart count gives every attempt its own keys. Call `init_distributed` before building ``TrainingArguments``;
Accelerate then adopts the initialised group.

Only the shared store needs that prefix. Without it (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, what a multi-node job
that re-forms with a replacement node needs), rank 0 hosts a new store on a new port in every rendezvous round, so
there are no stale keys; and the restart count is per *agent*, not per job: after a node dies, the surviving agent
counts a failure restart while a replacement agent starts from 0 (or an agent restarts for the membership change
without counting), so ranks of one round would use different prefixes and never meet (observed on two emulated
nodes, tests/multinode/test_multinode_antdt.py). A fixed prefix is used there.
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
    timeout = datetime.timedelta(seconds=timeout_s)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                         is_master=False if agent_store else rank == 0, timeout=timeout)
    # a store shared across attempts needs per-attempt keys; a store of this round only must not depend on the
    # per-agent restart count (see the module docstring)
    prefix = f"antdt/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}" if agent_store else "antdt/round"
    store = dist.PrefixStore(prefix, base)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return True
