"""Scratch: what the controller runs per request at 1 stream after the fixed arms fed its statistics."""
import sys, tempfile, time, collections
from pathlib import Path
import grpc
from specserve.tooling.stack import PoolSpec, Stack, StackSpec
from specserve.tooling.modelbuild.build import load_eval_prompts
from specserve.v1 import generation_pb2, generation_pb2_grpc
pair = Path("models/specserve-demo-v1")
prompts = [p["prompt"] for p in load_eval_prompts(pair)][:8]
with tempfile.TemporaryDirectory() as tmp:
    spec = StackSpec(pair_dir=str(pair), run_dir=tmp, target_threads=2,
                     pools={"small": PoolSpec("draft", 1), "ngram": PoolSpec("ngram", 1)})
    with Stack(spec).running() as s:
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(s.info.router))
        def gen(p, **kw):
            t = time.perf_counter()
            r = stub.Generate(generation_pb2.GenerateRequest(prompt=p, max_tokens=64, temperature=0.0, **kw), timeout=300)
            return r, time.perf_counter() - t
        for arm in [dict(draft_pool="none"), dict(draft_pool="small", num_draft_tokens=4), dict(draft_pool="ngram", num_draft_tokens=4)]:
            for i in range(4):
                r, dt = gen(prompts[i % 8], **arm)
            print(arm, f"{len(r.token_ids)/dt:.1f} tok/s", flush=True)
        for rep in range(2):
            for i in range(4):
                r1, d1 = gen(prompts[i], draft_pool="ngram", num_draft_tokens=4)
                r2, d2 = gen(prompts[i])
                k1 = collections.Counter(rd.k for rd in r1.stats.round); k2 = collections.Counter(rd.k for rd in r2.stats.round)
                print(f"prompt {i}: pinned {len(r1.token_ids)/d1:6.1f} tok/s {r1.stats.rounds} rounds {dict(k1)} | ctrl {r2.stats.draft_pool} {len(r2.token_ids)/d2:6.1f} tok/s {r2.stats.rounds} rounds {dict(k2)} same={list(r1.token_ids)==list(r2.token_ids)}", flush=True)
