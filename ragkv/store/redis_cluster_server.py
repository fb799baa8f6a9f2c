"""A private Redis Cluster on free localhost ports (masters, each with replicas; no persistence), for tests and
benchmarks. Built with CLUSTER ADDSLOTS / MEET / REPLICATE through redis-py, so it needs only redis-server."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from ragkv.net import free_port
from ragkv.store.redis_server import INSTALL_HINT, RedisStartError

SLOTS = 16384


@dataclass
class ClusterNode:
    port: int
    bus_port: int
    proc: subprocess.Popen
    log: Path

    def client(self, timeout_s: float = 1.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=timeout_s,
                           socket_timeout=timeout_s)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class LocalCluster:
    nodes: list[ClusterNode] = field(default_factory=list)

    @property
    def url(self) -> str:
        """redis+cluster://... naming every node as a seed (the store spec form)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def node(self, port: int) -> ClusterNode:
        return next(n for n in self.nodes if n.port == port)

    def masters(self) -> list[ClusterNode]:
        """The live nodes that are masters now."""
        out = []
        for n in self.nodes:
            if n.alive:
                with contextlib.closing(n.client()) as c:
                    if c.info("replication")["role"] == "master":
                        out.append(n)
        return out

    def master_port(self, key: str) -> int:
        """Port of the master serving `key`'s slot now, asked of any live node."""
        for n in self.nodes:
            if not n.alive:
                continue
            with contextlib.closing(n.client()) as c:
                try:
                    slot = c.execute_command("CLUSTER KEYSLOT", key)
                    for start, end, master, *_ in c.execute_command("CLUSTER SLOTS"):
                        if start <= slot <= end:
                            return int(master[1])
                except redis.exceptions.RedisError:
                    continue
        raise RedisStartError(f"no live cluster node knows the master of {key!r}")

    def kill(self, port: int) -> None:
        """SIGKILL one node (a crash: no goodbye to the cluster)."""
        n = self.node(port)
        n.proc.send_signal(signal.SIGKILL)
        n.proc.wait()

    def wait_synced(self, timeout_s: float = 10.0) -> None:
        """Until every live master's writes reached all its replicas (replication is asynchronous)."""
        deadline = time.monotonic() + timeout_s
        for n in self.nodes:
            if not n.alive:
                continue
            with contextlib.closing(n.client()) as c:
                def synced():
                    info = c.info("replication")
                    replicas = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
                    return info["role"] != "master" or all(r["offset"] >= info["master_repl_offset"]
                                                           for r in replicas)
                _wait_until(f"replicas of {n.port} in sync", synced, deadline, n.log)

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says cluster_state:ok and agrees on who serves each slot."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                views = set()
                for n in self.nodes:
                    if n.alive:
                        with contextlib.closing(n.client()) as c:
                            if c.execute_command("CLUSTER INFO")["cluster_state"] != "ok":
                                raise redis.exceptions.ClusterDownError("not ok yet")
                            slots = sorted(c.execute_command("CLUSTER SLOTS"))
                            views.add(tuple((start, end, master[1]) for start, end, master, *_ in slots))
                if len(views) == 1:
                    return
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RedisStartError(f"the local cluster did not settle in {timeout_s:.0f} s; see {self.nodes[0].log}")
            time.sleep(0.05)


def _start_node(exe: str, workdir: Path, node_timeout_ms: int) -> ClusterNode:
    port, bus = free_port(), free_port()  # the bus port given explicitly: port + 10000 may not exist
    log = workdir / f"redis-{port}.log"
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                             "--cluster-port", str(bus), "--cluster-config-file", f"nodes-{port}.conf",
                             "--cluster-node-timeout", str(node_timeout_ms), "--repl-diskless-sync-delay", "0",
                             "--cluster-replica-validity-factor", "0",  # a replica always takes over
                             "--save", "", "--appendonly", "no",
                             "--dir", str(workdir), "--logfile", str(log), "--daemonize", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    return ClusterNode(port, bus, proc, log)


def _wait_until(what: str, check, deadline: float, log: Path) -> None:
    while True:
        try:
            if check():
                return
        except redis.exceptions.RedisError:
            pass
        if time.monotonic() > deadline:
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RedisStartError(f"local cluster: {what} did not happen in time; {log}: {tail}")
        time.sleep(0.02)


def _knows(client: redis.Redis, count: int) -> bool:
    """Whether the node has shaken hands with `count` nodes (itself included)."""
    nodes = client.execute_command("CLUSTER NODES").values()
    return len(nodes) == count and not any("handshake" in n["flags"] for n in nodes)


@contextlib.contextmanager
def private_redis_cluster(workdir: str | Path, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000,
                          timeout_s: float = 30.0):
    """Start `masters` x (1 + `replicas`) cluster-enabled redis-servers in `workdir`, join them (slots split
    evenly over the masters), yield a LocalCluster once every replica is in sync, kill every node on exit."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RedisStartError(f"redis-server is not installed; {INSTALL_HINT}")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    cluster, deadline = LocalCluster(), time.monotonic() + timeout_s
    try:
        for _ in range(masters * (1 + replicas)):
            cluster.nodes.append(_start_node(exe, workdir, node_timeout_ms))
        clients = [n.client() for n in cluster.nodes]
        for n, c in zip(cluster.nodes, clients):
            _wait_until(f"redis-server on port {n.port} answering", c.ping, deadline, n.log)
        ids = [c.execute_command("CLUSTER MYID").decode() for c in clients]
        bounds = [SLOTS * i // masters for i in range(masters + 1)]
        for i in range(masters):
            clients[i].execute_command("CLUSTER ADDSLOTS", *range(bounds[i], bounds[i + 1]))
        for n in cluster.nodes[1:]:
            clients[0].execute_command("CLUSTER MEET", "127.0.0.1", n.port, n.bus_port)
        everyone = len(cluster.nodes)
        for n, c in zip(cluster.nodes, clients):
            _wait_until("every node meeting every other", lambda c=c: _knows(c, everyone), deadline, n.log)
        for j, (n, c) in enumerate(zip(cluster.nodes[masters:], clients[masters:])):
            master = ids[j % masters]
            _wait_until(f"node {n.port} replicating its master",
                        lambda c=c, m=master: c.execute_command("CLUSTER REPLICATE", m), deadline, n.log)
        for n, c in zip(cluster.nodes[masters:], clients[masters:]):
            _wait_until(f"replica {n.port} in sync", lambda c=c: c.info("replication").get("master_link_status")
                        == "up", deadline, n.log)
        for c in clients:
            c.close()
        cluster.wait_ok(max(1.0, deadline - time.monotonic()))
        yield cluster
    finally:
        for n in cluster.nodes:
            if n.alive:
                n.proc.kill()
        for n in cluster.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                n.proc.wait(timeout=5)
        for conf in workdir.glob("nodes-*.conf"):
            with contextlib.suppress(OSError):
                os.unlink(conf)
