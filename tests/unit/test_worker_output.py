"""Why a trainer failed, read off its last lines (:mod:`tfelastic.daemon.worker.output`), and what the agent puts
in a trainer's environment besides the generation's variables (:func:`tfelastic.daemon.agent.runner.trainer_env`)."""

from __future__ import annotations

import pytest
from tfelastic.daemon.agent.runner import trainer_env
from tfelastic.daemon.rendezvous import api
from tfelastic.daemon.rendezvous.api import FailureCause
from tfelastic.daemon.rendezvous.convert import report_from_proto, report_to_proto
from tfelastic.daemon.worker.output import exception_line, failure_cause

TRACEBACK = """\
epoch 1/3
Traceback (most recent call last):
  File "/srv/train.py", line 12, in <module>
    lr = base / warmup
         ~~~~~^~~~~~~~
ZeroDivisionError: float division by zero""".splitlines()


@pytest.mark.parametrize(("lines", "expected"), [
    (TRACEBACK, "ZeroDivisionError: float division by zero"),
    (["Traceback (most recent call last):", '  File "x", line 1', "KeyboardInterrupt"], "KeyboardInterrupt"),
    (["tensorflow.python.framework.errors_impl.UnavailableError: Collective ops is aborted by: recvmsg"],
     "tensorflow.python.framework.errors_impl.UnavailableError: Collective ops is aborted by: recvmsg"),
    (["step 1", "step 2", "killed"], None),
    ([], None),
    # an earlier, handled traceback does not hide the last one
    (["Traceback (most recent call last):", "ValueError: first", "retrying", *TRACEBACK],
     "ZeroDivisionError: float division by zero"),
], ids=["traceback", "interrupt", "tensorflow-error-alone", "no-exception", "no-output", "last-traceback"])
def test_the_exception_a_trainer_died_of(lines: list[str], expected: str | None) -> None:
    assert exception_line(lines) == expected


ASSIGNMENT = api.Assignment(3, 1, 2, (api.Member("a", 0, "10.0.0.1", 1), api.Member("b", 1, "10.0.0.2", 2)), 2)


def env(base: dict[str, str]) -> dict[str, str]:
    return trainer_env(base, ASSIGNMENT, job="j", node_id="b", backup_dir="/b", progress_socket="/p",
                       instrument=False)


def test_python_trainers_are_unbuffered_and_use_tf_keras_unless_the_job_says_otherwise() -> None:
    assert (env({})["PYTHONUNBUFFERED"], env({})["TF_USE_LEGACY_KERAS"]) == ("1", "1")
    mine = env({"PYTHONUNBUFFERED": "", "TF_USE_LEGACY_KERAS": "0"})
    assert (mine["PYTHONUNBUFFERED"], mine["TF_USE_LEGACY_KERAS"]) == ("", "0")


def test_the_generations_variables_win_over_the_agents_environment() -> None:
    mine = env({"TFELASTIC_RANK": "7", "TF_CONFIG": "{}"})
    assert (mine["TFELASTIC_RANK"], mine["TFELASTIC_GENERATION"]) == ("1", "3")
    assert mine["TF_CONFIG"] != "{}"


OOM = ["Traceback (most recent call last):", '  File "/srv/train.py", line 40, in <module>',
       "tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating tensor with "
       "shape[8192,8192] and type float on /job:worker/replica:0/task:0/device:GPU:0"]
PEER = ["Traceback (most recent call last):", '  File "/srv/train.py", line 40, in <module>',
        "tensorflow.python.framework.errors_impl.UnavailableError: Collective ops is aborted by: recvmsg:Connection "
        "reset by peer"]


@pytest.mark.parametrize(("code", "lines", "cause"), [
    (1, OOM, FailureCause.OUT_OF_MEMORY),
    (1, PEER, FailureCause.PEER_FAILURE),
    (1, TRACEBACK, FailureCause.EXCEPTION),
    (-9, TRACEBACK, FailureCause.SIGNAL),  # killed: whatever it printed before
    (-9, OOM, FailureCause.SIGNAL),
    (3, ["step 1"], FailureCause.EXIT_CODE),
    (0, [], FailureCause.EXIT_CODE),  # a serving task's exit 0
    # A C++ abort prints no Python exception: its last lines decide.
    (-6, ["2026-12-03 F tensorflow/core/common_runtime/bfc_allocator.cc] CUDA_ERROR_OUT_OF_MEMORY: out of memory"],
     FailureCause.OUT_OF_MEMORY),
    (-6, ["E0000 coordination_service.cc] tasks are unhealthy (stopped sending heartbeats)"],
     FailureCause.PEER_FAILURE),
    (-6, ["terminate called without an active exception"], FailureCause.SIGNAL),
    # A peer's failure the trainer survived earlier does not hide its own exception.
    (1, ["Worker /job:worker/replica:0/task:1 failed with UnavailableError: Connection reset by peer", *TRACEBACK],
     FailureCause.EXCEPTION),
], ids=["oom", "peer", "exception", "sigkill-after-traceback", "sigkill-after-oom", "exit-code", "serving-exit-0",
        "abort-oom", "abort-peer", "abort", "own-exception-after-a-peer"])
def test_the_cause_of_a_failure(code: int, lines: list[str], cause: FailureCause) -> None:
    assert failure_cause(code, lines) is cause


def test_a_cause_crosses_the_wire_and_one_this_version_does_not_know_is_other() -> None:
    report = api.WorkerReport(3, api.WorkerStatus.FAILED, exit_code=1, cause=FailureCause.OUT_OF_MEMORY)
    assert report_from_proto(report_to_proto(report, 0.0), 0.0).cause is FailureCause.OUT_OF_MEMORY
    assert report_from_proto(report_to_proto(api.WorkerReport(3, api.WorkerStatus.RUNNING), 0.0), 0.0).cause is None
    newer = report_to_proto(report, 0.0)
    newer.cause = "thermal_throttle"
    assert report_from_proto(newer, 0.0).cause is FailureCause.OTHER


@pytest.mark.parametrize(("code", "cause"), [(-9, FailureCause.OUT_OF_MEMORY), (-15, FailureCause.SIGNAL),
                                             (1, FailureCause.EXIT_CODE)])
def test_a_sigkill_while_the_memory_cgroup_counted_an_oom_kill_is_out_of_memory(code: int,
                                                                                 cause: FailureCause) -> None:
    assert failure_cause(code, [], oom_killed=True) is cause
    assert failure_cause(-9, []) is FailureCause.SIGNAL  # without the count: any SIGKILL
