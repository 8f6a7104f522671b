"""The `specserve` command line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer

if not sys.stdout.isatty():  # CI has no terminal: no progress bars from libraries either
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")

app = typer.Typer(no_args_is_help=True, add_completion=False, help="specserve: distributed, lossless speculative decoding")
models_app = typer.Typer(no_args_is_help=True, help="Build and inspect the offline model pair.")
app.add_typer(models_app, name="models")
RUN_DIR = Path("run")


@models_app.command("build")
def models_build(
    out: Path = typer.Option(Path(".cache/models"), help="Directory that holds built pairs."),
    preset: str = typer.Option("demo", help="demo (the shipped pair's recipe), default, tiny or micro."),
    force: bool = typer.Option(False, help="Rebuild even if a cached pair matches the config."),
    shipped: Path = typer.Option(Path("models") / "specserve-demo-v1", help="The committed pair to compare with."),
) -> None:
    """Build the tokenizer, target and distilled draft offline (cached by config hash). The
    demo preset is the recipe of the committed pair: the build says whether this machine
    reproduced its weights exactly (same sha256) or not (another CPU type rounds differently)."""
    from specserve.tooling.modelbuild.build import PRESETS, build_pair

    if preset not in PRESETS:
        raise typer.BadParameter(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    path = build_pair(PRESETS[preset], out, force=force, log=typer.echo)
    meta = json.loads((path / "build.json").read_text())
    typer.echo(f"pair ready: {path}")
    # equal digests mean identical weights and tokenizer: compare them before comparing benchmarks
    typer.echo(f"weights sha256: {meta['weights_sha256']}")
    card = shipped / "build.json"
    if preset == "demo" and card.exists():
        committed = json.loads(card.read_text())
        if committed["digest"] != meta["digest"]:
            typer.echo(f"the committed pair was built from another config ({committed['digest']}): not comparable")
        elif committed["weights_sha256"] == meta["weights_sha256"]:
            typer.echo(f"identical to the committed pair ({shipped}): this machine reproduces it exactly")
        else:
            typer.echo(f"differs from the committed pair ({committed['weights_sha256'][:12]}...): same recipe, "
                       "other rounding (bf16 autocast and thread splits differ by CPU type); every service "
                       f"keeps serving the committed {shipped}")


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
    decoding through the same target) vs on (model draft pool `small`, n-gram pool `ngram`)."""
    import time

    from rich.console import Console
    from rich.table import Table

    from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts
    from specserve.tooling.modelbuild.evaluate import demo_choice
    from specserve.v1 import generation_pb2, generation_pb2_grpc

    pair_path = find_pair(models)
    prompts = load_eval_prompts(pair_path)
    console = Console()
    _demo_notice(console, pair_path)
    address = _router_address(router, run_dir)
    table = Table(title=f"specserve through the router at {address}: greedy, K={k}, {max_tokens} tokens, "
                        f"{prompts_per_class} held-out prompts per class")
    for col in ("class", "speculation", "ms/token", "speedup", "accepted/drafted", "same tokens as off"):
        table.add_column(col)
    with _channel(address, run_dir) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        def call(prompt: str, cls: str, pool: str) -> tuple[generation_pb2.GenerateResponse, float]:
            req = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, workload_class=cls,
                                                 draft_pool=pool, num_draft_tokens=k)
            t = time.perf_counter()
            resp = stub.Generate(req, timeout=600)
            return resp, time.perf_counter() - t

        call(prompts[0]["prompt"], prompts[0]["workload_class"], "small")  # warm caches and channels
        for cls in ("code", "chat", "extraction"):
            chosen = [p["prompt"] for p in demo_choice(prompts, cls, prompts_per_class)]
            runs = {name: [call(p, cls, pool) for p in chosen]
                    for name, pool in (("off", "none"), ("on: small", "small"), ("on: ngram", "ngram"))}
            plain = runs["off"]
            console.rule(f"[bold]{cls}[/bold]")
            for prompt, (resp, _) in zip(chosen, plain, strict=True):
                console.print(f"[dim]prompt:[/dim] {prompt[-120:]!r}")
                console.print(f"[dim]output:[/dim] {resp.text!r}")
            base = sum(s for _, s in plain) / max(sum(len(r.token_ids) for r, _ in plain), 1)
            for name, results in runs.items():
                per_token = sum(s for _, s in results) / max(sum(len(r.token_ids) for r, _ in results), 1)
                acc, drafted = (sum(r.stats.accepted_tokens for r, _ in results),
                                sum(r.stats.draft_tokens for r, _ in results))
                same = all(list(r.token_ids) == list(p.token_ids) for (r, _), (p, _) in zip(results, plain, strict=True))
                table.add_row(cls, name, f"{per_token * 1e3:.1f}", f"{base / per_token:.2f}x",
                              f"{acc}/{drafted}" if drafted else "-", str(same))
        console.print(table)
        if router is None:  # the local stack: its HTTP API's address is in run/router.http
            code = demo_choice(prompts, "code", 1)[0]["prompt"]
            _demo_openai(console, run_dir, code, call(code, "code", "none")[0], max_tokens)
        _demo_policies(console, channel, prompts, prompts_per_class, max_tokens)


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
    """The in-process engine (no services) on one held-out prompt per workload class."""
    import time

    import torch
    from rich.console import Console
    from rich.table import Table

    from specserve.drafters import HFDrafter, NgramDrafter
    from specserve.models.engine import GenerationParams, SpecEngine
    from specserve.models.loading import load_pair
    from specserve.models.verifier import TargetModel
    from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts
    from specserve.tooling.modelbuild.evaluate import demo_choice

    torch.set_num_threads(2)
    pair_path = find_pair(models)
    pair = load_pair(str(pair_path / "target"), str(pair_path / "draft"))
    target = TargetModel(pair.target)
    if pair.draft is None:
        raise typer.BadParameter(f"{pair_path} has no draft model")
    engines = {
        "off (plain)": SpecEngine(target, None, pair.tokenizer),
        "model draft": SpecEngine(target, HFDrafter(pair.draft), pair.tokenizer),
        "n-gram draft": SpecEngine(target, NgramDrafter(target.vocab_size), pair.tokenizer),
    }
    console = Console()
    _demo_notice(console, pair_path)
    prompts = load_eval_prompts(pair_path)
    table = Table(title=f"specserve in-process engine, greedy, K={k}, {max_tokens} tokens")
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
            acc = res.acceptance_lengths
            table.add_row(cls, name, f"{ms:.1f}", f"{base_ms / ms:.2f}x",
                          f"{sum(acc) / len(acc):.2f}" if acc else "-", str(res.token_ids == plain.token_ids))
    console.print(table)




def _stack_spec(models: Path, run_dir: Path, http_port: int = 8000):
    import json
    import secrets

    from specserve.tooling.files import write_private
    from specserve.tooling.modelbuild.build import find_pair
    from specserve.tooling.stack import PoolSpec, StackSpec

    pair = find_pair(models)
    # PolicyAdmin's token for this local stack: the environment's, or a fresh one kept in
    # run/admin.token (0600) where `specserve policy` finds it
    token = os.environ.get("SPECSERVE_ROUTER_ADMIN_TOKEN") or secrets.token_urlsafe(24)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_private(run_dir / "admin.token", token)
    # every class may use both pools: the controller moves each to the pool that pays
    policies = {"code": {"draft_pool": "small", "draft_pools": ["ngram"], "adaptive_k": True, "k_min": 1, "k_max": 8},
                "chat": {"draft_pool": "small", "draft_pools": ["ngram"], "k": 4},
                "extraction": {"draft_pool": "ngram", "draft_pools": ["small"], "adaptive_k": True, "k_min": 2,
                               "k_max": 12}}
    return StackSpec(pair_dir=str(pair.resolve()), run_dir=str(run_dir.resolve()),
                     pools={"small": PoolSpec("draft", replicas=2), "ngram": PoolSpec("ngram", replicas=1)},
                     redis_url=os.environ.get("SPECSERVE_REDIS_URL", ""), http_port=http_port,
                     router_env={"SPECSERVE_ROUTER_ADMIN_TOKEN": token,
                                 "SPECSERVE_ROUTER_POLICIES": json.dumps(policies)})


@app.command("up")
def up(
    models: Path = typer.Option(Path("models"), help="The pair, or the directory holding specserve-demo-v1/."),
    run_dir: Path = typer.Option(RUN_DIR, help="Logs, ports and PIDs of the local stack."),
    tls: bool = typer.Option(False, "--tls", help="TLS on every hop (mTLS to workers), with a local CA in run/tls."),
    http_port: int = typer.Option(8000, "--http-port", help="The router's OpenAI-compatible HTTP API port "
                                  "(0 = a free one)."),
) -> None:
    """Start Redis (unless SPECSERVE_REDIS_URL is set), Ray + the target, two draft pools
    (small: 2 replicas, ngram: 1) and the router (gRPC, and the OpenAI HTTP API), all on
    loopback."""
    from specserve.serving.tls import make_local_ca
    from specserve.tooling.stack import Stack, StackError, down_from

    down_from(str(run_dir))  # a stale stack from an earlier `up` is stopped first
    spec = _stack_spec(models, run_dir, http_port)
    (run_dir / "router.tls").unlink(missing_ok=True)
    if tls:
        spec.tls_dir = str(make_local_ca(run_dir.resolve() / "tls"))
        (run_dir / "router.tls").write_text(spec.tls_dir)  # where the CLI's clients find the CA
    try:
        info = Stack(spec).up()
    except StackError as err:
        typer.echo(f"specserve up failed: {err}", err=True)
        raise typer.Exit(1) from err
    typer.echo(f"router {info.router}  redis {info.redis_url}  target {info.target.get('address')}")
    for pool, addrs in info.pools.items():
        typer.echo(f"draft pool {pool}: {', '.join(addrs)}")
    (run_dir / "router.address").write_text(info.router)
    (run_dir / "router.http").write_text(info.http)
    typer.echo(f"OpenAI-compatible API: {info.http}/v1 (model \"specserve\")")
    typer.echo(f"policies: `specserve policy list` (admin token in {run_dir / 'admin.token'})")


@app.command("down")
def down(run_dir: Path = typer.Option(RUN_DIR, help="The run directory `up` used.")) -> None:
    """Stop what `specserve up` started, by PID."""
    from specserve.tooling.stack import down_from

    stopped = down_from(str(run_dir))
    typer.echo("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))


def _channel(address: str, run_dir: Path):
    """A channel to the router: TLS with the local CA when `specserve up --tls` made one."""
    from specserve.serving.tls import channel

    path = run_dir / "router.tls"
    return channel(address, path.read_text().strip() if path.exists() else "")


def _router_address(router: str | None, run_dir: Path) -> str:
    if router:
        return router
    path = run_dir / "router.address"
    if not path.exists():
        raise typer.BadParameter("no --router given and no local stack is running (run `specserve up`)")
    return path.read_text().strip()


@app.command("generate")
def generate(
    prompt: str = typer.Argument(..., help="Prompt text."),
    workload_class: str = typer.Option("", "--class", help="code | chat | extraction (empty: classify)."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    max_tokens: int = typer.Option(64),
    seed: int | None = typer.Option(None),
    pool: str = typer.Option("", help="Draft pool; 'none' disables speculation."),
    k: int | None = typer.Option(None, "--k", help="Draft tokens per round."),
    stream: bool = typer.Option(False, help="Print chunks as they are committed."),
    predict: Path | None = typer.Option(None, "--predict", help="Predicted Outputs: a file holding the text "
                                        "the output is expected to mostly repeat (it drafts; the output is "
                                        "exact)."),
    router: str | None = typer.Option(None, help="host:port of a router (default: the local stack)."),
    run_dir: Path = typer.Option(RUN_DIR),
) -> None:
    """Send one request to a running router."""
    import grpc

    from specserve.v1 import generation_pb2, generation_pb2_grpc

    req = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                         top_k=top_k, workload_class=workload_class, draft_pool=pool)
    if top_p < 1.0:
        req.top_p = top_p
    if seed is not None:
        req.seed = seed
    if k is not None:
        req.num_draft_tokens = k
    if predict is not None:
        if not predict.is_file():
            raise typer.BadParameter(f"{predict} is not a readable file", param_hint="--predict")
        req.prediction = predict.read_text()
    with _channel(_router_address(router, run_dir), run_dir) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            if stream:
                for chunk in stub.GenerateStream(req, timeout=300):
                    typer.echo(chunk.text, nl=False)
                    if chunk.finish_reason:
                        typer.echo(f"\n[{chunk.finish_reason}] session {chunk.session_id}")
                return
            resp = stub.Generate(req, timeout=300)
        except grpc.RpcError as err:
            typer.echo(f"{err.code().name}: {err.details()}", err=True)
            raise typer.Exit(2) from err
    st = resp.stats
    typer.echo(resp.text)
    typer.echo(f"[{resp.finish_reason}] class={st.workload_class} pool={st.draft_pool or '-'} rounds={st.rounds} "
               f"accepted={st.accepted_tokens}/{st.draft_tokens} seed={st.seed}"
               + (f" prediction accepted={st.accepted_prediction_tokens} rejected={st.rejected_prediction_tokens}"
                  if predict is not None else ""))


@app.command("trace")
def trace_cmd(
    trace_file: Path = typer.Argument(..., help="Spans as JSON (an OtlpReceiver dump or a bench report)."),
    session: str | None = typer.Option(None, help="Session id of the request (default: the latest one)."),
    out: Path = typer.Option(Path("trace.png"), help="Where to write the waterfall PNG."),
) -> None:
    """Render one request's rounds as a waterfall PNG: the engine steps and their draft blocks."""
    from specserve.tooling.waterfall import load_spans, pick_trace, render

    if not trace_file.exists():
        raise typer.BadParameter(f"{trace_file} does not exist")
    try:
        path = render(pick_trace(load_spans(trace_file), session), out)
    except ValueError as err:
        typer.echo(f"specserve trace: {err}", err=True)
        raise typer.Exit(2) from err
    typer.echo(f"wrote {path}")


# -- policies -------------------------------------------------------------------------------
policy_app = typer.Typer(no_args_is_help=True, help="Per workload class speculation policies (PolicyAdmin).")
app.add_typer(policy_app, name="policy")
_ROUTER_OPT = typer.Option(None, "--router", help="Router host:port (default: the local stack).")
_TOKEN_OPT = typer.Option(None, "--token", envvar="SPECSERVE_ADMIN_TOKEN",
                          help="Admin token (or SPECSERVE_ADMIN_TOKEN).")


def _admin_token(token: str | None, router: str | None, run_dir: Path) -> str:
    """The given token, else (for the local stack, i.e. no --router) the one `up` wrote."""
    if not token and router is None and (run_dir / "admin.token").exists():
        token = (run_dir / "admin.token").read_text().strip()
    return token or ""


def _admin(router: str | None, token: str | None, run_dir: Path = RUN_DIR):

    from specserve.v1 import policy_pb2_grpc

    token = _admin_token(token, router, run_dir)
    if not token:
        raise typer.BadParameter("an admin token is needed: --token or SPECSERVE_ADMIN_TOKEN")
    channel = _channel(_router_address(router, run_dir), run_dir)
    return policy_pb2_grpc.PolicyAdminStub(channel), [("authorization", f"Bearer {token}")]


def _call(fn, request, metadata):
    import grpc

    try:
        return fn(request, metadata=metadata, timeout=30)
    except grpc.RpcError as err:
        typer.echo(f"error: {err.code().name}: {err.details()}", err=True)
        raise typer.Exit(2) from None


def _policy_json(p) -> dict:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(p, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _echo_json(obj) -> None:
    import json

    typer.echo(json.dumps(obj, indent=2, sort_keys=True))


@policy_app.command("list")
def policy_list(router: str | None = _ROUTER_OPT, token: str | None = _TOKEN_OPT) -> None:
    """Every stored policy."""
    from specserve.v1 import policy_pb2

    stub, md = _admin(router, token)
    resp = _call(stub.ListPolicies, policy_pb2.ListPoliciesRequest(), md)
    _echo_json([_policy_json(p) for p in resp.policies])


@policy_app.command("get")
def policy_get(workload_class: str = typer.Argument(..., help="Class name."),
               effective: bool = typer.Option(False, help="The policy in force with the controller's decision."),
               router: str | None = _ROUTER_OPT, token: str | None = _TOKEN_OPT) -> None:
    """A class's stored policy, or (--effective) what applies now and why."""
    from specserve.v1 import policy_pb2

    stub, md = _admin(router, token)
    if effective:
        resp = _call(stub.GetEffectivePolicy, policy_pb2.GetEffectivePolicyRequest(workload_class=workload_class), md)
    else:
        resp = _call(stub.GetPolicy, policy_pb2.GetPolicyRequest(workload_class=workload_class), md)
    _echo_json(_policy_json(resp))


@policy_app.command("set")
def policy_set(
    workload_class: str = typer.Argument(..., help="Class name (`default` covers classes without a policy)."),
    mode: str | None = typer.Option(None, help="enabled | shadow | off"),
    pool: str | None = typer.Option(None, "--pool", help="Draft pool (the preferred one)."),
    also_pools: list[str] | None = typer.Option(
        None, "--also-pool", help="Another pool the controller may move the class to (repeat; '' clears)."),
    k: str | None = typer.Option(None, "--k", help="Draft tokens per round, or 'adaptive'."),
    k_min: int | None = typer.Option(None, help="Adaptive K lower bound."),
    k_max: int | None = typer.Option(None, help="Adaptive K upper bound."),
    temperature_ceiling: float | None = typer.Option(None, help="Requests above run plain (negative: no ceiling)."),
    max_prompt_tokens: int | None = typer.Option(None, help="Longer prompts run plain (0: no limit)."),
    margin: float | None = typer.Option(None, "--margin", help="Safety margin: speculate while S >= 1 + margin."),
    probe: float | None = typer.Option(None, "--probe", help="Probe fraction."),
    output_format: str | None = typer.Option(
        None, "--output-format", help="text | json_object: the class's output when a request names no constraint."),
    from_file: Path | None = typer.Option(None, "--file", help="A JSON policy (fields as in `policy get`)."),
    expected_version: int | None = typer.Option(
        None, "--expected-version", help="Compare-and-set against this version (default: the version read)."),
    comment: str = typer.Option("", help="Kept in the audit log."),
    router: str | None = _ROUTER_OPT, token: str | None = _TOKEN_OPT,
) -> None:
    """Create or change a policy: reads the current one, applies the options, writes it back
    with compare-and-set, so a concurrent change is refused rather than lost."""
    import json

    import grpc
    from google.protobuf.json_format import ParseDict

    from specserve.v1 import policy_pb2

    stub, md = _admin(router, token)
    try:
        current = stub.GetPolicy(policy_pb2.GetPolicyRequest(workload_class=workload_class), metadata=md, timeout=30)
        version = current.version
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.NOT_FOUND:
            typer.echo(f"error: {err.code().name}: {err.details()}", err=True)
            raise typer.Exit(2) from None
        from specserve.control.policy import Policy

        d = Policy(workload_class)  # a new class starts from the one set of policy defaults
        current = policy_pb2.Policy(workload_class=workload_class, mode=policy_pb2.POLICY_MODE_ENABLED,
                                    draft_pool=d.draft_pool, k=d.k, k_min=d.k_min, k_max=d.k_max,
                                    safety_margin=d.safety_margin, probe_fraction=d.probe_fraction,
                                    output_format=d.output_format)
        version = 0
    policy = policy_pb2.Policy()
    policy.CopyFrom(current)
    if from_file is not None:
        try:
            ParseDict(json.loads(from_file.read_text()), policy, ignore_unknown_fields=False)
        except Exception as exc:
            raise typer.BadParameter(f"{from_file}: {exc}") from exc
    policy.workload_class = workload_class
    if mode is not None:
        modes = {"enabled": policy_pb2.POLICY_MODE_ENABLED, "shadow": policy_pb2.POLICY_MODE_SHADOW,
                 "off": policy_pb2.POLICY_MODE_OFF}
        if mode not in modes:
            raise typer.BadParameter(f"--mode must be one of {', '.join(modes)}")
        policy.mode = modes[mode]
    if pool is not None:
        policy.draft_pool = pool
    if also_pools is not None:
        del policy.draft_pools[:]
        policy.draft_pools.extend(p for p in also_pools if p)
    if k is not None:
        if k == "adaptive":
            policy.adaptive_k = True
        elif k.isdigit():
            policy.adaptive_k, policy.k = False, int(k)
        else:
            raise typer.BadParameter("--k must be a number or 'adaptive'")
    for name, value in (("k_min", k_min), ("k_max", k_max), ("max_prompt_tokens", max_prompt_tokens),
                        ("safety_margin", margin), ("probe_fraction", probe)):
        if value is not None:
            setattr(policy, name, value)
    if output_format is not None:
        policy.output_format = output_format
    if temperature_ceiling is not None:
        if temperature_ceiling < 0:
            policy.ClearField("temperature_ceiling")
        else:
            policy.temperature_ceiling = temperature_ceiling
    req = policy_pb2.SetPolicyRequest(policy=policy, comment=comment,
                                      expected_version=version if expected_version is None else expected_version)
    _echo_json(_policy_json(_call(stub.SetPolicy, req, md)))


@policy_app.command("delete")
def policy_delete(workload_class: str = typer.Argument(...),
                  expected_version: int | None = typer.Option(None, "--expected-version"),
                  comment: str = typer.Option(""),
                  router: str | None = _ROUTER_OPT, token: str | None = _TOKEN_OPT) -> None:
    """Remove a class's policy (it then falls under `default`)."""
    from specserve.v1 import policy_pb2

    stub, md = _admin(router, token)
    req = policy_pb2.DeletePolicyRequest(workload_class=workload_class, comment=comment)
    if expected_version is not None:
        req.expected_version = expected_version
    resp = _call(stub.DeletePolicy, req, md)
    typer.echo("deleted" if resp.deleted else f"no policy for {workload_class!r}")


@policy_app.command("history")
def policy_history(workload_class: str = typer.Argument("", help="Only this class (default: all)."),
                   limit: int = typer.Option(20, help="Newest entries to show."),
                   router: str | None = _ROUTER_OPT, token: str | None = _TOKEN_OPT) -> None:
    """The audit log, newest first: who changed what, when, old -> new."""
    import datetime

    from specserve.v1 import policy_pb2

    stub, md = _admin(router, token)
    resp = _call(stub.ListAudit, policy_pb2.ListAuditRequest(workload_class=workload_class, limit=limit), md)
    for e in resp.entries:
        when = datetime.datetime.fromtimestamp(e.at, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
        old = f"v{e.old.version}" if e.HasField("old") else "-"
        new = f"v{e.new.version}" if e.HasField("new") else "-"
        changes = _diff(_policy_json(e.old) if e.HasField("old") else {},
                        _policy_json(e.new) if e.HasField("new") else {})
        typer.echo(f"{when}Z  {e.action:<6} {e.workload_class:<12} {old} -> {new}  by {e.who} ({e.peer})"
                   f"{'  ' + e.comment if e.comment else ''}")
        for line in changes:
            typer.echo(f"    {line}")


def _diff(old: dict, new: dict) -> list[str]:
    skip = {"version", "updated_by", "updated_at", "workload_class"}
    return [f"{k}: {old.get(k, '-')} -> {new.get(k, '-')}" for k in sorted(set(old) | set(new))
            if k not in skip and old.get(k) != new.get(k)]


if __name__ == "__main__":
    app()
