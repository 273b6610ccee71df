"""The report as a picture, from a real job: three local agents run the counter trainer through a worker's
SIGKILL, a node's loss (its agent SIGKILLed and started again), a drain, and a second failure of the same node's
worker that quarantines it; then ``tfelastic report --html`` and ``--tensorboard`` draw it, and a headless Chromium
takes the screenshot that docs/goodput.md shows.

    python -m bench.report_page [--png docs/report-timeline.png] [--keep DIR]

Prints how long each output took and how large it is. Traffic stays on loopback; every wait is bounded.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.netutil import free_port

from tests.browser import screenshot
from tests.cluster import COUNTER, Cluster, kill, members

# --last-call 3: a, b and c in the first round; --nodes 1:3 (below): c's quarantine leaves a alone
FLAGS = ["--stop-grace", "2", "--last-call", "3", "--settle", "1", "--quarantine-after", "2",
         "--quarantine-cooldown", "600", "--max-restarts", "20"]


def run_job(workdir: Path) -> Cluster:
    cluster = Cluster(workdir, Endpoint("127.0.0.1", free_port()), [sys.executable, COUNTER], nodes="1:3",
                      extra_args=FLAGS, env={"COUNTER_STEPS": "1000000", "COUNTER_STEP_SECONDS": "0.05"},
                      warm_start=False)
    cluster.start_host("a")
    cluster.start("b")
    cluster.start("c")
    doc = cluster.wait_running(1, 3, step=100, timeout=60)  # 5 s of steps between the events, for the picture
    kill(_member(doc, "c")["worker_pid"])  # a fault: c's trainer SIGKILLed
    doc = cluster.wait_running(2, 3, step=_step(doc) + 100, timeout=60)
    next(agent for agent in cluster.agents if agent.node_id == "b").proc.kill()  # b's node lost
    doc = cluster.wait_running(3, 2, step=_step(doc) + 50, timeout=60)
    cluster.start("b")  # and back, as systemd would start its agent again
    doc = cluster.wait_running(4, 3, step=_step(doc) + 100, timeout=60)
    subprocess.run([sys.executable, "-m", "tfelastic.daemon", "drain", "b", "--reason", "maintenance",
                    "--rendezvous", str(cluster.endpoint)], check=True, capture_output=True, timeout=60)
    doc = cluster.wait_running(5, 2, step=_step(doc) + 100, timeout=60)
    kill(_member(doc, "c")["worker_pid"])  # c's second first failure in the window: quarantined
    cluster.wait_running(6, 1, step=_step(doc) + 100, timeout=60)
    return cluster


def _member(doc: dict[str, Any], node_id: str) -> dict[str, Any]:
    return next(n for n in members(doc) if n["node_id"] == node_id)


def _step(doc: dict[str, Any]) -> int:
    return max(n["step"] or 0 for n in members(doc))


def report(cluster: Cluster, *flags: str) -> float:
    began = time.monotonic()
    subprocess.run([sys.executable, "-m", "tfelastic.daemon", "report", "--rendezvous", str(cluster.endpoint),
                    *flags], check=True, capture_output=True, timeout=60)
    return time.monotonic() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--png", type=Path, default=Path("docs/report-timeline.png"))
    parser.add_argument("--keep", type=Path, help="keep the page and the scalars here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tfelastic-report-page-") as tmp:
        workdir = Path(tmp)
        cluster = run_job(workdir)
        try:
            page, scalars = workdir / "report.html", workdir / "tensorboard"
            html_seconds = report(cluster, "--html", str(page))
            tensorboard_seconds = report(cluster, "--tensorboard", str(scalars))
        finally:
            cluster.stop()
        began = time.monotonic()
        screenshot(page, args.png, width=1280, height=760)
        shot_seconds = time.monotonic() - began
        print(f"report --html: {html_seconds:.2f} s, {page.stat().st_size / 1024:.0f} KiB")
        print(f"report --tensorboard: {tensorboard_seconds:.2f} s, "
              f"{sum(f.stat().st_size for f in scalars.iterdir()) / 1024:.1f} KiB")
        print(f"screenshot: {shot_seconds:.2f} s, {args.png} ({args.png.stat().st_size / 1024:.0f} KiB)")
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(page, args.keep / page.name)
            shutil.copytree(scalars, args.keep / scalars.name, dirs_exist_ok=True)


if __name__ == "__main__":
    main()
