"""An emulated two-node cluster on one Linux machine, for communication benchmarks.

Why: PaRO's gains come from keeping traffic off the slow inter-node link. On one machine every rank talks over
loopback at the same speed, so nothing distinguishes intra- from inter-node collectives. Two network namespaces
joined by a veth pair whose both ends carry a ``tbf`` qdisc give each emulated node its own address and a shaped
link between them, while ranks inside one namespace keep talking over the (fast) loopback path. The recipe is the
one in ``shared/docs/ARCHITECTURE.md``; it needs root (CAP_NET_ADMIN) and iproute2 (``ip``, ``tc``).

Usage::

    from hf_placement.testing.emulated_cluster import EmulatedCluster

    with EmulatedCluster(nodes=2, procs_per_node=2, inter_mbit=400) as cluster:
        print(cluster.measure_bandwidth())            # {"inter_mb_s": ..., "intra_mb_s": ..., "ratio": ...}
        before = cluster.inter_node_bytes()
        results = cluster.run([sys.executable, "worker.py", "--steps", "8"], timeout=600)
        crossed = cluster.inter_node_bytes() - before
        rank0 = results[0].last_json()                # the last JSON line the worker printed

Every rank is started inside its node's namespace with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK,
MASTER_ADDR (node 0's address), MASTER_PORT, GLOO_SOCKET_IFNAME (its node's interface) and OMP_NUM_THREADS=1, so
``torch.distributed.init_process_group("gloo")`` with the env:// method works unchanged. A rank that fails or a run
that exceeds its timeout raises :class:`ClusterRunError` naming the rank(s) and showing the tail of their stderr;
the other ranks are killed, never left hanging. Namespaces are removed on exit (and stale ones left by a killed
run are removed on the next start).

Run ``python -m hf_placement.testing.emulated_cluster --inter-mbit 400`` to check the set-up and print measured
bandwidths.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_PREFIX = "hfsp"


class EmulationUnavailable(RuntimeError):
    """The machine cannot host the emulation (not root, no iproute2, no netns support)."""


class ClusterRunError(RuntimeError):
    """A rank of an emulated-cluster run failed or the run timed out."""


@dataclass
class RankResult:
    """What one rank's process left behind."""

    rank: int
    returncode: int
    stdout: str
    stderr: str
    wall_s: float

    def last_json(self) -> dict:
        """The last line of stdout that parses as a JSON object (workers report results this way)."""
        for line in reversed(self.stdout.splitlines()):
            line = line.strip()
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    continue
        raise ClusterRunError(f"rank {self.rank} printed no JSON result line; stdout tail:\n{self.stdout[-2000:]}")


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise EmulationUnavailable(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _remove_stale_namespaces() -> None:
    """Delete namespaces left by a run whose process no longer exists (e.g. a SIGKILLed benchmark)."""
    out = _sh("ip", "netns", "list", check=False).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(_PREFIX):
            continue
        digits = name[len(_PREFIX) :].rstrip("ab")
        if digits.isdigit() and not Path(f"/proc/{int(digits)}").exists():
            _sh("ip", "netns", "del", name, check=False)


class EmulatedCluster:
    """Two emulated nodes (network namespaces) joined by a bandwidth-shaped link.

    Args:
        nodes: number of emulated nodes; two (one veth pair) is what is supported.
        procs_per_node: ranks started in each node by :meth:`run`.
        inter_mbit: rate of the inter-node link in Mbit/s (``tbf`` on both ends, so each direction gets it).
        burst_kb: ``tbf`` bucket size; raised automatically for high rates so the shaper is not the bottleneck.
        latency_ms: ``tbf`` queue latency bound.
    """

    def __init__(
        self,
        nodes: int = 2,
        procs_per_node: int = 2,
        inter_mbit: float = 400.0,
        burst_kb: int = 256,
        latency_ms: int = 100,
    ) -> None:
        if nodes != 2:
            raise ValueError(f"nodes={nodes}: only two emulated nodes (one veth pair) are supported; use nodes=2")
        if procs_per_node < 1:
            raise ValueError(f"procs_per_node={procs_per_node} must be >= 1")
        if inter_mbit <= 0:
            raise ValueError(f"inter_mbit={inter_mbit} must be > 0")
        self.nodes = nodes
        self.procs_per_node = procs_per_node
        self.inter_mbit = float(inter_mbit)
        self.burst_kb = burst_kb
        self.latency_ms = latency_ms
        pid = os.getpid()
        self.namespaces = [f"{_PREFIX}{pid}a", f"{_PREFIX}{pid}b"]
        self.interfaces = [f"hv{pid}a", f"hv{pid}b"]
        subnet = f"10.{100 + pid % 100}.{(pid // 100) % 250}"
        self.addresses = [f"{subnet}.1", f"{subnet}.2"]
        self._up = False

    # -- set-up / tear-down -------------------------------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if os.geteuid() != 0:
            raise EmulationUnavailable(
                "the emulated cluster needs root (CAP_NET_ADMIN) to create network namespaces; run the benchmark "
                "as root or in a container with --cap-add NET_ADMIN"
            )
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise EmulationUnavailable(f"`{tool}` not found: install iproute2")
        _remove_stale_namespaces()
        ns_a, ns_b = self.namespaces
        if_a, if_b = self.interfaces
        atexit.register(self.stop)
        self._up = True
        try:
            _sh("ip", "netns", "add", ns_a)
            _sh("ip", "netns", "add", ns_b)
            _sh("ip", "link", "add", if_a, "type", "veth", "peer", "name", if_b)
            for ns, iface, addr in zip(self.namespaces, self.interfaces, self.addresses, strict=True):
                _sh("ip", "link", "set", iface, "netns", ns)
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
                _sh("ip", "-n", ns, "link", "set", iface, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
            self._apply_rate("add")
        except Exception:
            self.stop()
            raise

    def _tbf_args(self) -> list[str]:
        rate_bytes_per_s = self.inter_mbit * 1e6 / 8
        burst = max(self.burst_kb * 1024, int(rate_bytes_per_s / 100))  # >= 10 ms worth of traffic
        return ["tbf", "rate", f"{self.inter_mbit:g}mbit", "burst", str(burst), "latency", f"{self.latency_ms}ms"]

    def _apply_rate(self, verb: str) -> None:
        for ns, iface in zip(self.namespaces, self.interfaces, strict=True):
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", verb, "dev", iface, "root", *self._tbf_args())

    def set_inter_mbit(self, inter_mbit: float) -> None:
        """Change the inter-node rate in place (for bandwidth sweeps without rebuilding the namespaces)."""
        if inter_mbit <= 0:
            raise ValueError(f"inter_mbit={inter_mbit} must be > 0")
        self.inter_mbit = float(inter_mbit)
        self._apply_rate("change")

    def stop(self) -> None:
        if not self._up:
            return
        for ns in self.namespaces:
            _sh("ip", "netns", "del", ns, check=False)  # deleting a namespace removes its veth end and the pair
        self._up = False

    # -- measurements -------------------------------------------------------------------------------------------
    def inter_node_bytes(self) -> int:
        """Bytes sent through the inter-node link so far, both directions (tx of both veth ends)."""
        total = 0
        for ns, iface in zip(self.namespaces, self.interfaces, strict=True):
            out = _sh("ip", "-n", ns, "-s", "-j", "link", "show", iface).stdout
            total += int(json.loads(out)[0]["stats64"]["tx"]["bytes"])
        return total

    def measure_bandwidth(self, seconds: float = 1.5) -> dict[str, float]:
        """TCP stream throughput between the nodes and inside node 0, in MB/s (1e6 bytes)."""
        inter = self._stream(self.namespaces[1], self.addresses[1], self.namespaces[0], seconds)
        intra = self._stream(self.namespaces[0], self.addresses[0], self.namespaces[0], seconds)
        return {"inter_mb_s": inter, "intra_mb_s": intra, "intra_over_inter": intra / inter}

    def _stream(self, server_ns: str, server_addr: str, client_ns: str, seconds: float) -> float:
        port = _free_port()
        server_code = (
            "import socket,sys;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
            f"s.bind(('{server_addr}',{port}));s.listen(1);print('ready',flush=True);c,_=s.accept();n=0\n"
            "while True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\n"
            "print(n,flush=True)"
        )
        client_code = (
            "import socket,time;s=socket.socket();"
            f"s.connect(('{server_addr}',{port}));buf=b'x'*(1<<20);t=time.perf_counter()\n"
            f"while time.perf_counter()-t<{seconds}: s.sendall(buf)\n"
            "s.shutdown(socket.SHUT_WR);s.recv(1);print(time.perf_counter()-t,flush=True)"
        )
        server = subprocess.Popen(
            ["ip", "netns", "exec", server_ns, sys.executable, "-c", server_code], stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "ready":
                raise EmulationUnavailable("bandwidth probe server did not start")
            client = subprocess.run(
                ["ip", "netns", "exec", client_ns, sys.executable, "-c", client_code],
                capture_output=True,
                text=True,
                timeout=60 + 4 * seconds,
            )
            received = int(server.stdout.readline().strip() or 0)
            server.wait(timeout=30)
            if client.returncode != 0:
                raise EmulationUnavailable(f"bandwidth probe client failed: {client.stderr.strip()}")
            elapsed = float(client.stdout.strip().splitlines()[-1])
        finally:
            if server.poll() is None:
                server.kill()
                server.wait(timeout=30)
            if server.stdout is not None:
                server.stdout.close()
        return received / elapsed / 1e6

    # -- running ranks ------------------------------------------------------------------------------------------
    def rank_env(self, rank: int, master_port: int) -> dict[str, str]:
        """The environment of one rank (what torchrun would set on a real node)."""
        node = rank // self.procs_per_node
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.nodes * self.procs_per_node),
            "LOCAL_RANK": str(rank % self.procs_per_node),
            "LOCAL_WORLD_SIZE": str(self.procs_per_node),
            "NODE_RANK": str(node),
            "GROUP_RANK": str(node),
            "MASTER_ADDR": self.addresses[0],
            "MASTER_PORT": str(master_port),
            "GLOO_SOCKET_IFNAME": self.interfaces[node],
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }

    def run(self, argv: list[str], env: dict[str, str] | None = None, timeout: float = 600.0) -> list[RankResult]:
        """Start one process per rank inside its node and wait for all of them.

        Raises:
            ClusterRunError: a rank exited non-zero (named, with its stderr tail; the others are killed after a
                short grace period), or the run exceeded ``timeout`` seconds (the ranks still running are named).
        """
        if not self._up:
            raise RuntimeError("EmulatedCluster.run() outside `with EmulatedCluster(...)` (or before start())")
        master_port = _free_port()
        world = self.nodes * self.procs_per_node
        base_env = {**os.environ, **(env or {})}
        logdir = Path(tempfile.mkdtemp(prefix="hfsp-cluster-"))
        procs: list[subprocess.Popen] = []
        files = []
        start = time.perf_counter()
        try:
            for rank in range(world):
                out = open(logdir / f"rank{rank}.out", "w+")  # closed in the finally block
                err = open(logdir / f"rank{rank}.err", "w+")
                files.append((out, err))
                ns = self.namespaces[rank // self.procs_per_node]
                procs.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", ns, *argv],
                        env={**base_env, **self.rank_env(rank, master_port)},
                        stdout=out,
                        stderr=err,
                        start_new_session=True,
                    )
                )
            ends: dict[int, float] = {}
            failed_at: float | None = None
            while len(ends) < world:
                now = time.perf_counter()
                for rank, proc in enumerate(procs):
                    if rank not in ends and proc.poll() is not None:
                        ends[rank] = now - start
                        if proc.returncode != 0 and failed_at is None:
                            failed_at = now
                if failed_at is not None and now - failed_at > 10.0:
                    break  # give peers a moment to report their own errors, then stop waiting
                if now - start > timeout:
                    break
                time.sleep(0.05)
            running = [r for r in range(world) if r not in ends]
            for rank in running:
                _kill_group(procs[rank])
            results = []
            for rank, (out, err) in enumerate(files):
                out.seek(0)
                err.seek(0)
                results.append(
                    RankResult(
                        rank=rank,
                        returncode=procs[rank].returncode if rank in ends else -9,
                        stdout=out.read(),
                        stderr=err.read(),
                        wall_s=ends.get(rank, time.perf_counter() - start),
                    )
                )
        finally:
            for proc in procs:
                if proc.poll() is None:
                    _kill_group(proc)
            for out, err in files:
                out.close()
                err.close()
            shutil.rmtree(logdir, ignore_errors=True)
        failed = [r for r in results if r.rank in ends and r.returncode != 0]
        if failed:
            first = min(failed, key=lambda r: r.wall_s)
            raise ClusterRunError(
                f"rank {first.rank} failed with exit code {first.returncode} "
                f"(failed ranks: {[r.rank for r in failed]}, killed: {running}); its stderr tail:\n"
                f"{first.stderr[-3000:]}"
            )
        if running:
            raise ClusterRunError(
                f"emulated-cluster run exceeded timeout={timeout:.0f}s; ranks still running (killed): {running}. "
                f"Rank {running[0]} stderr tail:\n{results[running[0]].stderr[-2000:]}"
            )
        return results


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description="Set up an emulated two-node cluster and print its bandwidths.")
    parser.add_argument("--inter-mbit", type=float, default=400.0, help="inter-node link rate in Mbit/s")
    parser.add_argument("--seconds", type=float, default=1.5, help="duration of each TCP probe")
    args = parser.parse_args()
    with EmulatedCluster(inter_mbit=args.inter_mbit) as cluster:
        bw = cluster.measure_bandwidth(args.seconds)
        print(json.dumps({"inter_mbit": args.inter_mbit, **{k: round(v, 2) for k, v in bw.items()}}))


if __name__ == "__main__":
    main()
