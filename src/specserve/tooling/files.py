"""Files that hold secrets (the Redis password inside a URL, the admin token)."""

from __future__ import annotations

import os
from pathlib import Path


def write_private(path: Path | str, text: str) -> None:
    """Write `text` to `path`, readable by its owner only (0600), whatever the umask and
    whether or not the file existed: the content goes to a fresh 0600 file that replaces
    the old one, so the secret is never readable by others, not even for a moment."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            os.fchmod(f.fileno(), 0o600)  # O_CREAT's mode is masked by the umask; an old tmp kept its own
            f.write(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
