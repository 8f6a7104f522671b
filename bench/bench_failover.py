"""Redis under Sentinel (ADR 0023): what the readers' replica acknowledgement costs on a healthy
primary, and how long a primary failover pauses the streams.

Real processes: a primary, one replica and three sentinels on loopback (`start_redis_ha`).
N simulated drivers commit a round of --round-tokens tokens every --round-ms through the
store's fenced commit script (what the engine's committer sends), and one store reader per
session follows it (what a router streams to a client).

- cost: per arm (replica_acks 0 = serve at once, 1 = serve what the replica acknowledged) the
  delay from a round's commit to its delivery to the reader, p50/p99, and the Redis commands
  per delivered token;
- failover: with replica_acks 1, the primary is killed (SIGKILL) mid-generation; per stream the
  longest gap between deliveries around the kill (p50/p99), and every stream checked against
  its session's committed tokens (nothing repeated, skipped or changed).

- throughput: what a Redis Cluster buys. One writer sends what the engine sends, one
  `commit_batch` per step with a round for each of --sessions sessions, as fast as Redis
  answers, for --seconds: steps and tokens a second on one Redis against a local Cluster of
  three masters (a replica each). On this machine every server shares the same cores.

Writes <out>/failover/failover.json and failover.png.

    python bench/bench_failover.py [--sessions 8 64] [--seconds 4]
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
import uuid
from pathlib import Path

from common import parser, warn_if_busy

from specserve.state.connection import connect, ride_out
from specserve.state.store import CommitStatus, SessionStore
from specserve.tooling.redis_server import start_redis, start_redis_cluster, start_redis_ha


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


async def _arm(url: str, sessions: int, acks: int, seconds: float, round_tokens: int, round_s: float,
               kill=None) -> dict:
    client = connect(url)
    store = SessionStore(client, replica_acks=acks)
    total = int(seconds / round_s) * round_tokens
    sids = [(await store.create_or_join(uuid.uuid4().hex, {}, [1], "bench")).session_id for _ in range(sessions)]
    sent: dict[str, dict[int, float]] = {s: {} for s in sids}
    got: dict[str, list[int]] = {s: [] for s in sids}
    times: dict[str, list[float]] = {s: [] for s in sids}
    delays: list[float] = []

    async def drive(sid: str) -> None:
        n, epoch = 0, 1
        while n < total:
            toks = [(n + i) % 30000 for i in range(round_tokens)]
            sent[sid][n] = time.monotonic()
            finish = "length" if n + round_tokens >= total else None
            res = await ride_out(lambda n=n, epoch=epoch, toks=toks, finish=finish: store.commit(
                sid, n, epoch, f"{epoch}-{n}", toks, "", finish), 60.0)
            if res.status is CommitStatus.STALE_LEN:  # the failover lost a tail: drive on from Redis
                epoch = await ride_out(lambda: store.take_over(sid, "bench"), 60.0)
                n = len(await store.committed_tokens(sid))
                continue
            n += round_tokens
            await asyncio.sleep(round_s)

    async def read(sid: str) -> None:
        async for chunk in store.read_chunks(sid, 0, block_ms=200, outage_s=60.0):
            now = time.monotonic()
            if chunk.offset in sent[sid]:
                delays.append(now - sent[sid][chunk.offset])
            got[sid].extend(chunk.tokens)
            times[sid].append(now)

    info0 = await client.info("commandstats")
    tasks = [asyncio.create_task(drive(s)) for s in sids] + [asyncio.create_task(read(s)) for s in sids]
    kill_at = None
    if kill is not None:
        await asyncio.sleep(seconds / 3)
        kill_at = time.monotonic()
        await asyncio.to_thread(kill)
    await asyncio.wait_for(asyncio.gather(*tasks), 120)
    info1 = await client.info("commandstats")
    final = {s: await store.committed_tokens(s) for s in sids}
    await store.aclose()
    await client.aclose()
    wrong = sum(got[s] != final[s] or len(final[s]) != total for s in sids)
    out = {"sessions": sessions, "replica_acks": acks, "tokens": total * sessions, "wrong_streams": wrong,
           "delivery_ms_p50": 1e3 * _pct(delays, 0.5), "delivery_ms_p99": 1e3 * _pct(delays, 0.99),
           "unreplicated_reads": store.replicas.unreplicated_reads}
    if kill_at is None:  # (after a failover the counts are another server's)
        calls = sum(v["calls"] for v in info1.values()) - sum(v["calls"] for v in info0.values())
        out["redis_calls_per_token"] = calls / (total * sessions)
    else:
        pauses = [max((b - a for a, b in zip(times[s], times[s][1:], strict=False) if b > kill_at), default=0.0)
                  for s in sids]
        out.update(pause_s_p50=_pct(pauses, 0.5), pause_s_p99=_pct(pauses, 0.99))
    return out


class _Round:
    def __init__(self, sid: str, n: int, tokens: list[int]) -> None:
        self.session_id, self.epoch, self.expected_len, self.round_id = sid, 1, n, f"r{n}"
        self.tokens, self.text, self.finish_reason, self.stats = tokens, "", None, ""


def _server_cpu_s(ports: list[int], password: str) -> float:
    """CPU seconds the servers on `ports` have used (INFO cpu: user + sys)."""
    import redis

    total = 0.0
    for port in ports:
        with redis.Redis(port=port, password=password or None, socket_timeout=5) as c:
            cpu = c.info("cpu")
            total += cpu["used_cpu_user"] + cpu["used_cpu_sys"]
    return total


async def _throughput(url: str, sessions: int, seconds: float, round_tokens: int) -> dict:
    client = connect(url)
    store = SessionStore(client)
    sids = [(await store.create_or_join(None, {}, [1], "bench")).session_id for _ in range(sessions)]
    n, steps, t0 = 0, 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        results = await store.commit_batch([_Round(s, n, list(range(n, n + round_tokens))) for s in sids])
        assert all(r.applied for r in results), results[:3]
        n += round_tokens
        steps += 1
    dt = time.monotonic() - t0
    await store.aclose()
    await client.aclose()
    return {"sessions": sessions, "steps_per_s": steps / dt, "tokens_per_s": steps * sessions * round_tokens / dt,
            "step_ms": 1e3 * dt / steps}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--sessions", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--seconds", type=float, default=4.0, help="each session's writing time")
    ap.add_argument("--round-tokens", type=int, default=2)
    ap.add_argument("--round-ms", type=float, default=40.0)
    a = ap.parse_args()
    load = warn_if_busy()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.sessions:
            ha = start_redis_ha(Path(tmp) / f"cost-{n}")
            try:
                for acks in (0, 1):
                    rows.append({"kind": "cost", **asyncio.run(_arm(ha.url, n, acks, a.seconds, a.round_tokens,
                                                                     a.round_ms / 1e3))})
                    print(json.dumps(rows[-1]), flush=True)
            finally:
                ha.stop()
            ha = start_redis_ha(Path(tmp) / f"failover-{n}")
            try:
                rows.append({"kind": "failover", **asyncio.run(_arm(
                    ha.url, n, 1, 2 * a.seconds, a.round_tokens, a.round_ms / 1e3, kill=ha.primary.kill))})
                print(json.dumps(rows[-1]), flush=True)
            finally:
                ha.stop()
        for kind, start in (("one Redis", start_redis), ("Cluster 3x2", start_redis_cluster)):
            servers = start(Path(tmp) / kind.replace(" ", "-"))
            ports = [n.port for n in getattr(servers, "nodes", [servers])]
            try:
                cpu0 = _server_cpu_s(ports, servers.password)
                row = asyncio.run(_throughput(servers.url, max(a.sessions), a.seconds, a.round_tokens))
                cpu = _server_cpu_s(ports, servers.password) - cpu0
                steps = row["steps_per_s"] * a.seconds
                # the servers' CPU per step: how many steps a second they could take at 100 % of
                # one core each (the client, on the same 2 cores, is what limits the run here)
                # (replicas' CPU counted too: the Cluster's figure is conservative)
                cores = 1 if kind == "one Redis" else len(ports) // 2  # one core per master
                row.update(redis_cpu_ms_per_step=1e3 * cpu / steps,
                           steps_per_s_at_full_redis_cpu=cores / max(cpu / steps, 1e-9))
                rows.append({"kind": "throughput", "redis": kind, **row})
                print(json.dumps(rows[-1]), flush=True)
            finally:
                servers.stop()
    out = Path(a.out) / "failover"
    out.mkdir(parents=True, exist_ok=True)
    summary = {"load_before": load, "round_tokens": a.round_tokens, "round_ms": a.round_ms, "rows": rows}
    (out / "failover.json").write_text(json.dumps(summary, indent=1))
    _plot(rows, out / "failover.png")
    for r in rows:
        if r["kind"] == "cost":
            print(f"{r['sessions']:3d} sessions, replica_acks {r['replica_acks']}: delivery p50 "
                  f"{r['delivery_ms_p50']:.1f} ms p99 {r['delivery_ms_p99']:.1f} ms, "
                  f"{r['redis_calls_per_token']:.2f} Redis calls a token, wrong streams {r['wrong_streams']}")
        elif r["kind"] == "throughput":
            print(f"{r['sessions']:3d} sessions, {r['redis']}: {r['steps_per_s']:.0f} commit steps/s "
                  f"({r['step_ms']:.2f} ms each), {r['tokens_per_s']:.0f} tokens/s; Redis CPU "
                  f"{r['redis_cpu_ms_per_step']:.2f} ms a step: {r['steps_per_s_at_full_redis_cpu']:.0f} steps/s "
                  "with its masters' cores full")
        else:
            print(f"{r['sessions']:3d} sessions, failover: pause p50 {r['pause_s_p50']:.2f} s p99 "
                  f"{r['pause_s_p99']:.2f} s, wrong streams {r['wrong_streams']}")


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 4))
    cost = [r for r in rows if r["kind"] == "cost"]
    labels = [f"{r['sessions']} s., acks {r['replica_acks']}" for r in cost]
    ax1.bar(labels, [r["delivery_ms_p50"] for r in cost], label="p50")
    ax1.bar(labels, [r["delivery_ms_p99"] - r["delivery_ms_p50"] for r in cost],
            bottom=[r["delivery_ms_p50"] for r in cost], alpha=0.5, label="p99")
    ax1.set_ylabel("commit -> reader (ms)")
    ax1.set_title("delivery delay, healthy primary")
    ax1.legend()
    ax1.tick_params(axis="x", rotation=20)
    fo = [r for r in rows if r["kind"] == "failover"]
    ax2.bar([f"{r['sessions']} sessions" for r in fo], [r["pause_s_p50"] for r in fo], label="p50")
    ax2.plot([f"{r['sessions']} sessions" for r in fo], [r["pause_s_p99"] for r in fo], "ko", label="p99")
    ax2.set_ylabel("longest gap in a stream (s)")
    ax2.set_title("primary killed (replica_acks 1)")
    ax2.legend()
    tp = [r for r in rows if r["kind"] == "throughput"]
    ax3.bar([r["redis"] for r in tp], [r["tokens_per_s"] for r in tp])
    ax3.set_ylabel("committed tokens/s")
    ax3.set_title(f"engine-style commit steps, {tp[0]['sessions'] if tp else 0} sessions")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
