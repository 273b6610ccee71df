"""Why a trainer failed, read off its last lines (:mod:`tfelastic.daemon.worker.output`), and what the agent puts
in a trainer's environment besides the generation's variables (:func:`tfelastic.daemon.agent.runner.trainer_env`)."""

from __future__ import annotations

import pytest
from tfelastic.daemon.agent.runner import trainer_env
from tfelastic.daemon.rendezvous import api
from tfelastic.daemon.worker.output import exception_line

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
