"""The engine loop beside the target under simulated devices (ADR 0014), in process: what a
GPU deployment's rounds would do, measured without a GPU.

A small real target (a random-init 2 × 64 Llama) runs every step on this CPU, padded up to
the profile's step time (bench/profiles.py: `seed`, `h100`). Drafts come from a simulated
remote pool:
- each block arrives after the profile's drafting time, on a timer, while the target keeps
  stepping;
- the all-accepted branch is drafted ahead and pushed as the draft workers do;
- acceptance is synthetic: the drafter proposes the target's own greedy continuation (known
  in advance: at T = 0 the output is the target's alone) and corrupts each position with
  probability 1 − α, from a seeded draw.

Arms: plain, fixed K, the engine's own K choice (adaptive), the target's own EAGLE head drafting
inside its device step (`eagle:K=4`, `eagle:adaptive`; ADR 0025: a random head whose drafts are
replaced on the device by the synthetic ones, so its cost is paid and its acceptance is α; the
rounds chain on the device where the lookahead is on), and token trees (`tree:K=4`: the
engine's `tree_width` 2, which offers a tree of two first candidates, each followed by its
chain to K, where its cost model says the wider verify pays; else chains), at 1, 4, 16 and 64
streams. A tree's second candidate is right with probability β (`--beta`) where the first is
wrong; its branches are drafted as one batch (the profile's draft at 2 rows).
Each cell first runs an unmeasured wave of sessions on the same engine, so its acceptance
table, cost fit and draft latency are warm, as on a running server.
Reported per cell:
- tok/s, TPOT p50/p90;
- device busy: the simulated step time over the wall time;
- the engine's bookkeeping per step (schedule + postprocess, p50/p99);
- the share of rounds whose block was already there (pushed);
- the engine's own S(K) estimates.
Results: bench/results/engine_loop.json and engine_loop.png.

    python bench/bench_engine_loop.py [--profiles seed,h100] [--streams 1,4,16,64] [--alpha 0.7]

On a GPU node, `--profiles real --device cuda --model 1b` runs the same loop with nothing
simulated on the target's side: a 1B-class target (gpu_check's TinyLlama-shape random model,
made decisive) steps on the device, and device busy is the measured forward time (which ends
in the step's one host transfer) over the wall. The drafts still come from the synthetic pool,
timed by the `h100` profile's draft (a 0.6B-class model on a small GPU of its own).
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import statistics
import threading
import time
import zlib
from dataclasses import replace
from pathlib import Path

import torch
from profiles import PROFILES, Profile
from transformers import LlamaConfig, LlamaForCausalLM

from specserve.algorithm.rng import Purpose, uniform
from specserve.algorithm.stops import StopChecker
from specserve.engine.loop import EngineLoop
from specserve.engine.scheduler import Budget
from specserve.engine.session import DraftBlock, EnginePlan, EngineSession, Outcome
from specserve.engine.speculation import SpeculationSettings
from specserve.models.verifier import TargetModel
from specserve.params import GenerationParams
from specserve.serving.busy import BusyMeter
from specserve.state.prefix import CommittedPrefix
from specserve.worker.model_step import Batching, make_target_step

VOCAB = 512  # the stand-in's; the 1B model's is gpu_check's (32000)
PROMPT_LEN = 16
REAL = "real"  # the profile name for a real device: no padding; the drafts as in `h100`


class SyntheticDrafts:
    """A remote draft pool with chosen acceptance α and a profile's drafting time. One
    delivery thread sleeps until each block is due: per-block timer threads would fight the
    engine thread for the GIL and show up as the engine's own bookkeeping."""

    def __init__(self, reference: dict[str, list[int]], prompts: dict[str, list[int]], alpha: float,
                 profile: Profile, beta: float = 0.0) -> None:
        self.reference, self.alpha, self.profile = reference, alpha, profile
        self.prompt_len = {sid: len(p) for sid, p in prompts.items()}
        self.prefix = {sid: CommittedPrefix([*p, *reference[sid]]) for sid, p in prompts.items()}  # hashes once
        # Every draw decided up front, so the engine thread (which calls `outcome`) pays for
        # a slice and a heap push, as with the real pool's link (a call_soon_threadsafe), and
        # not for the simulation: the drafted token at each position, and whether the
        # all-accepted branch is drafted ahead from there.
        # Seeded per session: with one seed, every session would meet the same accepted and
        # rejected positions at the same step, and the engine's acceptance table would learn
        # from a handful of correlated draws.
        seeds = {sid: zlib.crc32(sid.encode()) for sid in reference}
        self.drafted = {sid: [t if uniform(seeds[sid], i, Purpose.DRAFT) < alpha else t + 1 if t == 0 else t - 1
                              for i, t in enumerate(ref)] for sid, ref in reference.items()}
        self.ahead = {sid: [uniform(seeds[sid] + 1, i, Purpose.DRAFT) < alpha for i in range(len(ref) + 1)]
                      for sid, ref in reference.items()}
        # a tree's second first candidate: the target's token where the first is not, with probability β
        self.sibling = {sid: [uniform(seeds[sid] + 2, i, Purpose.DRAFT) < beta for i in range(len(ref))]
                        for sid, ref in reference.items()}
        self.deliver = None
        self.due: list[tuple[float, int, DraftBlock]] = []
        self.wake = threading.Condition()
        self.seq = 0
        self.stopped = False
        threading.Thread(target=self._run, daemon=True).start()

    def stop(self) -> None:
        with self.wake:
            self.stopped = True
            self.wake.notify()

    def attach(self, deliver) -> None:
        self.deliver = deliver

    def drafts_for(self, session_id: str) -> bool:
        return True

    def refused(self, session_id: str) -> bool:
        return False

    def open(self, session: EngineSession) -> None:
        self._draft(session.id, len(session.generated), session.k_next)

    def outcome(self, o: Outcome) -> None:
        self._draft(o.session_id, o.committed_len - self.prompt_len[o.session_id], o.k, o.width)

    def close(self, session_id: str) -> None:
        pass

    def _block(self, sid: str, n: int, k: int) -> tuple[int, ...]:
        return tuple(self.drafted[sid][n:n + k])

    def _tree(self, sid: str, n: int, chain: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The chain and a second first candidate with its own chain, depth-first (the pools'
        tree shape): the target's token where the chain's first is not and the draw says so
        (then the chain after it is the same drafted continuation), else a wrong token
        followed by wrong ones."""
        ref = self.reference[sid]
        k = len(chain)
        if chain[0] != ref[n] and self.sibling[sid][n]:
            second = (ref[n], *chain[1:])
        else:
            second = tuple(ref[n + j] ^ 2 for j in range(k))  # neither the target's token nor the first's (t ± 1)
        return (*chain, *second), (*range(-1, k - 1), -1, *range(k, 2 * k - 1))

    def _draft(self, sid: str, n: int, k: int, width: int = 1) -> None:
        """The block after n generated tokens, due when the simulated draft is done; and the
        all-accepted branch drafted ahead (its bonus guessed right with probability α)."""
        if k <= 0 or n >= len(self.reference[sid]):
            return
        now = time.monotonic()
        tokens = self._block(sid, n, k)
        rows = 2 if width > 1 else 1
        delay = self.profile.draft_ms(len(tokens), rows) / 1e3
        self._at(now + delay, self._make(sid, n, tokens, False, delay * 1e3, width))
        nxt = n + len(tokens) + 1
        if tokens == tuple(self.reference[sid][n:n + len(tokens)]) and nxt < len(self.reference[sid]) \
                and self.ahead[sid][nxt]:
            ahead = self._block(sid, nxt, k)
            self._at(now + delay + self.profile.draft_ms(len(ahead) + 1, rows) / 1e3,
                     self._make(sid, nxt, ahead, True, 0.0, width))

    def _make(self, sid: str, n: int, tokens: tuple[int, ...], predrafted: bool, ms: float,
              width: int = 1) -> DraftBlock:
        base = self.prompt_len[sid] + n
        parents = None
        if width > 1:
            tokens, parents = self._tree(sid, n, tokens)
        return DraftBlock(sid, base, self.prefix[sid].hash_at(base), tokens, predrafted=predrafted, draft_ms=ms,
                          parents=parents)

    def _at(self, when: float, block: DraftBlock) -> None:
        with self.wake:
            self.seq += 1
            heapq.heappush(self.due, (when, self.seq, block))
            self.wake.notify()

    def _run(self) -> None:
        while True:
            with self.wake:
                while not self.stopped and (not self.due or self.due[0][0] > time.monotonic()):
                    self.wake.wait(None if not self.due else self.due[0][0] - time.monotonic())
                if self.stopped:
                    return
                _, _, block = heapq.heappop(self.due)
            if self.deliver is not None:
                self.deliver(block)


def _model(seed: int, size: str = "tiny", device: str = "cpu") -> TargetModel:
    torch.manual_seed(seed)
    if size == "1b":  # gpu_check's target, decisive (see gpu_check._decisive), built where it will run
        from gpu_check import SHAPES, _decisive

        cfg = LlamaConfig(**SHAPES["full"]["target"], tie_word_embeddings=False, eos_token_id=None,
                          bos_token_id=None, pad_token_id=None)
        with torch.device(device):
            model = LlamaForCausalLM(cfg).eval()
        _decisive(model)
        return TargetModel(model)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return TargetModel(LlamaForCausalLM(cfg).eval())


def _stops(p):
    return StopChecker(frozenset(), p.stop, lambda ids: "")


def _loop(target: TargetModel, sources, profile: Profile | None, streams: int, busy: list[float],
          tile: int | None, gather: bool = True, device: str = "cpu", tree_width: int = 1,
          head: tuple[dict, float] | None = None) -> EngineLoop:
    """`tile`: the stand-in forward's runner. Its own CPU time is not what a cell measures
    (the profile's step time is), so by default it is the fast one: no padding to tiles, the
    cheapest on the CPU (bench_runner: runner-plain below runner-t4 at every batch). `head`:
    (references by session, alpha): the pool `eagle` drafts on the target's own head inside
    its device step (ADR 0025), its acceptance synthetic (gpu_head.synthetic_acceptance)."""
    # (a cell's own target: its start-up capture short, the warm wave captures what the cell meets)
    model = make_target_step(target, Batching(kv_budget_mb=64 if device == "cpu" else 4096,
                                           max_sessions=max(streams, 4),
                                           prefill_chunk=128, tile=tile, device=device, max_len=512,
                                           max_batch=max(streams, 4), fixed_step=True if head else None,
                                           capture_budget_s=2.0))
    if head is not None:
        sources = {**sources, "eagle": _own_head(model, target, *head)}
    if tile is None and device == "cpu":  # the stand-in's rows in one attention call: the least CPU per step (ADR 0014)
        model.runner.short_rows = True

    def step_ms(step, out) -> float:
        ms = profile.target_ms(sum(r.fed for r in out.rows), sum(len(row.ids) for row in step.rows))
        busy.append(ms)
        return ms

    return EngineLoop(model, _stops, sources, budget=Budget(max_batch=64, max_batched_tokens=4096),
                      speculation=SpeculationSettings(block_wait_max_s=0.05, gather=gather, tree_width=tree_width),
                      simulated_step_ms=step_ms if profile else None)


def _own_head(model, target: TargetModel, refs: dict[str, list[int]], alpha: float):
    """A random head for the target, inside its device step, with synthetic acceptance: its
    drafts replaced on the device by the session's reference continuation, kept with
    probability alpha (bench/gpu_head.py); the pool's source."""
    from gpu_head import synthetic_acceptance

    from specserve.drafters.eagle import EagleConfig, EagleHead, TargetParts
    from specserve.engine.eagle_local import DeviceHeadDrafts

    torch.manual_seed(3)
    head = EagleHead(EagleConfig.for_target(target.model.config)).eval()
    model.enable_head(head)
    table, alpha_t = synthetic_acceptance(model)
    alpha_t.fill_(alpha)
    opened = model.open

    def open_with_reference(session_id: str):
        handle = opened(session_id)
        ref = refs[session_id.removeprefix("warm-")]  # the continuation after the prompt (PROMPT_LEN tokens)
        row = torch.tensor(ref[:table.shape[1] - PROMPT_LEN], dtype=torch.long, device=table.device)
        table[model.runner.kv.slot(handle), PROMPT_LEN:PROMPT_LEN + row.shape[0]] = row
        return handle

    model.open = open_with_reference
    return DeviceHeadDrafts(head, TargetParts(target.model, head.cfg.feature_layers))


def references(target: TargetModel, prompts: dict[str, list[int]], tokens: int,
               tile: int | None, device: str = "cpu") -> dict[str, list[int]]:
    loop = _loop(target, {}, None, len(prompts), [], tile, device=device)
    for sid, p in prompts.items():
        loop.add(sid, p, EnginePlan(GenerationParams(max_tokens=tokens, num_draft_tokens=0, seed=1)))
    loop.run_until_idle()
    return {sid: loop.ended[sid].generated for sid in prompts}


def cell(target, prompts, refs, profile: Profile, arm: str, tokens: int, alpha: float, tile: int | None,
         gather: bool = True, device: str = "cpu", real: bool = False, beta: float = 0.0) -> dict:
    """One arm at one load. A first wave of sessions warms the engine (its acceptance table,
    cost fit and draft latency, as on a running server) and is not measured; the second is.
    `real`: the target's steps are not padded; device busy is their measured forward time."""
    busy: list[float] = []
    waves = {f"{w}{sid}": (sid, p) for w in ("warm-", "") for sid, p in prompts.items()}
    drafts = SyntheticDrafts({wid: refs[sid] for wid, (sid, _) in waves.items()},
                             {wid: p for wid, (_, p) in waves.items()}, alpha, profile, beta)
    book: list[float] = []
    tree = arm.startswith("tree:")
    own = arm.startswith("eagle:")  # drafted on the target's own head, in its device step (ADR 0025)
    loop = _loop(target, {"syn": drafts}, None if real else profile, len(prompts), busy, tile, gather, device,
                 tree_width=2 if tree else 1, head=(refs, alpha) if own else None)
    pool = "eagle" if own else "syn"

    adaptive = arm.removeprefix("eagle:") == "adaptive"
    k = 0 if arm == "plain" else 8 if adaptive else int(arm.split("K=")[1])

    def run_wave(prefix: str) -> float:
        for sid, p in prompts.items():
            loop.add(prefix + sid, p, EnginePlan(GenerationParams(max_tokens=tokens, num_draft_tokens=k, seed=1),
                                                 pool=pool if k else None, workload_class="code",
                                                 adaptive=adaptive))
        t = time.perf_counter()
        loop.run_until_idle()
        return time.perf_counter() - t

    run_wave("warm-")
    busy.clear()
    meter = BusyMeter(window_s=1e9)  # the workers' specserve_device_busy_ratio, over the whole wave
    loop.on_step = lambda r: (book.append(r.bookkeeping_ms), real and busy.append(r.busy_ms),
                              meter.add(r.busy_ms / 1e3))
    gc.collect()  # the cells before left garbage: a full collection mid-wave would count as bookkeeping
    meter.started = time.monotonic()
    gaps = getattr(loop.model, "gaps_ms", None)  # the target's lookahead steps: the device idle between them
    if gaps is not None:
        gaps.clear()
    wall = run_wave("")
    busy_metric = meter.ratio()
    drafts.stop()
    sessions = [loop.ended[s] for s in prompts]
    assert all(s.generated == refs[s.id] for s in sessions), "the output must be the target's alone"
    rounds = [r for s in sessions for r in s.rounds]
    tpot = sorted(wall * 1e3 / len(s.generated) for s in sessions)  # all start together: wall per token
    return {"arm": arm, "streams": len(prompts), "tok_s": len(prompts) * tokens / wall, "wall_s": wall,
            "tpot_ms_p50": statistics.median(tpot), "device_busy": sum(busy) / 1e3 / wall, "busy_metric": busy_metric,
            "forward_ms_p50": statistics.median(busy) if real else None,
            "forward_ms_min": min(busy) if real else None,
            "bookkeeping_ms_p50": statistics.median(book),
            "bookkeeping_ms_p99": sorted(book)[int(0.99 * (len(book) - 1))],
            "steps": len(book), "pushed_share": sum(r.predraft == "pushed" for r in rounds) / max(len(rounds), 1),
            "late_share": sum(r.fallback_reason == "draft_late" for r in rounds) / max(len(rounds), 1),
            "mean_k": statistics.mean(r.k for r in rounds),
            "tokens_per_pass": sum(r.emitted for r in rounds) / max(len(rounds), 1),
            "tree_share": sum(r.tree_size > 0 for r in rounds) / max(len(rounds), 1),
            "estimates": loop.speculation.estimates.get(("code", pool), {}),
            "draft_latency_ms_per_token": loop.speculation.measured.draft_latency.get(pool, 0.0) * 1e3,
            "lookahead": dict(getattr(loop.model, "ahead_counts", {})),  # the target's lookahead steps
            "chained": dict(loop.model.rounds.counts) if getattr(loop.model, "rounds", None) else None,
            "gap_ms_p50": statistics.median(gaps) if gaps else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profiles", default="seed,h100")
    ap.add_argument("--streams", default="1,4,16,64")
    ap.add_argument("--arms", default="plain,K=1,K=2,K=3,K=4,K=6,K=8,tree:K=4,adaptive")
    ap.add_argument("--alpha", type=float, default=0.7)
    ap.add_argument("--beta", type=float, default=0.3,
                    help="a tree's second first candidate: right with this probability where the first is wrong")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--exact-batching", choices=("fast", "invariant"), default="fast",
                    help="the stand-in forward's runner (see _loop)")
    ap.add_argument("--gather", choices=("on", "off"), default="on",
                    help="hold a step for blocks due within it (SpeculationSettings.gather)")
    ap.add_argument("--device", default="cpu", help="where the target steps: cpu, cuda (with --profiles real)")
    ap.add_argument("--model", choices=("tiny", "1b"), default="tiny",
                    help="tiny: the 2 x 64 stand-in; 1b: gpu_check's 1B-class target (for a GPU)")
    ap.add_argument("--real-draft-ms", type=float, default=None,
                    help="with --profiles real: the synthetic pool's time a drafted token (default: the h100 "
                         "profile's, 2.7 ms, which is slower than a graphed 1B step; the H200's 100M-class draft "
                         "took 0.50 ms a position as a graph, ADR 0019)")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    tile = None if a.exact_batching == "fast" else Batching.tile
    if a.device == "cpu":
        torch.set_num_threads(1)
    target = _model(0, a.model, a.device)
    vocab = target.model.config.vocab_size
    streams = [int(s) for s in a.streams.split(",")]
    all_prompts = {f"s{i}": [(31 * i + 7 * j) % vocab for j in range(PROMPT_LEN)] for i in range(max(streams))}
    refs = references(target, all_prompts, a.tokens, tile, a.device)
    rows = []
    for pname in a.profiles.split(","):
        real = pname == REAL
        for n in streams:
            prompts = dict(list(all_prompts.items())[:n])
            for arm in a.arms.split(","):
                prof = PROFILES["h100" if real else pname]
                if real and a.real_draft_ms is not None:  # the drafts timed as this device's own draft
                    prof = replace(prof, draft_step_ms=a.real_draft_ms, draft_token_ms=0.0)
                r = {"profile": pname, "draft_step_ms": prof.draft_step_ms, "draft_token_ms": prof.draft_token_ms,
                     **cell(target, prompts, refs, prof, arm,
                                              a.tokens, a.alpha, tile, a.gather == "on", a.device, real, a.beta)}
                rows.append(r)
                _write(a, rows)
                print(f"{pname:5} {n:3} streams {arm:9} {r['tok_s']:8.1f} tok/s  TPOT {r['tpot_ms_p50']:6.1f} ms  "
                      f"busy {r['device_busy']:.0%} (metric {r['busy_metric']:.0%})  "
                      f"book p50 {r['bookkeeping_ms_p50']:.2f} p99 "
                      f"{r['bookkeeping_ms_p99']:.2f} ms  pushed {r['pushed_share']:.0%}  late {r['late_share']:.0%}"
                      f"  K {r['mean_k']:.1f}  tok/pass {r['tokens_per_pass']:.2f}  trees {r['tree_share']:.0%}"
                      + (f"  forward p50 {r['forward_ms_p50']:.1f} ms" if r["forward_ms_p50"] else "")
                      + (f"  lookahead {r['lookahead']['hit']}/{r['lookahead']['missed']}" if r["lookahead"] else "")
                      + (f"  chained {r['chained']['taken']}/{r['chained']['thrown']}" if r["chained"] else "")
                      + (f"  gap p50 {r['gap_ms_p50']:.3f} ms" if r["gap_ms_p50"] is not None else ""),
                      flush=True)
            if not real:
                _bounds([r for r in rows if r["profile"] == pname and r["streams"] == n], PROFILES[pname], a)
    _write(a, rows, issue51(rows))
    _plot(rows, Path(a.out) / "engine_loop.png")


def _write(a, rows: list[dict], goals: list[dict] | None = None) -> None:
    """The results so far (after every cell: a run cut short by its time limit keeps them)."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_loop.json").write_text(json.dumps({"alpha": a.alpha, "tokens": a.tokens, "targets": goals,
                                                   "exact_batching": a.exact_batching,
                                                   "gather": a.gather, "device": a.device, "model": a.model,
                                                   "device_name": torch.cuda.get_device_name()
                                                   if a.device.startswith("cuda")
                                                   else "cpu", "rows": rows}, indent=1))


# issue 51's engine-loop figures: (arm, streams, goal over plain at that load)
GOALS = [("eagle:K=4", 1, 1.8), ("eagle:K=4", 16, 1.3), ("eagle:adaptive", 64, 1.0), ("K=4", 1, 1.3)]


def issue51(rows: list[dict]) -> list[dict]:
    """Each arm's tok/s over plain's at the same profile and load, beside issue 51's goal
    (the own head in the round, remote blocks with pre-drafting, the controller never below
    plain at any load), and the device busy of the head's rounds at one stream; printed."""
    out = []
    for r in rows:
        plain = next((p for p in rows if p["arm"] == "plain" and p["profile"] == r["profile"]
                      and p["streams"] == r["streams"]), None)
        if plain is None or r["arm"] == "plain":
            continue
        ratio = r["tok_s"] / plain["tok_s"]
        goal = next((g for arm, n, g in GOALS if arm == r["arm"] and n == r["streams"]), None)
        if goal is None and r["arm"].endswith("adaptive"):
            goal = 1.0  # the controller: never below plain
        if goal is not None:
            out.append({"profile": r["profile"], "arm": r["arm"], "streams": r["streams"], "vs_plain": ratio,
                        "goal": goal, "met": ratio >= goal})
        if r["arm"] == "eagle:K=4" and r["streams"] == 1:
            out.append({"profile": r["profile"], "arm": r["arm"], "streams": 1, "device_busy": r["device_busy"],
                        "goal": 0.9, "met": r["device_busy"] >= 0.9})
    for g in out:
        value = f"{g['vs_plain']:.2f}x plain" if "vs_plain" in g else f"device busy {g['device_busy']:.0%}"
        print(f"  {'met   ' if g['met'] else 'MISSED'} {g['profile']} {g['arm']} at {g['streams']} streams: {value} "
              f"(goal >= {g['goal']})", flush=True)
    return out


def _bounds(cells: list[dict], profile: Profile, a) -> None:
    """Beside each fixed-K cell of a load: its tok/s over plain's, and the most that K can
    gain in the profile (Profile.speculation_bound), with the engine's own time a step as
    the plain cell measured it (its wall between the padded steps)."""
    plain = next((r for r in cells if r["arm"] == "plain"), None)
    if plain is None:
        return
    overhead_ms = plain["wall_s"] * (1.0 - plain["device_busy"]) / plain["steps"] * 1e3
    cached = plain["streams"] * (PROMPT_LEN + a.tokens // 2)  # the mean over a session's life
    for r in cells:
        if r["arm"].startswith(("K=", "tree:")):
            k = int(r["arm"].split("K=")[1])
            r["vs_plain"] = r["tok_s"] / plain["tok_s"]
            r["bound"] = profile.speculation_bound(a.alpha, k, r["streams"], cached, overhead_ms)
            if r["arm"].startswith("tree:"):  # the engine chooses tree or chain: the better bound of the two
                tree = profile.speculation_bound(a.alpha, k, r["streams"], cached, overhead_ms, width=2, beta=a.beta)
                r["bound"] = max(r["bound"], tree, key=lambda b: b["any"])
            print(f"      {r['arm']:8} / plain {r['vs_plain']:.2f}: "
                  f"the most any schedule gets {r['bound']['any']:.2f}, "
                  f"steps held for every block {r['bound']['held']:.2f} (busy {r['bound']['held_busy']:.0%}); "
                  f"engine overhead {overhead_ms:.2f} ms a step", flush=True)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = sorted({r["profile"] for r in rows})
    fig, axes = plt.subplots(1, len(profiles), figsize=(6 * len(profiles), 4), squeeze=False)
    for ax, pname in zip(axes[0], profiles, strict=True):
        for arm in dict.fromkeys(r["arm"] for r in rows):
            pts = [(r["streams"], r["tok_s"]) for r in rows if r["profile"] == pname and r["arm"] == arm]
            ax.plot(*zip(*pts, strict=True), marker="o", label=arm, lw=2.5 if arm in ("plain", "adaptive") else 1)
        ax.set(xscale="log", yscale="log", xlabel="streams", ylabel="tok/s", title=f"engine loop, {pname} profile")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
