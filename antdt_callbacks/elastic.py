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
import signal
import socket
import time

import torch
import torch.distributed as dist

__all__ = ["EXIT_EVICTED", "init_distributed", "leave_node", "node_id"]

EXIT_EVICTED = 76
"""Exit code of a worker whose node was evicted (it stops its torchrun agent first, so the agent does not restart
it and leaves the rendezvous; the remaining agents re-form the job without the node)."""


def node_id() -> str:
    """The name of the node this process runs on: ``$ANTDT_NODE_ID``, else the emulated cluster's ``$HFSP_NODE``,
    else the host name. The service blacklists nodes by this name, so every worker of one node must agree on it."""
    explicit = os.environ.get("ANTDT_NODE_ID")
    if explicit:
        return explicit
    if os.environ.get("HFSP_NODE"):
        return f"node{os.environ['HFSP_NODE']}"
    return socket.gethostname()


def leave_node(code: int = EXIT_EVICTED, grace_s: float = 60.0) -> None:
    """Take this node out of the elastic job: SIGTERM the torchrun agent that launched this worker (a signalled agent
    stops its workers and exits *without* closing the rendezvous, so the other agents can re-form; an agent left
    running would restart this worker into the next round), then wait to be stopped with it. Outside torchrun, or
    if the agent does not stop us within ``grace_s``, exit with ``code``."""
    agent = os.getppid()
    if os.environ.get("TORCHELASTIC_RUN_ID") and agent > 1:
        try:
            os.kill(agent, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            time.sleep(0.1)
    os._exit(code)


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> bool:
    """Initialise the default process group from torchrun's environment with an attempt-scoped store.

    ``backend`` defaults to NCCL for GPU ranks (each takes ``cuda:LOCAL_RANK``), with gloo beside it for the CPU
    tensors AntDT exchanges (``"cpu:gloo,cuda:nccl"``), and to gloo on CPU-only hosts. Returns ``False`` (and does
    nothing) outside a multi-process launch or when a group already exists."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or dist.is_initialized():
        return False
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be positive: collectives without a timeout can hang forever.")
    rank = int(os.environ["RANK"])
    if backend is None:
        backend = "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            backend = "cpu:gloo,cuda:nccl"
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
