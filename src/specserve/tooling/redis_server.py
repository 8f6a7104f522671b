"""A private, throw-away `redis-server` for integration tests and `make run`.

The developer machines already run a Redis on 6379 that belongs to someone else, and a fresh
machine runs none (DESIGN §10), so specserve starts its own: loopback only, a free port, in
its own process group so a Ctrl-C in the terminal does not reach it before we stop it. It is
stopped by PID (SIGTERM, then SIGKILL), never by name.

Secure and durable by default (ADR 0011): a password (generated unless given; in the URL) so
no other local process can write sessions, and an append-only file fsynced every second, so
a `kill -9` loses at most the last second of commits and a restart on the same `dir` and port
(`restart`) brings the sessions and policies back.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from specserve.errors import SpecserveError
from specserve.tooling.files import write_private

INSTALL_HINT = "install it with `sudo apt-get install redis-server` (Debian/Ubuntu)"


class RedisServerError(SpecserveError, RuntimeError):
    """The local redis-server could not be found, started or reached."""


@dataclass
class LocalRedis:
    port: int
    pid: int
    dir: Path
    log_path: Path
    password: str = ""
    # Present only in the process that started the server; a pidfile reader has just the PID.
    process: subprocess.Popen | None = field(default=None, repr=False, compare=False)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        """SIGKILL now (fault tests: no shutdown save, the AOF has what was fsynced)."""
        _signal(self.pid, signal.SIGKILL)
        self._wait_gone(5.0)

    def restart(self, timeout_s: float = 30.0) -> LocalRedis:
        """A new server on the same port, directory and password: it loads the AOF."""
        self.stop()
        return start_redis(self.dir, timeout_s=timeout_s, port=self.port, password=self.password, attempts=20)

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return _pid_is_redis(self.pid)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM by PID, SIGKILL if it is still there after `grace_s`. Idempotent."""
        if not self.alive():
            return
        _signal(self.pid, signal.SIGTERM)
        if not self._wait_gone(grace_s):
            _signal(self.pid, signal.SIGKILL)
            self._wait_gone(grace_s)

    def _wait_gone(self, timeout_s: float) -> bool:
        if self.process is not None:
            try:
                self.process.wait(timeout=timeout_s)
                return True
            except subprocess.TimeoutExpired:
                return False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not _pid_is_redis(self.pid):
                return True
            time.sleep(0.05)
        return False


def start_redis(
    dir: Path, *, timeout_s: float = 10.0, binary: str | None = None, attempts: int = 3,
    port: int | None = None, password: str | None = None, durable: bool = True,
) -> LocalRedis:
    """Start redis-server on a free loopback port (or `port`), wait until it answers PING.
    `password` None: a fresh random one; "": none. `durable`: AOF, appendfsync everysec."""
    password = secrets.token_urlsafe(18) if password is None else password
    exe = binary or shutil.which("redis-server") or "/usr/bin/redis-server"
    if not os.access(exe, os.X_OK):
        raise RedisServerError(f"redis-server is not installed (no {exe}); {INSTALL_HINT}")
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    last_error = ""
    # The port is free when we probe it but another process may grab it before redis binds;
    # a fresh port on the next attempt makes that race harmless.
    for _ in range(attempts):
        server = _spawn(exe, dir, port or _free_port(), password, durable)
        try:
            _wait_for_ping(server, timeout_s)
            return server
        except RedisServerError as err:
            server.stop(grace_s=1.0)
            last_error = str(err)
            if "Address already in use" not in last_error:
                break
            if port:  # the same port again, once the old socket is released
                time.sleep(0.25)
    raise RedisServerError(last_error)


def _spawn(exe: str, dir: Path, port: int, password: str, durable: bool, extra: tuple[str, ...] = ()) -> LocalRedis:
    log_path = dir / f"redis-{port}.log"
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(dir),
            "--daemonize", "no", "--appendonly", "yes" if durable else "no", "--appendfsync", "everysec",
            "--appendfilename", f"specserve-{port}.aof", "--appenddirname", f"aof-{port}", *extra]
    if password:
        args += ["--requirepass", password, "--masterauth", password]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: terminal signals do not reach it
        )
    return LocalRedis(port=port, pid=proc.pid, dir=dir, log_path=log_path, password=password, process=proc)


def _wait_for_ping(server: LocalRedis, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not server.alive():
            raise RedisServerError(
                f"redis-server exited during start-up (port {server.port}); "
                f"log tail:\n{_log_tail(server.log_path)}"
            )
        if _ping(server.port, server.password):
            return
        time.sleep(0.05)
    raise RedisServerError(
        f"redis-server on port {server.port} did not answer PING within {timeout_s:.0f} s; "
        f"log tail:\n{_log_tail(server.log_path)}"
    )


def _ping(port: int, password: str = "") -> bool:
    """PONG, after AUTH if a password is set; a server still loading its AOF says LOADING."""
    # The inline protocol keeps this free of client-library state (pools, event loops).
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            f = sock.makefile("rb")
            if password:
                sock.sendall(f"AUTH {password}\r\n".encode())
                if not f.readline().startswith(b"+OK"):
                    return False
            sock.sendall(b"PING\r\n")
            return f.readline().startswith(b"+PONG")
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.kill(pid, sig)


def _pid_is_redis(pid: int) -> bool:
    """True if `pid` is alive and is a redis-server: a recycled PID is never signalled."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # A zombie (state Z) has exited; only its parent can still reap it.
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state != "Z" and b"redis-server" in cmdline


# --- pidfile, so `make down` can stop what `make run` started --------------------------------


def write_pidfile(path: Path, server: LocalRedis) -> None:
    record = {
        "pid": server.pid,
        "port": server.port,
        "dir": str(server.dir),
        "log_path": str(server.log_path),
        "password": server.password,
    }
    write_private(path, json.dumps(record) + "\n")  # it holds the password


MASTER = "specserve"  # the master name the local sentinels monitor


@dataclass
class LocalRedisHA:
    """A primary, its replica and three sentinels on loopback (ADR 0023): what `--redis-ha`
    starts for tests and demos. `url` is the services' `redis+sentinel://` address."""

    primary: LocalRedis
    replica: LocalRedis
    sentinels: list[LocalRedis]
    password: str

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        auth = f":{self.password}@" if self.password else ""
        return f"redis+sentinel://{auth}{hosts}/{MASTER}/0"

    def stop(self) -> None:
        for server in (*self.sentinels, self.replica, self.primary):
            server.stop(grace_s=2.0)

    def cut_replication(self) -> None:
        """Fault injection (tests, the soak): stop the replica (SIGSTOP) and cut its link on the
        primary (CLIENT KILL TYPE replica), so that nothing the primary writes from now on
        reaches it, until `resume_replica`. Killing the primary in between makes the sentinels
        promote a replica that lacks those writes: real replication lag, made certain."""
        _cut(self.replica, self.primary, self.password)

    def resume_replica(self) -> None:
        os.kill(self.replica.pid, signal.SIGCONT)


def start_redis_ha(dir: Path, *, down_after_ms: int = 1000, failover_timeout_ms: int = 5000,
                   timeout_s: float = 20.0) -> LocalRedisHA:
    """A primary and one replica (AOF each, one password), and three sentinels that promote
    the replica `down_after_ms` after the primary stops answering (quorum 2)."""
    dir = Path(dir)
    password = secrets.token_urlsafe(18)
    primary = start_redis(dir / "primary", password=password, timeout_s=timeout_s)
    replica = _start_with(dir / "replica", password, ("--replicaof", "127.0.0.1", str(primary.port)), timeout_s)
    _wait_synced(replica, timeout_s)  # (a failover before the first sync would promote an empty replica)
    sentinels = []
    for i in range(3):
        sdir = dir / f"sentinel-{i}"
        sdir.mkdir(parents=True, exist_ok=True)
        port = _free_port()
        conf = sdir / "sentinel.conf"  # a sentinel rewrites its own config: one file each
        conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {sdir}\n"
                        f"sentinel monitor {MASTER} 127.0.0.1 {primary.port} 2\n"
                        f"sentinel auth-pass {MASTER} {password}\n"
                        f"sentinel down-after-milliseconds {MASTER} {down_after_ms}\n"
                        f"sentinel failover-timeout {MASTER} {failover_timeout_ms}\n"
                        f"sentinel parallel-syncs {MASTER} 1\n")
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        log_path = sdir / "sentinel.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([exe, str(conf), "--sentinel"], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        sentinels.append(LocalRedis(port=port, pid=proc.pid, dir=sdir, log_path=log_path, process=proc))
    for s in sentinels:
        _wait_for_ping(s, timeout_s)
    return LocalRedisHA(primary, replica, sentinels, password)


def _wait_synced(replica: LocalRedis, timeout_s: float) -> None:
    import redis

    client = redis.Redis(port=replica.port, password=replica.password or None, socket_timeout=1.0)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if client.info("replication").get("master_link_status") == "up":
                return
            time.sleep(0.05)
    finally:
        client.close()
    raise RedisServerError(f"replica on port {replica.port} did not sync within {timeout_s} s; "
                           f"log tail:\n{_log_tail(replica.log_path)}")


def _start_with(dir: Path, password: str, extra: tuple[str, ...], timeout_s: float) -> LocalRedis:
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    dir.mkdir(parents=True, exist_ok=True)
    server = _spawn(exe, dir, _free_port(), password, True, extra)
    _wait_for_ping(server, timeout_s)
    return server



@dataclass
class LocalRedisCluster:
    """A Redis Cluster on loopback (ADR 0023): `masters` primaries with `replicas` replicas
    each, slots spread by `redis-cli --cluster create`. `url` is the services'
    `redis+cluster://` address; `nodes` in start order."""

    nodes: list[LocalRedis]
    password: str

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        return f"redis+cluster://:{self.password}@{hosts}"

    def stop(self) -> None:
        for node in self.nodes:
            node.stop(grace_s=2.0)

    def master_of(self, key: str) -> LocalRedis:
        """The node that serves `key`'s slot now."""
        from redis.crc import key_slot

        return _master_for_slot(self, key_slot(key.encode()))

    def replica_of(self, master: LocalRedis) -> LocalRedis:
        return _replica_of(self, master)

    def cut_replication(self, master: LocalRedis) -> LocalRedis:
        """`LocalRedisHA.cut_replication` for one master: its replica stopped (SIGSTOP) and the
        link cut on the master. Returns the replica (`resume` continues it)."""
        replica = self.replica_of(master)
        _cut(replica, master, self.password)
        return replica

    @staticmethod
    def resume(replica: LocalRedis) -> None:
        _signal(replica.pid, signal.SIGCONT)

    def role(self, node: LocalRedis) -> str:
        """"master" or "slave", as the node says (a replica can have been promoted)."""
        with _client(node.port, self.password) as c:
            return c.info("replication")["role"]


def _client(port: int, password: str):  # (a sync client to one server)
    import redis

    return redis.Redis(port=port, password=password or None, socket_timeout=5)


def _cut(replica: LocalRedis, primary: LocalRedis, password: str) -> None:
    """The replica stopped (SIGSTOP) and its link cut on the primary: what the primary writes
    from now on reaches no replica (`cut_replication`)."""
    os.kill(replica.pid, signal.SIGSTOP)
    with _client(primary.port, password) as c:
        c.execute_command("CLIENT", "KILL", "TYPE", "replica")


def _master_for_slot(cluster: LocalRedisCluster, slot: int) -> LocalRedis:
    with _client(cluster.nodes[0].port, cluster.password) as c:
        for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                port = int(master[1])
                return next(n for n in cluster.nodes if n.port == port)
    raise RedisServerError(f"no master serves slot {slot}")


def _replica_of(cluster: LocalRedisCluster, master: LocalRedis) -> LocalRedis:
    with _client(master.port, cluster.password) as c:
        info = c.info("replication")
    port = int(info["slave0"]["port"])
    return next(n for n in cluster.nodes if n.port == port)


def start_redis_cluster(dir: Path, *, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 2000,
                        timeout_s: float = 30.0) -> LocalRedisCluster:
    """`masters * (1 + replicas)` cluster-enabled servers (AOF each, one password, each with
    its own free cluster-bus port), joined by `redis-cli --cluster create`; returns once every
    node reports `cluster_state:ok`. A master stopped for `node_timeout_ms` has its replica
    promoted by the others."""

    dir = Path(dir)
    password = secrets.token_urlsafe(18)
    cli = shutil.which("redis-cli") or "/usr/bin/redis-cli"
    nodes: list[LocalRedis] = []
    try:
        for i in range(masters * (1 + replicas)):
            ndir = dir / f"node-{i}"
            extra = ("--cluster-enabled", "yes", "--cluster-config-file", str(ndir / "nodes.conf"),
                     "--cluster-node-timeout", str(node_timeout_ms), "--cluster-port", str(_free_port()),
                     "--repl-diskless-sync-delay", "0")  # (a replica's first sync at once, not in 5 s)
            nodes.append(_start_with(ndir, password, extra, timeout_s))
        create = [cli, "-a", password, "--no-auth-warning", "--cluster", "create",
                  *(f"127.0.0.1:{n.port}" for n in nodes), "--cluster-replicas", str(replicas), "--cluster-yes"]
        done = subprocess.run(create, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RedisServerError(f"redis-cli --cluster create failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        deadline = time.monotonic() + timeout_s
        for n in nodes:
            with _client(n.port, password) as client:
                while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                    if time.monotonic() > deadline:
                        raise RedisServerError(f"cluster node {n.port} not ok within {timeout_s} s")
                    time.sleep(0.1)
        cluster = LocalRedisCluster(nodes, password)
        for n in nodes:  # a failover before a replica's first sync would promote an empty one
            if cluster.role(n) == "slave":
                _wait_synced(n, timeout_s)
    except BaseException:
        for n in nodes:
            n.stop(grace_s=1.0)
        raise
    return cluster
