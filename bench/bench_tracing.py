"""Tracing on vs off: the same stack, prompts and sampling, run twice — once with tracing
off, once exporting every span (sampler always_on) to a real OTLP receiver. Reports ms/token
for both and the overhead (goal < 2 %). Writes <out>/tracing.json and the spans of the traced
run to <out>/tracing_spans.json (input for `specserve trace`)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import grpc

from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts
from specserve.tooling.otlp_receiver import OtlpReceiver
from specserve.tooling.stack import PoolSpec, Stack, StackSpec
from specserve.v1 import generation_pb2, generation_pb2_grpc


def run_stack(pair: Path, prompts: list[str], env: dict[str, str], args) -> float:
    with tempfile.TemporaryDirectory(prefix="specserve-trace-bench-") as run_dir:
        stack = Stack(StackSpec(pair_dir=str(pair), run_dir=run_dir, env=env,
                                pools={"small": PoolSpec("draft", 1)}))
        with stack.running(), grpc.insecure_channel(stack.info.router) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            eos = json.loads((pair / "target" / "generation_config.json").read_text())["eos_token_id"]

            def one(p: str, n: int) -> tuple[float, int]:
                req = generation_pb2.GenerateRequest(prompt=p, max_tokens=n, draft_pool="small",
                                                     num_draft_tokens=args.k, banned_token_ids=[eos])
                t0 = time.perf_counter()
                resp = stub.Generate(req, timeout=600)
                return (time.perf_counter() - t0) * 1e3, len(resp.token_ids)

            one(prompts[0], 8)
            best = {}
            for _ in range(args.repeats):
                for i, p in enumerate(prompts):
                    ms, n = one(p, args.max_tokens)
                    best[i] = min(best.get(i, (float("inf"), n)), (ms, n))
            return sum(ms for ms, _ in best.values()) / sum(n for _, n in best.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="models/default")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ratio", type=float, default=1.0,
                    help="trace sampling ratio (1 = always_on; else parentbased_traceidratio)")
    args = ap.parse_args()
    pair = find_pair(args.models)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = [p["prompt"] for p in load_eval_prompts(pair)][:: max(1, len(load_eval_prompts(pair)) // args.prompts)]
    prompts = prompts[: args.prompts]
    off = run_stack(pair, prompts, {"SPECSERVE_TRACING": "off"}, args)
    receiver = OtlpReceiver().start()
    try:
        sampler = {"OTEL_TRACES_SAMPLER": "always_on"} if args.ratio >= 1 else {
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": str(args.ratio)}
        on = run_stack(pair, prompts, {"SPECSERVE_TRACING": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                                       **sampler}, args)
        time.sleep(1.5)
        if args.ratio >= 1:
            receiver.dump(out / "tracing_spans.json")
        n_spans = len(receiver.snapshot())
    finally:
        receiver.stop()
    overhead = (on - off) / off * 100
    result = {"ms_per_token_off": off, "ms_per_token_on": on, "overhead_percent": overhead, "spans": n_spans,
              "args": vars(args), "pair": str(pair)}
    suffix = "" if args.ratio >= 1 else f"_ratio{args.ratio:g}"
    (out / f"tracing{suffix}.json").write_text(json.dumps(result, indent=1))
    print(f"tracing off {off:.2f} ms/token, on (OTLP, sampling ratio {args.ratio:g}) {on:.2f} ms/token: "
          f"overhead {overhead:+.1f} % "
          f"({n_spans} spans exported)")
    print(f"wrote {out / f'tracing{suffix}.json'}" + ("" if suffix else f" and {out / 'tracing_spans.json'}"),
          file=sys.stderr)


if __name__ == "__main__":
    main()
