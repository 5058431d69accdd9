"""Real multi-node launches on the emulated cluster: one launcher agent (``torchrun`` / ``accelerate launch``) per node.

Why: `EmulatedCluster.run` starts every rank itself with the environment torchrun would set, so the code paths that
only a real launcher exercises stay untested: the c10d rendezvous, one elastic agent per node, ``RANK`` assigned by
the rendezvous rather than by us, ``LOCAL_WORLD_SIZE`` as the agent sets it (what the intra/inter topology is derived
from), and agent restarts. Here each node of the emulated cluster (a network namespace with its own address) runs a
real launcher agent; node 0 hosts the c10d rendezvous store.

Usage::

    from hf_placement.testing.multinode import MultiNodeCluster

    with MultiNodeCluster() as cluster:                              # two nodes; skip_unless_available() in tests
        agents = cluster.torchrun("worker.py", ["--steps", "2"], nproc_per_node=2, timeout=120)
        print(agents[0].json_lines())                                # JSON lines node 0's workers printed
        agents = cluster.accelerate("train.py", nproc_per_node=1, env={"PARO_CONFIG_FILE": "paro.yaml"})

Each agent gets ``HFSP_NODE`` (its node index), ``HFSP_NODE_ADDR``, ``GLOO_SOCKET_IFNAME`` (its interface) and
``OMP_NUM_THREADS=1``; its workers inherit them, so a worker can check that its node-local group really is one node.
Every agent and the whole run have timeouts, the rendezvous has a join timeout, and a failure raises
`MultiNodeError` naming the node and launcher with the agent's stderr tail (workers' output goes through their
agent). Whatever happens, every process started in a namespace is killed and the namespaces are removed on exit.

A service the launches talk to (a sharding or parameter server on node 0, reachable from every node at
``cluster.addresses[0]``) runs in a node's namespace with `MultiNodeCluster.node_argv`; `register_service` (or
`start_service`, which does both) keeps it alive across launches, whose cleanup otherwise kills everything in the
namespaces. It still dies with its node (`MultiNodeRun.kill_node`) and on exit::

    svc = cluster.start_service(0, [sys.executable, "-m", "my_service", "--host", cluster.addresses[0]])
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .emulated_cluster import EmulatedCluster, EmulationUnavailable, RankResult, _free_port, _sh

__all__ = ["AgentResult", "MultiNodeCluster", "MultiNodeError", "MultiNodeRun", "multinode_unavailable_reason",
           "skip_unless_available"]

_GRACE_S = 5.0  # after an agent fails, how long its peers get to report their own errors before they are killed


class MultiNodeError(RuntimeError):
    """An agent of a multi-node launch failed, or the run (or one agent) exceeded its timeout."""


@dataclass
class AgentResult(RankResult):
    """What one launcher agent left behind (its workers' output included). ``rank`` is the node index."""

    launcher: str = ""

    @property
    def node(self) -> int:
        return self.rank

    def json_lines(self) -> list[dict]:
        """Every JSON object a worker printed on a line of its own, in order (workers report results this way).

        The workers of one agent share its stdout, so two reports printed at the same moment can land on one line
        (``print`` writes the text and the newline separately): each line is scanned for consecutive objects.
        """
        decoder = json.JSONDecoder()
        out = []
        for line in self.stdout.splitlines():
            line, pos = line.strip(), 0
            while line.startswith("{", pos):
                try:
                    obj, pos = decoder.raw_decode(line, pos)
                except json.JSONDecodeError:
                    break
                if isinstance(obj, dict):
                    out.append(obj)
        return out


def multinode_unavailable_reason() -> str | None:
    """Why this machine cannot run the emulated multi-node launches, or None when it can."""
    if os.geteuid() != 0:
        return "multi-node launch tests need root (CAP_NET_ADMIN) to create network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"multi-node launch tests need iproute2 (`{tool}` not found)"
    probe = f"hfspprobe{os.getpid()}"
    made = _sh("ip", "netns", "add", probe, check=False)
    _sh("ip", "netns", "del", probe, check=False)
    if made.returncode != 0:
        return f"network namespaces are unavailable here: {made.stderr.strip()}"
    if shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None:
        return f"torchrun is not installed next to {sys.executable}"
    return None


def skip_unless_available() -> None:
    """`pytest.skip` with the reason when `multinode_unavailable_reason` finds one (call it from a test)."""
    reason = multinode_unavailable_reason()
    if reason is not None:
        import pytest

        pytest.skip(reason)


def _bin(name: str) -> str:
    """The launcher next to this interpreter (the venv's), so agents use the same torch as the test."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


class MultiNodeRun:
    """Launcher agents running, one per node; `wait` collects them. Built by `MultiNodeCluster.start`.

    One launch at a time per cluster: `close` (called by `wait`) kills every process in the nodes' namespaces.
    """

    def __init__(self, cluster: MultiNodeCluster, argvs: Sequence[Sequence[str]], envs: Sequence[dict[str, str]],
                 launcher: str, agent_timeout: float):
        self.cluster, self.launcher, self.agent_timeout = cluster, launcher, agent_timeout
        self.argvs, self.envs = [list(a) for a in argvs], [dict(e) for e in envs]
        self.logdir = Path(tempfile.mkdtemp(prefix="hfsp-multinode-"))
        self.start_time = time.perf_counter()
        self.procs: list[subprocess.Popen] = []
        self.started: list[float] = []
        self.ended: dict[int, float] = {}
        self._files: list = []
        for node in range(len(self.argvs)):
            self._spawn(node, append=False)

    def _spawn(self, node: int, append: bool) -> None:
        mode = "a+" if append else "w+"
        out = open(self.logdir / f"node{node}.out", mode)  # closed in close()
        err = open(self.logdir / f"node{node}.err", mode)
        self._files.append((out, err))
        proc = subprocess.Popen(["ip", "netns", "exec", self.cluster.namespaces[node], *self.argvs[node]],
                                env=self.envs[node], stdout=out, stderr=err, start_new_session=True)
        if append:
            self.procs[node], self.started[node] = proc, time.perf_counter()
            self.ended.pop(node, None)
        else:
            self.procs.append(proc)
            self.started.append(time.perf_counter())

    def kill_node(self, node: int) -> None:
        """SIGKILL every process in the node's namespace (its agent and all its workers): the node dies. Unless
        `restart_agent` replaces it, `wait` reports the node as failed."""
        self.cluster.kill_namespace(node)
        self.procs[node].wait(timeout=30)
        self.ended[node] = time.perf_counter() - self.start_time

    def restart_agent(self, node: int) -> None:
        """Start the node's agent again with the same command (a replacement node joining the rendezvous)."""
        if self.procs[node].poll() is None:
            raise RuntimeError(f"node {node}'s agent is still running; kill_node({node}) first")
        self._spawn(node, append=True)

    def wait_for(self, path: str | os.PathLike, timeout: float) -> None:
        """Block until ``path`` exists (a worker's progress marker); raise `MultiNodeError` if an agent exits first
        or ``timeout`` passes."""
        deadline = time.perf_counter() + timeout
        while not Path(path).exists():
            dead = [n for n, p in enumerate(self.procs) if p.poll() is not None]
            if dead or time.perf_counter() > deadline:
                why = f"node {dead[0]}'s agent exited first" if dead else f"not within {timeout:.0f}s"
                message = f"waiting for {path}: {why}.\n{self._tails(dead or range(len(self.procs)))}"
                self.close()
                raise MultiNodeError(message)
            time.sleep(0.05)

    def wait_for_log(self, node: int, text: str, timeout: float) -> None:
        """Block until ``text`` appears in ``node``'s agent stderr (an agent event, e.g. a worker failure it saw);
        raise `MultiNodeError` with every node's tail if ``timeout`` passes first."""
        deadline = time.perf_counter() + timeout
        path = self.logdir / f"node{node}.err"
        while text not in path.read_text(errors="replace"):
            if time.perf_counter() > deadline:
                message = f"waiting for {text!r} in node {node}'s log: not within {timeout:.0f}s.\n"
                message += self._tails(range(len(self.procs)))
                self.close()
                raise MultiNodeError(message)
            time.sleep(0.05)

    def wait(self, timeout: float) -> list[AgentResult]:
        """Wait for every agent; raise `MultiNodeError` on a failed agent or a timeout, else return the results."""
        failed_at = None
        nodes = range(len(self.procs))
        try:
            while len(self.ended) < len(self.procs):
                now = time.perf_counter()
                for node in nodes:
                    proc = self.procs[node]
                    if node not in self.ended and proc.poll() is not None:
                        self.ended[node] = now - self.start_time
                        if proc.returncode != 0 and failed_at is None:
                            failed_at = now
                late = [n for n in nodes if n not in self.ended and now - self.started[n] > self.agent_timeout]
                if (failed_at is not None and now - failed_at > _GRACE_S) or now - self.start_time > timeout or late:
                    break
                time.sleep(0.05)
            running = [n for n in nodes if n not in self.ended]
            results = self._results()
        finally:
            self.close()
        failed = [r for r in results if r.node not in running and r.returncode != 0]
        if failed:
            first = min(failed, key=lambda r: r.wall_s)
            others = [n for n in nodes if n != first.node]
            raise MultiNodeError(
                f"node {first.node}'s agent ({self.launcher}) failed with exit code {first.returncode} (failed "
                f"nodes: {[r.node for r in failed]}, killed: {running}); its stderr tail:\n{first.stderr[-4000:]}"
                + (f"\n{self._tails(others, results)}" if others else ""))
        if running:
            raise MultiNodeError(
                f"{self.launcher} run exceeded its timeout (run {timeout:.0f}s, agent {self.agent_timeout:.0f}s); "
                f"agents still running (killed): nodes {running}.\n{self._tails(running, results)}")
        return results

    def _results(self) -> list[AgentResult]:
        out = []
        for node in range(len(self.procs)):
            text = [(self.logdir / f"node{node}.{k}").read_text(errors="replace") for k in ("out", "err")]
            code = self.procs[node].returncode if node in self.ended else -9
            out.append(AgentResult(rank=node, returncode=-9 if code is None else code, stdout=text[0],
                                   stderr=text[1], wall_s=self.ended.get(node, time.perf_counter() - self.start_time),
                                   launcher=self.launcher))
        return out

    def _tails(self, nodes: Sequence[int], results: list[AgentResult] | None = None) -> str:
        results = results or self._results()
        return "\n".join(f"--- node {n} ({self.launcher}) stderr tail ---\n{results[n].stderr[-2000:]}" for n in nodes)

    def close(self) -> None:
        """Kill whatever still runs in the namespaces (agents and orphaned workers, not the registered services) and
        drop the logs."""
        for node, proc in enumerate(self.procs):
            if proc.poll() is None:
                self.cluster.kill_namespace(node, services=False)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
        for node in range(len(self.procs)):
            # workers start their own sessions: they can outlive their agent. Registered services stay.
            self.cluster.kill_namespace(node, services=False)
        for out, err in self._files:
            out.close()
            err.close()
        self._files = []
        shutil.rmtree(self.logdir, ignore_errors=True)


class MultiNodeCluster:
    """Two emulated nodes, each running one real launcher agent per launch; c10d rendezvous on node 0.

    Args:
        inter_mbit (`float`, *optional*, defaults to 1000): inter-node link rate; tests want it fast, benchmarks slow.
        rdzv_timeout_s (`float`, *optional*, defaults to 60): rendezvous join timeout of every agent.
    """

    def __init__(self, inter_mbit: float = 1000.0, rdzv_timeout_s: float = 60.0):
        self.emulated = EmulatedCluster(nodes=2, procs_per_node=1, inter_mbit=inter_mbit)
        self.rdzv_timeout_s = rdzv_timeout_s
        self.namespaces, self.interfaces, self.addresses = (self.emulated.namespaces, self.emulated.interfaces,
                                                            self.emulated.addresses)
        self._workdir: Path | None = None
        self._runs: list[MultiNodeRun] = []
        self._services: list[subprocess.Popen] = []

    @property
    def nodes(self) -> int:
        return self.emulated.nodes

    def __enter__(self) -> MultiNodeCluster:
        reason = multinode_unavailable_reason()
        if reason is not None:
            raise EmulationUnavailable(reason)
        self.emulated.start()
        self._workdir = Path(tempfile.mkdtemp(prefix="hfsp-multinode-cfg-"))
        return self

    def __exit__(self, *exc: object) -> None:
        for run in self._runs:
            run.close()
        for node in range(self.nodes):  # services; deleting a namespace does not end the processes inside it
            self.kill_namespace(node)
        for proc in self._services:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.emulated.stop()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)

    def kill_namespace(self, node: int, services: bool = True) -> None:
        """SIGKILL every process in the node's namespace; with ``services=False``, not the registered services."""
        pids = _sh("ip", "netns", "pids", self.namespaces[node], check=False).stdout.split()
        if not services:
            alive = {str(p.pid) for p in self._services if p.poll() is None}
            pids = [pid for pid in pids if pid not in alive]
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    # -- services ----------------------------------------------------------------------------------------------------
    def node_argv(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``node``'s namespace (``ip netns exec`` execs it: the process keeps the pid). A server
        started this way is reachable from every node at ``addresses[node]`` when it binds that address."""
        return ["ip", "netns", "exec", self.namespaces[node], *argv]

    def register_service(self, proc: subprocess.Popen) -> subprocess.Popen:
        """Keep ``proc`` (started with `node_argv`) alive across launches: a launch's cleanup spares it; it dies with
        its node (`MultiNodeRun.kill_node`) and when the cluster exits."""
        self._services.append(proc)
        return proc

    def start_service(self, node: int, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """`subprocess.Popen` of ``argv`` in ``node``'s namespace, registered as a service (`register_service`)."""
        if self._workdir is None:
            raise RuntimeError("MultiNodeCluster.start_service() outside `with MultiNodeCluster(...)`")
        env = {**os.environ, "OMP_NUM_THREADS": "1", **popen_kwargs.pop("env", {})}
        return self.register_service(subprocess.Popen(self.node_argv(node, argv), env=env, **popen_kwargs))

    # -- environment and command lines ---------------------------------------------------------------------------
    def node_env(self, node: int, env: dict[str, str] | None = None) -> dict[str, str]:
        """The agent's environment: the caller's, plus what identifies the node to its workers."""
        return {**os.environ, **(env or {}), "HFSP_NODE": str(node), "HFSP_NODE_ADDR": self.addresses[node],
                "GLOO_SOCKET_IFNAME": self.interfaces[node], "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                # torchrun's --local-addr as a variable: accelerate launch does not forward the flag, and without it
                # the rendezvous advertises the shared hostname, which resolves to an address outside the namespace
                "PET_LOCAL_ADDR": self.addresses[node]}

    def _rdzv_conf(self, node: int) -> str:
        # is_host explicit: both namespaces share one hostname, so torch cannot tell which node hosts the store.
        # keep_alive_interval=1: a dead node's heartbeat expires after 3 s instead of 15 s, so re-formation is quick.
        return f"is_host={int(node == 0)},join_timeout={int(self.rdzv_timeout_s)},keep_alive_interval=1"

    def torchrun_argv(self, node: int, script: str, args: Sequence[str], nproc_per_node: int, port: int,
                      run_id: str, max_restarts: int = 0) -> list[str]:
        return [_bin("torchrun"), "--nnodes", str(self.nodes), "--nproc-per-node", str(nproc_per_node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.addresses[0]}:{port}", "--rdzv-id", run_id,
                "--rdzv-conf", self._rdzv_conf(node), "--local-addr", self.addresses[node],
                "--max-restarts", str(max_restarts), "--monitor-interval", "0.5", str(script), *args]

    def write_accelerate_config(self, node: int, nproc_per_node: int, port: int,
                                extra: dict[str, object] | None = None) -> Path:
        """The per-machine Accelerate config of ``node`` (machine_rank differs per machine, as on a real cluster)."""
        import yaml

        assert self._workdir is not None, "use MultiNodeCluster as a context manager"
        cfg = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "use_cpu": True,
               "mixed_precision": "no", "num_machines": self.nodes, "num_processes": self.nodes * nproc_per_node,
               "machine_rank": node, "main_process_ip": self.addresses[0], "main_process_port": port,
               "rdzv_backend": "c10d", "same_network": False, "main_training_function": "main", **(extra or {})}
        path = self._workdir / f"accelerate_node{node}_{port}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def accelerate_argv(self, node: int, script: str, args: Sequence[str], config_file: Path, port: int) -> list[str]:
        return [_bin("accelerate"), "launch", "--config_file", str(config_file), "--num_machines", str(self.nodes),
                "--machine_rank", str(node), "--main_process_ip", self.addresses[0], "--main_process_port", str(port),
                "--rdzv_conf", self._rdzv_conf(node), "--monitor_interval", "0.5", str(script), *args]

    # -- launching -------------------------------------------------------------------------------------------------
    def start(self, argvs: Sequence[Sequence[str]], launcher: str, env: dict[str, str] | None = None,
              agent_timeout: float = 180.0) -> MultiNodeRun:
        """Start one agent per node (``argvs[node]`` inside the node's namespace) and return the running launch."""
        if self._workdir is None:
            raise RuntimeError("MultiNodeCluster.start() outside `with MultiNodeCluster(...)`")
        run = MultiNodeRun(self, argvs, [self.node_env(n, env) for n in range(self.nodes)], launcher, agent_timeout)
        self._runs.append(run)
        return run

    def start_torchrun(self, script: str, args: Sequence[str] = (), *, nproc_per_node: int = 1, max_restarts: int = 0,
                       env: dict[str, str] | None = None, agent_timeout: float = 180.0) -> MultiNodeRun:
        port = _free_port()
        run_id = f"hfsp{os.getpid()}_{port}"
        if max_restarts > 0:
            # torch >= 2.4 shares the rendezvous store with the workers and publishes MASTER_ADDR only in an agent's
            # first round: a replacement agent joining a later round (a node that came back) waits for that key
            # until its store timeout. Opting out of the sharing makes rank 0 publish it in every round.
            env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})}
        argvs = [self.torchrun_argv(n, script, args, nproc_per_node, port, run_id, max_restarts)
                 for n in range(self.nodes)]
        return self.start(argvs, "torchrun", env, agent_timeout)

    def torchrun(self, script: str, args: Sequence[str] = (), *, nproc_per_node: int = 1, max_restarts: int = 0,
                 env: dict[str, str] | None = None, timeout: float = 180.0) -> list[AgentResult]:
        """``torchrun --nnodes 2 --rdzv-backend c10d`` on every node; returns the agents' results by node."""
        run = self.start_torchrun(script, args, nproc_per_node=nproc_per_node, max_restarts=max_restarts, env=env,
                                  agent_timeout=timeout)
        return run.wait(timeout)

    def accelerate(self, script: str, args: Sequence[str] = (), *, nproc_per_node: int = 1,
                   env: dict[str, str] | None = None, config_extra: dict[str, object] | None = None,
                   timeout: float = 180.0) -> list[AgentResult]:
        """``accelerate launch --num_machines 2 --machine_rank R`` with a per-machine config on every node."""
        port = _free_port()
        argvs = [self.accelerate_argv(n, script, args, self.write_accelerate_config(n, nproc_per_node, port,
                                                                                    config_extra), port)
                 for n in range(self.nodes)]
        return self.start(argvs, "accelerate launch", env, timeout).wait(timeout)
