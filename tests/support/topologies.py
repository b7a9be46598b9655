"""Redis Sentinel and Redis Cluster, started from the redis-server binary for tests."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support.servers import Process, RedisServer, free_cluster_port, free_port, redis_binary


def redis_cli(port: int, *args: str, timeout: float = 10) -> str:
    cli = shutil.which("redis-cli")
    if cli is None:
        raise RuntimeError(
            "redis-cli is not on PATH: run scripts/setup (it comes with redis-server)"
        )
    result = subprocess.run(
        [cli, "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return result.stdout.strip()


def wait_until(check: object, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what}")


def replica_synced(port: int) -> bool:
    return "master_link_status:up" in redis_cli(port, "info", "replication")


class ReplicatedSetup:
    """One master and one replica of it, no Sentinel: what `store.url` with
    `wait_for_replicas` points at."""

    def __init__(self) -> None:
        self.master = RedisServer()
        self.replica = RedisServer("--replicaof", "127.0.0.1", "0")  # port set in start()

    def start(self) -> ReplicatedSetup:
        self.master.start()
        index = self.replica.args.index("--replicaof")
        self.replica.args[index + 2] = str(self.master.port)
        self.replica.start()
        wait_until(lambda: replica_synced(self.replica.port), "the replica to sync")
        return self

    def stop(self) -> None:
        for process in (self.replica, self.master):
            process.stop()


class SentinelSetup:
    """One master, one replica, three sentinels watching them as `mymaster`."""

    master_name = "mymaster"

    def __init__(self) -> None:
        self.master = RedisServer()
        self.replica = RedisServer("--replicaof", "127.0.0.1", "0")  # port set in start()
        self.sentinels: list[Process] = []
        self.dir = Path(tempfile.mkdtemp(prefix="sentinel-"))

    def start(self) -> SentinelSetup:
        self.master.start()
        index = self.replica.args.index("--replicaof")
        self.replica.args[index + 2] = str(self.master.port)
        self.replica.start()
        wait_until(lambda: replica_synced(self.replica.port), "the replica to sync")
        for _ in range(3):
            port = free_port()
            conf = self.dir / f"sentinel-{port}.conf"
            # down-after 2 s: a loaded CI machine stalls a master for a second (see
            # restart_as_replica), which must not count as a failure.
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.dir}\n"
                f"sentinel monitor {self.master_name} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {self.master_name} 2000\n"
                f"sentinel failover-timeout {self.master_name} 5000\n"
                f"sentinel parallel-syncs {self.master_name} 1\n"
            )
            self.sentinels.append(
                Process([redis_binary(), str(conf), "--sentinel"], port, "sentinel").start()
            )
        wait_until(
            lambda: all(
                "num-other-sentinels" in redis_cli(s.port, "sentinel", "master", self.master_name)
                for s in self.sentinels
            ),
            "the sentinels",
        )
        return self

    def current_master_port(self) -> int:
        reply = redis_cli(
            self.sentinels[0].port, "sentinel", "get-master-addr-by-name", self.master_name
        )
        return int(reply.split()[-1])

    def restart_as_replica(self, node: RedisServer) -> None:
        """Bring a killed node back as a replica of the current master, as an operator
        must when Redis runs without persistence, and not promotable (replica-priority
        0) while it is still empty.

        Back as an empty master, it can win a second failover and wipe the dataset.
        Back as a plain replica, it still can: Sentinel elects a replica that has not
        finished its first sync (it reports no link-down time). Seen in CI: the new
        master stalled a second under load while it forked for this node's sync, the
        sentinels failed over again, promoted this empty node, and keys completed
        before ran again (Redis's Sentinel docs warn of the same). No WAIT can help:
        the data is gone from every node."""
        node.args = [
            *node.args,
            "--replicaof",
            "127.0.0.1",
            str(self.current_master_port()),
            "--replica-priority",
            "0",
        ]
        node.start()

    @property
    def nodes(self) -> list[str]:
        return [f"127.0.0.1:{s.port}" for s in self.sentinels]

    def stop(self) -> None:
        for process in [*self.sentinels, self.replica, self.master]:
            process.stop()


class ClusterSetup:
    """Three masters, all 16384 slots assigned, and `replicas` replicas of each (none
    unless asked)."""

    def __init__(self, masters: int = 3, replicas: int = 0) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="cluster-"))
        self.replicas = replicas
        self.nodes: list[RedisServer] = []
        for _ in range(masters * (1 + replicas)):
            node = RedisServer(
                "--cluster-enabled",
                "yes",
                "--cluster-node-timeout",
                "2000",
                port=free_cluster_port(),
            )
            node.args += ["--cluster-config-file", str(self.dir / f"nodes-{node.port}.conf")]
            self.nodes.append(node)

    def start(self) -> ClusterSetup:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        cli = shutil.which("redis-cli")
        assert cli is not None
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *addresses,
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        wait_until(
            lambda: all(
                "cluster_state:ok" in redis_cli(n.port, "cluster", "info") for n in self.nodes
            ),
            "the cluster to be ok",
        )
        if self.replicas:
            wait_until(
                lambda: (
                    len(self.replica_nodes()) == len(self.nodes) - len(self.masters())
                    and all(replica_synced(n.port) for n in self.replica_nodes())
                ),
                "the cluster's replicas to sync",
                timeout=60,
            )
        return self

    def _role(self, node: RedisServer) -> str:
        for line in redis_cli(node.port, "info", "replication").splitlines():
            if line.startswith("role:"):
                return line.partition(":")[2].strip()
        return ""

    def masters(self) -> list[RedisServer]:
        return [n for n in self.nodes if self._role(n) == "master"]

    def replica_nodes(self) -> list[RedisServer]:
        return [n for n in self.nodes if self._role(n) == "slave"]

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{n.port}" for n in self.nodes]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
