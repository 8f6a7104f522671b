"""`specserve adapter`: LoRA adapters on the fleet's targets, through a router's AdapterAdmin (ADR 0029)."""

from __future__ import annotations

import typer

from specserve.tooling.cli.app import app
from specserve.tooling.cli.policy import _ROUTER_OPT, _TOKEN_OPT, _admin, _call, _echo_json, _policy_json

adapter_app = typer.Typer(no_args_is_help=True, help="LoRA adapters on the targets (AdapterAdmin).")
app.add_typer(adapter_app, name="adapter")


def _stub(router: str | None, token: str | None):
    from specserve.v1 import adapter_pb2_grpc

    return _admin(router, token, stub=adapter_pb2_grpc.AdapterAdminStub)


def _show(resp) -> None:
    _echo_json(_policy_json(resp))


@adapter_app.command("load")
def adapter_load(name: str = typer.Argument(..., help="The adapter's name: requests name it (OpenAI `model`)."),
                 path: str = typer.Argument(..., help="Its PEFT directory, as the targets see it."),
                 router: str | None = _ROUTER_OPT, token: str | None = _TOKEN_OPT) -> None:
    """Load an adapter on every live target (and on those started later); a refusal says why."""
    from specserve.v1 import target_pb2

    stub, md = _stub(router, token)
    _show(_call(stub.LoadAdapter, target_pb2.LoadAdapterRequest(name=name, path=path), md))


@adapter_app.command("unload")
def adapter_unload(name: str = typer.Argument(...), router: str | None = _ROUTER_OPT,
                   token: str | None = _TOKEN_OPT) -> None:
    """Unload an adapter: new requests naming it get NOT_FOUND; running ones finish on it."""
    from specserve.v1 import target_pb2

    stub, md = _stub(router, token)
    _show(_call(stub.UnloadAdapter, target_pb2.UnloadAdapterRequest(name=name), md))


@adapter_app.command("list")
def adapter_list(router: str | None = _ROUTER_OPT, token: str | None = _TOKEN_OPT) -> None:
    """The adapters each target holds (rank, running sessions) and the fleet's registered ones."""
    from specserve.v1 import target_pb2

    stub, md = _stub(router, token)
    _show(_call(stub.ListAdapters, target_pb2.ListAdaptersRequest(), md))
