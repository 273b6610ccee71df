"""Warm start with real processes: a script cannot tell it from a cold start, exit codes are the same, the
standby holds nothing and dies with its agent, and a failed generation relaunches through it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from tfelastic.daemon.worker.process import WorkerProcess, WorkerSpec
from tfelastic.daemon.worker.warm import STANDBY_PATH, Standby, StandbyKey

from tests.cluster import COUNTER, processes_of, scrape, wait_for
from tests.conftest import ClusterFactory

pytestmark = pytest.mark.integration

PROBE = """
import json, os, sys
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(2)  # raises once TensorFlow's runtime is initialized
spec = globals().get("__spec__")
print(json.dumps({
    "name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
    "package": __package__, "spec": spec.name if spec else None, "executable": sys.executable,
    "env": dict(os.environ), "path": sys.path, "orig_argv": sys.orig_argv,
    "main_is_me": sys.modules["__main__"].__dict__ is globals(),
}), flush=True)
sys.exit(int(os.environ.get("EXIT_WITH", "0")))
"""

GENERATION_ENV = {"TF_CONFIG": '{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}',
                  "TFELASTIC_RANK": "0", "TFELASTIC_WORLD_SIZE": "1", "TFELASTIC_GENERATION": "4",
                  "TFELASTIC_RESTART_COUNT": "3", "TFELASTIC_BACKUP_DIR": "/nowhere", "MARK": "x"}


# What importing TensorFlow 2.21 sets in the environment: a cold start has them after its import, and so must a
# warm one (whose import came before the launch's environment). Left out, so that the test always sees it.
SET_BY_TF_IMPORT = ("TF2_BEHAVIOR", "TPU_ML_PLATFORM", "TPU_ML_PLATFORM_VERSION", "ENABLE_RUNTIME_UPTIME_TELEMETRY",
                    "HDF5_PLUGIN_PATH")


def spec_for(command: tuple[str, ...], cwd: Path, **env: str) -> WorkerSpec:
    full = {k: v for k, v in os.environ.items()
            if not k.startswith("TFELASTIC_") and k != "TF_CONFIG" and k not in SET_BY_TF_IMPORT}
    full.update(GENERATION_ENV, TF_CPP_MIN_LOG_LEVEL="3", TF_USE_LEGACY_KERAS="1", PYTHONUNBUFFERED="1", **env)
    return WorkerSpec(command, full, str(cwd), "[rank 0]", 1.0)


async def run_cold(spec: WorkerSpec) -> tuple[int, list[str]]:
    worker = await WorkerProcess.start(spec)
    code = await worker.wait()
    return code, list(worker.tail)


async def run_warm(spec: WorkerSpec) -> tuple[int, list[str]]:
    key = StandbyKey.of(spec)
    assert key is not None
    standby = await Standby.start(key, spec)
    await wait_ready(standby)
    worker = await standby.activate(spec)
    code = await worker.wait()
    return code, list(worker.tail)


async def wait_ready(standby: Standby, timeout: float = 120.0) -> None:
    async def ready() -> None:
        while standby.ready_after is None:
            assert standby.alive(), list(standby.worker.tail)
            await asyncio.sleep(0.05)

    await asyncio.wait_for(ready(), timeout)


def probe_output(lines: list[str]) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(next(line for line in lines if line.startswith("{")))
    return result


@pytest.fixture
def probe_dir(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "probe.py").write_text(PROBE)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "probe.py").write_text(PROBE)
    return tmp_path


@pytest.mark.tensorflow
@pytest.mark.parametrize("command", [("scripts/probe.py", "--flag", "value"), ("-m", "pkg.probe", "--flag")],
                         ids=["script", "module"])
def test_a_script_cannot_tell_a_warm_start_from_a_cold_one(probe_dir: Path, command: tuple[str, ...]) -> None:
    spec = spec_for((sys.executable, *command), probe_dir)
    cold_code, cold_lines = asyncio.run(run_cold(spec))
    warm_code, warm_lines = asyncio.run(run_warm(spec))
    assert cold_code == warm_code == 0, (cold_lines, warm_lines)
    cold, warm = probe_output(cold_lines), probe_output(warm_lines)
    assert warm == cold
    assert warm["name"] == "__main__" and warm["main_is_me"] is True
    assert {k: warm["env"][k] for k in GENERATION_ENV} == GENERATION_ENV  # the generation's values, set at launch
    assert warm["cwd"] == str(probe_dir)


@pytest.mark.parametrize(("code", "expected"), [
    ("import sys; sys.exit(7)", 7),
    ("raise ValueError('bad batch')", 1),
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM),
    ("pass", 0),
])
def test_exit_codes_and_signals_are_those_of_a_cold_start(tmp_path: Path, code: str, expected: int) -> None:
    (tmp_path / "t.py").write_text(code + "\n")
    spec = spec_for((sys.executable, "t.py"), tmp_path)
    cold, warm = asyncio.run(run_cold(spec)), asyncio.run(run_warm(spec))
    assert cold[0] == warm[0] == expected, (cold, warm)
    if expected == 1:
        assert warm[1][-1] == cold[1][-1] == "ValueError: bad batch"


def test_a_standby_holds_no_port_waits_without_the_generations_values_and_retires(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("pass\n")
    spec = spec_for((sys.executable, "t.py"), tmp_path)

    async def scenario() -> tuple[list[Any], dict[str, str], int, bool]:
        key = StandbyKey.of(spec)
        assert key is not None
        standby = await Standby.start(key, spec)
        await wait_ready(standby)
        interpreter = psutil.Process(standby.worker.trainer_pid())
        held = interpreter.net_connections(kind="all")
        environ = interpreter.environ()
        memory = standby.memory_bytes()
        await standby.retire()
        return held, environ, memory, interpreter.is_running()

    held, environ, memory, running = asyncio.run(scenario())
    assert held == []
    assert not set(environ) & set(GENERATION_ENV) - {"TFELASTIC_BACKUP_DIR", "MARK"}
    assert memory > 50 << 20  # an interpreter with TensorFlow imported
    assert not running


NICED = """
import json, os
print(json.dumps(sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")})))
"""


@pytest.mark.tensorflow
def test_a_standby_imports_at_a_lower_priority_and_its_trainer_runs_at_the_usual_one(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text(NICED)
    spec = spec_for((sys.executable, "t.py"), tmp_path)
    usual = os.getpriority(os.PRIO_PROCESS, 0)

    async def scenario() -> tuple[set[int], int, list[str]]:
        key = StandbyKey.of(spec)
        assert key is not None
        standby = await Standby.start(key, spec, nice=10)
        await wait_ready(standby)
        interpreter = psutil.Process(standby.worker.trainer_pid())
        waiting = {psutil.Process(t.id).nice() for t in interpreter.threads()}
        worker = await standby.activate(spec)
        return waiting, await worker.wait(), list(worker.tail)

    waiting, code, lines = asyncio.run(scenario())
    assert waiting == {usual + 10}, waiting  # every thread the import started, too
    assert code == 0, lines
    assert json.loads(lines[-1]) == [usual]  # every thread of the trainer


AGENT_FLAGS = ["--stop-grace", "2", "--last-call", "0.5", "--settle", "1", "--restart-backoff", "0"]


def standby_ready(address: str) -> bool:
    return scrape(f"http://{address}/metrics")[1].get(("tfelastic_standby_ready", ())) == 1.0


def launches(address: str) -> dict[str, float]:
    samples = scrape(f"http://{address}/metrics")[1]
    return {start: samples.get(("tfelastic_worker_launches_total", (("start", start),)), 0.0)
            for start in ("warm", "cold")}


def test_a_failed_generation_relaunches_through_the_standby(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    cluster = make_cluster([sys.executable, COUNTER], nodes="1", extra_args=AGENT_FLAGS, warm_start=True,
                           env={"COUNTER_STEPS": "100000", "COUNTER_STEP_SECONDS": "0.05"})
    agent = cluster.start("a")
    address = agent.metrics_address()
    wait_for(lambda: standby_ready(address), 120, "the standby interpreter ready")
    first = cluster.wait_running(1, 1, step=1)["nodes"][0]["worker_pid"]
    os.kill(first, signal.SIGKILL)
    cluster.wait_running(2, 1, step=1)
    assert launches(address) == {"warm": 1.0, "cold": 1.0}
    assert "launched through the standby interpreter" in agent.log()
    events = [e for e in cluster.events() if e["event"] == "start"]
    assert [e["generation"] for e in events] == [1, 2] and events[1]["stale"] == [], events
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.wait(30) in (0, 1, 143), agent.log()
    wait_for(lambda: not processes_of(str(tmp_path)), 20, "no process of the job left, the standby included")


def test_a_standby_dies_with_its_agent(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    cluster = make_cluster([sys.executable, COUNTER], nodes="1", extra_args=AGENT_FLAGS, warm_start=True,
                           env={"COUNTER_STEPS": "100000"})
    agent = cluster.start("a")
    wait_for(lambda: standby_ready(agent.metrics_address()), 120, "the standby interpreter ready")
    standbys = [p for p in processes_of(str(tmp_path)) if STANDBY_PATH in p.cmdline()]
    assert len(standbys) == 2, standbys  # the keeper and the interpreter
    agent.proc.kill()
    agent.proc.wait()
    wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in standbys), 20,
             "the standby gone with its agent")


def test_warm_start_off_starts_every_generation_cold(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster([sys.executable, COUNTER], nodes="1", extra_args=[*AGENT_FLAGS, "--warm-start", "off"],
                           env={"COUNTER_STEPS": "60", "COUNTER_FAIL_AT": "20"})
    agent = cluster.start("a")
    address = agent.metrics_address()
    cluster.wait_running(2, 1, step=21)
    assert launches(address) == {"warm": 0.0, "cold": 2.0}
    assert agent.wait(60) == 0, agent.log()
    assert "standby" not in agent.log()


def test_a_standby_that_died_falls_back_to_a_cold_start(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    cluster = make_cluster([sys.executable, COUNTER], nodes="1", extra_args=AGENT_FLAGS, warm_start=True,
                           env={"COUNTER_STEPS": "100000"})
    agent = cluster.start("a")
    address = agent.metrics_address()
    wait_for(lambda: standby_ready(address), 120, "the standby interpreter ready")
    interpreter = next(p for p in processes_of(str(tmp_path)) if p.cmdline()[1:2] == [STANDBY_PATH])
    interpreter.kill()
    first = cluster.wait_running(1, 1, step=1)["nodes"][0]["worker_pid"]
    os.kill(first, signal.SIGKILL)
    cluster.wait_running(2, 1, step=1)
    assert launches(address) == {"warm": 0.0, "cold": 2.0}
    # Found dead before the launch, or (while the kernel still tears it down) by its missing answer to it.
    assert re.search(r"the standby interpreter (exited before its launch|\d+ did not take the launch)"
                     r".*; this launch starts cold", agent.log()), agent.log()


def test_a_launch_never_waits_for_a_standby_still_importing(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    """A trainer without TensorFlow starts in a fraction of the import: the relaunch goes cold, and the standby
    stays for the next one."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('TFELASTIC_STANDBY_FD') and os.path.exists(os.environ['SLOW']):\n"
        "    time.sleep(60)  # a standby that takes its time to import\n")
    slow = tmp_path / "slow"
    slow.touch()
    cluster = make_cluster([sys.executable, COUNTER], nodes="1", extra_args=AGENT_FLAGS, warm_start=True,
                           env={"COUNTER_STEPS": "100000", "PYTHONPATH": str(hook), "SLOW": str(slow)})
    agent = cluster.start("a")
    address = agent.metrics_address()
    wait_for(lambda: "standby interpreter" in agent.log(), 60, "a standby started")
    first = cluster.wait_running(1, 1, step=1)["nodes"][0]["worker_pid"]
    os.kill(first, signal.SIGKILL)
    cluster.wait_running(2, 1, step=1, timeout=20)  # well before the standby's minute
    assert launches(address) == {"warm": 0.0, "cold": 2.0}
    assert "is still importing TensorFlow: this launch starts cold" in agent.log()
    standbys = [p for p in processes_of(str(tmp_path)) if STANDBY_PATH in p.cmdline()]
    assert standbys, "the standby was retired: it should wait for the next launch"
