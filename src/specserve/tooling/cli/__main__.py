"""`python -m specserve.tooling.cli`."""

from specserve.tooling.cli import app

app()
