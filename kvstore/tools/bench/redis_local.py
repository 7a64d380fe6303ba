"""Local redis-server processes for the remote tier's tests and ``kvstore bench remote``.

Not a deployment tool: a real cluster is someone's existing Redis. ``RedisCluster.start(tmp)`` runs 6 ``redis-server`` processes on free loopback ports (3
primaries, 3 replicas, built by ``redis-cli --cluster create``), persistence off, a small
``maxmemory`` with ``allkeys-lru``, and waits until every node says ``cluster_state:ok``.
Nodes can be killed (SIGKILL), paused, stopped and restarted, which the fault tests do.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

MIB = 1 << 20


def need_binaries() -> str | None:
    """None when redis-server and redis-cli are on PATH, else what is missing."""
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    return None if not missing else f"{' and '.join(missing)} not found (Debian: redis-server, redis-tools)"


def free_port(bus: bool) -> int:
    """A loopback port that is free now (and, for a cluster node, so is port + 10000)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not bus:
            return port
        if port + 10000 < 65536 and _is_free(port + 10000) and _is_free(port):
            return port
    raise RuntimeError("no free loopback port pair found")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cli(port: int, *args: str, timeout: float = 10.0) -> str:
    """Run one redis-cli command against a node; its stdout."""
    out = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
                         capture_output=True, text=True, timeout=timeout)
    return out.stdout


@dataclass
class Node:
    port: int
    directory: Path
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(["redis-server", *self.args], cwd=self.directory,
                                     stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited with {self.proc.returncode}: "
                                   f"{(self.directory / 'redis.log').read_text()[-2000:]}")
            if cli(self.port, "PING").strip() in ("PONG", "NOAUTH Authentication required."):
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING within 10 s")

    def kill(self) -> None:
        """SIGKILL, no shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def info(self, section: str) -> dict[str, str]:
        found: dict[str, str] = {}
        for line in cli(self.port, "INFO", section).splitlines():
            name, sep, value = line.strip().partition(":")
            if sep:
                found[name] = value
        return found


def _node_args(port: int, maxmemory: int, extra: list[str]) -> list[str]:
    return ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--maxmemory", str(maxmemory), "--maxmemory-policy", "allkeys-lru", "--daemonize", "no",
            *extra]


@dataclass
class RedisServer:
    """One redis-server (the ``redis://`` case)."""

    node: Node

    @classmethod
    def start(cls, tmp: Path, maxmemory: int = 64 * MIB, password: str | None = None,
              port: int | None = None) -> RedisServer:
        port = port or free_port(bus=False)
        directory = tmp / f"redis-{port}"
        directory.mkdir(parents=True, exist_ok=True)
        extra = ["--requirepass", password] if password else []
        node = Node(port, directory, _node_args(port, maxmemory, extra))
        node.start()
        return cls(node)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.node.port}"

    def close(self) -> None:
        self.node.stop()


@dataclass
class RedisCluster:
    """Six nodes, three primaries with one replica each."""

    nodes: list[Node] = field(default_factory=list)
    maxmemory: int = 0

    @classmethod
    def start(cls, tmp: Path, maxmemory: int = 64 * MIB, node_timeout_ms: int = 1000,
              num_primaries: int = 3, base_port: int | None = None) -> RedisCluster:
        """Start the nodes on free ports, or on ``base_port`` and the ports after it."""
        cluster = cls(maxmemory=maxmemory)
        try:
            for i in range(2 * num_primaries):
                port = free_port(bus=True) if base_port is None else base_port + i
                directory = tmp / f"node-{port}"
                directory.mkdir(parents=True)
                extra = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                         "--cluster-node-timeout", str(node_timeout_ms),
                         "--cluster-replica-validity-factor", "0",
                         "--cluster-require-full-coverage", "no"]
                node = Node(port, directory, _node_args(port, maxmemory, extra))
                node.start()
                cluster.nodes.append(node)
            hosts = [f"127.0.0.1:{n.port}" for n in cluster.nodes]
            made = subprocess.run(["redis-cli", "--cluster", "create", *hosts, "--cluster-replicas", "1",
                                   "--cluster-yes"], capture_output=True, text=True, timeout=60)
            if made.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {made.stdout[-2000:]}{made.stderr}")
            cluster.wait_ok()
            cluster.wait_replicas()
        except BaseException:
            cluster.close()
            raise
        return cluster

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:3])

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node reports cluster_state:ok and the primaries cover all slots."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [n for n in self.nodes if n.alive]
            if all(_cluster_ok(cli(n.port, "CLUSTER", "INFO")) for n in live):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the cluster did not reach cluster_state:ok within {timeout} s")

    def wait_replicas(self, timeout: float = 30.0) -> None:
        """Until every live replica's link to its primary is up (a failover needs a synced one)
        and every live node's ``CLUSTER SLOTS`` names a replica for each range (the gossip
        that tells them lags the links by up to a second on a new cluster; a client reads a
        down primary's replica only once it knows it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [n for n in self.nodes if n.alive]
            infos = [n.info("replication") for n in live]
            replicas = [i for i in infos if i.get("role") == "slave"]
            if (len(replicas) >= len(infos) // 2 and all(i.get("master_link_status") == "up" for i in replicas)
                    and all(_slots_name_replicas(n.port) for n in live)):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the replicas did not sync within {timeout} s")

    def primaries(self) -> list[Node]:
        """Live nodes that are primaries now (``role:master``)."""
        return [n for n in self.nodes if n.alive and n.info("replication").get("role") == "master"]

    def replica_of(self, primary: Node) -> Node:
        """The live replica that replicates ``primary``."""
        for node in self.nodes:
            if node.alive and node is not primary:
                info = node.info("replication")
                if info.get("role") == "slave" and info.get("master_port") == str(primary.port):
                    return node
        raise RuntimeError(f"no live replica of port {primary.port}")

    def wait_failover(self, dead: Node, timeout: float = 30.0) -> None:
        """Until a replica has taken over the slots of killed ``dead`` and the cluster is ok."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [n for n in self.nodes if n.alive]
            if len([n for n in live if n.info("replication").get("role") == "master"]) >= 3:
                break
            time.sleep(0.1)
        self.wait_ok(max(1.0, deadline - time.monotonic()))

    def close(self) -> None:
        for node in self.nodes:
            node.stop()
        for node in self.nodes:
            node.kill()


def _slots_name_replicas(port: int) -> bool:
    """Whether the node's CLUSTER SLOTS names at least one replica for every range."""
    reply = redis.Redis(port=port, socket_timeout=5).execute_command("CLUSTER", "SLOTS")
    return bool(reply) and all(len(entry) > 3 for entry in reply)


def _cluster_ok(cluster_info: str) -> bool:
    return "cluster_state:ok" in cluster_info and "cluster_slots_ok:16384" in cluster_info

