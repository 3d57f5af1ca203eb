"""Real servers for the tests: redis-server and a moto S3 server, on free loopback ports.

Used by the fixtures in ``conftest.py`` and importable by subprocess helpers. Never
touches a server this machine already runs (e.g. a Redis on 6379): every server here
gets its own free port and its own temporary directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from trainguard.core.process import free_port, wait_until

PERSISTENCE = ("none", "everysec", "always")




def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float, what: str) -> None:
    def listening() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return True
        return False

    if not wait_until(listening, timeout_s, interval_s=0.02):
        raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s} s")


class RedisServer:
    """One real ``redis-server`` process. ``kill()`` is SIGKILL; ``restart()`` keeps
    the port and the data directory, so with AOF the data survives and without
    persistence it comes back empty."""

    def __init__(self, data_dir: Path, *, persistence: str = "none", port: int | None = None):
        if persistence not in PERSISTENCE:
            raise ValueError(f"persistence must be one of {PERSISTENCE}, got {persistence!r}")
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH: run `make test`, which installs it")
        self.binary = binary
        self.data_dir = data_dir
        self.persistence = persistence
        self.port = port or free_port()
        self._may_move = port is None  # see start()
        self.proc: subprocess.Popen[bytes] | None = None
        data_dir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def _args(self) -> list[str]:
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.data_dir), "--save", "", "--daemonize", "no",
            "--logfile", str(self.data_dir / "redis.log"), "--protected-mode", "no",
        ]
        if self.persistence == "none":
            args += ["--appendonly", "no"]
        else:
            args += ["--appendonly", "yes", "--appendfsync", self.persistence]
        return args

    def start(self) -> RedisServer:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        for attempt in range(50):
            self.proc = subprocess.Popen(
                self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            try:
                _wait_port(self.port, self.proc, 10.0, f"redis-server :{self.port}")
                self._check_owner()
                break
            except RuntimeError:
                # After kill -9 the port can linger a moment; try again briefly.
                self.proc.kill()
                self.proc.wait()
                if attempt == 49:
                    raise
                if self._may_move and attempt >= 2:
                    # A port picked free can be taken since, for good: the kernel gives
                    # the same range to outgoing connections as their local ports. Not
                    # started yet, so nothing knows the port: pick others.
                    self._pick_ports()
                time.sleep(0.1)
        self._may_move = False  # a restart keeps the port: clients know it now
        self._wait_loaded()
        return self

    def _pick_ports(self) -> None:
        self.port = free_port()

    def _check_owner(self) -> None:
        """The server answering on our port is our process, not another that holds the
        port while ours failed to bind it."""
        import redis

        client = redis.Redis(port=self.port, socket_timeout=5)
        try:
            pid = int(client.info("server")["process_id"])
        except redis.exceptions.BusyLoadingError:
            pid = None  # loading: answered by a server, whose pid we learn below
        except (redis.exceptions.RedisError, OSError) as e:
            raise RuntimeError(f"redis-server :{self.port} is not answering: {e}") from e
        finally:
            client.close()
        if pid is not None and self.proc is not None and pid != self.proc.pid:
            raise RuntimeError(f"port {self.port} is served by pid {pid}, not by our "
                               f"redis-server (pid {self.proc.pid})")

    def _wait_loaded(self) -> None:
        import redis

        client = redis.Redis(port=self.port, socket_timeout=5)
        deadline = time.monotonic() + 20
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.exceptions.BusyLoadingError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final fsync."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class MotoServer:
    """moto's S3 in server mode, in its own process, reached over real HTTP."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoServer:
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        )
        _wait_port(self.port, self.proc, 60.0, "moto server")
        return self

    def storage_options(self) -> dict[str, object]:
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
            "skip_instance_cache": True,
        }

    def create_bucket(self, name: str) -> str:
        import s3fs

        fs = s3fs.S3FileSystem(**self.storage_options())  # type: ignore[arg-type]
        # A plain CreateBucket: s3fs.mkdir sends a LocationConstraint, which moto
        # (like AWS) refuses for us-east-1.
        fs.call_s3("create_bucket", Bucket=name)
        return name

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class RedisCluster:
    """A real Redis Cluster: ``masters`` masters with ``replicas`` replicas each, every
    node a :class:`RedisServer` started with ``--cluster-enabled yes`` and joined by
    ``redis-cli --cluster create``. ``cluster-node-timeout`` is short, so a master
    killed with ``kill_master`` is replaced by its replica within about a second.
    ``url`` is the ``redis+cluster://`` URL trainguard reads (every node listed)."""

    NODE_TIMEOUT_MS = 500

    def __init__(self, data_dir: Path, *, masters: int = 3, replicas: int = 1):
        self.data_dir = data_dir
        self.nodes = [
            _ClusterNode(data_dir / f"node-{i}", node_timeout_ms=self.NODE_TIMEOUT_MS)
            for i in range(masters * (1 + replicas))
        ]
        self.masters = masters
        self.replicas = replicas
        self._cut: set[int] = set()  # ports of replicas cut_replication cut off

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> RedisCluster:
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not on PATH: run `make test`, which installs it")
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
             "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60,
        )
        self.wait_healthy()
        return self

    def _info(self, node: RedisServer) -> tuple[str, str]:
        """(``cluster_state``, role) as ``node`` sees them."""
        import redis

        client = redis.Redis(port=node.port, socket_timeout=2)
        try:
            state = client.execute_command("CLUSTER INFO")
            info = state if isinstance(state, dict) else {}
            role = client.execute_command("ROLE")[0]
            return str(info.get("cluster_state", "")), role.decode() if isinstance(role, bytes) else role
        finally:
            client.close()

    def wait_healthy(self, timeout_s: float = 60.0, *, replicas_synced: bool = True) -> None:
        """Until every live node says ``cluster_state:ok`` and ``masters`` masters are
        up and (``replicas_synced``) every live replica has finished its first sync."""
        import redis

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                live = [n for n in self.nodes if n.is_running()]
                seen = [self._info(n) for n in live]
                healthy = (all(s == "ok" for s, _ in seen)
                           and sum(r == "master" for _, r in seen) == self.masters)
                if healthy and (not replicas_synced or all(
                        self._synced(n) for n, (_, r) in zip(live, seen) if r == "slave")):
                    return
            except (redis.exceptions.RedisError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"Redis Cluster in {self.data_dir} not healthy within {timeout_s} s")
            time.sleep(0.05)

    def _synced(self, node: RedisServer) -> bool:
        import redis

        client = redis.Redis(port=node.port, socket_timeout=2)
        try:
            return client.info("replication").get("master_link_status") == "up"
        finally:
            client.close()

    def flushall(self) -> None:
        """Empty every master (replicas follow) and forget loaded scripts."""
        import redis

        for node in self.nodes:
            if not node.is_running():
                continue
            client = redis.Redis(port=node.port, socket_timeout=5)
            try:
                if client.execute_command("ROLE")[0] in (b"master", "master"):
                    client.flushall()
                    client.script_flush()
            finally:
                client.close()

    def wait_replicated(self, timeout_s: float = 30.0) -> None:
        """Until every live replica has every write its master has (a test's fixture
        data must not be what a failover loses)."""
        import redis

        deadline = time.monotonic() + timeout_s
        while True:
            behind = False
            for node in self.nodes:
                if not node.is_running():
                    continue
                client = redis.Redis(port=node.port, socket_timeout=5)
                try:
                    info = client.info("replication")
                finally:
                    client.close()
                if info.get("role") != "master":
                    continue
                for k, v in info.items():
                    if k.startswith("slave") and isinstance(v, dict):
                        behind |= int(v["offset"]) < int(info["master_repl_offset"])
            if not behind:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas of {self.data_dir} did not catch up in {timeout_s} s")
            time.sleep(0.05)

    def master_of(self, key: str) -> RedisServer:
        """The node that serves ``key``'s slot now."""
        import redis

        for node in self.nodes:
            if not node.is_running():
                continue
            client = redis.Redis(port=node.port, socket_timeout=2)
            try:
                slot = client.execute_command("CLUSTER KEYSLOT", key)
                for start, end, master, *_ in client.execute_command("CLUSTER SLOTS"):
                    if start <= slot <= end:
                        port = int(master[1])
                        return next(n for n in self.nodes if n.port == port)
            except redis.exceptions.RedisError:
                continue
            finally:
                client.close()
        raise RuntimeError(f"no live node of {self.data_dir} knows the owner of {key!r}")

    def cut_replication(self, key: str) -> None:
        """From now on, the replicas of ``key``'s master get none of its writes (they
        authenticate as a user that does not exist, and the master drops them): a
        ``kill_master`` then surely loses those writes, which asynchronous replication
        only may."""
        import redis

        master = redis.Redis(port=self.master_of(key).port, socket_timeout=2)
        try:
            for role in master.execute_command("ROLE")[2]:
                replica = redis.Redis(port=int(role[1]), socket_timeout=2)
                try:
                    replica.config_set("masteruser", "tg-no-such-user")
                    replica.config_set("masterauth", "tg-no-such-password")
                finally:
                    replica.close()
                self._cut.add(int(role[1]))
            master.execute_command("CLIENT", "KILL", "TYPE", "replica")
        finally:
            master.close()

    def kill_master(self, key: str) -> RedisServer:
        """kill -9 the master serving ``key`` and wait until its replica took over (the
        cluster says ok again). Returns the killed node (``restart()`` brings it back as
        a replica)."""
        import redis

        victim = self.master_of(key)
        victim.kill()
        self.wait_healthy(replicas_synced=not self._cut)
        for port in self._cut:
            replica = redis.Redis(port=port, socket_timeout=2)
            try:
                replica.config_set("masteruser", "")
                replica.config_set("masterauth", "")
            finally:
                replica.close()
        self._cut.clear()
        return victim

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()


class _ClusterNode(RedisServer):
    def __init__(self, data_dir: Path, *, node_timeout_ms: int):
        super().__init__(data_dir)
        self.node_timeout_ms = node_timeout_ms
        # The bus port defaults to port + 10000, which a free port may exceed.
        self.bus_port = free_port()

    def _pick_ports(self) -> None:
        super()._pick_ports()
        self.bus_port = free_port()

    def _args(self) -> list[str]:
        return [
            *super()._args(), "--cluster-enabled", "yes",
            "--cluster-config-file", str(self.data_dir / "nodes.conf"),
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-port", str(self.bus_port),
            # A replica of a killed master must promote itself however stale it is.
            "--cluster-replica-validity-factor", "0",
        ]
