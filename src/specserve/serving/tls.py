"""TLS on every gRPC hop (ADR 0011). A service given a TLS directory finds in it the names
cert-manager writes into a Secret: `tls.crt`, `tls.key` (its certificate and key) and
`ca.crt` (the CA that signs every specserve certificate).

- The router serves clients over server TLS (clients need `ca.crt`, no certificate).
- Draft and target workers require a client certificate signed by `ca.crt` (mutual TLS):
  only a router holding one can call them.
- The router calls the workers with its own certificate as the client certificate.

`make_local_ca` writes a CA and one certificate for 127.0.0.1/localhost (server and client
use) for `specserve up --tls` and the tests, with the openssl command-line tool.
"""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsFiles:
    cert: bytes
    key: bytes
    ca: bytes
    server_name: str = ""  # check the peers' certificates against this name, not their address

    @classmethod
    def load(cls, directory: str | Path, server_name: str = "") -> TlsFiles:
        d = Path(directory)
        missing = [n for n in ("tls.crt", "tls.key", "ca.crt") if not (d / n).is_file()]
        if missing:
            raise SystemExit(f"TLS directory {d} lacks {', '.join(missing)} (cert-manager names)")
        return cls((d / "tls.crt").read_bytes(), (d / "tls.key").read_bytes(), (d / "ca.crt").read_bytes(),
                   server_name)

    def server(self, require_client_cert: bool) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=require_client_cert)

    def client(self) -> grpc.ChannelCredentials:
        """For calling a worker: trust the CA, present our certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def load(directory: str, server_name: str = "") -> TlsFiles | None:
    return TlsFiles.load(directory, server_name) if directory else None


def aio_channel(address: str, tls: TlsFiles | None, options: list) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    if tls.server_name:
        options = [*options, ("grpc.ssl_target_name_override", tls.server_name)]
    return grpc.aio.secure_channel(address, tls.client(), options=options)


def channel(address: str, tls_dir: str = "") -> grpc.Channel:
    """A blocking client channel: TLS trusting `tls_dir`/ca.crt (with its certificate as the
    client certificate, so it can reach workers too), or plain without a directory."""
    if not tls_dir:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, TlsFiles.load(tls_dir).client())


def make_local_ca(directory: str | Path, days: int = 30) -> Path:
    """A throw-away CA and one certificate for 127.0.0.1 and localhost, in cert-manager's
    names, for the local stack. Returns the directory."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if all((d / n).is_file() for n in ("tls.crt", "tls.key", "ca.crt")):
        return d
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        ext = t / "ext.cnf"
        ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
                       "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n")
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days",
                 str(days), "-subj", "/CN=specserve local CA", "-keyout", t / "ca.key", "-out", d / "ca.crt")
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj",
                 "/CN=specserve", "-keyout", d / "tls.key", "-out", t / "tls.csr")
        _openssl("x509", "-req", "-in", t / "tls.csr", "-CA", d / "ca.crt", "-CAkey", t / "ca.key",
                 "-CAcreateserial", "-days", str(days), "-extfile", ext, "-out", d / "tls.crt")
    (d / "tls.key").chmod(0o600)
    return d


def _openssl(*args) -> None:
    try:
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)
    except FileNotFoundError as exc:
        raise SystemExit("`specserve up --tls` needs the openssl command-line tool") from exc
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"openssl {args[0]} failed: {exc.stderr.decode(errors='replace')}") from exc
