"""The `specserve` command line, one module per command group:

- `base`: the root app, the local stack's run directory, the channel to a router;
- `models`: `specserve models build`;
- `stack`: `specserve up | down`;
- `demo`: `specserve demo | demo-local`;
- `generate`: `specserve generate | trace`;
- `policy`: `specserve policy list | get | set | delete | history`;
- `adapter`: `specserve adapter load | list | unload` (LoRA adapters, ADR 0029)."""

from specserve.tooling.cli import adapter, demo, generate, models, policy, stack  # noqa: F401 - they register their commands
from specserve.tooling.cli.app import app

__all__ = ["app"]
