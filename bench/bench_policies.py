"""Mixed workload (code + chat + extraction): static speculation vs the controller, side by
side on one stack, and how fast the controller reacts when a class's draft pool degrades.

Two arms run at the same time, each with one client per class:
- static: every request pins its class's pool and K (what a server without a controller does);
- controller: the same classes under policies (adaptive K, margin 0.05, probe 5 %).
Phase 1 is healthy. At the start of phase 2 the `chatpool` draft replica is replaced by
an untrained model at the same address (a bad checkpoint rolled out to the chat pool). Both
arms then see the degraded pool: static keeps speculating, while the controller should turn
chat to plain. The reaction time is measured from the swap until the controller's decision
for chat is `plain`.

The target sleeps --pass-ms per forward pass and the model draft --draft-token-ms per token
(simulated device costs, ADR 0006); with the default pair on this CPU use --pass-ms 0.
Writes <out>/policies.json and <out>/policies.png.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import grpc
from common import parser

from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts, untrained_copy
from specserve.tooling.stack import PoolSpec, Stack, StackSpec, _alive
from specserve.v1 import generation_pb2, generation_pb2_grpc, policy_pb2, policy_pb2_grpc

CLASSES = ("code", "chat", "extraction")
POOL = {"code": "small", "chat": "chatpool", "extraction": "ngram"}
TOKEN = "bench-token"
AUTH = [("authorization", f"Bearer {TOKEN}")]


def client(stub, arm: str, cls: str, prompts: list[str], max_tokens: int, k: int, stop: threading.Event,
           log: list) -> None:
    i = 0
    while not stop.is_set():
        prompt = prompts[i % len(prompts)]
        i += 1
        if arm == "static":
            req = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, workload_class=f"static-{cls}",
                                                 draft_pool=POOL[cls], num_draft_tokens=k)
        else:
            req = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, workload_class=cls)
        t0 = time.time()
        try:
            resp = stub.Generate(req, timeout=300)
        except grpc.RpcError as err:
            log.append((arm, cls, t0, time.time(), 0, "error:" + err.code().name, 0))
            continue
        log.append((arm, cls, t0, time.time(), len(resp.token_ids), resp.stats.draft_pool or "plain",
                    resp.stats.round[0].k if resp.stats.round else 0))


def rates(log: list, t_from: float, t_to: float) -> dict:
    """tokens/s per (arm, class) over requests that started and ended inside the window."""
    tok: dict = defaultdict(int)
    for arm, cls, t0, t1, n, _pool, _k in log:
        if t0 >= t_from and t1 <= t_to:
            tok[(arm, cls)] += n
    span = t_to - t_from
    out = {f"{arm}/{cls}": tok[(arm, cls)] / span for arm in ("static", "controller") for cls in CLASSES}
    for arm in ("static", "controller"):
        out[f"{arm}/all"] = sum(tok[(arm, c)] for c in CLASSES) / span
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--phase-s", type=float, default=60.0)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4, help="static arm's K")
    ap.add_argument("--pass-ms", type=float, default=30.0, help="simulated target pass cost (0 = off)")
    ap.add_argument("--draft-token-ms", type=float, default=3.0, help="simulated model-draft cost per token")
    ap.add_argument("--half-life-s", type=float, default=15.0)
    args = ap.parse_args()
    pair = find_pair(args.models)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_eval_prompts(pair)
    by_class = {c: [p["prompt"] for p in prompts if p["workload_class"] == c][:6] for c in CLASSES}

    with tempfile.TemporaryDirectory(prefix="specserve-bench-") as tmp:
        poor = untrained_copy(pair / "draft", Path(tmp) / "poor-draft", seed=1)
        draft_env = {"SPECSERVE_DRAFT_SIMULATED_TOKEN_MS": str(args.draft_token_ms)}
        spec = StackSpec(
            pair_dir=str(pair), run_dir=str(Path(tmp) / "run"), target_threads=1,
            pools={"small": PoolSpec("draft", env=draft_env), "chatpool": PoolSpec("draft", env=draft_env),
                   "ngram": PoolSpec("ngram")},
            router_env={"SPECSERVE_ROUTER_ADMIN_TOKENS": json.dumps({"bench": TOKEN}),
                        "SPECSERVE_ROUTER_CONTROLLER_HALF_LIFE_S": str(args.half_life_s),
                        "SPECSERVE_ROUTER_POLICIES": json.dumps({
                            c: {"draft_pool": POOL[c], "adaptive_k": True, "k_min": 1, "k_max": 8,
                                "safety_margin": 0.05, "probe_fraction": 0.05} for c in CLASSES})},
            env={"SPECSERVE_TARGET_SIMULATED_PASS_MS": str(args.pass_ms)},
        )
        with Stack(spec).running() as stack:
            result = run(stack, by_class, args, poor, draft_env)
    result["config"] = vars(args)
    path = out / "policies.json"
    path.write_text(json.dumps(result, indent=1))
    plot(result, out / "policies.png")
    print_table(result)
    print(f"wrote {path} and {out / 'policies.png'}")


def run(stack: Stack, by_class, args, poor: Path, draft_env: dict) -> dict:
    info = stack.info
    channel = grpc.insecure_channel(info.router)
    stub = generation_pb2_grpc.GenerationStub(channel)
    admin = policy_pb2_grpc.PolicyAdminStub(channel)
    log: list = []
    stop = threading.Event()
    threads = [threading.Thread(target=client, args=(stub, arm, c, by_class[c], args.max_tokens, args.k, stop, log),
                                daemon=True) for arm in ("static", "controller") for c in CLASSES]
    start = time.time()
    for t in threads:
        t.start()
    decisions: list = []

    def decision(cls: str) -> policy_pb2.ControllerDecision:
        return admin.GetEffectivePolicy(policy_pb2.GetEffectivePolicyRequest(workload_class=cls), metadata=AUTH,
                                        timeout=10).decision

    def watch(until: float) -> None:
        while time.time() < until:
            for c in CLASSES:
                d = decision(c)
                decisions.append((time.time() - start, c, d.decision, d.k, d.expected_speedup))
            time.sleep(0.5)

    warm = start + min(20.0, args.phase_s / 3)
    phase1_end = start + args.phase_s
    watch(phase1_end)
    # degrade: the chat pool's replica becomes an untrained model at the same address
    address = info.pools["chatpool"][0]
    port = address.rsplit(":", 1)[1]
    pid = stack.info.pids["draft-chatpool-0"]
    os.killpg(pid, 15)
    while _alive(pid):
        time.sleep(0.05)
    swapped = time.time()
    stack._spawn("draft-chatpool-0b", "specserve.services.draft", {
        "SPECSERVE_DRAFT_POOL": "chatpool", "SPECSERVE_DRAFT_MODEL": str(poor), "SPECSERVE_DRAFT_PORT": port,
        "SPECSERVE_DRAFT_METRICS_PORT": "-1", **draft_env})
    reaction = None
    phase2_end = swapped + args.phase_s
    while time.time() < phase2_end:
        d = decision("chat")
        decisions.append((time.time() - start, "chat", d.decision, d.k, d.expected_speedup))
        if reaction is None and d.decision == "plain":
            reaction = time.time() - swapped
        time.sleep(0.25)
    stop.set()
    for t in threads:
        t.join(timeout=300)
    chat_requests_until_plain = sum(1 for arm, cls, t0, _t1, _n, _p, _k in log
                                    if arm == "controller" and cls == "chat"
                                    and swapped <= t0 <= swapped + (reaction or 0))
    return {
        "phase1": rates(log, warm, phase1_end),
        "phase2": rates(log, swapped + (reaction or 0) + 2.0, phase2_end),
        "phase2_whole": rates(log, swapped, phase2_end),
        "reaction_s": reaction,
        "chat_requests_until_plain": chat_requests_until_plain,
        "decisions": decisions,
        "requests": [dict(arm=a, cls=c, t0=t0 - start, t1=t1 - start, tokens=n, pool=p, k=k)
                     for a, c, t0, t1, n, p, k in log],
        "swap_at_s": swapped - start,
    }


def print_table(r: dict) -> None:
    print(f"{'phase':<14}{'class':<12}{'static tok/s':>14}{'controller tok/s':>18}{'ratio':>8}")
    for phase in ("phase1", "phase2", "phase2_whole"):
        for c in (*CLASSES, "all"):
            s, k = r[phase][f"static/{c}"], r[phase][f"controller/{c}"]
            print(f"{phase:<14}{c:<12}{s:>14.1f}{k:>18.1f}{(k / s if s else float('nan')):>8.2f}")
    print(f"controller reaction to the degraded chat pool: {r['reaction_s']} s, "
          f"{r['chat_requests_until_plain']} chat requests")


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    width = 0.2
    labels = [*CLASSES, "all"]
    for i, (phase, arm) in enumerate([("phase1", "static"), ("phase1", "controller"), ("phase2", "static"),
                                      ("phase2", "controller")]):
        ax.bar([j + (i - 1.5) * width for j in range(len(labels))], [r[phase][f"{arm}/{c}"] for c in labels],
               width, label=f"{phase} {arm}")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("tokens/s")
    ax.set_title("static speculation vs the controller")
    ax.legend(fontsize=8)
    ax = axes[1]
    for c in CLASSES:
        pts = [(t, s) for t, cls, _d, _k, s in r["decisions"] if cls == c]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{c} expected S")
    ax.axvline(r["swap_at_s"], color="k", linestyle="--", label="chat pool degraded")
    if r["reaction_s"] is not None:
        ax.axvline(r["swap_at_s"] + r["reaction_s"], color="r", linestyle=":", label="controller: chat plain")
    ax.axhline(1.05, color="grey", linewidth=0.8)
    ax.set_xlabel("s")
    ax.set_ylabel("expected speedup S")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
