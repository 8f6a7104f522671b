"""The `specserve` command line's root app and what its command groups share: the local
stack's run directory and the channel to a router."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

if not sys.stdout.isatty():  # CI has no terminal: no progress bars from libraries either
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="specserve: distributed, lossless speculative decoding")
RUN_DIR = Path("run")


def router_channel(address: str, run_dir: Path):
    """A channel to the router: TLS with the local CA when `specserve up --tls` made one."""
    from specserve.serving.tls import channel

    path = run_dir / "router.tls"
    return channel(address, path.read_text().strip() if path.exists() else "")


def router_address(router: str | None, run_dir: Path) -> str:
    if router:
        return router
    path = run_dir / "router.address"
    if not path.exists():
        raise typer.BadParameter("no --router given and no local stack is running (run `specserve up`)")
    return path.read_text().strip()
