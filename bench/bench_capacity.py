"""The stack's capacity at a device's speed (issue 52, ADR 0028): what the router, Redis and the
target's host cost a token when the forward costs next to nothing.

The stack as a user starts it (`tooling/stack.py`: redis-server, the Ray target, the routers),
on a target the benchmark builds: a random 1-layer Llama, 32 wide, on the demo pair's tokenizer
(4,096 tokens), whose CPU forward stands in for the device, padded up to an H200's measured step
(`profiles.H200_STEP`: 1.61 ms at 1 row, 3.35 ms at 64, a line through them; the target's
`simulated_pass_ms` and `simulated_row_ms`). Plain greedy decoding, EOS banned, so every request
emits `--tokens` tokens.

Clients (this process, asyncio): `streams` streams each sending one request after another, over
gRPC (`GenerateStream`, token ids in) or the OpenAI HTTP API (`/v1/completions`, SSE, a plain
asyncio HTTP/1.1 client on a kept-alive connection), spread over the routers round-robin. Each
cell warms up for `--warm` seconds, then measures `--seconds`; the streams then finish their
requests and stop.

Reported per cell:
- tok/s delivered to clients in the window (a request's tokens counted where its chunks came);
- TPOT p50 / p90 and TTFT p50 of the requests wholly inside the window, and the TPOT the stack
  adds: TPOT p50 through the stack minus the engine's own, the same engine on the same model and
  simulated step in this process, with no committer, no Redis and no client (`engine_alone`);
- CPU a token of each process, from /proc/<pid>/stat over the window: every router, Redis (a
  Cluster's masters and replicas apart), the target (split with its own counters
  `specserve_target_step_cpu_seconds{part}`: the forward, the engine thread's bookkeeping, and
  the rest: its event loop, gRPC, commits, telemetry; the rest plus the bookkeeping is the
  target's host work), Ray's own processes, and the client;
- Redis commands a token, by command (INFO commandstats), and their time a token.

Arms (`--arms`): `base` (one router, one Redis; every `--streams` over each of `--apis`),
`routers` (`--router-counts` routers at `--scale-streams` streams, gRPC and HTTP), `cluster` (a
local Redis Cluster, three masters with a replica each, as the fault tests start it; one router,
at `--cluster-streams`). One stack per arm and router count. And two parts alone: `commit` (the
engine's commit path: a step of 64 rounds through the store, Redis's CPU and the client's a round)
and `grpc` (a bare grpc.aio servicer streaming small chunks: its CPU a message, the floor under
the router's cost a token).

    python bench/bench_capacity.py [--arms base,routers,cluster] [--streams 1,16,64,256] [--label after]
    python bench/bench_capacity.py --smoke --out /tmp/x       # the suite's run: seconds, checks the fields

Results: bench/results/capacity/capacity[-label].json and .png.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from common import engine_running, parser, warn_if_busy
from profiles import H200_STEP

from specserve.tooling.stack import Stack, StackSpec

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "models" / "specserve-demo-v1" / "target"
EOS = 0  # the demo tokenizer's (banned: every request runs to its max_tokens)
PROMPT = [17, 301, 1029, 77, 2048, 5, 911, 64]  # 8 token ids; the same for every request
TICK = os.sysconf("SC_CLK_TCK")


# ---- the stand-in target ----

def tiny_pair(directory: Path) -> Path:
    """A pair directory whose target is a random 1-layer Llama on the demo tokenizer (built once:
    a second of CPU). Its forward is a CPU stand-in for the device's."""
    target = directory / "target"
    if (target / "model.safetensors").exists():
        return directory
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      eos_token_id=EOS, bos_token_id=EOS, pad_token_id=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    # Its greedy picks are tokens that decode to plain text on their own: a random model's would
    # mostly be pieces of characters, which the engine holds back until they complete, and an
    # HTTP stream would send one event for many tokens (the router's cost a token understated).
    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    plain = torch.tensor([(t := tok.decode([i])).isascii() and t.strip() != "" and t.isprintable()
                          for i in range(cfg.vocab_size)])
    plain[EOS] = False
    with torch.no_grad():
        model.lm_head.weight[~plain] = 0.0
        model.lm_head.weight[plain] *= 8.0
    model.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(TOKENIZER / name, target / name)
    return directory


def stack_spec(pair: Path, run_dir: str, routers: int, cluster: bool) -> StackSpec:
    step = H200_STEP
    return StackSpec(
        pair_dir=str(pair), run_dir=run_dir, pools={}, target_threads=1, routers=routers, redis_cluster=cluster,
        env={"SPECSERVE_TARGET_SIMULATED_PASS_MS": f"{step.pass_ms:.4f}",
             "SPECSERVE_TARGET_SIMULATED_ROW_MS": f"{step.row_ms:.5f}",
             "SPECSERVE_TARGET_MAX_BATCH": "256", "SPECSERVE_TARGET_MAX_SESSIONS": "512",
             "SPECSERVE_TARGET_KV_BUDGET_MB": "64", "SPECSERVE_TARGET_MAX_LEN": "256",
             "SPECSERVE_TARGET_EXACT_BATCHING": "fast"},
        router_env={"SPECSERVE_ROUTER_HTTP_MAX_IN_FLIGHT": "4096", "SPECSERVE_ROUTER_MAX_CONCURRENT_RPCS": "8192"})


# ---- what each process spent ----

def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


@dataclass
class Roles:
    """The processes of one stack by role (pids), read once it is up."""

    routers: list[int]
    redis_masters: list[int]
    redis_replicas: list[int]
    target: int
    ray: list[int]
    metrics: str  # the target's /metrics host:port
    redis: list[tuple[int, str]]  # (port, password) of each master, for INFO commandstats

    @classmethod
    def of(cls, stack: Stack) -> Roles:
        info = stack.info
        routers = [pid for name, pid in info.pids.items() if name.startswith("router")]
        target = int(info.target["pid"])
        ray = [p for p in _descendants(info.pids["target"]) if p != target]  # the launcher and its Ray head
        if stack.redis_cluster is not None:
            c = stack.redis_cluster
            masters = [n for n in c.nodes if c.role(n) == "master"]
            replicas = [n for n in c.nodes if n not in masters]
            return cls(routers, [n.pid for n in masters], [n.pid for n in replicas], target, sorted(set(ray)),
                       info.metrics["target"], [(n.port, c.password) for n in masters])
        r = stack.redis
        assert r is not None
        return cls(routers, [r.pid], [], target, sorted(set(ray)), info.metrics["target"], [(r.port, r.password)])

    def snapshot(self) -> dict:
        m = target_metrics(self.metrics)
        return {"t": time.perf_counter(), "client": sum(os.times()[:2]),
                "routers": [_cpu_s(p) for p in self.routers], "redis": sum(_cpu_s(p) for p in self.redis_masters),
                "redis_replicas": sum(_cpu_s(p) for p in self.redis_replicas), "target": _cpu_s(self.target),
                "ray": sum(_cpu_s(p) for p in self.ray), **m, "commandstats": commandstats(self.redis)}


_SAMPLE = re.compile(r'^(\w+)(?:\{([^}]*)\})? ([0-9.eE+-]+|NaN)$')


def target_metrics(address: str) -> dict:
    """The target's counters this benchmark reads: its steps, their rows and forward wall time,
    the engine thread's CPU split, the tokens it committed."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    out = {"steps": 0.0, "rows": 0.0, "step_s": 0.0, "forward_cpu": 0.0, "engine_cpu": 0.0, "output_tokens": 0.0,
           "overhead_s": 0.0, "overhead_n": 0.0}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "specserve_target_call_seconds_count" and 'method="step"' in labels:
            out["steps"] += value
        elif name == "specserve_target_call_seconds_sum" and 'method="step"' in labels:
            out["step_s"] += value
        elif name == "specserve_target_batch_size_sum":
            out["rows"] += value
        elif name == "specserve_target_step_cpu_seconds_total":
            out["forward_cpu" if 'part="forward"' in labels else "engine_cpu"] += value
        elif name == "specserve_output_tokens_total":
            out["output_tokens"] += value
        elif name == "specserve_round_overhead_seconds_sum":  # a round's share: its step's bookkeeping
            out["overhead_s"] += value
        elif name == "specserve_round_overhead_seconds_count":
            out["overhead_n"] += value
    return out


def commandstats(nodes: list[tuple[int, str]]) -> dict[str, list[float]]:
    """INFO commandstats summed over the masters: command -> [calls, usec]."""
    import redis

    out: dict[str, list[float]] = {}
    for port, password in nodes:
        with redis.Redis(port=port, password=password or None, socket_timeout=5) as c:
            for key, v in c.info("commandstats").items():
                cmd = key.removeprefix("cmdstat_")
                acc = out.setdefault(cmd, [0.0, 0.0])
                acc[0] += v["calls"]
                acc[1] += v["usec"]
    return out


def per_token(before: dict, after: dict, tokens: float) -> dict:
    """CPU ms a token of each role over the window (the target split into its parts)."""
    def ms(x: float) -> float:
        return x * 1e3 / tokens if tokens else float("nan")

    routers = [ms(b - a) for a, b in zip(before["routers"], after["routers"], strict=True)]
    d = {k: after[k] - before[k] for k in ("client", "redis", "redis_replicas", "target", "ray", "forward_cpu",
                                           "engine_cpu", "steps", "rows", "step_s", "overhead_s", "overhead_n")}
    host = d["target"] - d["forward_cpu"]
    stats = {cmd: (v[0] - before["commandstats"].get(cmd, [0, 0])[0], v[1] - before["commandstats"].get(cmd, [0, 0])[1])
             for cmd, v in after["commandstats"].items()}
    stats = {cmd: cu for cmd, cu in stats.items() if cu[0] > 0 and cmd not in ("info", "ping")}
    return {
        "router_ms": sum(routers), "router_ms_each": routers, "redis_ms": ms(d["redis"]),
        "redis_replicas_ms": ms(d["redis_replicas"]), "target_ms": ms(d["target"]),
        "target_forward_ms": ms(d["forward_cpu"]), "target_engine_ms": ms(d["engine_cpu"]),
        "target_host_ms": ms(host), "target_event_loop_ms": ms(host - d["engine_cpu"]), "ray_ms": ms(d["ray"]),
        "client_ms": ms(d["client"]),
        "engine_steps": d["steps"], "engine_rows_per_step": d["rows"] / d["steps"] if d["steps"] else 0.0,
        "engine_step_ms": d["step_s"] * 1e3 / d["steps"] if d["steps"] else 0.0,
        # the engine's own time a step (its forward, padded, and its bookkeeping) in this run: at one
        # stream the TPOT the engine alone would give, measured beside the stack, in its process
        "engine_tpot_ms": (d["step_s"] * 1e3 / d["steps"] if d["steps"] else 0.0)
        + (d["overhead_s"] * 1e3 / d["overhead_n"] if d["overhead_n"] else 0.0),
        "redis_calls_per_token": sum(c for c, _ in stats.values()) / tokens if tokens else 0.0,
        "redis_usec_per_token": sum(u for _, u in stats.values()) / tokens if tokens else 0.0,
        "redis_commands": {cmd: {"calls_per_token": c / tokens, "usec_per_call": u / c}
                           for cmd, (c, u) in sorted(stats.items(), key=lambda kv: -kv[1][1])} if tokens else {},
    }


# ---- the clients ----

@dataclass
class Request:
    sent: float
    chunks: list[tuple[float, float]] = field(default_factory=list)  # (arrival, tokens)

    @property
    def tokens(self) -> float:
        return sum(n for _, n in self.chunks)

    def tpot_ms(self) -> float | None:
        if len(self.chunks) < 2 or self.tokens < 2:
            return None
        return (self.chunks[-1][0] - self.chunks[0][0]) * 1e3 / (self.tokens - self.chunks[0][1])


def prompt(i: int) -> list[int]:
    """Request i's prompt: 8 token ids, the first varied so requests are not all alike."""
    return [2 + (i * 7919) % 4000, *PROMPT[1:]]


class Clients:
    """`streams` streams over one API, each sending requests one after another until `stop`."""

    def __init__(self, api: str, routers: list[str], https: list[str], streams: int, tokens: int,
                 pool: str = "none", k: int = 0, prompts: list[list[int]] | None = None) -> None:
        self.api, self.routers, self.https, self.streams, self.tokens = api, routers, https, streams, tokens
        self.pool, self.k = pool, k  # the draft pool and K each request names (gpu_stack.py's arms)
        self.prompt = (lambda i: prompts[i % len(prompts)]) if prompts else prompt
        self.done: list[Request] = []
        self.errors: list[str] = []
        self.stop = False
        self.sent = 0

    async def run(self) -> None:
        if self.api == "grpc":
            import grpc

            from specserve.v1 import generation_pb2_grpc

            channels = [grpc.aio.insecure_channel(a) for a in self.routers]
            stubs = [generation_pb2_grpc.GenerationStub(c) for c in channels]
            try:
                await asyncio.gather(*(self._grpc(stubs[i % len(stubs)]) for i in range(self.streams)))
            finally:
                for c in channels:
                    await c.close()
        else:
            await asyncio.gather(*(self._http(self.https[i % len(self.https)]) for i in range(self.streams)))

    async def _grpc(self, stub) -> None:
        from specserve.v1 import generation_pb2

        while not self.stop:
            req = generation_pb2.GenerateRequest(max_tokens=self.tokens, draft_pool=self.pool, banned_token_ids=[EOS],
                                                 **({"num_draft_tokens": self.k} if self.k else {}))
            req.prompt_ids.ids.extend(self.prompt(self.sent))
            self.sent += 1
            r = Request(time.perf_counter())
            try:
                async for chunk in stub.GenerateStream(req):
                    if chunk.token_ids:
                        r.chunks.append((time.perf_counter(), len(chunk.token_ids)))
            except Exception as exc:  # noqa: BLE001 - counted, the stream goes on
                self.errors.append(repr(exc)[:300])
                await asyncio.sleep(0.1)
                continue
            self.done.append(r)

    async def _http(self, base: str) -> None:
        host, port = base.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            while not self.stop:
                body = json.dumps({"model": "specserve", "prompt": self.prompt(self.sent), "max_tokens": self.tokens,
                                   "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                                   "draft_pool": self.pool, **({"num_draft_tokens": self.k} if self.k else {})}
                                  ).encode()
                self.sent += 1
                r = Request(time.perf_counter())
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                try:
                    await _sse(reader, r)
                except Exception as exc:  # noqa: BLE001 - counted, the stream goes on with a new connection
                    self.errors.append(repr(exc)[:300])
                    writer.close()
                    reader, writer = await asyncio.open_connection(host, int(port))
                    continue
                self.done.append(r)
        finally:
            writer.close()


async def _sse(reader: asyncio.StreamReader, r: Request) -> None:
    """One streamed completion's response (chunked transfer, one SSE event a chunk): each text
    event's arrival into `r`, then the usage's token count spread over them."""
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"HTTP {status!r}")
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        chunked |= line.lower().startswith(b"transfer-encoding: chunked")
    if not chunked:
        raise RuntimeError("expected a chunked SSE response")
    usage, buf = 0, b""
    while True:
        size = int((await reader.readline()).strip(), 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            break
        buf += data[:-2]
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            payload = event.removeprefix(b"data: ")
            if payload == b"[DONE]":
                continue
            msg = json.loads(payload)
            if "error" in msg:
                raise RuntimeError(str(msg["error"])[:200])
            if msg.get("usage"):
                usage = msg["usage"]["completion_tokens"]
            if msg.get("choices") and msg["choices"][0].get("text"):
                r.chunks.append((time.perf_counter(), 1.0))
    if r.chunks and usage:  # a chunk whose text was empty (a partial character) had no event
        each = usage / len(r.chunks)
        r.chunks = [(t, each) for t, _ in r.chunks]


# ---- one cell ----

def run_cell(roles: Roles, stack: Stack, api: str, streams: int, a, pool: str = "none", k: int = 0,
             prompts: list[list[int]] | None = None) -> dict:
    clients = Clients(api, stack.info.routers, stack.info.https, streams, a.tokens, pool, k, prompts)

    async def measured() -> tuple[dict, dict]:
        task = asyncio.ensure_future(clients.run())
        await asyncio.sleep(a.warm)
        before = roles.snapshot()
        await asyncio.sleep(a.seconds)
        after = roles.snapshot()
        clients.stop = True
        await asyncio.wait_for(task, timeout=300)
        return before, after

    before, after = asyncio.run(measured())
    t0, t1 = before["t"], after["t"]
    tokens = sum(n for r in clients.done for t, n in r.chunks if t0 <= t < t1)
    inside = [r for r in clients.done if r.sent >= t0 and r.chunks and r.chunks[-1][0] <= t1]
    timed = inside or [r for r in clients.done if r.chunks and r.chunks[0][0] >= t0]
    tpots = sorted(x for r in timed if (x := r.tpot_ms()) is not None)
    # the time between a request's chunks, a token: TPOT without its first chunk's lateness (a
    # reader that starts behind the engine gets its first tokens together, which shortens TPOT)
    gaps = sorted((b[0] - a[0]) * 1e3 / b[1] for r in timed for a, b in zip(r.chunks, r.chunks[1:], strict=False))
    ttfts = sorted((r.chunks[0][0] - r.sent) * 1e3 for r in timed if r.chunks)
    cell = {"api": api, "streams": streams, "routers": len(stack.info.routers),
            "redis": "cluster" if stack.redis_cluster is not None else "one", "window_s": t1 - t0,
            "tokens": tokens, "tok_s": tokens / (t1 - t0), "requests": len(clients.done), "timed_requests": len(timed),
            "tokens_per_request": statistics.mean(r.tokens for r in clients.done) if clients.done else 0.0,
            "tpot_ms_p50": _pct(tpots, 50), "tpot_ms_p90": _pct(tpots, 90), "ttft_ms_p50": _pct(ttfts, 50),
            "gap_ms_p50": _pct(gaps, 50),
            "errors": len(clients.errors), "error_examples": clients.errors[:3], "load_after": os.getloadavg()[0],
            **per_token(before, after, tokens)}
    cell["committed_tok_s"] = (after["output_tokens"] - before["output_tokens"]) / (t1 - t0)
    return cell


def _pct(xs: list[float], p: int) -> float | None:
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


# ---- the engine alone: the same model and simulated step, in this process ----

def engine_alone(pair: Path, loads: list[int], tokens: int, seconds: float) -> dict[int, dict]:
    """TPOT p50 of the target's engine loop in process, on the same tiny model and H200 step,
    with no committer, no Redis and no client: the TPOT the stack adds is measured over it."""
    import torch

    from specserve.algorithm.stops import StopChecker
    from specserve.engine.loop import EngineLoop
    from specserve.engine.scheduler import Budget
    from specserve.engine.session import EnginePlan
    from specserve.models.loading import load_model
    from specserve.models.verifier import TargetModel
    from specserve.params import GenerationParams, SamplingParams
    from specserve.worker.model_step import Batching, make_target_step, warm_up
    from specserve.worker.threads import ModelThread

    torch.set_num_threads(1)
    model_thread = ModelThread("engine")

    def build():
        target = TargetModel(load_model(str(pair / "target")))
        model = make_target_step(target, Batching(tile=None, max_batch=256, max_sessions=512, kv_budget_mb=64,
                                                  max_len=256))
        warm_up(model)
        return target, model

    target, model = model_thread.submit(build).result()
    ends: dict[str, tuple[threading.Event, list[float]]] = {}

    class Watch:
        def round(self, session, stats) -> None:
            ends[session.id][1].append(time.perf_counter())

        def finished(self, session) -> None:
            ends[session.id][0].set()

    loop = EngineLoop(model, lambda p: StopChecker(frozenset(target.eos_token_ids), tuple(p.stop), str), {}, None,
                      observers=[Watch()], budget=Budget(max_batch=256),
                      simulated_step_ms=lambda step, out: H200_STEP.step_ms(len(step.rows)))
    params = GenerationParams(max_tokens=tokens, sampling=SamplingParams(banned_token_ids=(EOS,)), seed=0)
    out = {}
    with engine_running(loop, model_thread):
        for streams in loads:
            tpots: list[float] = []
            requests = max(2, min(20, int(seconds / (tokens * H200_STEP.step_ms(streams) / 1e3))))

            def client(i: int, requests=requests, streams=streams, tpots=tpots) -> None:
                for j in range(requests):
                    sid = f"alone-{streams}-{i}-{j}"
                    ends[sid] = (threading.Event(), [])
                    loop.add(sid, prompt(i * requests + j), EnginePlan(params)).result()
                    ends[sid][0].wait(120)
                    times = ends[sid][1]
                    if len(times) > 2:  # (the first round is the prefill's, with the first token)
                        tpots.append((times[-1] - times[0]) * 1e3 / (len(times) - 1))

            threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            tpots.sort()
            out[streams] = {"tpot_ms_p50": _pct(tpots, 50), "tpot_ms_p90": _pct(tpots, 90),
                            "step_ms": H200_STEP.step_ms(streams), "requests": len(tpots)}
    return out


# ---- two parts alone: the commit path, and gRPC's own cost a message ----

def commit_cost(steps: int = 150, rows: int = 64) -> dict:
    """A step of `rows` rounds committed `steps` times through the store on a fresh redis-server
    (its AOF on, as the stack runs it): Redis's CPU and this process's a round, and Redis's calls."""
    import redis as sync_redis

    from specserve.state.store import SessionStore, connect
    from specserve.tooling.redis_server import start_redis

    @dataclass(frozen=True)
    class Round:
        session_id: str
        epoch: int
        expected_len: int
        round_id: str
        tokens: tuple[int, ...]
        text: str
        finish_reason: str | None = None
        stats: str = ""

    async def run(url: str, pid: int) -> dict:
        client = connect(url)
        store = SessionStore(client, prefix="cost")
        sids = [(await store.create_or_join(None, {"k": 1}, [1, 2], "bench")).session_id for _ in range(rows)]
        await store.commit_batch([Round(s, 1, 0, f"{s}:w", (1,), "w") for s in sids])
        redis0, me0 = _cpu_s(pid), time.process_time()
        for n in range(1, steps + 1):
            await store.commit_batch([Round(s, 1, n, f"{s}:{n}", (5,), "x") for s in sids])
        out = {"redis_us_a_round": (_cpu_s(pid) - redis0) * 1e6 / (steps * rows),
               "client_us_a_round": (time.process_time() - me0) * 1e6 / (steps * rows)}
        await client.aclose()
        return out

    with tempfile.TemporaryDirectory(prefix="specserve-capacity-redis-") as d:
        server = start_redis(Path(d))
        try:
            with sync_redis.Redis(port=server.port, password=server.password) as c:
                c.config_resetstat()
                out = asyncio.run(run(server.url, server.pid))
                stats = c.info("commandstats")
            calls = sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_config", "cmdstat_info"))
            out["redis_calls_a_round"] = calls / ((steps + 1) * rows)
        finally:
            server.stop()
    return {"rows": rows, "steps": steps, **out}


class _Chunks:
    """A bare Generation servicer: `max_tokens` small chunks a call, 2 ms apart (gRPC alone)."""

    def __init__(self) -> None:
        from specserve.v1 import generation_pb2, generation_pb2_grpc

        self.pb = generation_pb2
        self.servicer = type("S", (generation_pb2_grpc.GenerationServicer,), {"GenerateStream": self.stream})()

    async def stream(self, request, context):
        for i in range(request.max_tokens):
            yield self.pb.GenerateChunk(session_id="0" * 32, offset=i, token_ids=[5], text="ab")
            await asyncio.sleep(0.002)


def grpc_floor(loads: tuple[int, ...] = (1, 64)) -> dict:
    """The CPU a streamed message costs a grpc.aio server on its own (a servicer that yields small
    chunks 2 ms apart, in a process of its own): the floor under the router's cost a token."""
    import subprocess

    code = ("import asyncio, sys; sys.path.insert(0, 'bench'); import grpc, bench_capacity as b\n"
            "from specserve.v1 import generation_pb2_grpc as g\n"
            "async def main():\n"
            "    s = grpc.aio.server(); g.add_GenerationServicer_to_server(b._Chunks().servicer, s)\n"
            "    print(s.add_insecure_port('127.0.0.1:0'), flush=True)\n"
            "    await s.start(); await s.wait_for_termination()\n"
            "asyncio.run(main())\n")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]
        out = {}
        for streams in loads:
            per = max(20, 2000 // streams)
            asyncio.run(_stream_all(port, 2, 5))  # warm
            before = _cpu_s(server.pid)
            n = asyncio.run(_stream_all(port, streams, per))
            out[str(streams)] = {"messages": n, "server_us_a_message": (_cpu_s(server.pid) - before) * 1e6 / n}
        return out
    finally:
        server.terminate()
        server.wait(10)


async def _stream_all(port: int, streams: int, per: int) -> int:
    import grpc

    from specserve.v1 import generation_pb2, generation_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one() -> int:
            return len([c async for c in stub.GenerateStream(generation_pb2.GenerateRequest(max_tokens=per))])

        return sum(await asyncio.gather(*(one() for _ in range(streams))))


# ---- the arms, the report ----

def measure_stack(pair: Path, routers: int, cluster: bool, cells: list[tuple[str, int]], a, arm: str) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory(prefix="specserve-capacity-") as run_dir:
        t0 = time.perf_counter()
        with Stack(stack_spec(pair, run_dir, routers, cluster)).running(timeout_s=300) as stack:
            print(f"[bench] {arm}: stack up in {time.perf_counter() - t0:.1f} s ({routers} routers, "
                  f"{'a Cluster' if cluster else 'one Redis'})", file=sys.stderr, flush=True)
            roles = Roles.of(stack)
            warm = Clients("grpc", stack.info.routers, stack.info.https, 1, 4)  # the first requests' imports
            asyncio.run(_briefly(warm))
            for api, streams in cells:
                cell = {"arm": arm, **run_cell(roles, stack, api, streams, a)}
                print(f"[bench] {arm} {api} {streams} streams: {cell['tok_s']:.0f} tok/s, router "
                      f"{cell['router_ms']:.3f} ms, redis {cell['redis_ms']:.3f}, target host "
                      f"{cell['target_host_ms']:.3f} a token, errors {cell['errors']}", file=sys.stderr, flush=True)
                out.append(cell)
    return out


async def _briefly(clients: Clients) -> None:
    task = asyncio.ensure_future(clients.run())
    await asyncio.sleep(0.5)
    clients.stop = True
    await asyncio.wait_for(task, timeout=60)


def targets(cells: list[dict], alone: dict[int, dict]) -> dict:
    """Issue 52's targets against this run (None where the run had no such cell)."""
    def cell(arm: str, api: str, streams: int, routers: int = 1) -> dict | None:
        return next((c for c in cells if c["arm"] == arm and c["api"] == api and c["streams"] == streams
                     and c["routers"] == routers), None)

    out: dict = {}
    for api in ("grpc", "http"):
        c64 = cell("base", api, 64)
        if c64 is not None:
            out[f"{api}_64"] = {"router_ms": c64["router_ms"], "router_ok": c64["router_ms"] <= 0.05,
                                "redis_ms": c64["redis_ms"], "redis_ok": c64["redis_ms"] <= 0.02,
                                "target_host_ms": c64["target_host_ms"],
                                "target_host_ok": c64["target_host_ms"] <= 0.05}
        c1 = cell("base", api, 1)
        if c1 is not None and c1["tpot_ms_p50"] is not None:
            # TPOT over the engine's own time a step in the same run (its process, its priority,
            # this moment); and over the engine alone in the benchmark's process (the issue's
            # wording; on a loaded machine its sleeps overshoot at this process's niceness, below
            # the target's). A reader that starts behind gets its first tokens together, which
            # shortens TPOT: `gap_ms_p50` and `ttft_ms_p50` say when
            added = c1["tpot_ms_p50"] - c1["engine_tpot_ms"]
            ref = alone.get(1, {}).get("tpot_ms_p50")
            out[f"{api}_tpot_added_1"] = {"ms": added, "ok": added <= 0.3, "engine_tpot_ms": c1["engine_tpot_ms"],
                                          "over_engine_alone_ms": None if ref is None else c1["tpot_ms_p50"] - ref}
        r1, r2 = cell("routers", api, _scale(cells), 1), cell("routers", api, _scale(cells), 2)
        if r1 is not None and r2 is not None:
            out[f"{api}_router_scaling"] = {"x": r2["tok_s"] / r1["tok_s"], "ok": r2["tok_s"] / r1["tok_s"] >= 1.8}
    return out


def _scale(cells: list[dict]) -> int:
    return next((c["streams"] for c in cells if c["arm"] == "routers"), 0)


def table(cells: list[dict], alone: dict[int, dict]) -> str:
    head = ("| arm | API | streams | routers | Redis | tok/s | TPOT p50 (added) ms | router | Redis | target host "
            "(engine + loop) | forward | Ray | client | Redis calls a token |")
    rows = [head, "|" + "---|" * 14]
    for c in cells:
        base = alone.get(c["streams"], {}).get("tpot_ms_p50")
        tpot = "-" if c["tpot_ms_p50"] is None else f"{c['tpot_ms_p50']:.2f}" + (
            f" ({c['tpot_ms_p50'] - base:+.2f})" if base else "")
        rows.append(f"| {c['arm']} | {c['api']} | {c['streams']} | {c['routers']} | {c['redis']} | {c['tok_s']:.0f} "
                    f"| {tpot} | {c['router_ms']:.3f} | {c['redis_ms']:.3f}"
                    + (f" (+{c['redis_replicas_ms']:.3f} replicas)" if c["redis"] == "cluster" else "")
                    + f" | {c['target_host_ms']:.3f} ({c['target_engine_ms']:.3f} + {c['target_event_loop_ms']:.3f}) "
                    f"| {c['target_forward_ms']:.3f} | {c['ray_ms']:.3f} | {c['client_ms']:.3f} "
                    f"| {c['redis_calls_per_token']:.2f} |")
    return "\n".join(rows)


def plot(cells: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    parts = [("router_ms", "router"), ("redis_ms", "Redis"), ("target_host_ms", "target host"),
             ("target_forward_ms", "forward (stand-in)"), ("client_ms", "client")]
    base = [c for c in cells if c["arm"] == "base"]
    labels = [f"{c['api']}\n{c['streams']}" for c in base]
    bottom = [0.0] * len(base)
    for key, name in parts:
        vals = [c[key] for c in base]
        axes[0].bar(range(len(base)), vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    axes[0].set_xticks(range(len(base)), labels, fontsize=7)
    axes[0].set_ylabel("CPU ms a token")
    axes[0].set_title("one router, one Redis")
    axes[0].legend(fontsize=7)
    for api, style in (("grpc", "o-"), ("http", "s--")):
        xs = [c for c in base if c["api"] == api]
        axes[1].plot([c["streams"] for c in xs], [c["tok_s"] for c in xs], style, label=api)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("streams")
    axes[1].set_ylabel("tok/s delivered")
    axes[1].legend()
    other = [c for c in cells if c["arm"] != "base"]
    axes[2].bar(range(len(other)), [c["tok_s"] for c in other])
    axes[2].set_xticks(range(len(other)), [f"{c['api']} {c['streams']}\n{c['routers']}r {c['redis']}" for c in other],
                       fontsize=7)
    axes[2].set_ylabel("tok/s delivered")
    axes[2].set_title("routers; one Redis against a Cluster")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--arms", default="base,routers,cluster,commit,grpc")
    ap.add_argument("--apis", default="grpc,http")
    ap.add_argument("--streams", default="1,16,64,256")
    ap.add_argument("--router-counts", default="1,2,4")
    ap.add_argument("--scale-streams", type=int, default=64)
    ap.add_argument("--cluster-streams", default="64,256")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warm", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--label", default="")
    ap.add_argument("--smoke", action="store_true", help="seconds: two cells of 4 streams; checks the script")
    a = ap.parse_args()
    if a.smoke:
        a.arms, a.streams, a.tokens, a.warm, a.seconds = "base,commit", "1,4", 16, 0.5, 1.5
    apis = a.apis.split(",")
    streams = [int(s) for s in a.streams.split(",")]
    out = Path(a.out) / "capacity"
    out.mkdir(parents=True, exist_ok=True)
    load_before = warn_if_busy()
    with tempfile.TemporaryDirectory(prefix="specserve-capacity-pair-") as tmp:
        pair = tiny_pair(Path(tmp))
        t0 = time.perf_counter()
        cells: list[dict] = []
        arms = a.arms.split(",")
        alone = engine_alone(pair, [1] if a.smoke else streams, a.tokens, 1.0 if a.smoke else 3.0) \
            if "base" in arms else {}
        if alone:
            print(f"[bench] the engine alone ({time.perf_counter() - t0:.1f} s): "
                  + ", ".join(f"{s}: {v['tpot_ms_p50']:.2f} ms" for s, v in alone.items()), file=sys.stderr,
                  flush=True)
        if "base" in arms:
            order = [(api, s) for s in streams for api in apis] if not a.smoke else [("grpc", 4), ("http", 4)]
            if a.smoke:
                order.insert(0, ("grpc", 1))
            cells += measure_stack(pair, 1, False, order, a, "base")
            # the one-stream reference again, right after: the machine's speed drifts, and the TPOT
            # the stack adds at one stream is a fraction of a millisecond (the mean of the two)
            again = engine_alone(pair, [1], a.tokens, 1.0 if a.smoke else 3.0)[1]
            alone[1] = {**alone[1], "tpot_ms_p50_runs": [alone[1]["tpot_ms_p50"], again["tpot_ms_p50"]],
                        "tpot_ms_p50": (alone[1]["tpot_ms_p50"] + again["tpot_ms_p50"]) / 2}
        if "routers" in arms:
            for n in (int(x) for x in a.router_counts.split(",")):
                cells += measure_stack(pair, n, False, [(api, a.scale_streams) for api in apis], a, "routers")
        if "cluster" in arms:
            cells += measure_stack(pair, 1, True, [("grpc", int(s)) for s in a.cluster_streams.split(",")], a,
                                   "cluster")
    parts = {}
    if "commit" in arms:  # the engine's commit path alone: a step of 64 rounds, Redis's CPU a round
        parts["commit"] = commit_cost(steps=20 if a.smoke else 150)
        print(f"[bench] commit: {parts['commit']}", file=sys.stderr, flush=True)
    if "grpc" in arms:  # gRPC's own CPU a streamed message: the floor under the router's
        parts["grpc"] = grpc_floor((4,) if a.smoke else (1, 64))
        print(f"[bench] grpc alone: {parts['grpc']}", file=sys.stderr, flush=True)
    met = targets(cells, alone)
    name = "capacity" + (f"-{a.label}" if a.label else "")
    result = {"meta": {"args": vars(a), "cpus": os.cpu_count(), "load_before": load_before,
                       "load_after": os.getloadavg(), "h200_step": {"pass_ms": H200_STEP.pass_ms,
                                                                    "row_ms": H200_STEP.row_ms,
                                                                    "measured": H200_STEP.measured}},
              "engine_alone": {str(k): v for k, v in alone.items()}, "cells": cells, "parts": parts, "targets": met}
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    plot(cells, out / f"{name}.png")
    print(table(cells, alone))
    print("\ntargets:", json.dumps(met, indent=1))
    print(f"wrote {out / name}.json and .png", file=sys.stderr)


if __name__ == "__main__":
    main()
