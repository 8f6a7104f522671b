"""`specserve generate` (one request to a running router) and `specserve trace` (one
request's rounds as a waterfall)."""

from __future__ import annotations

from pathlib import Path

import typer

from specserve.tooling.cli.app import RUN_DIR, app, router_address, router_channel


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
    adapter: str = typer.Option("", help="A LoRA adapter to run on (ADR 0029; empty: the base model)."),
    router: str | None = typer.Option(None, help="host:port of a router (default: the local stack)."),
    run_dir: Path = typer.Option(RUN_DIR),
) -> None:
    """Send one request to a running router."""
    import grpc

    from specserve.v1 import generation_pb2, generation_pb2_grpc

    req = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                         top_k=top_k, workload_class=workload_class, draft_pool=pool,
                                         adapter=adapter)
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
    with router_channel(router_address(router, run_dir), run_dir) as channel:
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
