"""Soak (issue 13, ADR 0011; not part of `make test`): many concurrent streams for minutes,
with random cancels and client disconnects, and every `--kill-every-s` a `kill -9` of one
draft replica and one router replica, which the harness restarts on the same address.

Every request is greedy, so every finished output must equal target-only greedy decoding
(the in-process reference decoder). A client whose router dies retries the same request_id on another
router (it joins the session, which the target drives on: a router kill does not touch it); a client
that disconnects Resumes from its offset. Sampled every few seconds: tokens/s delivered,
each process's RSS, and Redis's key count.

Optional kills in each period (issue 41), one after another, `--kill-every-s` / kinds apart and
so that no kill falls in another's `--dip-window-s` before or after it. `--kill-target` SIGKILLs
the target actor's process (Ray restarts it; the new incarnation adopts its sessions, under
load). `--kill-redis-primary` (with `--redis-ha`: a primary, a replica and three sentinels, ADR
0023) SIGKILLs whichever Redis is primary now, waits for the sentinels to promote the replica,
restarts the killed server (Sentinel makes it a replica of the new primary) and waits until it
has synced. Each kill is printed with its kind and time; the summary gives the tokens/s in the
sample windows before and after each kill, per kill and per kind.

Checks reported (not asserted): wrong outputs (must be 0: a token that differs from the
reference), incomplete ones (no finish within the client's attempts) and errors other than for
cancelled requests (both must be 0), RSS growth of every process after warm-up (< 10 %), and the sessions'
Redis keys back to baseline once their TTL (`--session-ttl-s`) has passed.

  python bench/soak.py --models models --minutes 10 --streams 64 --out bench/results
  python bench/soak.py --models models --minutes 5 --streams 16 --kill-every-s 45 --sample-s 2.5 \
      --kill-target --redis-ha --kill-redis-primary --session-ttl-s 30 --out /tmp/soak-out
Writes <out>/soak.json and <out>/soak.png (throughput and RSS over time).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import redis

from specserve.v1 import generation_pb2, generation_pb2_grpc

MAX_TOKENS = 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=Path, default=Path("models"))
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--kill-every-s", type=float, default=60.0)
    ap.add_argument("--session-ttl-s", type=int, default=60)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--deadline-s", type=float, default=60.0, help="each call's deadline (a late call Resumes)")
    ap.add_argument("--max-len", type=int, default=256,
                    help="KV positions per session in the workers: the soak's requests need under 128; at the "
                         "model's 1024 the target's 1 GiB holds 42 sessions, fewer than 64 streams and the "
                         "sessions their disconnects leave running, so admission would refuse some")
    ap.add_argument("--give-up-s", type=float, default=180.0,
                    help="how long a client keeps retrying one request (backoff 0.2 s doubling to 2 s)")
    ap.add_argument("--kill-target", action="store_true",
                    help="each kill period also SIGKILLs the target actor's process "
                         "(Ray restarts it; it adopts its sessions)")
    ap.add_argument("--redis-ha", action="store_true",
                    help="Redis as a primary, a replica and three sentinels (ADR 0023) instead of one server")
    ap.add_argument("--kill-redis-primary", action="store_true",
                    help="(with --redis-ha) each kill period also SIGKILLs the current Redis primary, then restarts "
                         "it as a replica of the new one")
    ap.add_argument("--dip-window-s", type=float, default=10.0,
                    help="the throughput dip of a kill: mean tokens/s of the samples this long before vs after it")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--run-dir", type=Path, default=None, help="keep the services' logs here (default: a temp dir)")
    args = ap.parse_args()
    if args.kill_redis_primary and not args.redis_ha:
        ap.error("--kill-redis-primary needs --redis-ha (a replica to promote)")

    from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts
    from specserve.tooling.stack import PoolSpec, Stack, StackSpec

    pair = find_pair(args.models)
    prompts = [p["prompt"] for p in load_eval_prompts(pair)][:12]
    refs = references(pair, prompts)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        spec = StackSpec(pair_dir=str(pair), run_dir=str(args.run_dir or tmp),
                         pools={"small": PoolSpec("draft", replicas=2)},
                         routers=2, target_threads=1, redis_ha=args.redis_ha,
                         env={"SPECSERVE_TARGET_MAX_LEN": str(args.max_len),
                              "SPECSERVE_DRAFT_MAX_LEN": str(args.max_len),
                              "SPECSERVE_TARGET_SESSION_TTL_S": str(args.session_ttl_s),
                              "SPECSERVE_TARGET_DETACHED_IDLE_S": "20"},
                         router_env={"SPECSERVE_ROUTER_SESSION_TTL_S": str(args.session_ttl_s)})
        with Stack(spec).running() as stack:
            result = soak(stack, args, prompts, refs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "soak.png")
    print(json.dumps(result["summary"], indent=1))


def references(pair: Path, prompts: list[str]) -> dict[str, list[int]]:
    from specserve.drafters import NgramDrafter
    from specserve.models.loading import load_pair
    from specserve.models.verifier import TargetModel
    from specserve.worker.reference import GenerationParams, ReferenceDecoder

    loaded = load_pair(str(pair / "target"), str(pair / "draft"))
    target = TargetModel(loaded.target)
    engine = ReferenceDecoder(target, NgramDrafter(target.vocab_size), loaded.tokenizer)
    return {p: engine.generate(p, GenerationParams(max_tokens=MAX_TOKENS, num_draft_tokens=0)).token_ids
            for p in prompts}


class Client:
    """One stream at a time, forever: finish, cancel or disconnect + Resume, at random."""

    def __init__(self, i: int, stubs, prompts, refs, stats: Counter, delivered: list[int], stop: threading.Event,
                 deadline_s: float = 60.0, give_up_s: float = 180.0):
        self.rng = random.Random(i)
        self.deadline_s, self.give_up_s = deadline_s, give_up_s
        self.i, self.stubs, self.prompts, self.refs = i, stubs, prompts, refs
        self.stats, self.delivered, self.stop = stats, delivered, stop

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            prompt = self.rng.choice(self.prompts)
            action = self.rng.choices(["finish", "cancel", "disconnect"], [0.8, 0.1, 0.1])[0]
            try:
                self.one(prompt, action, f"soak-{self.i}-{n}")
            except grpc.RpcError as err:
                self.stats[f"error:{err.code().name}"] += 1

    def one(self, prompt: str, action: str, request_id: str) -> None:
        req = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS, draft_pool="small",
                                             request_id=request_id)
        chunks: list = []
        last = "none"  # the last failure seen: an incomplete request is counted under it
        give_up = time.monotonic() + self.give_up_s  # a client's patience, not a count of tries
        for attempt in itertools.count():
            if time.monotonic() >= give_up:
                break
            # a router that does not answer: the next one (it joins or Resumes the same session)
            stub = self.stubs[(self.i + attempt) % len(self.stubs)]
            pos = sum(len(c.token_ids) for c in chunks)
            call = stub.Resume(generation_pb2.ResumeRequest(session_id=chunks[0].session_id, from_offset=pos),
                               timeout=self.deadline_s) if chunks else stub.GenerateStream(req, timeout=self.deadline_s)
            try:
                for c in call:
                    chunks.append(c)
                    self.delivered[0] += len(c.token_ids)
                    got = sum(len(x.token_ids) for x in chunks)
                    if action != "finish" and got >= 4 and not c.finish_reason:
                        if action == "cancel":
                            stub.Cancel(generation_pb2.CancelRequest(session_id=c.session_id), timeout=10)
                        else:
                            call.cancel()  # the client goes away; it Resumes on the next attempt
                            action = "finish"
                        break
            except grpc.RpcError as err:
                code = err.code()
                last = code.name
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    self.stats["retried"] += 1
                    time.sleep(min(0.2 * 2 ** min(attempt, 4), 2.0))
                elif code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED):
                    # overload, as a production client meets it: a late call's session runs on
                    # detached (Resume or the same request_id collects it); a refused request
                    # failed for good, so it is sent again, after a pause, as a new request.
                    # Counted apart, so an overloaded run shows as one.
                    self.stats[f"overload:{code.name}"] += 1
                    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and not chunks:
                        req.request_id = f"{request_id}-again{attempt}"
                    time.sleep(1.0 + self.rng.random())
                else:
                    raise
            if chunks and chunks[-1].finish_reason:
                break
        tokens = [t for c in chunks for t in c.token_ids]
        want = self.refs[prompt]
        reason = chunks[-1].finish_reason if chunks else ""
        if reason == "cancelled":
            self.stats["cancelled"] += 1
            ok = tokens == want[: len(tokens)]
        elif reason not in ("eos", "length"):
            # no finish after every attempt (each with its own deadline): an availability
            # failure, not a wrong token; a prefix that differs is still wrong
            if tokens == want[: len(tokens)]:
                self.stats["incomplete"] += 1
                self.stats[f"incomplete_after:{reason or last}"] += 1
            else:
                self.stats["wrong"] += 1
            return
        else:
            ok = tokens == want
        self.stats["ok" if ok else "wrong"] += 1


def session_keys(r: redis.Redis) -> int:
    """Keys a session leaves (hash, tokens, stream, rounds, request id, the running index):
    what must go back to the baseline once the TTLs pass. Policies, controller statistics
    and the target registry are long-lived by design. SCAN patterns, so that hash-tagged
    names (`specserve:sess:{ab}ab12...`, a tagged running index) are counted too."""
    keys: set[bytes] = set()
    for pattern in ("specserve:sess:*", "specserve:req:*", "specserve:*running*"):
        keys.update(r.scan_iter(match=pattern, count=1000))
    return len(keys)


def redis_client(url: str) -> redis.Redis:
    """A client for the stack's Redis; for a `redis+sentinel://` URL (which redis-py's from_url
    does not read), the primary the sentinels name now, found again after a failover."""
    from specserve.state.connection import SENTINEL_SCHEME, parse_sentinel_url

    if not url.startswith(SENTINEL_SCHEME):
        return redis.Redis.from_url(url)
    from redis.sentinel import Sentinel

    sentinels, master, password, db = parse_sentinel_url(url)
    return Sentinel(sentinels, socket_connect_timeout=2.0, socket_timeout=2.0).master_for(
        master, password=password or None, db=db, socket_connect_timeout=2.0, socket_timeout=5.0)


def quietly(call, default=None):
    """`call()`, or `default` while Redis is down or failing over (the soak samples on)."""
    try:
        return call()
    except redis.RedisError:
        return default


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def soak(stack, args, prompts, refs) -> dict:
    from specserve.serving.tls import channel

    channels = [channel(a, stack.spec.tls_dir) for a in stack.info.routers]
    stubs = [generation_pb2_grpc.GenerationStub(ch) for ch in channels]
    r = redis_client(stack.info.redis_url)
    baseline_keys = session_keys(r)
    stats: Counter = Counter()
    delivered = [0]
    stop = threading.Event()
    clients = [threading.Thread(target=Client(i, stubs, prompts, refs, stats, delivered, stop, args.deadline_s,
                                              args.give_up_s).run, daemon=True)
               for i in range(args.streams)]
    for t in clients:
        t.start()
    samples: list[dict] = []
    kills: list[dict] = []
    target: dict = {}  # the target's registry entry, as last read
    t0 = last_kill = last_t = time.monotonic()
    last_tokens, rng, chaos_thread = 0, random.Random(0), None
    pace = {"at": -1e9, "done": -1e9}  # the last kill (period)
    kinds = ["draft+router", *(["target"] if args.kill_target else []),
             *(["redis-primary"] if args.kill_redis_primary else [])]
    while time.monotonic() - t0 < args.minutes * 60:
        time.sleep(args.sample_s)
        now = time.monotonic()
        if now - last_kill >= args.kill_every_s and not (chaos_thread and chaos_thread.is_alive()):
            last_kill = now  # in the background (sampling goes on), one at a time
            chaos_thread = threading.Thread(target=period, args=(stack, r, rng, kinds, args, t0, kills, pace),
                                            daemon=True)
            chaos_thread.start()
        target = quietly(lambda: json.loads(r.get("specserve:target:target-0") or "{}"), target)
        pids = {**{n: p for n, p in stack.info.pids.items() if n.startswith(("router", "draft", "redis"))},
                "target": target.get("pid", 0)}
        samples.append({"t": round(now - t0, 1), "tokens_per_s": (delivered[0] - last_tokens) / (now - last_t),
                        "rss_mb": {n: round(rss_mb(p), 1) for n, p in pids.items()},
                        "session_keys": quietly(lambda: session_keys(r))})
        last_tokens, last_t = delivered[0], now
        print(f"t={samples[-1]['t']:6.0f}s  {samples[-1]['tokens_per_s']:7.1f} tok/s  {dict(stats)}", flush=True)
    stop.set()
    if chaos_thread is not None:
        chaos_thread.join(180)
    for t in clients:
        t.join(120)
    drained = time.monotonic()
    while quietly(lambda: session_keys(r), baseline_keys + 1) > baseline_keys and \
            time.monotonic() - drained < args.session_ttl_s + 30:
        time.sleep(2)
    for ch in channels:
        ch.close()
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    return {"config": config, "samples": samples,
            "kills": kills, "summary": summary(samples, stats, baseline_keys, quietly(lambda: session_keys(r)), kills,
                                               args.dip_window_s)}


def period(stack, r, rng: random.Random, kinds: list[str], args, t0: float, kills: list, pace: dict) -> None:
    """One kill period. One kind (the draft+router kill alone): at once. Several: in turn,
    `--kill-every-s / kinds` apart, and each only once the kill before has restarted and a dip
    window has passed since, and two since that kill, so that each kill's before and after
    windows hold no other kill (`pace`: the last kill's monotonic time and when it was done).
    A kill that would fall into the run's last dip window is left out."""
    start, window, end = time.monotonic(), args.dip_window_s, t0 + args.minutes * 60
    for i, kind in enumerate(kinds):
        when = start
        if len(kinds) > 1:
            when = max(start + i * args.kill_every_s / len(kinds), pace["at"] + 2 * window, pace["done"] + window)
            if when > end - window:
                print(f"kill: {kind} left out (t={when - t0:.0f}s is in the run's last {window:.0f} s)", flush=True)
                break
        time.sleep(max(0.0, when - time.monotonic()))
        pace["at"] = time.monotonic()
        at = pace["at"] - t0
        try:
            if kind == "target":
                kill = kill_target(r, at)
            elif kind == "redis-primary":
                kill = kill_redis_primary(stack, at)
            else:
                kill = chaos(stack, rng, at)
        except Exception as err:  # noqa: BLE001 - reported, and the soak goes on
            kill = {"at_s": round(at, 1), "failed": f"{type(err).__name__}: {err}"}
        kill = {"kind": kind, **kill}
        kills.append(kill)
        pace["done"] = time.monotonic()
        rest = {k: v for k, v in kill.items() if k not in ("kind", "at_s")}
        print(f"kill {len(kills)}: {kind} at t={kill['at_s']:.1f}s  {json.dumps(rest)}", flush=True)


def chaos(stack, rng: random.Random, at: float) -> dict:
    """kill -9 one draft replica and one router replica; restart both on their addresses."""
    draft = rng.choice([n for n in stack.info.pids if n.startswith("draft-")])
    router = rng.choice([n for n in stack.info.pids if n.startswith("router")])
    addresses = {draft: stack.info.pools["small"][int(draft.rsplit("-", 1)[1])],
                 router: stack.info.routers[0 if router == "router" else int(router.rsplit("-", 1)[1])]}
    for name in (draft, router):
        os.killpg(stack.info.pids[name], signal.SIGKILL)
    t = time.monotonic()
    for name in (draft, router):
        stack.restart(name, addresses[name])
    return {"at_s": round(at, 1), "killed": [draft, router], "restart_s": round(time.monotonic() - t, 1)}


def kill_target(r: redis.Redis, at: float, timeout_s: float = 300.0) -> dict:
    """SIGKILL the target actor's process (its pid is in its registry entry); Ray restarts the
    actor, and the new incarnation registers and adopts its sessions. Done when the registry
    names a new pid."""
    key = "specserve:target:target-0"
    before = json.loads(r.get(key) or "{}")
    os.kill(before["pid"], signal.SIGKILL)
    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        now = quietly(lambda: json.loads(r.get(key) or "{}"), {})
        if now.get("pid") not in (None, before["pid"]):
            return {"at_s": round(at, 1), "killed": [f"target pid {before['pid']}"],
                    "restart_s": round(time.monotonic() - t, 1), "incarnation": now.get("incarnation")}
        time.sleep(0.2)
    raise TimeoutError(f"no new target incarnation registered {timeout_s:.0f} s after the kill")


def _sentinel_primary_ports(ha) -> list[int]:
    """The primary's port as each sentinel that answers names it now."""
    from specserve.tooling.redis_server import MASTER

    ports = []
    for s in ha.sentinels:
        c = redis.Redis(port=s.port, socket_timeout=2.0, socket_connect_timeout=1.0)
        try:
            ports.append(int(c.execute_command("SENTINEL", "get-master-addr-by-name", MASTER)[1]))
        except (redis.RedisError, TypeError, IndexError):
            pass
        finally:
            c.close()
    return ports


def kill_redis_primary(stack, at: float, timeout_s: float = 120.0) -> dict:
    """SIGKILL whichever data node the sentinels call primary now (roles swap with each
    failover), wait until a majority of them name the other one, restart the killed server on
    its port and directory (Sentinel turns it into a replica of the new primary) and wait until
    it reports `master_link_status:up`, so that the next kill has a replica to promote."""
    ha = stack.redis_ha
    ports = _sentinel_primary_ports(ha)
    port = Counter(ports).most_common(1)[0][0] if ports else None
    nodes = {n.port: n for n in (ha.primary, ha.replica)}
    if port not in nodes:
        raise RuntimeError(f"the sentinels name {ports}, not one of the data nodes {sorted(nodes)}")
    killed = nodes.pop(port)
    survivor = next(iter(nodes.values()))
    killed.kill()
    t = time.monotonic()
    deadline = t + timeout_s
    while sum(p == survivor.port for p in _sentinel_primary_ports(ha)) < 2:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no failover to {survivor.port} within {timeout_s:.0f} s")
        time.sleep(0.1)
    failover_s = time.monotonic() - t
    back = killed.restart(timeout_s=60.0)
    ha.primary, ha.replica = survivor, back  # the roles now (teardown stops both by pid)
    stack.info.pids["redis"], stack.info.pids["redis-replica"] = survivor.pid, back.pid
    c = redis.Redis(port=back.port, password=ha.password or None, socket_timeout=2.0)
    try:
        while quietly(lambda: c.info("replication"), {}).get("master_link_status") != "up":
            if time.monotonic() > deadline:
                raise TimeoutError(f"the restarted server on {back.port} did not sync with {survivor.port}")
            time.sleep(0.2)
    finally:
        c.close()
    return {"at_s": round(at, 1), "killed": [f"redis primary :{port}"], "new_primary": survivor.port,
            "failover_s": round(failover_s, 1), "restart_s": round(time.monotonic() - t, 1)}


def kill_dips(samples, kills, window_s: float) -> list[dict]:
    """Per kill: mean tokens/s of the samples in the `window_s` before it vs those in the
    `window_s` after it (a sample covers the interval that ends at its time, so the one that
    spans the kill counts as after), the lowest sample after, and the seconds of the after window
    below 80 % of before. A kill whose after window the run did not sample whole is left out."""
    out = []
    last = samples[-1]["t"] if samples else 0
    for k in kills:
        a = k["at_s"]
        before = [s["tokens_per_s"] for s in samples if a - window_s < s["t"] <= a]
        after = [s["tokens_per_s"] for s in samples if a < s["t"] <= a + window_s]
        if "failed" in k or not before or not after or last < a + window_s:
            continue
        b, f = sum(before) / len(before), sum(after) / len(after)
        low = sum(s["t"] - p["t"] for p, s in itertools.pairwise(samples)
                  if a < s["t"] <= a + window_s and s["tokens_per_s"] < 0.8 * b)
        out.append({"kind": k["kind"], "at_s": a, "tokens_per_s_before": round(b, 1), "tokens_per_s_after": round(f, 1),
                    "dip_pct": round((1 - f / b) * 100, 1) if b else None,
                    "min_tokens_per_s_after": round(min(after), 1),
                    "below_80pct_s": round(low, 1)})
    return out


def dips_by_kind(per_kill: list[dict]) -> dict:
    out = {}
    for kind in dict.fromkeys(d["kind"] for d in per_kill):
        ds = [d for d in per_kill if d["kind"] == kind]
        b = sum(d["tokens_per_s_before"] for d in ds) / len(ds)
        f = sum(d["tokens_per_s_after"] for d in ds) / len(ds)
        out[kind] = {"kills": len(ds), "tokens_per_s_before": round(b, 1), "tokens_per_s_after": round(f, 1),
                     "dip_pct": round((1 - f / b) * 100, 1) if b else None,
                     "per_kill_dip_pct": [d["dip_pct"] for d in ds],
                     "min_tokens_per_s_after": min(d["min_tokens_per_s_after"] for d in ds),
                     "below_80pct_s_max": max(d["below_80pct_s"] for d in ds)}
    return out


def summary(samples, stats: Counter, baseline_keys: int, final_keys: int, kills, dip_window_s: float = 15.0) -> dict:
    warm = [s for s in samples if s["t"] >= 60] or samples
    growth = {}
    for name in warm[0]["rss_mb"]:
        first = next((s["rss_mb"][name] for s in warm if s["rss_mb"].get(name)), 0)
        last = warm[-1]["rss_mb"].get(name, 0)
        growth[name] = round((last - first) / first * 100, 1) if first else None
    errors = {k: v for k, v in stats.items() if k.startswith("error:")}
    per_kill = kill_dips(samples, kills, dip_window_s)
    done = sum(stats[k] for k in ("ok", "wrong", "incomplete", "cancelled")) + sum(errors.values())
    return {"requests": dict(stats), "requests_done": done, "wrong_outputs": stats["wrong"],
            "incomplete": stats["incomplete"],
            "errors": errors,
            "mean_tokens_per_s": round(sum(s["tokens_per_s"] for s in samples) / max(len(samples), 1), 1),
            "rss_growth_pct_after_warmup": growth, "session_keys_baseline": baseline_keys,
            "session_keys_final": final_keys, "kills": len(kills),
            "kills_by_kind": dict(Counter(k["kind"] for k in kills)),
            "kills_failed": [k for k in kills if "failed" in k],
            "throughput_dip_by_kind": dips_by_kind(per_kill), "throughput_dip_per_kill": per_kill,
            "note": "RSS growth compares a process's first and last sample after 60 s; a restarted process "
                    "starts afresh (compare the un-killed ones)"}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    t = [s["t"] for s in samples]
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    a.plot(t, [s["tokens_per_s"] for s in samples])
    a.set_ylabel("tokens/s delivered")
    colours = {"draft+router": "red", "target": "purple", "redis-primary": "orange"}
    for k in result["kills"]:
        a.axvline(k["at_s"], color=colours.get(k.get("kind", ""), "red"), alpha=0.3)
    for name in samples[0]["rss_mb"]:
        b.plot(t, [s["rss_mb"].get(name, 0) for s in samples], label=name)
    b.set_ylabel("RSS (MB)")
    b.set_xlabel("seconds (kill -9: red a draft and a router replica, purple the target, orange the Redis primary)")
    b.legend(fontsize=7)
    fig.suptitle(f"soak: {result['config']['streams']} streams, {result['config']['minutes']} min")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
