"""What the benchmark scripts share: their common arguments. The scripts run from the
repository root as `python bench/<name>.py`, so this directory is on their import path."""

from __future__ import annotations

import argparse


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A script's parser with the arguments every benchmark takes: --models (the directory
    holding the shipped pair) and --out (where the JSON and PNG go)."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    ap.add_argument("--models", default="models")
    ap.add_argument("--out", default="bench/results")
    return ap
