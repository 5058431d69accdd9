"""Run a function on N gloo ranks on CPU: the harness every distributed test, example and benchmark shares.

Why a harness of our own rather than ``torch.multiprocessing.spawn``: a test needs (1) a free rendezvous port picked
for it, (2) a timeout on every collective *and* on the whole call, so a stalled rank becomes an error that names it
instead of a hung CI job, (3) the failing rank's own traceback in the parent, and (4) the other ranks torn down at
once when one fails (their pending collectives would otherwise wait for the gloo timeout).

Example:

```python
import torch
import torch.distributed as dist
from hf_placement.testing import run_distributed


def all_reduce_sum(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


if __name__ == "__main__":
    print(run_distributed(all_reduce_sum, world_size=2))  # [3.0, 3.0]
```

The function must be importable by the child processes (defined at module level), because ranks are started with the
``spawn`` method by default: fork is unsafe once torch has started threads. A spawned rank imports its modules afresh
(torch and transformers take seconds). A process that starts many short runs, such as a test session, can call
``set_start_method("forkserver", preload=[...])`` once: a server process imports the listed modules once, before any
thread work, and every later rank is forked from it. The setting is this process's alone; the processes it starts
keep the default. Either way a rank sees the caller's environment as it is at the call.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from ..lifecycle import release_process_groups

__all__ = ["RankError", "RankTimeoutError", "find_free_port", "run_distributed", "set_start_method"]

_START_METHODS = ("spawn", "forkserver")
_default_start_method = "spawn"


class RankError(RuntimeError):
    """A rank raised. ``rank`` names it and ``remote_traceback`` is its traceback as text."""

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str):
        self.rank = rank
        self.exc_type = exc_type
        self.remote_message = message
        self.remote_traceback = remote_traceback
        super().__init__(f"rank {rank} failed with {exc_type}: {message}\n--- traceback of rank {rank} ---\n"
                         f"{remote_traceback}")


class RankTimeoutError(TimeoutError):
    """Some ranks did not finish within the timeout; ``ranks`` lists them."""

    def __init__(self, ranks: Sequence[int], timeout: float):
        self.ranks = list(ranks)
        super().__init__(
            f"rank(s) {self.ranks} did not finish within {timeout:.0f} s (stalled or deadlocked in a collective). "
            "Raise `timeout` if the work is legitimately slow."
        )


def find_free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check_start_method(method: str) -> str:
    if method not in _START_METHODS:
        raise ValueError(f"start method {method!r} is not one of {_START_METHODS}: ranks are started with spawn, "
                         "or forked from a fork server.")
    return method


def set_start_method(method: str, preload: Sequence[str] = ()) -> None:
    """This process's default way of starting `run_distributed` ranks.

    Args:
        method (`str`): `"spawn"` (the default: every rank a fresh interpreter) or `"forkserver"` (ranks forked from
            one server process, which imports ``preload`` once).
        preload (`Sequence[str]`, *optional*): modules the fork server imports when it starts, which happens at the
            first forkserver run of this process; later calls cannot change what a running server holds. A module
            that fails to import there is imported by each rank as usual. Ranks get the caller's environment, but a
            variable that a preloaded module reads only when it is imported keeps the value it had when the server
            started.
    """
    global _default_start_method
    _default_start_method = _check_start_method(method)
    if method == "forkserver" and preload:
        mp.get_context("forkserver").set_forkserver_preload(list(preload))


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str,
               collective_timeout: float, threads: int, caller_env: dict[str, str], env: dict[str, str],
               args: tuple, kwargs: dict, results: Any) -> None:
    try:
        # A forked-from-server rank starts with the server's environment, not the caller's: restore the caller's.
        if os.environ != caller_env:
            os.environ.clear()
            os.environ.update(caller_env)
        os.environ.update(env)
        # one "node" by default; env={"LOCAL_WORLD_SIZE": "2"} emulates nodes of 2 ranks (as torchrun would set it)
        local = int(env.get("LOCAL_WORLD_SIZE", world_size))
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                           "LOCAL_RANK": str(rank % local), "WORLD_SIZE": str(world_size),
                           "LOCAL_WORLD_SIZE": str(local), "OMP_NUM_THREADS": str(threads)})
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        try:
            value = fn(rank, world_size, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
            # Report before the process group is torn down: closing this rank's sockets makes its peers fail with
            # connection errors, and the parent should see the root cause first.
            results.put((rank, "error", (type(exc).__name__, str(exc), traceback.format_exc())))
            return
        finally:
            # destroy without a barrier: a barrier here would hang if a peer already failed.
            release_process_groups()
        results.put((rank, "ok", value))
    except BaseException as exc:  # noqa: BLE001 - failures while starting up or tearing down
        results.put((rank, "error", (type(exc).__name__, str(exc), traceback.format_exc())))


# Messages of errors that a rank gets because a *peer* went away (its sockets closed), not because of its own work.
_PEER_FAILURE_MARKERS = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "Broken pipe",
                         "NCCL communicator was aborted")


def _is_peer_failure(message: str) -> bool:
    return any(marker in message for marker in _PEER_FAILURE_MARKERS)


def _root_cause(first: tuple[int, str, str, str], results: Any, procs: list, values: dict,
                grace_s: float = 2.0) -> RankError:
    """The error to report once some rank failed: a rank's own failure rather than a peer's connection error.

    When one rank raises, its peers often fail a moment later in a pending collective with "connection closed"; their
    reports can reach the queue first. Collect reports for a short grace period and prefer one that is not such an
    echo.
    """
    errors = [first]
    deadline = time.monotonic() + grace_s
    while _is_peer_failure(first[2]) and time.monotonic() < deadline:
        if all(r in values or r in {e[0] for e in errors} for r in range(len(procs))):
            break
        try:
            rank, status, payload = results.get(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
        except queue.Empty:
            continue
        if status == "error":
            errors.append((rank, *payload))
            if not _is_peer_failure(payload[1]):
                break
    rank, exc_type, message, tb = next((e for e in errors if not _is_peer_failure(e[2])), errors[0])
    return RankError(rank, exc_type, message, tb)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    collective_timeout: float | None = None,
    backend: str = "gloo",
    threads_per_rank: int = 1,
    env: dict[str, str] | None = None,
    start_method: str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes joined in one process group.

    Args:
        fn (`Callable`): module-level function; its return value must be picklable.
        world_size (`int`): number of ranks (processes).
        timeout (`float`, *optional*, defaults to 120): seconds for the whole call; ranks still running then are
            killed and a `RankTimeoutError` names them.
        collective_timeout (`float`, *optional*): timeout of every collective of the default group; defaults to
            `timeout`.
        backend (`str`, *optional*, defaults to `"gloo"`): `torch.distributed` backend.
        threads_per_rank (`int`, *optional*, defaults to 1): `torch.set_num_threads` in each rank, so N ranks do not
            oversubscribe a small machine.
        env (`dict`, *optional*): extra environment variables for the ranks.
        start_method (`str`, *optional*): `"spawn"` or `"forkserver"` (see `set_start_method`); defaults to this
            process's default, `"spawn"` unless `set_start_method` changed it.

    Returns:
        `list`: the return values, indexed by rank.

    Raises:
        `RankError`: the first rank that raised, with its traceback; the other ranks are terminated.
        `RankTimeoutError`: ranks that neither returned nor raised within `timeout`.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}.")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}.")
    ctx = mp.get_context(_check_start_method(start_method or _default_start_method))
    results = ctx.Queue()
    port = find_free_port()
    coll_timeout = float(collective_timeout if collective_timeout is not None else timeout)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, backend, coll_timeout, threads_per_rank, dict(os.environ),
                  dict(env or {}), args, kwargs, results),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RankTimeoutError(sorted(set(range(world_size)) - set(values)), timeout)
            try:
                rank, status, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode is not None]
                if dead:
                    # A rank can die without reporting (SIGKILL, segfault, os._exit); give its message a moment.
                    try:
                        rank, status, payload = results.get(timeout=1.0)
                    except queue.Empty:
                        r = dead[0]
                        raise RankError(r, "ProcessExit", f"process exited with code {procs[r].exitcode} "
                                        "without reporting a result",
                                        "(no Python traceback: the process died)") from None
                else:
                    continue
            if status == "error":
                raise _root_cause((rank, *payload), results, procs, values)
            values[rank] = payload
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=0.0 if len(values) < world_size else 10.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=10.0)
        results.close()
    return [values[r] for r in range(world_size)]
