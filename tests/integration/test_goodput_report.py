"""The goodput ledger end to end: real agents, a killed worker, `tfelastic report` from the coordinator while the
job runs, and from etcd after a job on etcd ended (no coordinator leads it any more)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tfelastic.daemon.report_page import COLOURS, TIMELINE_BACKGROUND

from bench.ledger_check import LEDGER_TRAINER, trainer_fresh_seconds, trainer_redone
from tests.browser import BROWSER, colours_within, dom, png_size_and_colours, screenshot
from tests.cluster import COUNTER, kill, members, scrape, wait_for
from tests.conftest import ClusterFactory
from tests.etcd import EtcdCluster
from tests.unit.test_report_tensorboard import scalars as tensorboard_scalars

pytestmark = pytest.mark.integration

TRAINER = [sys.executable, COUNTER]
FAST = ["--stop-grace", "2", "--last-call", "0.5", "--settle", "1"]


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    folder = tmp_path / "etcd"
    folder.mkdir()
    cluster = EtcdCluster(folder).start()
    yield cluster
    cluster.stop()


def report(rendezvous: str, *extra: str) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-m", "tfelastic.daemon", "report", "--json", "--rendezvous",
                             rendezvous, *extra], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


@pytest.mark.skipif(BROWSER is None, reason="chromium-headless-shell is not installed (tests/run.sh installs it)")
def test_a_running_jobs_report_metrics_page_and_scalars_account_for_killed_workers(
        make_cluster: ClusterFactory, tmp_path: Path) -> None:
    cluster = make_cluster(TRAINER, extra_args=FAST, env={"COUNTER_STEPS": "100000"})
    cluster.start_host("a")
    cluster.start("b")
    doc = cluster.wait_running(1, 2, step=20)
    kill(members(doc)[0]["worker_pid"])  # the chief
    doc = cluster.wait_running(2, 2, step=doc["nodes"][0]["step"] + 20, timeout=60)
    ledger = report(str(cluster.endpoint))
    assert ledger["source"] == "coordinator"
    first, second = ledger["generations"]
    assert first["ended"].startswith("worker_exit: a: trainer was killed by SIGKILL"), first
    assert (first["restored_step"], second["ended"]) == (1, "")  # its first report after start-up
    assert second["restored_step"] is not None and second["restored_step"] > 0  # from the counter's step file
    goodput = ledger["goodput"]
    assert 0.0 < goodput["ratio"] < 1.0
    assert goodput["seconds"]["startup"] > 0 and goodput["seconds"]["training"] > 0
    assert abs(sum(goodput["seconds"].values()) - goodput["wall_seconds"]) < 1e-2
    _, samples = scrape(f"http://{cluster.agents[0].metrics_address()}/metrics")
    metric = {c: samples.get(("tfelastic_job_seconds_total", (("category", c),))) for c in goodput["seconds"]}
    assert all(value is not None for value in metric.values()), metric
    assert metric["training"] >= goodput["seconds"]["training"] * 0.5  # scraped a moment apart
    kill(members(doc)[1]["worker_pid"])  # a second fault: three generations for the page
    cluster.wait_running(3, 2, step=doc["nodes"][0]["step"] + 10, timeout=60)
    page, scalars_dir = tmp_path / "report.html", tmp_path / "tensorboard"
    drawn = subprocess.run([sys.executable, "-m", "tfelastic.daemon", "report", "--rendezvous", str(cluster.endpoint),
                            "--html", str(page), "--tensorboard", str(scalars_dir)],
                           capture_output=True, text=True, timeout=60)
    assert drawn.returncode == 0 and drawn.stdout == "", drawn
    assert f"wrote {page}" in drawn.stderr and "wrote TensorBoard scalars" in drawn.stderr
    ended = [g for g in report(str(cluster.endpoint))["generations"] if g["ended"]]
    cluster.stop()
    check_page_in_a_browser(page, tmp_path / "report.png", ended, running=True)
    goodput_points = tensorboard_scalars(scalars_dir)["tfelastic/goodput"]
    assert len(goodput_points) == 3 and all(0.0 < value < 1.0 for _, _, value in goodput_points), goodput_points
    assert [step for _, step, _ in goodput_points] == sorted(step for _, step, _ in goodput_points)


def check_page_in_a_browser(page: Path, png: Path, ended: list[dict[str, Any]], *, running: bool) -> None:
    """The page as Chromium parsed and painted it: every generation drawn, every restart marked, every category of
    the generations that ended drawn, and the categories' colours on the screen."""
    parsed = dom(page)
    drawn = {g for first, last in re.findall(r'data-generation="(\d+)" data-last-generation="(\d+)"', parsed)
             for g in range(int(first), int(last) + 1)}
    assert drawn == set(range(1, len(ended) + 1 + running)), drawn
    restarts = dict(re.findall(r'data-restart="(\d+)" data-kind="(\w+)"', parsed))
    assert restarts == {str(g["generation"]): "end" if g["ended"].startswith(("succeeded", "failed")) else "fault"
                        for g in ended}, restarts
    categories = set(re.findall(r'data-category="(\w+)"', parsed))
    assert {c for g in ended for c, seconds in g["seconds"].items() if seconds > 0} <= categories, categories
    assert ("still running" in parsed) == running
    screenshot(page, png)
    size, _ = png_size_and_colours(png)
    assert size == (1280, 1400)
    drawn_colours = colours_within(png, rgb(TIMELINE_BACKGROUND))  # the timeline alone: no legend, no table
    # Training fills most of three lanes and the job's row (about 1000 px by 16 px each); each start-up a sliver.
    assert drawn_colours.get(rgb(COLOURS["training"]), 0) > 20_000, "the lanes are not painted"
    assert drawn_colours.get(rgb(COLOURS["startup"]), 0) > 100, "no start-up is painted"


def rgb(colour: str) -> tuple[int, int, int]:
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


def test_steps_redone_count_the_steps_a_killed_chief_made_after_its_last_report(
        make_cluster: ClusterFactory, tmp_path: Path) -> None:
    """The chief reports once a second, steps 50 times a second, and is SIGKILLed with steps its agent never heard
    of: the step file makes the coordinator's count of redone steps the trainer's own."""
    events = tmp_path / "ledger-events.jsonl"
    began = time.time()
    cluster = make_cluster([sys.executable, LEDGER_TRAINER], extra_args=FAST, env={
        "LEDGER_EVENTS": str(events), "LEDGER_STEPS": "100000", "LEDGER_STEP_SECONDS": "0.02",
        "LEDGER_REPORT_INTERVAL": "1.0", "LEDGER_SAVE_EVERY": "100000"})
    cluster.start_host("a")
    cluster.start("b")
    doc = cluster.wait_running(1, 2, step=30)
    chief = members(doc)[0]
    reached = tmp_path / f"{events.name}.reached-1-0"

    def ahead_of_its_report() -> bool:
        status = cluster.status()
        step = members(status)[0]["step"] if status else None
        return step is not None and int(reached.read_text()) >= step + 10

    wait_for(ahead_of_its_report, 30, "the chief 10 steps past its last report")
    kill(chief["worker_pid"])
    doc = cluster.wait_running(2, 2, step=5, timeout=60)
    furthest = int(reached.read_text())
    assert doc["goodput"]["steps_redone"] == trainer_redone(events) == furthest, doc["goodput"]  # restored 0
    # The chief's own clock, which the chaos soak sets beside the ledger: every new step took its 0.02 s at least
    # (the first has no previous end; the kill may land between the step's mark and its time).
    assert 0.02 * (furthest - 2) <= trainer_fresh_seconds(events) < time.time() - began
    cluster.stop()


def test_the_report_of_an_ended_job_on_etcd_comes_from_etcd(make_cluster: ClusterFactory, etcd: EtcdCluster,
                                                            tmp_path: Path) -> None:
    cluster = make_cluster(TRAINER, extra_args=FAST, env={"COUNTER_STEPS": "80"}, etcd=etcd.url)
    cluster.start("a")
    cluster.start("b")
    doc = cluster.wait_running(1, 2, step=10)
    kill(members(doc)[1]["worker_pid"])
    assert cluster.wait_all(90) == [0, 0], cluster.logs()
    ledger = report(etcd.url)
    assert ledger["source"] == "etcd" and ledger["state"] == "succeeded"
    assert [g["generation"] for g in ledger["generations"]] == [1, 2]
    assert ledger["generations"][-1]["ended"] == "succeeded: every trainer of generation 2 exited 0"
    assert 0.0 < ledger["goodput"]["ratio"] < 1.0
    text = subprocess.run([sys.executable, "-m", "tfelastic.daemon", "report", "--rendezvous", etcd.url],
                          capture_output=True, text=True, timeout=60)
    assert text.returncode == 0 and "goodput " in text.stdout and "  training " in text.stdout, text
    page = subprocess.run([sys.executable, "-m", "tfelastic.daemon", "report", "--rendezvous", etcd.url, "--html",
                           "-", "--tensorboard", str(tmp_path / "tensorboard")], capture_output=True, text=True,
                          timeout=60)
    assert page.returncode == 0 and page.stdout.startswith("<!DOCTYPE html>"), page.stderr
    assert [value for _, _, value in tensorboard_scalars(tmp_path / "tensorboard")["tfelastic/restarts/worker_exit"]
            ] == [1.0, 1.0]
    assert re.findall(r'data-restart="(\d+)" data-kind="(\w+)"', page.stdout) == [("1", "fault"), ("2", "end")]
    assert "still running" not in page.stdout and "succeeded: every trainer of generation 2 exited 0" in page.stdout


def test_the_time_after_the_chiefs_training_is_other(make_cluster: ClusterFactory, etcd: EtcdCluster,
                                                     tmp_path: Path) -> None:
    """The trainers report their training done, then spend 4 s before they exit (an evaluation, an export, the
    teardown of an input pipeline): the ledger books those seconds as other, not as training."""
    events = tmp_path / "ledger-events.jsonl"
    cluster = make_cluster([sys.executable, LEDGER_TRAINER], extra_args=FAST, etcd=etcd.url, env={
        "LEDGER_EVENTS": str(events), "LEDGER_STEPS": "40", "LEDGER_STEP_SECONDS": "0.02",
        "LEDGER_AFTER_SECONDS": "4"})
    cluster.start("a")
    cluster.start("b")
    assert cluster.wait_all(90) == [0, 0], cluster.logs()
    seconds = report(etcd.url)["goodput"]["seconds"]
    assert seconds["other"] >= 3.5, seconds  # the done report read at once, both exits 4 s later
    assert seconds["training"] <= trainer_fresh_seconds(events) + 1.0, seconds
