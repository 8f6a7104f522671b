"""`specserve demo` (through the router of a running stack) and `specserve demo-local` (the
in-process reference decoder): held-out prompts of each class, speculation off and on."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import typer

from specserve.tooling.cli.app import RUN_DIR, app, router_address, router_channel

SUFFIX_K = 32  # the suffix pool's K in the demo: its drafts' length follows its matches within it


@app.command("demo")
def demo(
    models: Path = typer.Option(Path("models"), help="The pair, or the directory holding specserve-demo-v1/."),
    max_tokens: int = typer.Option(48, help="Tokens per request."),
    k: int = typer.Option(4, "--k", help="Draft tokens per round (K)."),
    prompts_per_class: int = typer.Option(3, help="Held-out prompts per workload class."),
    router: str | None = typer.Option(None, help="Router host:port (default: the local stack)."),
    run_dir: Path = typer.Option(RUN_DIR),
) -> None:
    """Through the router: held-out prompts of each workload class, speculation off (plain
    decoding through the same target) vs on (model draft pool `small`, n-gram pool `ngram`,
    suffix decoding `suffix` at K 32, and the pair's EAGLE head `eagle-local` where it ships
    one); and the repeat-heavy `agent` class, whose suffix index first learns from its warm
    requests."""
    import time

    from rich.console import Console
    from rich.table import Table

    from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts
    from specserve.tooling.modelbuild.evaluate import demo_choice
    from specserve.tooling.workloads import agent_workload
    from specserve.v1 import generation_pb2, generation_pb2_grpc

    pair_path = find_pair(models)
    prompts = load_eval_prompts(pair_path)
    console = Console()
    _demo_notice(console, pair_path)
    address = router_address(router, run_dir)
    table = Table(title=f"specserve through the router at {address}: greedy, K={k} (suffix: up to {SUFFIX_K}), "
                        f"{max_tokens} tokens, {prompts_per_class} held-out prompts per class")
    for col in ("class", "speculation", "ms/token", "speedup", "accepted/drafted", "same tokens as off"):
        table.add_column(col)
    with router_channel(address, run_dir) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        def call(prompt: str, cls: str, pool: str) -> tuple[generation_pb2.GenerateResponse, float]:
            req = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, workload_class=cls,
                                                 draft_pool=pool, num_draft_tokens=SUFFIX_K if pool == "suffix" else k)
            t = time.perf_counter()
            resp = stub.Generate(req, timeout=600)
            return resp, time.perf_counter() - t

        call("def warm_up(self):", "code", "small")  # caches and channels (no demo prompt: its output is indexed)
        for cls in ("code", "chat", "extraction"):
            _demo_class(console, table, call, [p["prompt"] for p in demo_choice(prompts, cls, prompts_per_class)],
                        cls, eagle=_eagle_pools(pair_path, router, run_dir))
        agent = agent_workload(prompts_per_class)
        for prompt in agent.warm:  # the class index learns the orders' outputs (served plain)
            call(prompt, agent.workload_class, "none")
        _demo_class(console, table, call, agent.held_out[:prompts_per_class], agent.workload_class)
        console.print(table)
        if router is None:  # the local stack: its HTTP API's address is in run/router.http
            code = demo_choice(prompts, "code", 1)[0]["prompt"]
            _demo_openai(console, run_dir, code, call(code, "code", "none")[0], max_tokens)
        _demo_policies(console, channel, prompts, prompts_per_class, max_tokens)
        _demo_adapters(console, stub, pair_path, max_tokens, k, prompts_per_class)


def _eagle_pools(pair_path: Path, router: str | None, run_dir: Path) -> list[str]:
    """The EAGLE pools to show: where the pair ships a head, `eagle-local`, and the remote
    `eagle` where the local stack serves it (`run/stack.json`); a router elsewhere, the first."""
    if not (pair_path / "eagle" / "config.json").exists():
        return []
    stack = run_dir / "stack.json"
    served = json.loads(stack.read_text()).get("pools", {}) if router is None and stack.exists() else {}
    return [p for p in ("eagle-local", "eagle") if p == "eagle-local" or p in served]


def _demo_class(console, table, call, chosen: list[str], cls: str, eagle: Sequence[str] = ()) -> None:
    """One class's prompts with speculation off and on each pool: the plain outputs printed,
    a table row per arm (time per token, speedup, acceptance, same tokens as plain). The
    suffix arm runs first: every arm's outputs join the class's index, and a prompt's own
    output, drafted back to it, would flatter the suffix pool."""
    arms = [("on: suffix", "suffix"), ("off", "none"), ("on: small", "small"), ("on: ngram", "ngram")] + [
        (f"on: {p}" if p == "eagle-local" else f"on: {p} (remote)", p) for p in eagle]
    runs = {name: [call(p, cls, pool) for p in chosen] for name, pool in arms}
    plain = runs["off"]
    console.rule(f"[bold]{cls}[/bold]")
    for prompt, (resp, _) in zip(chosen, plain, strict=True):
        console.print(f"[dim]prompt:[/dim] {prompt[-120:]!r}")
        console.print(f"[dim]output:[/dim] {resp.text!r}")
    base = sum(s for _, s in plain) / max(sum(len(r.token_ids) for r, _ in plain), 1)
    for name, results in sorted(runs.items(), key=lambda kv: kv[0] != "off"):  # (off first, as the reference)
        per_token = sum(s for _, s in results) / max(sum(len(r.token_ids) for r, _ in results), 1)
        acc, drafted = (sum(r.stats.accepted_tokens for r, _ in results),
                        sum(r.stats.draft_tokens for r, _ in results))
        same = all(list(r.token_ids) == list(p.token_ids) for (r, _), (p, _) in zip(results, plain, strict=True))
        table.add_row(cls, name, f"{per_token * 1e3:.1f}", f"{base / per_token:.2f}x",
                      f"{acc}/{drafted}" if drafted else "-", str(same))


def _demo_openai(console, run_dir: Path, prompt: str, plain, max_tokens: int) -> None:
    """One call through the OpenAI SDK with a Predicted Output: the plain output as the
    prediction (as an editor sends the file being edited); the output is the same, faster."""
    http = run_dir / "router.http"
    if not http.exists():
        return
    import time

    from openai import OpenAI

    client = OpenAI(base_url=f"{http.read_text().strip()}/v1", api_key="unused")
    t = time.perf_counter()
    got = client.completions.create(model="specserve", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                    extra_body={"prediction": {"type": "content", "content": plain.text}})
    ms = (time.perf_counter() - t) * 1e3
    usage = got.usage
    assert usage is not None and usage.completion_tokens_details is not None, "the router always reports usage"
    d = usage.completion_tokens_details
    console.rule("[bold]OpenAI SDK: client.completions.create(..., extra_body={\"prediction\": ...})[/bold]")
    console.print(f"[dim]base_url:[/dim] {client.base_url}  [dim]output:[/dim] {got.choices[0].text!r}")
    console.print(f"{usage.completion_tokens} tokens in {ms:.0f} ms; prediction tokens accepted "
                  f"{d.accepted_prediction_tokens}, rejected {d.rejected_prediction_tokens}; same text as plain "
                  f"decoding over gRPC: {got.choices[0].text == plain.text}", highlight=False)


def _demo_adapters(console, stub, pair_path: Path, max_tokens: int, k: int, n: int) -> None:
    """Each of the pair's LoRA adapters (ADR 0029) on its own held-out prompts: one answer of the
    base model and of the adapter (its style), then the adapter's requests with speculation off,
    drafted by the base draft (`small`) and by the adapter's own drafter (`small-<adapter>`), side
    by side: accepted drafts a round, time per token, and the same tokens as off."""
    import time

    from rich.table import Table

    from specserve.v1 import generation_pb2

    for held in sorted((pair_path / "adapters").glob("*/eval_prompts.json")):
        name = held.parent.name
        chosen = [p["prompt"] for p in json.loads(held.read_text())["prompts"][:n]]
        table = Table(title=f"LoRA adapter {name!r} (OpenAI model={name!r}, gRPC adapter): greedy, K={k}, "
                            f"{max_tokens} tokens, {len(chosen)} of its held-out prompts")
        for col in ("drafter", "ms/token", "speedup", "accepted drafts a round", "same tokens as off"):
            table.add_column(col)

        def call(prompt: str, adapter: str, pool: str):
            req = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, workload_class="extraction",
                                                 adapter=adapter, draft_pool=pool, num_draft_tokens=k)
            t = time.perf_counter()
            resp = stub.Generate(req, timeout=600)
            return resp, time.perf_counter() - t

        console.rule(f"[bold]adapter {name}[/bold]")
        console.print(f"[dim]prompt:[/dim] {chosen[0][-120:]!r}")
        console.print(f"[dim]base model:[/dim] {call(chosen[0], '', 'none')[0].text!r}")
        runs = {arm: [call(p, name, pool) for p in chosen] for arm, pool in
                (("off", "none"), ("base draft (small)", "small"), (f"its own (small-{name})", f"small-{name}"))}
        console.print(f"[dim]adapter {name}:[/dim] {runs['off'][0][0].text!r}")
        plain = runs["off"]
        base = sum(s for _, s in plain) / max(sum(len(r.token_ids) for r, _ in plain), 1)
        for arm, results in runs.items():
            per_token = sum(s for _, s in results) / max(sum(len(r.token_ids) for r, _ in results), 1)
            rounds = [rd for r, _ in results for rd in r.stats.round if rd.k > 0]
            same = all(list(r.token_ids) == list(p.token_ids) for (r, _), (p, _) in zip(results, plain, strict=True))
            table.add_row(arm, f"{per_token * 1e3:.1f}", f"{base / per_token:.2f}x",
                          f"{sum(rd.accepted for rd in rounds) / len(rounds):.2f}" if rounds else "-", str(same))
        console.print(table)


def _demo_notice(console, pair_path: Path) -> None:
    """Say what the pair is, before anyone reads its text as the system's quality, and which
    weights these are (the sha256 of its model card)."""
    meta = json.loads((pair_path / "build.json").read_text())
    params = f"{meta['target_params'] / 1e6:.0f} M-parameter target, {meta['draft_params'] / 1e6:.1f} M draft"
    console.print(
        f"[bold]The specserve demo pair[/bold] {pair_path.name} ({params}, trained once for "
        f"{meta['seconds'] / 60:.0f} min on 2 CPU cores from Python's own sources, docs and generated records; "
        f"weights sha256 {meta['weights_sha256']}, as in its MODEL_CARD.md): a small demo, expect rough text. "
        "The prompts below are held-out ones it continues without looping; `make bench` reports every prompt.\n"
        "To serve a real Hugging Face pair that shares a tokenizer (e.g. Qwen/Qwen3-0.6B drafting for "
        "Qwen/Qwen3-8B): set SPECSERVE_TARGET_MODEL and SPECSERVE_DRAFT_MODEL to a directory or hub id "
        "(Helm: target.model and draft.pools[].model), or in-process: "
        "load_pair(\"Qwen/Qwen3-8B\", \"Qwen/Qwen3-0.6B\").", highlight=False)


def _demo_policies(console, channel, prompts: list[dict], n: int, max_tokens: int) -> None:
    """Unpinned requests: the router classifies each prompt, and its class's policy and the
    controller pick the arm. Each row shows the arm, K and the decision with its reason as
    they applied to that request (its plan, in the response), so they always agree."""
    from rich.table import Table

    from specserve.v1 import generation_pb2, generation_pb2_grpc

    stub = generation_pb2_grpc.GenerationStub(channel)
    table = Table(title="classified by the router, served under each class's policy and the controller")
    for col in ("true class", "classified as", "arm (pool, K)", "decision", "why"):
        table.add_column(col)
    for cls in ("code", "chat", "extraction"):
        for p in [p["prompt"] for p in prompts if p["workload_class"] == cls][:n]:
            s = stub.Generate(generation_pb2.GenerateRequest(prompt=p, max_tokens=max_tokens), timeout=600).stats
            arm = f"{s.draft_pool} K={s.k}" if s.draft_pool and s.k else "plain"
            table.add_row(cls, s.workload_class, arm, s.decision or "-", s.decision_reason or "-")
    console.print(table)


@app.command("demo-local")
def demo_local(
    models: Path = typer.Option(Path("models"), help="The pair, or the directory holding specserve-demo-v1/."),
    max_tokens: int = typer.Option(48, help="Tokens per request."),
    k: int = typer.Option(4, "--k", help="Draft tokens per round (K)."),
) -> None:
    """The in-process reference decoder (no services) on one held-out prompt per workload class."""
    import time

    import torch
    from rich.console import Console
    from rich.table import Table

    from specserve.drafters import HFDrafter, NgramDrafter
    from specserve.models.loading import load_pair
    from specserve.models.verifier import TargetModel
    from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts
    from specserve.tooling.modelbuild.evaluate import demo_choice
    from specserve.worker.reference import GenerationParams, ReferenceDecoder

    torch.set_num_threads(2)
    pair_path = find_pair(models)
    pair = load_pair(str(pair_path / "target"), str(pair_path / "draft"))
    target = TargetModel(pair.target)
    if pair.draft is None:
        raise typer.BadParameter(f"{pair_path} has no draft model")
    engines = {
        "off (plain)": ReferenceDecoder(target, None, pair.tokenizer),
        "model draft": ReferenceDecoder(target, HFDrafter(pair.draft), pair.tokenizer),
        "n-gram draft": ReferenceDecoder(target, NgramDrafter(target.vocab_size), pair.tokenizer),
    }
    console = Console()
    _demo_notice(console, pair_path)
    prompts = load_eval_prompts(pair_path)
    table = Table(title=f"specserve in-process reference decoder, greedy, K={k}, {max_tokens} tokens")
    for col in ("class", "speculation", "ms/token", "speedup", "mean accepted", "same text as plain"):
        table.add_column(col)
    for cls in ("code", "chat", "extraction"):
        prompt = demo_choice(prompts, cls, 1)[0]["prompt"]
        results = {}
        for name, engine in engines.items():
            params = GenerationParams(max_tokens=max_tokens, num_draft_tokens=0 if "off" in name else k)
            engine.generate(prompt, GenerationParams(max_tokens=4, num_draft_tokens=params.num_draft_tokens))
            t = time.perf_counter()
            res = engine.generate(prompt, params)
            results[name] = (res, (time.perf_counter() - t) * 1e3 / max(len(res.token_ids), 1))
        plain, base_ms = results["off (plain)"]
        console.rule(f"[bold]{cls}[/bold]")
        console.print(f"[dim]prompt:[/dim] {prompt[-160:]!r}")
        console.print(f"[dim]output:[/dim] {plain.text!r}")
        for name, (res, ms) in results.items():
            acc = res.accepted_per_round
            table.add_row(cls, name, f"{ms:.1f}", f"{base_ms / ms:.2f}x",
                          f"{sum(acc) / len(acc):.2f}" if acc else "-", str(res.token_ids == plain.token_ids))
    console.print(table)
