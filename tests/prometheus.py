"""A real Prometheus server (Debian's prometheus package) for the tests: a free loopback port, storage in the
test's folder, fast scrape and rule intervals, and a small client for its HTTP API."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.cluster import wait_for
from tests.ports import free_port

PROMETHEUS = shutil.which("prometheus")


class Prometheus:
    def __init__(self, workdir: Path, targets: dict[str, Sequence[str]], rule_files: Sequence[Path] = (),
                 interval: str = "1s") -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(addresses)}]}
                               for job, addresses in targets.items()],
        }
        (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self._log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 (the server writes to it)
        assert PROMETHEUS is not None, "prometheus is not installed"
        self._proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self._log, stderr=subprocess.STDOUT)
        wait_for(self._ready, 60, "Prometheus to be ready", interval=0.2)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as response:
            doc = json.load(response)
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.get("/api/v1/query", query=expr)["result"]
        return result

    def firing(self) -> list[dict[str, Any]]:
        return [a for a in self.get("/api/v1/alerts")["alerts"] if a["state"] == "firing"]

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(20)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()
