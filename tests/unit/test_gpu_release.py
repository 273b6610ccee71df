"""The GPU release check before a Join that may start a generation (daemon/agent/node.py, owned by the agent's
shell; the decisions are the core's, in tests/unit/test_agent_core.py). A killed CUDA process can keep its device
memory for seconds after it is gone, and a trainer started into it fails with out-of-memory. NVML is the named
fake of tests/nvml_fake.py (a fake for hardware we lack), with processes that give their memory back late or
never; the agent is only constructed, from its config, and driven through the preparations its core returns
before a Join."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from pathlib import Path

import pynvml  # type: ignore[import-untyped]
import pytest
from tfelastic.daemon.agent import node
from tfelastic.daemon.agent.agent import Agent
from tfelastic.daemon.agent.api import ListenForProbe, Send, StopResult
from tfelastic.daemon.config import from_values
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.rendezvous import api

from tests.nvml_fake import FakeGpu, FakeGpuProcess, FakeNvml

# Pids above the kernel's largest pid_max (2**22): never a live process, as a killed trainer's pid is not.
DEAD, ALSO_DEAD, SOMEONE_ELSES = 5_000_001, 5_000_002, 5_000_003
GIB = 2**30


def make_agent(tmp_path: Path, nvml: FakeNvml, **values: object) -> Agent:
    return Agent(from_values({"command": ("python",), "rendezvous": Endpoint("127.0.0.1", 29400), "node_id": "a",
                              "job": "mnist", "backup_dir": str(tmp_path / "backup"), "local_checkpoint_dir": "",
                              "metrics_port": None, **values}), nvml=nvml)


def one_gpu(*processes: FakeGpuProcess) -> FakeNvml:
    return FakeNvml([FakeGpu(processes=list(processes))])


def stopped(agent: Agent, *pids: int) -> None:
    """The old worker's processes are all gone: the runner hands its stop's result to the agent."""
    asyncio.run(agent.worker.before_stopped(StopResult(-9, True, pids)))


def before_a_session(agent: Agent) -> None:
    """The shell carries out what the core wants done before a session's Join that may start a generation."""
    asyncio.run(agent.worker.prepare(agent.core.session_starting()))


def wait_sum(agent: Agent) -> float | None:
    return agent.registry.get_sample_value("tfelastic_gpu_release_wait_seconds_sum")


def test_memory_given_back_late_is_awaited_before_the_join(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    nvml = one_gpu()
    agent = make_agent(tmp_path, nvml)
    stopped(agent, DEAD, ALSO_DEAD)
    started = time.monotonic()
    nvml.gpus[0].processes = [FakeGpuProcess(DEAD, 8 * GIB, frees_at=started + 0.6),
                              FakeGpuProcess(ALSO_DEAD, 2 * GIB, frees_at=started + 0.3),
                              FakeGpuProcess(SOMEONE_ELSES, GIB)]  # another program's: never ours to wait for
    with caplog.at_level(logging.INFO, "tfelastic.agent"):
        before_a_session(agent)
    assert time.monotonic() - started >= 0.6
    assert agent.core.gpu_holders == ()
    assert agent.registry.get_sample_value("tfelastic_gpu_release_wait_seconds_count") == 1.0
    assert 0.5 <= (wait_sum(agent) or 0) < 5
    assert f"waiting for the GPUs to give back the stopped worker's memory (GPU 0: pid {DEAD} with 8192 MiB, " \
           f"GPU 0: pid {ALSO_DEAD} with 2048 MiB)" in caplog.text
    assert re.search(r"the GPUs gave back the stopped worker's memory after \d+\.\d{3}s", caplog.text)


def test_memory_never_given_back_fails_the_node_check_that_the_join_carries(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node, "GPU_RELEASE_SECONDS", 0.3)
    agent = make_agent(tmp_path, one_gpu(FakeGpuProcess(DEAD, 8 * GIB)))
    stopped(agent, DEAD)
    before_a_session(agent)
    assert agent.core.gpu_holders == (DEAD,)  # awaited again before the next Join
    assert 0.3 <= (wait_sum(agent) or 0) < 5
    [listen] = agent.core.session_opened()
    assert isinstance(listen, ListenForProbe)  # a checked Join: the coordinator probes its port
    [send] = agent.core.probe_listening("")
    assert isinstance(send, Send) and isinstance(send.message, api.Join) and send.message.checked
    assert send.message.check_failure.startswith("GPU memory of the stopped worker is still held 0s after it "
                                                 f"stopped (GPU 0: pid {DEAD} with 8192 MiB): reset the GPU")


def test_a_pid_that_runs_again_is_not_the_stopped_worker(tmp_path: Path) -> None:
    """The stopped worker's processes are all gone or zombies: a running process with one of their pids got it
    since, and its memory is its own."""
    agent = make_agent(tmp_path, one_gpu(FakeGpuProcess(os.getpid(), GIB)))
    stopped(agent, os.getpid())
    started = time.monotonic()
    before_a_session(agent)
    assert time.monotonic() - started < 1 and agent.core.gpu_holders == ()


def test_without_a_driver_nothing_is_awaited(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, FakeNvml(1, init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    stopped(agent, DEAD)
    before_a_session(agent)
    assert agent.core.gpu_holders == ()
    assert agent.registry.get_sample_value("tfelastic_gpu_release_wait_seconds_count") == 0.0


def test_a_gpu_that_cannot_list_its_processes_is_not_awaited(tmp_path: Path) -> None:
    gpu = FakeGpu(processes=[FakeGpuProcess(DEAD)]).unsupported("nvmlDeviceGetComputeRunningProcesses_v3",
                                                                 "nvmlDeviceGetGraphicsRunningProcesses_v3")
    agent = make_agent(tmp_path, FakeNvml([gpu]))
    stopped(agent, DEAD)
    before_a_session(agent)
    assert agent.core.gpu_holders == ()


def test_graphics_contexts_count_too_and_only_the_trainers_gpus_are_looked_at(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    nvml = FakeNvml([FakeGpu(processes=[FakeGpuProcess(DEAD)]), FakeGpu()])  # GPU 0: another agent's trainer's
    agent = make_agent(tmp_path, nvml)
    stopped(agent, DEAD, ALSO_DEAD)
    started = time.monotonic()  # after the agent is built: a loaded machine builds it slowly
    nvml.gpus[1].graphics_processes = [FakeGpuProcess(ALSO_DEAD, None, frees_at=started + 0.3)]
    before_a_session(agent)
    assert 0.25 <= time.monotonic() - started < 5 and agent.core.gpu_holders == ()


def test_a_parameter_server_jobs_worker_relaunched_alone_waits_for_the_memory_too(tmp_path: Path) -> None:
    """No Join comes between a worker task's kill and its relaunch at the same address: the wait comes before the
    stop is reported done, which is when the core relaunches it."""
    nvml = one_gpu()
    agent = make_agent(tmp_path, nvml, strategy="parameter-server", ps=1, min_nodes=3, max_nodes=3)
    tasks = (("chief", 0), ("ps", 0), ("worker", 0))
    members = tuple(api.Member(node, rank, "127.0.0.1", 5555 + rank, *tasks[rank])
                    for rank, node in enumerate(("c", "p", "a")))
    agent.core.session_opened()
    agent.core.received(api.Assignment(1, 2, 3, members, 0))
    agent.core.worker_started(1, DEAD)
    agent.core.worker_exited(1, -9)  # replaced alone: the core stops what is left of it, then relaunches it
    started = time.monotonic()
    nvml.gpus[0].processes = [FakeGpuProcess(DEAD, 8 * GIB, frees_at=started + 0.4)]
    stopped(agent, DEAD)
    assert time.monotonic() - started >= 0.4 and agent.core.gpu_holders == ()
    assert agent.registry.get_sample_value("tfelastic_gpu_release_wait_seconds_count") == 1.0
