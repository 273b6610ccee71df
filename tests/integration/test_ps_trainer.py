"""Parameter-server jobs (ParameterServerStrategy) with real TensorFlow processes on localhost and no daemon: a
chief, 1 ps and 2 workers of each example, started with the environment an agent writes
(``TrainerEnvironment.to_env``). A worker SIGKILLed and relaunched alone at its address 3 s later: the chief trains
on to its target without a restart of its own or of the ps. A chief killed with its job (as the agents restart a
parameter-server job) resumes from its checkpoint; a SIGTERMed one saves and exits 42. TensorFlow's tutorial script
runs unmodified. The chief's progress reports come to a datagram socket of the test's own, as they would come to
its agent. The ps and workers never exit by themselves: every test stops them, and checks that nothing is left."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from tfelastic.trainer.environment import TrainerEnvironment
from tfelastic.trainer.instrument import SITE_DIR
from tfelastic.trainer.progress import Phase, ProgressMessage, decode

from tests.cluster import ROOT, TF_DEADLINE, alive, processes_of, wait_for
from tests.ports import free_ports
from tests.workers import example, summaries, worker_env

pytestmark = [pytest.mark.integration, pytest.mark.tensorflow]

TUTORIAL = [sys.executable, str(ROOT / "tests" / "trainers" / "ps_tutorial.py")]
CHECKPOINTED_AND_STOPPED = 42
EXAMPLES = ["ps_custom_loop", "ps_keras_fit"]


def command(name: str, steps: int, save_every: int) -> list[str]:
    """``name`` training ``steps`` steps (fit: 4 epochs), the chief pausing 20 ms after scheduling each so that
    faults land mid-training on a loaded 2-core machine whatever the workers' speed."""
    length = ["--steps", str(steps)] if name == "ps_custom_loop" else ["--epochs", "4", "--steps-per-epoch",
                                                                        str(steps // 4)]
    return example(name, *length, "--save-every", str(save_every), "--step-seconds", "0.02")


class ProgressSink:
    """The agent's end of ``TFELASTIC_PROGRESS_SOCKET``: every report, decoded, with the time it arrived."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.reports: list[tuple[float, ProgressMessage]] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(path)
        self._sock.settimeout(0.2)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._closed.is_set():
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.reports.append((time.monotonic(), decode(data)))

    def of(self, pid: int) -> list[ProgressMessage]:
        return [m for _, m in list(self.reports) if m.pid == pid]

    def max_step(self, pid: int) -> int:
        return max((m.step for m in self.of(pid)), default=-1)

    def checkpoints(self, pid: int) -> list[int]:
        return [m.checkpoint_step for m in self.of(pid) if m.checkpoint_step is not None]

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5)
        self._sock.close()


@dataclass
class Task:
    name: str  # "chief", "ps0", "worker1"
    proc: subprocess.Popen[bytes]
    log_path: Path
    started: float

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


# What an agent sets for every trainer it launches (daemon/agent/runner.py): tf_keras, since Keras 3 cannot run
# ParameterServerStrategy's Model.fit (docs/facts.md, fact 19).
AGENT_SETS = {"TF_USE_LEGACY_KERAS": "1"}


@dataclass
class PsJob:
    """A chief, ``ps`` parameter servers and ``workers`` workers of one command, on free localhost ports."""

    tmp: Path
    command: Sequence[str]
    sink: ProgressSink
    ps: int = 1
    workers: int = 2
    generation: int = 1
    extra_env: dict[str, str] = field(default_factory=dict)
    tasks: dict[str, Task] = field(default_factory=dict)
    history: list[Task] = field(default_factory=list)  # every process ever started, the replaced ones too

    def __post_init__(self) -> None:
        addresses = [f"127.0.0.1:{port}" for port in free_ports(1 + self.ps + self.workers)]
        self.chief_address = addresses[0]
        self.ps_addresses = tuple(addresses[1:1 + self.ps])
        self.worker_addresses = tuple(addresses[1 + self.ps:])

    def environment(self, name: str) -> dict[str, str]:
        """What an agent sets for task ``name``: ranks chief, ps..., workers... (the daemon's order)."""
        task_type, index = ("chief", 0) if name == "chief" else (name.rstrip("0123456789"), int(name[-1]))
        rank = {"chief": 0, "ps": 1 + index, "worker": 1 + self.ps + index}[task_type]
        return TrainerEnvironment(
            rank=rank, world_size=1 + self.ps + self.workers, generation=self.generation, job="ps-test",
            task_type=task_type, task_index=index, has_chief_job=True,
            workers=(self.chief_address, *self.worker_addresses), ps=self.ps_addresses,
            backup_dir=str(self.tmp / "backup"), progress_socket=self.sink.path).to_env()

    @property
    def names(self) -> list[str]:
        return ["chief", *(f"ps{i}" for i in range(self.ps)), *(f"worker{i}" for i in range(self.workers))]

    def start(self, name: str) -> Task:
        log_path = self.tmp / f"g{self.generation}-{name}-{len(self.history)}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp,
                                    env=worker_env({**AGENT_SETS, **self.environment(name), **self.extra_env}))
        task = Task(name, proc, log_path, time.monotonic())
        self.tasks[name] = task
        self.history.append(task)
        return task

    def start_all(self) -> PsJob:
        for name in self.names:
            self.start(name)
        return self

    @property
    def chief(self) -> Task:
        return self.tasks["chief"]

    def wait_chief(self, timeout: float) -> int:
        try:
            return self.chief.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the chief still runs after {timeout}s:\n{self.logs()}") from None

    def wait_reported(self, condition: Callable[[list[ProgressMessage]], bool], timeout: float, what: str) -> None:
        """Waits for the chief's reports to meet ``condition``, failing early if any task exits."""
        def met() -> bool:
            exited = [t.name for t in self.tasks.values() if t.proc.poll() is not None]
            if exited:
                raise AssertionError(f"{exited} exited while waiting for {what}:\n{self.logs()}")
            return condition(self.sink.of(self.chief.pid))

        wait_for(met, timeout, what, interval=0.1)

    def stop_servers(self) -> None:
        """What the agents do once the chief is done (or failed): SIGTERM, then SIGKILL after a grace."""
        servers = [t for t in self.tasks.values() if t.name != "chief" and t.proc.poll() is None]
        for task in servers:
            task.proc.send_signal(signal.SIGTERM)
        for task in servers:
            try:
                task.proc.wait(10)
            except subprocess.TimeoutExpired:
                task.proc.kill()
                task.proc.wait()

    def kill_all(self) -> None:
        for task in self.history:
            if task.proc.poll() is None:
                task.proc.kill()
                task.proc.wait()

    def chief_summary(self) -> dict[str, Any]:
        found = summaries(self.chief.output())
        assert found, f"the chief printed no summary:\n{self.logs()}"
        return found[-1]

    def logs(self) -> str:
        return "\n".join(f"===== {t.name} (pid {t.pid}, exit {t.proc.poll()})\n{t.output()[-3000:]}"
                         for t in self.history)


JobFactory = Callable[..., PsJob]


@pytest.fixture
def ps_job(tmp_path: Path) -> Iterator[JobFactory]:
    """Builds jobs whose processes are all gone when the test ends (checked: the ps and workers never exit by
    themselves, so a test that forgets to stop them fails here)."""
    socket_dir = tempfile.mkdtemp(prefix="tfe-ps-")  # a Unix socket's path must stay under 108 bytes
    sink = ProgressSink(str(Path(socket_dir) / "progress.sock"))
    jobs: list[PsJob] = []

    def factory(command: Sequence[str], **kwargs: Any) -> PsJob:
        job = PsJob(tmp_path, command, sink, **kwargs)
        jobs.append(job)
        return job

    try:
        yield factory
    finally:
        for job in jobs:
            job.stop_servers()
            job.kill_all()
        sink.close()
        shutil.rmtree(socket_dir, ignore_errors=True)
    leftovers = processes_of(str(tmp_path))
    for p in leftovers:
        p.kill()
    assert not leftovers, f"processes outlived the test: {[(p.pid, p.name()) for p in leftovers]}"


def assert_never_back(reports: list[ProgressMessage]) -> None:
    steps = [m.step for m in reports]
    assert steps == sorted(steps), f"the reported step went back: {steps}"
    saved = [m.checkpoint_step for m in reports if m.checkpoint_step is not None]
    assert saved == sorted(saved) and saved, f"the checkpointed step went back (or none): {saved}"


def wait_recovered(task: Task, since: int, timeout: float) -> float | None:
    """Seconds from now until the chief logs that a worker was re-attached (its ``since``-th such line), or None
    if it exits first."""
    began = time.monotonic()

    def seen() -> bool:
        return task.output().count("has been recovered") > since or task.proc.poll() is not None

    wait_for(seen, timeout, "the chief to re-attach the worker or finish", interval=0.1)
    return time.monotonic() - began if task.output().count("has been recovered") > since else None


@pytest.mark.parametrize("name", EXAMPLES)
def test_a_killed_worker_is_relaunched_alone_and_the_chief_trains_on(ps_job: JobFactory, name: str) -> None:
    target = 400  # about 10 s with both workers: the relaunched one has the time to be re-attached
    job = ps_job(command(name, target, 50)).start_all()
    chief, ps = job.chief, job.tasks["ps0"]
    job.wait_reported(lambda r: any(m.step >= 60 for m in r), 90, "the chief past step 60")
    victim = job.tasks["worker1"]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    killed_at = job.sink.max_step(chief.pid)
    time.sleep(3)  # the agent's relaunch delay in this scenario
    replacement = job.start("worker1")
    recovered_after = wait_recovered(chief, 0, 90)
    assert job.wait_chief(90) == 0, job.logs()

    summary = job.chief_summary()
    assert summary["preempted"] is False and summary["pid"] == chief.pid, summary
    assert summary["final_step"] >= target == summary["target_step"], summary
    assert summary["accuracy"] > 0.3, summary  # 10 classes: chance is 0.1
    reports = job.sink.of(chief.pid)
    assert_never_back(reports)
    assert reports[-1].done and reports[-1].step == summary["final_step"], reports[-1]
    assert killed_at < target, f"the worker was killed after training ended (step {killed_at})"
    assert {m.pid for _, m in job.sink.reports} == {chief.pid}, "a ps or worker reported progress"
    # Neither the chief nor the ps was replaced, and the ps still serves: it never exits by itself.
    assert [t.name for t in job.history].count("chief") == 1 and alive(ps.pid) and ps.proc.poll() is None
    # On a loaded machine the chief can reach its target before the relaunched worker has imported TensorFlow.
    wait_for(lambda: "serving as worker 1" in replacement.output() or replacement.proc.poll() is not None,
             TF_DEADLINE, "the relaunched worker to serve")
    assert replacement.proc.poll() is None and "serving as worker 1" in replacement.output(), replacement.output()
    print(f"{name}: worker 1 killed at step {killed_at}, relaunched 3 s later, re-attached "
          f"{'never' if recovered_after is None else f'{recovered_after:.1f} s after its relaunch'}; chief done at "
          f"step {summary['final_step']} (target {target})")
    job.stop_servers()
    assert all(t.proc.poll() is not None for t in job.history)


@pytest.mark.parametrize("name", EXAMPLES)
def test_a_killed_chief_restarts_the_job_and_resumes_from_its_checkpoint(ps_job: JobFactory, name: str) -> None:
    target = 240
    first = ps_job(command(name, target, 40), workers=1).start_all()  # one worker: a quicker start
    first.wait_reported(lambda r: any((m.checkpoint_step or 0) >= 80 for m in r), 90, "a checkpoint past step 80")
    first.chief.proc.send_signal(signal.SIGKILL)
    first.chief.proc.wait()
    saved = max(first.sink.checkpoints(first.chief.pid))
    first.stop_servers()  # a chief's failure restarts every task of the job

    second = ps_job(first.command, workers=1, generation=2)
    second.chief_address, second.ps_addresses, second.worker_addresses = (
        first.chief_address, first.ps_addresses, first.worker_addresses)  # the agents keep their ports
    second.start_all()
    assert second.wait_chief(90) == 0, second.logs()
    summary = second.chief_summary()
    assert summary["initial_step"] >= saved > 0, (summary, saved)
    assert summary["final_step"] >= target, summary
    reports = second.sink.of(second.chief.pid)
    restored = [m for m in reports if m.restored_tier is not None]
    assert [(m.restored_tier, m.restored_step) for m in restored] == [("shared", summary["initial_step"])], restored
    assert_never_back(reports)
    assert min(m.step for m in reports if m.restored_tier is None and m.step > 0) >= summary["initial_step"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_a_sigtermed_chief_saves_exits_42_and_resumes_there(ps_job: JobFactory, name: str) -> None:
    """Saved at the step the stop came, not at the last periodic checkpoint (every 200 steps here)."""
    target = 240
    first = ps_job(command(name, target, 200), workers=1).start_all()  # one worker: a quicker start
    first.wait_reported(lambda r: any(m.step >= 80 for m in r), 90, "the chief past step 80")
    first.chief.proc.send_signal(signal.SIGTERM)
    assert first.wait_chief(30) == CHECKPOINTED_AND_STOPPED, first.logs()
    stopped = first.chief_summary()
    assert stopped["preempted"] is True and 80 <= stopped["final_step"] < target, stopped
    assert first.sink.checkpoints(first.chief.pid) == [stopped["final_step"]]
    first.stop_servers()

    second = ps_job(first.command, workers=1, generation=2).start_all()
    assert second.wait_chief(90) == 0, second.logs()
    summary = second.chief_summary()
    assert summary["initial_step"] == stopped["final_step"], (summary, stopped)
    assert summary["final_step"] >= target, summary


def test_tensorflows_tutorial_script_runs_unmodified(ps_job: JobFactory, tmp_path: Path) -> None:
    """Its workers and ps serve until stopped; its chief trains to the end and exits 0. A worker SIGKILLed and
    relaunched mid-training is re-attached without the chief noticing beyond its log."""
    job = ps_job([*TUTORIAL, str(tmp_path / "tutorial-backup")],
                 extra_env={"PS_TUTORIAL_EPOCHS": "6", "PS_TUTORIAL_STEPS": "20", "PS_TUTORIAL_EPOCH_SECONDS": "1"})
    job.start_all()
    wait_for(lambda: "Epoch 2/6" in job.chief.output() or job.chief.proc.poll() is not None, TF_DEADLINE,
             "the tutorial's second epoch")
    job.tasks["worker0"].proc.send_signal(signal.SIGKILL)
    job.tasks["worker0"].proc.wait()
    time.sleep(3)  # the agent's relaunch delay in this scenario
    job.start("worker0")
    assert job.wait_chief(90) == 0, job.logs()
    # A step is applied at least once under this strategy: the closure a killed worker ran is retried, and the
    # steps of it already applied (up to steps_per_execution=10) are applied again.
    done = re.search(r"done at step (\d+)", job.chief.output())
    assert done is not None and 120 <= int(done.group(1)) <= 130, job.logs()
    assert all(t.proc.poll() is None for t in job.tasks.values() if t.name != "chief"), job.logs()


def test_the_automatic_instrumentation_reports_the_tutorial_chiefs_steps(ps_job: JobFactory, tmp_path: Path) -> None:
    """What an agent adds to an unmodified script (its sitecustomize on PYTHONPATH): the chief's fit reports its
    steps between epochs, as hang detection needs."""
    job = ps_job([*TUTORIAL, str(tmp_path / "tutorial-backup")], workers=1,
                 extra_env={"PYTHONPATH": SITE_DIR, "PS_TUTORIAL_EPOCHS": "3", "PS_TUTORIAL_STEPS": "20"})
    job.start_all()
    assert job.wait_chief(90) == 0, job.logs()
    assert "automatic progress reporting is off" not in job.chief.output(), job.logs()
    training = [m.step for m in job.sink.of(job.chief.pid) if m.phase is Phase.TRAIN]
    assert training and training[-1] == 60, job.sink.of(job.chief.pid)
