"""A private Prometheus for tests and local checks: its own port on 127.0.0.1, its own data
dir, scraping the given /metrics endpoints every `interval_s` and evaluating the given rules
as often; stopped by its PID. The machine's own Prometheus (a Debian package may start one
on 9090) is never touched."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


class PrometheusUnavailable(RuntimeError):
    pass


class QueryError(RuntimeError):
    """Prometheus refused a query (bad PromQL, unknown function): the message is its own."""


@dataclass
class LocalPrometheus:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:port
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; the `data` member, or QueryError with Prometheus's message."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as err:  # 400/422: the query is wrong
            body = json.load(err)
        if body.get("status") != "success":
            raise QueryError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query; the result vector (empty when no series matched)."""
        return self.api("query", query=expr)["result"]

    def alerts(self) -> list[dict]:
        return self.api("alerts")["alerts"]

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_prometheus(workdir: Path, targets: dict[str, str], rules: dict | None = None,
                     interval_s: float = 1.0, timeout_s: float = 60.0) -> LocalPrometheus:
    """Scrape `targets` (instance name -> host:port) into job `specserve`, the instance label
    being the name; evaluate `rules` (a rules document) if given."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise PrometheusUnavailable("no prometheus binary: `make prometheus-tools` (apt-get install prometheus)")
    workdir.mkdir(parents=True, exist_ok=True)
    interval = f"{int(interval_s * 1000)}ms"
    config: dict[str, Any] = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
        "scrape_configs": [{"job_name": "specserve", "static_configs": [
            {"targets": [address], "labels": {"instance": name}} for name, address in targets.items()]}],
    }
    if rules is not None:
        (workdir / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
        config["rule_files"] = [str(workdir / "rules.yaml")]
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    port = _free_port()
    log = workdir / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    prom = LocalPrometheus(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PrometheusUnavailable(f"prometheus exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as resp:
                if resp.status == 200:
                    return prom
        except OSError:
            pass
        time.sleep(0.2)
    prom.stop()
    raise PrometheusUnavailable(f"prometheus not ready in {timeout_s} s: {log.read_text()[-2000:]}")


def main() -> None:
    """`python -m specserve.tooling.prometheus_server [RUN_DIR]`: a Prometheus on the stack that
    `make run` started (its metrics ports are in RUN_DIR/stack.json), with the production rules
    of deploy/prometheus/; Ctrl-C stops it."""
    import sys

    from specserve.tooling import promrules

    run_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "run")
    targets = json.loads((run_dir / "stack.json").read_text())["metrics"]
    prom = start_prometheus(run_dir / "prometheus", targets, promrules.load(), interval_s=5.0)
    print(f"Prometheus on {prom.url} scraping {', '.join(f'{n}={a}' for n, a in targets.items())}; "
          f"Ctrl-C stops it")
    try:
        prom.proc.wait()
    except KeyboardInterrupt:
        prom.stop()


if __name__ == "__main__":
    main()
