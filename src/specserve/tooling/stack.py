"""The local stack behind `make run` / `specserve up` and the integration tests: Redis (or
SPECSERVE_REDIS_URL), the target launcher (which owns a loopback Ray head), draft replicas
per pool and the router, each a process started here and stopped by PID (`down`).

Everything binds 127.0.0.1 on a free port; `run_dir/stack.json` records what was started.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specserve.config import LOCAL_DRAFT, LOCAL_EAGLE, LOCAL_NGRAM, LOCAL_SUFFIX
from specserve.tooling.files import write_private
from specserve.tooling.redis_server import LocalRedis


@dataclass
class PoolSpec:
    # "ngram", "eagle" (the pair's EAGLE head, `eagle/`, fed the target's features; ADR 0020),
    # "suffix" (suffix decoding, inside the target only; ADR 0026) or a model directory
    # (relative to the pair, or absolute)
    model: str
    replicas: int = 1
    env: dict[str, str] = field(default_factory=dict)  # e.g. SPECSERVE_DRAFT_SIMULATED_TOKEN_MS
    # drafted inside the target, no replica process: "ngram", "eagle" and "suffix" as
    # `local:ngram`, `local:eagle`, `local:suffix`; a model directory as `local:draft` (ADR 0025:
    # the target's `local_draft_model`, one such directory a stack)
    local: bool = False
    # a model pool's draft-side LoRA adapter, merged at load (ADR 0029: an adapter's own drafter);
    # relative to the pair, or absolute
    lora: str = ""


def local_target_threads(cores: int | None = None, reserved: int = 1) -> int:
    """The target's torch threads when every service shares this machine: its cores but those
    the other services need (`reserved`: one for the router, Redis and the clients, one for each
    router more and each thread of a draft model replica; `StackSpec.reserved_cores`), at least
    one. vLLM's CPU build keeps the same rule (its OpenMP threads on every core but the one it
    leaves to its scheduler and API server). On 2 cores that is one thread: a 2-thread target,
    even waiting passively, served 0.75-0.86x of the 1-thread one's tok/s beside vLLM
    (bench_peer, ADR 0028), and with libgomp's spinning wait its team stalled whenever the
    other services ran (ADR 0014)."""
    cores = cores if cores is not None else (os.cpu_count() or 2)
    return max(1, cores - reserved)


def target_omp_env(threads: int, reserved: int, cores: int | None = None,
                   environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """OpenMP's environment for the target: a team that shares cores with the other services
    (threads + reserved > cores) waits passively, its threads sleeping at the end of each
    parallel region instead of spinning on cores the router and Redis need (torch here runs GNU
    OpenMP, libgomp, whose knob this is; Intel's libiomp5 reads KMP_BLOCKTIME=0 for the same).
    A wait policy or spin count already in `environ` (the launcher's, the spec's) stands."""
    cores = cores if cores is not None else (os.cpu_count() or 2)
    named = set(os.environ if environ is None else environ)
    if threads < 2 or threads + reserved <= cores or {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & named:
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


@dataclass
class StackSpec:
    pair_dir: str  # built pair: target/ and draft/
    run_dir: str
    pools: dict[str, PoolSpec] = field(default_factory=dict)
    redis_url: str = ""  # empty: start a local redis-server
    # with no redis_url: a primary, a replica and three sentinels instead (ADR 0023); the
    # services get its redis+sentinel:// address
    redis_ha: bool = False
    redis_cluster: bool = False  # or a Redis Cluster: three masters, a replica each (ADR 0023)
    key_prefix: str = "specserve"
    target_threads: int = 0  # 0: local_target_threads(reserved=reserved_cores()), this machine's cores but theirs
    routers: int = 1  # router replicas (same Redis, same pools)
    router_env: dict[str, str] = field(default_factory=dict)
    router_env_each: list[dict[str, str]] = field(default_factory=list)  # router i's own additions
    env: dict[str, str] = field(default_factory=dict)  # for every service (e.g. OTEL_*, SPECSERVE_TRACING)
    tls_dir: str = ""  # tls.crt/tls.key/ca.crt: TLS on every hop, mTLS to workers (ADR 0011)
    http_port: int = 0  # router 0's HTTP API port (0 = a free one; the others always take a free one)
    tensor_parallel: int = 1  # the target over this many ranks (ADR 0030), target_threads each
    # LoRA adapters the target loads at start (ADR 0029): name -> directory (relative to the pair, or absolute)
    adapters: dict[str, str] = field(default_factory=dict)
    # False: the target in a plain process, without Ray (`services/target/plain.py`): for a node
    # that has no Ray, such as the GPU check's (ADR 0028); nobody restarts it there
    target_ray: bool = True

    def __post_init__(self) -> None:
        if self.target_threads <= 0:
            self.target_threads = local_target_threads(reserved=self.reserved_cores())

    def reserved_cores(self) -> int:
        """The cores the services beside the target need: one for the router, Redis and the
        clients, one for each router more, and a draft model replica's torch threads each (an
        n-gram replica runs no model; a pool drafted inside the target runs on its engine thread)."""
        replicas = sum(ps.replicas * int(ps.env.get("SPECSERVE_DRAFT_TORCH_THREADS", "1"))
                       for ps in self.pools.values() if not ps.local and ps.model != "ngram")
        return self.routers + replicas


@dataclass
class StackInfo:
    router: str = ""
    routers: list[str] = field(default_factory=list)  # every replica; router == routers[0]
    http: str = ""  # the OpenAI-compatible HTTP API of router 0: http://host:port
    https: list[str] = field(default_factory=list)  # every replica's, as `routers`
    redis_url: str = ""
    pools: dict[str, list[str]] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)  # name -> pid, in start order
    target: dict = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)  # name -> host:port of /metrics


class StackError(RuntimeError):
    pass


def local_draft_env(spec: StackSpec) -> dict[str, str]:
    """The target's `local_draft_model`: the directory of the stack's `local:draft` pools (a model
    directory with `local=True`, relative to the pair or absolute); none: nothing set."""
    dirs = sorted({str(Path(spec.pair_dir) / ps.model) for ps in spec.pools.values()
                   if ps.local and ps.model not in ("ngram", "eagle", "suffix")})
    if len(dirs) > 1:
        raise StackError(f"the target drafts inside itself with one draft model (local_draft_model), got {dirs}")
    if dirs and not (Path(dirs[0]) / "config.json").is_file():
        raise StackError(f"a local draft pool's model: no model at {dirs[0]}")
    return {"SPECSERVE_TARGET_LOCAL_DRAFT_MODEL": dirs[0]} if dirs else {}


def _wait_file(path: Path, proc: subprocess.Popen, what: str, timeout_s: float, log: Path) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if proc.poll() is not None:
            raise StackError(f"{what} exited with {proc.returncode}; log tail:\n{_tail(log)}")
        time.sleep(0.2)
    raise StackError(f"{what} not ready after {timeout_s:.0f} s; log tail:\n{_tail(log)}")


def _tail(log: Path, n: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def wait_serving(address: str, service: str, timeout_s: float, tls_dir: str = "") -> None:
    from specserve.serving.tls import channel

    deadline = time.monotonic() + timeout_s
    with channel(address, tls_dir) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise StackError(f"{service} at {address} not SERVING after {timeout_s:.0f} s")


class Stack:
    def __init__(self, spec: StackSpec) -> None:
        self.spec = spec
        self.run_dir = Path(spec.run_dir)
        self.info = StackInfo()
        self.procs: dict[str, subprocess.Popen] = {}
        self.redis: LocalRedis | None = None  # the LocalRedis started here (fault tests kill and restart it)
        self.redis_ha: Any = None  # the LocalRedisHA started here (redis_ha)
        self.redis_cluster: Any = None  # the LocalRedisCluster started here (redis_cluster)
        self.launched: dict[str, tuple[str, dict[str, str]]] = {}  # name -> (module, env), for restart

    def _spawn(self, name: str, module: str, env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
        log = self.run_dir / f"{name}.log"
        tls = {f"SPECSERVE_{s}_TLS_DIR": self.spec.tls_dir for s in ("ROUTER", "DRAFT", "TARGET")} \
            if self.spec.tls_dir else {}
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **tls, **self.spec.env,
                    **env}
        with open(log, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", module], env=full_env, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs[name] = proc
        self.launched[name] = (module, env)
        self.info.pids[name] = proc.pid
        self._save()
        return proc, log

    def _save(self) -> None:
        # the Redis URL carries its password: owner-only
        write_private(self.run_dir / "stack.json", json.dumps(asdict(self.info), indent=1))

    @contextlib.contextmanager
    def running(self, timeout_s: float = 600.0) -> Iterator[Stack]:
        """`up`, then `down` however the block ends."""
        self.up(timeout_s)
        try:
            yield self
        finally:
            self.down()

    def up(self, timeout_s: float = 600.0) -> StackInfo:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._up(timeout_s)
        except BaseException:
            self.down()
            raise
        return self.info

    def _up(self, timeout_s: float) -> None:
        """Redis, then the draft replicas, then the target (its engine links to every replica,
        ADR 0014: it starts once they serve), then the routers."""
        self._start_redis()
        self._start_pools(timeout_s)
        self._start_target(timeout_s)
        for i in range(self.spec.routers):
            self._start_router(i, timeout_s)
        self.info.router = self.info.routers[0]
        self.info.http = self.info.https[0]
        self._save()

    def _start_redis(self) -> None:
        if self.spec.redis_url:
            self.info.redis_url = self.spec.redis_url
        elif self.spec.redis_ha:
            from specserve.tooling.redis_server import start_redis_ha

            ha = self.redis_ha = start_redis_ha(self.run_dir / "redis-ha")
            self.info.redis_url = ha.url
            for name, server in (("redis", ha.primary), ("redis-replica", ha.replica),
                                 *((f"redis-sentinel-{i}", s) for i, s in enumerate(ha.sentinels))):
                self.info.pids[name] = server.pid
            self._save()
        elif self.spec.redis_cluster:
            from specserve.tooling.redis_server import start_redis_cluster

            cluster = self.redis_cluster = start_redis_cluster(self.run_dir / "redis-cluster")
            self.info.redis_url = cluster.url
            for i, node in enumerate(cluster.nodes):
                self.info.pids[f"redis-node-{i}"] = node.pid
            self._save()
        else:
            from specserve.tooling.redis_server import start_redis

            redis = self.redis = start_redis(self.run_dir / "redis")
            self.info.redis_url = redis.url
            self.info.pids["redis"] = redis.pid
            self._save()

    def _start_pools(self, timeout_s: float) -> None:
        spec, pair = self.spec, Path(self.spec.pair_dir)
        ports: list[tuple[str, str, subprocess.Popen, Path, Path]] = []
        for pool, ps in spec.pools.items():
            if ps.model == "eagle" and not (pair / "eagle" / "config.json").exists():
                raise StackError(f"pool {pool!r}: no EAGLE head at {pair / 'eagle'} "
                                 "(`specserve models eagle` trains one)")
            if ps.model == "suffix" and not ps.local:
                raise StackError(f"pool {pool!r}: a suffix pool drafts inside the target only (local=True)")
            if ps.local:
                self.info.pools[pool] = [{"ngram": LOCAL_NGRAM, "eagle": LOCAL_EAGLE,
                                          "suffix": LOCAL_SUFFIX}.get(ps.model, LOCAL_DRAFT)]
                continue
            for i in range(ps.replicas):
                name = f"draft-{pool}-{i}"
                port_file = self.run_dir / f"{name}.port"
                port_file.unlink(missing_ok=True)
                model = (ps.model if ps.model in ("ngram", "eagle")
                         else str(pair / ps.model) if not Path(ps.model).is_absolute() else ps.model)
                # a remote head reads the embeddings and LM head of the pair's target, and is fed
                # the target's features over the Link
                head = ({"SPECSERVE_DRAFT_EAGLE_HEAD": str(pair / "eagle"),
                         "SPECSERVE_DRAFT_EAGLE_TARGET": str(pair / "target")} if model == "eagle" else {})
                p, lg = self._spawn(name, "specserve.services.draft", {
                    "SPECSERVE_DRAFT_POOL": pool, "SPECSERVE_DRAFT_MODEL": model, **head,
                    # the pair's tokenizer: an n-gram replica masks its drafts under a constraint too
                    "SPECSERVE_DRAFT_TOKENIZER": str(pair / "target"),
                    "SPECSERVE_DRAFT_PORT_FILE": str(port_file), "SPECSERVE_DRAFT_METRICS_PORT": "0",
                    "SPECSERVE_DRAFT_METRICS_PORT_FILE": str(self.run_dir / f"{name}.metrics"),
                    **({"SPECSERVE_DRAFT_LORA": str(pair / ps.lora)} if ps.lora else {}), **ps.env})
                ports.append((pool, name, p, lg, port_file))
        for pool, name, p, lg, port_file in ports:
            port = _wait_file(port_file, p, name, timeout_s, lg)
            wait_serving(f"127.0.0.1:{port}", "specserve.v1.Draft", timeout_s, spec.tls_dir)
            self.info.pools.setdefault(pool, []).append(f"127.0.0.1:{port}")
            self.info.metrics[name] = f"127.0.0.1:{(self.run_dir / f'{name}.metrics').read_text().strip()}"

    def _start_target(self, timeout_s: float) -> None:
        spec, pair = self.spec, Path(self.spec.pair_dir)
        target_info = self.run_dir / "target.json"
        target_info.unlink(missing_ok=True)
        module = "specserve.services.target" if spec.target_ray else "specserve.services.target.plain"
        proc, log = self._spawn("target", module, {
            "SPECSERVE_TARGET_MODEL": str(pair / "target"), "SPECSERVE_TARGET_REDIS_URL": self.info.redis_url,
            "SPECSERVE_TARGET_KEY_PREFIX": spec.key_prefix, "SPECSERVE_TARGET_INFO_FILE": str(target_info),
            "SPECSERVE_TARGET_TORCH_THREADS": str(spec.target_threads), "RAY_USAGE_STATS_ENABLED": "0",
            **target_omp_env(spec.target_threads * spec.tensor_parallel, spec.reserved_cores(),
                             environ={**os.environ, **spec.env}),
            "SPECSERVE_TARGET_TENSOR_PARALLEL": str(spec.tensor_parallel),
            "SPECSERVE_TARGET_METRICS_PORT": "0", "SPECSERVE_TARGET_DRAFT_POOLS": json.dumps(self.info.pools),
            # the remote pools of EAGLE heads: the target sends them its features on the Link
            "SPECSERVE_TARGET_EAGLE_POOLS": json.dumps(
                [pool for pool, ps in spec.pools.items() if ps.model == "eagle" and not ps.local]),
            **local_draft_env(spec),
            "SPECSERVE_TARGET_ADAPTERS": json.dumps({name: str(pair / path) for name, path in spec.adapters.items()}),
        })
        self.info.target = json.loads(_wait_file(target_info, proc, "target", timeout_s, log))
        self.info.metrics["target"] = f"127.0.0.1:{self.info.target.get('metrics_port', -1)}"

    def _start_router(self, i: int, timeout_s: float) -> None:
        spec, pair = self.spec, Path(self.spec.pair_dir)
        name = "router" if i == 0 else f"router-{i}"
        router_port = self.run_dir / f"{name}.port"
        http_port = self.run_dir / f"{name}.http.port"
        router_port.unlink(missing_ok=True)
        http_port.unlink(missing_ok=True)
        p, lg = self._spawn(name, "specserve.services.router", {
            "SPECSERVE_ROUTER_PORT": "0", "SPECSERVE_ROUTER_PORT_FILE": str(router_port),
            "SPECSERVE_ROUTER_HTTP_PORT": str(spec.http_port if i == 0 else 0),
            "SPECSERVE_ROUTER_HTTP_PORT_FILE": str(http_port),
            "SPECSERVE_ROUTER_METRICS_PORT": "0",
            "SPECSERVE_ROUTER_METRICS_PORT_FILE": str(self.run_dir / f"{name}.metrics"),
            "SPECSERVE_ROUTER_REDIS_URL": self.info.redis_url, "SPECSERVE_ROUTER_KEY_PREFIX": spec.key_prefix,
            "SPECSERVE_ROUTER_TOKENIZER": str(pair / "target"),
            "SPECSERVE_ROUTER_DRAFT_POOLS": json.dumps(self.info.pools),
            "SPECSERVE_ROUTER_DEFAULT_POOL": next(iter(spec.pools), "none"), **spec.router_env,
            **(spec.router_env_each[i] if i < len(spec.router_env_each) else {}),
        })
        address = f"127.0.0.1:{_wait_file(router_port, p, name, timeout_s, lg)}"
        wait_serving(address, "specserve.v1.Generation", timeout_s, spec.tls_dir)
        self.info.routers.append(address)
        self.info.https.append(f"http://127.0.0.1:{_wait_file(http_port, p, name, timeout_s, lg)}")
        self.info.metrics[name] = f"127.0.0.1:{(self.run_dir / f'{name}.metrics').read_text().strip()}"

    def restart(self, name: str, address: str, timeout_s: float = 120.0) -> None:
        """Start a draft replica or router again (after a crash) on its old `address`."""
        module, env = self.launched[name]
        port = address.rsplit(":", 1)[1]
        kind = "ROUTER" if module == "specserve.services.router" else "DRAFT"
        proc, log = self._spawn(name, module, {**env, f"SPECSERVE_{kind}_PORT": port})
        service = "specserve.v1.Generation" if kind == "ROUTER" else "specserve.v1.Draft"
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                return wait_serving(address, service, 5.0, self.spec.tls_dir)
            except StackError:
                continue
        raise StackError(f"{name} did not come back; log tail:\n{_tail(log)}")

    def down(self, grace_s: float = 15.0) -> None:
        stop(self.info.pids, grace_s)


def stop(pids: dict[str, int], grace_s: float = 15.0) -> list[str]:
    """SIGTERM in reverse start order (router first), wait, then SIGKILL what is left.
    Only the PIDs recorded at start are touched."""
    stopped = []
    order = list(reversed(list(pids.items())))
    for name, pid in order:
        if _alive(pid):
            with _quiet():
                os.killpg(pid, signal.SIGTERM) if not name.startswith("redis") else os.kill(pid, signal.SIGTERM)
            stopped.append(name)
    deadline = time.monotonic() + grace_s
    for _name, pid in order:
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            with _quiet():
                os.killpg(pid, signal.SIGKILL)
    return stopped


def down_from(run_dir: str) -> list[str]:
    path = Path(run_dir) / "stack.json"
    if not path.exists():
        return []
    stopped = stop(json.loads(path.read_text())["pids"])
    path.unlink()
    return stopped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return exc[0] in (ProcessLookupError, PermissionError)
