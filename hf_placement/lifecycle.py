"""Process groups that end with their job, not with the interpreter: a clean exit for gloo workers.

Why: a gloo process group runs collectives on its own C++ threads. When a collective completes, the waiting Python
thread returns at once, and a gloo thread drops its last references to that collective's tensors a moment later.
Dropping a tensor that Python created takes the GIL. If the process group is still alive while the interpreter
finalizes, that release can land after finalization has begun: the thread then exits inside a ``noexcept``
destructor and the process dies with SIGABRT, "terminate called without an active exception". The worker has
finished its work, but the launcher sees a crash: torchrun restarts it or fails the job, and accelerate launch
reports a failed rank.

``dist.destroy_process_group()`` alone does not prevent it when something still references the groups:

- ``torch.distributed.nn.functional`` takes ``group.WORLD`` as a default argument. If the module is first imported
  after ``init_process_group``, those defaults hold the default group for the life of the process. Creating the
  first optimizer imports it, through ``torch._dynamo``.
- Caches of built groups hold them too: the base's topology and role-group caches.

`release_process_groups` drops those references and destroys every group. Groups with no other holder are freed
then, and freeing a gloo group joins its threads while the interpreter is still whole. Some groups stay alive because
other objects still reference them: DeepSpeed keeps its groups on every ZeRO-3 parameter and on its engine. For
those, the release waits until the groups' threads have gone idle, and it returns their names.

`release_process_groups_at_exit` registers the release to run when the interpreter exits. The trainers and
accelerators of this project call it, so a user's script needs no change.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import threading
import time
import weakref

import torch.distributed as dist

__all__ = ["release_process_groups", "release_process_groups_at_exit"]

logger = logging.getLogger(__name__)

_registered = False
_lock = threading.Lock()


def _unpin_nn_functional_defaults() -> int:
    """Replace process-group default arguments of ``torch.distributed.nn``'s functions by None (the default group,
    the same meaning), so they stop holding the group that was current at import. ``torch.distributed.nn``
    re-exports the functions of its ``functional`` module, and both namespaces are scanned. Returns how many
    functions were changed."""
    import sys

    replaced = 0
    for name in ("torch.distributed.nn.functional", "torch.distributed.nn"):
        module = sys.modules.get(name)
        for fn in vars(module).values() if module is not None else ():
            if not callable(fn):
                continue
            defaults = getattr(fn, "__defaults__", None)
            if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
                fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)
                replaced += 1
            kwdefaults = getattr(fn, "__kwdefaults__", None)
            if kwdefaults and any(isinstance(d, dist.ProcessGroup) for d in kwdefaults.values()):
                fn.__kwdefaults__ = {k: None if isinstance(d, dist.ProcessGroup) else d for k, d in kwdefaults.items()}
                replaced += 1
    return replaced


def _live_groups() -> list[dist.ProcessGroup]:
    """Every process group torch.distributed knows about (the default one first)."""
    from torch.distributed import distributed_c10d as c10d

    groups = list(c10d._world.pg_map)  # insertion order: the default group is created first
    return groups


def release_process_groups() -> list[str]:
    """Destroy every process group of this process. Drop the references this project and ``torch.distributed.nn``
    hold, so that each gloo group is freed, and its threads joined, while the interpreter is still alive.

    Returns the names of the groups that are still alive afterwards, because something outside this function holds
    them (an engine, a model's parameters). Those are freed only when their holder is; the call then waits for their
    threads to go idle, and logs them at debug level. The references are dropped even when the script has already
    called ``destroy_process_group()``: a group that only ``torch.distributed.nn`` still held is freed then. Safe
    to call when torch.distributed is unavailable or not initialized, and safe to call twice.
    """
    if not dist.is_available():
        return []
    from . import groups as _groups
    from . import topology as _topology

    initialized = dist.is_initialized()
    refs = [(getattr(pg, "group_name", "?"), weakref.ref(pg)) for pg in _live_groups()] if initialized else []
    _unpin_nn_functional_defaults()
    _topology._TOPOLOGY_CACHE.clear()
    _groups._ROLE_GROUPS_CACHE.clear()
    if not initialized:
        return []
    dist.destroy_process_group()
    alive = [name for name, ref in refs if ref() is not None]
    if alive:
        gc.collect()  # a group inside a reference cycle is freed here, not at finalization
        alive = [name for name, ref in refs if ref() is not None]
    if alive:
        logger.debug("process groups %s outlive destroy_process_group(): something else still references them (an "
                     "engine, a model's parameters); waiting for their threads to go idle instead", alive)
        _wait_for_threads_to_settle()
    return alive


def _runnable_threads() -> int | None:
    """How many threads of this process, other than the caller, are running or waiting for a CPU (state R in
    ``/proc/self/task/*/stat``). None where ``/proc`` is unavailable."""
    me = threading.get_native_id()
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return None
    runnable = 0
    for tid in tids:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        runnable += state == "R"
    return runnable


def _wait_for_threads_to_settle(max_wait_s: float = 0.5, poll_s: float = 0.01, quiet_polls: int = 3) -> None:
    """Sleep (GIL released) until no other thread has been runnable for ``quiet_polls`` polls in a row, at most
    ``max_wait_s``.

    A gloo group that something else still holds keeps its threads until the interpreter finalizes. Each of those
    threads may still be about to drop a finished collective's tensors, and that needs the GIL. Sleeping here releases
    the GIL, so they can do it while the interpreter is still whole. This narrows the window but cannot close it: a
    thread could stay descheduled for longer than the wait. Only freeing the group joins its threads for certain.
    """
    deadline, quiet = time.monotonic() + max_wait_s, 0
    while quiet < quiet_polls and time.monotonic() < deadline:
        time.sleep(poll_s)
        runnable = _runnable_threads()
        if runnable is None:
            time.sleep(max(0.0, min(0.1, deadline - time.monotonic())))
            return
        quiet = quiet + 1 if runnable == 0 else 0


def _release_at_exit() -> None:
    try:
        release_process_groups()
    except Exception as exc:  # an exit hook must not turn a finished run into a failed one
        logger.warning("releasing the process groups at exit failed: %s", exc)


def release_process_groups_at_exit() -> None:
    """Register `release_process_groups` to run once when the interpreter exits (idempotent). Trainers and
    accelerators call this when they start, because user scripts rarely destroy their process group."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(_release_at_exit)
            _registered = True
