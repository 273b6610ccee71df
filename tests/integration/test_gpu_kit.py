"""The GPU kit's dry mode (bench/gpu_kit.py --dry): the whole kit, here, against the FAKE NVML of
tests/nvml_fake.py (tests/gpu_kit_dry.py) and a CPU stand-in trainer, so that it cannot rot before a GPU runs it.

With real agents it also checks the GPU release check end to end: the fake GPU lists a stand-in trainer for a
second after it is gone, and without the agents' wait the kit's kill_and_relaunch fails (the next generation
starts while the killed trainer's memory is still listed, and no agent measured a wait)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tfelastic.daemon.agent.nodecheck import NO_TENSORFLOW

pytestmark = pytest.mark.integration

KIT = Path(__file__).resolve().parents[2] / "bench" / "gpu_kit.py"
CHECKS = {"two_agents", "metrics_vs_nvidia_smi", "agent_metrics", "health", "standby_holds_no_gpu", "node_check",
          "kill_and_relaunch", "no_leftovers"}


def test_the_kit_runs_dry_and_every_check_passes(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(KIT), "--dry", "--out", str(tmp_path / "out"), "--work",
                           str(tmp_path / "work")], capture_output=True, text=True, timeout=240)
    summary = json.loads(done.stdout)  # one JSON document, and nothing else, on stdout
    assert done.returncode == 0, (json.dumps(summary, indent=1)[-6000:], done.stderr[-3000:])
    assert summary["ok"] and summary["failed"] == [] and summary["mode"] == "dry: FAKE NVML, no GPU"
    checks = summary["checks"]
    assert set(checks) == CHECKS
    assert summary["machine"]["gpus"]["0"]["name"] == "Fake GPU of tests/nvml_fake.py (dry run)"
    relaunch = checks["kill_and_relaunch"]
    assert relaunch["relaunch_after_release"]
    assert relaunch["kill_to_next_generation_start_s"] >= max(relaunch["kill_to_memory_free_s"].values()) - 0.02
    assert all(w["count"] >= 1 and w["sum_s"] > 0 for w in relaunch["agents_release_wait"].values())
    assert all(launches["warm"] == 1 for launches in relaunch["launches"].values())  # through the standby
    standby = checks["standby_holds_no_gpu"]
    assert len(standby["standby_pids"]) == 2 and standby["standbys_listed_by_nvml"] == []
    assert checks["node_check"]["nvml_health"] == "passed" and checks["node_check"]["matmul"] == NO_TENSORFLOW
    assert all(field["ok"] for field in checks["metrics_vs_nvidia_smi"]["gpus"]["0"].values())
    assert [n for n in summary["not_checked"] if n.startswith(("TensorFlow on a GPU", "NCCL", "the hardened"))]
    assert json.loads((tmp_path / "out" / "gpu-kit-summary.json").read_text()) == summary
    assert {p.name for p in (tmp_path / "out").glob("agent-*.log")} == {"agent-a.log", "agent-b.log"}
