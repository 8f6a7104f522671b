"""`specserve up` and `specserve down`: the whole system on loopback, started and stopped by
PID (`specserve.tooling.stack` does the work)."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from specserve.config import LOCAL
from specserve.tooling.cli.app import RUN_DIR, app


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
    # every class may use every pool: the controller moves each to the pool that pays; the suffix
    # pool (ADR 0026) drafts up to K 32 where its matches are long, and `agent` is the demo's
    # repeat-heavy class (tooling/workloads.py)
    policies = {"code": {"draft_pool": "small", "draft_pools": ["ngram", "suffix"], "adaptive_k": True, "k_min": 1,
                         "k_max": 8},
                "chat": {"draft_pool": "small", "draft_pools": ["ngram", "suffix"], "k": 4},
                "extraction": {"draft_pool": "suffix", "draft_pools": ["ngram", "small"], "adaptive_k": True,
                               "k_min": 2, "k_max": 32},
                "agent": {"draft_pool": "suffix", "draft_pools": ["ngram", "small"], "adaptive_k": True, "k_min": 1,
                          "k_max": 32}}
    # draft-local: the pair's draft model inside the target (ADR 0025; on this CPU it drafts on the
    # engine's thread, the demo's table leaves it out: its drafts are `small`'s)
    pools = {"small": PoolSpec("draft", replicas=2), "ngram": PoolSpec("ngram", local=True),
             "suffix": PoolSpec("suffix", local=True), "draft-local": PoolSpec("draft", local=True)}
    if (pair / "eagle" / "config.json").exists():  # the pair's EAGLE head (ADR 0020): beside the target,
        pools["eagle-local"] = PoolSpec("eagle", local=True)
        pools["eagle"] = PoolSpec("eagle", replicas=1)  # and on a replica fed the target's features
    adapters = demo_adapters(pair, pools, policies)
    return StackSpec(pair_dir=str(pair.resolve()), run_dir=str(run_dir.resolve()),
                     pools=pools, adapters=adapters,
                     redis_url=os.environ.get("SPECSERVE_REDIS_URL", ""), http_port=http_port,
                     router_env={"SPECSERVE_ROUTER_ADMIN_TOKEN": token,
                                 "SPECSERVE_ROUTER_POLICIES": json.dumps(policies)})


def demo_adapters(pair: Path, pools: dict, policies: dict) -> dict[str, str]:
    """The pair's LoRA adapters (ADR 0029: `adapters/<name>/target`), loaded by the target; an
    adapter with a draft-side adapter (`draft/`) gets a pool of its own drafter (one replica of
    the draft with it merged), and its class's policy for it (`extraction@<name>`) drafts there."""
    from specserve.tooling.stack import PoolSpec

    out = {}
    for d in sorted((pair / "adapters").glob("*/target/adapter_config.json")):
        name = d.parent.parent.name
        out[name] = f"adapters/{name}/target"
        if (d.parent.parent / "draft" / "adapter_config.json").exists():
            pools[f"small-{name}"] = PoolSpec("draft", replicas=1, lora=f"adapters/{name}/draft")
            policies[f"extraction@{name}"] = {"draft_pool": f"small-{name}", "draft_pools": ["small", "suffix"],
                                              "adaptive_k": True, "k_min": 2, "k_max": 16}
    return out


@app.command("up")
def up(
    models: Path = typer.Option(Path("models"), help="The pair, or the directory holding specserve-demo-v1/."),
    run_dir: Path = typer.Option(RUN_DIR, help="Logs, ports and PIDs of the local stack."),
    tls: bool = typer.Option(False, "--tls", help="TLS on every hop (mTLS to workers), with a local CA in run/tls."),
    http_port: int = typer.Option(8000, "--http-port", help="The router's OpenAI-compatible HTTP API port "
                                  "(0 = a free one)."),
    redis_ha: bool = typer.Option(False, "--redis-ha", help="A Redis primary, a replica and three sentinels "
                                  "(ADR 0023) instead of one Redis; the services use its redis+sentinel:// address."),
    redis_cluster: bool = typer.Option(False, "--redis-cluster", help="A Redis Cluster of three masters with a "
                                       "replica each (ADR 0023); the services use its redis+cluster:// address."),
    tensor_parallel: int = typer.Option(1, "--tensor-parallel", help="The target split over this many ranks "
                                        "(1, 2, 4 or 8; ADR 0030): Ray actors in one placement group, gloo on "
                                        "the CPU, NCCL on GPUs."),
) -> None:
    """Start Redis (unless SPECSERVE_REDIS_URL is set), Ray + the target, the draft pools
    (small: 2 replicas, ngram, suffix, draft-local and eagle-local inside the target, eagle: 1 replica) and
    the router (gRPC, and the OpenAI HTTP API), all on loopback."""
    from specserve.serving.tls import make_local_ca
    from specserve.tooling.stack import Stack, StackError, down_from

    down_from(str(run_dir))  # a stale stack from an earlier `up` is stopped first
    spec = _stack_spec(models, run_dir, http_port)
    if redis_ha and redis_cluster:
        typer.echo("specserve up: --redis-ha and --redis-cluster are exclusive", err=True)
        raise typer.Exit(2)
    spec.redis_ha, spec.redis_cluster = redis_ha, redis_cluster
    if tensor_parallel not in (1, 2, 4, 8):
        typer.echo(f"specserve up: --tensor-parallel must be 1, 2, 4 or 8, got {tensor_parallel}", err=True)
        raise typer.Exit(2)
    spec.tensor_parallel = tensor_parallel
    if tensor_parallel > 1:  # every rank shares this machine's cores
        spec.target_threads = max(1, spec.target_threads // tensor_parallel)
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
        typer.echo(f"draft pool {pool}: {', '.join(addrs)}"
                   + (" (drafted inside the target)" if addrs[0] in LOCAL else ""))
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
