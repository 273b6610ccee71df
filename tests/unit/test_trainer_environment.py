"""What the trainer library reads from the agent's environment, and the Keras-3 guard (pure code, fake modules)."""

from __future__ import annotations

import json
import re
from types import ModuleType, SimpleNamespace
from typing import Any, cast

import pytest
from tfelastic.trainer.environment import TrainerEnvironment, TrainerEnvironmentError, parse_collective
from tfelastic.trainer.tfkeras import KerasVersionError, check_keras, check_model, ensure_legacy_keras


def tf_config(index: int, workers: int = 2, chief: bool = False, task_type: str = "worker") -> str:
    cluster: dict[str, list[str]] = {"worker": [f"10.0.0.{i}:2222" for i in range(workers)]}
    if chief:
        cluster["chief"] = ["10.0.0.99:2222"]
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def test_without_an_agent_it_is_a_single_chief_worker() -> None:
    env = TrainerEnvironment.from_env({})
    assert (env.rank, env.world_size, env.is_chief, env.managed, env.multi_worker) == (0, 1, True, False, False)
    assert env.backup_path("loop") == "tfelastic-backup/default/loop"


def test_what_the_agent_sets_is_read() -> None:
    env = TrainerEnvironment.from_env({
        "TF_CONFIG": tf_config(1), "TFELASTIC_RANK": "1", "TFELASTIC_WORLD_SIZE": "2", "TFELASTIC_GENERATION": "3",
        "TFELASTIC_RESTART_COUNT": "2", "TFELASTIC_BACKUP_DIR": "/shared/ckpt", "TFELASTIC_JOB": "mnist",
        "TFELASTIC_NODE_ID": "gpu-02", "TFELASTIC_PROGRESS_SOCKET": "/run/tfelastic/p.sock"})
    assert (env.rank, env.world_size, env.generation, env.restart_count) == (1, 2, 3, 2)
    assert (env.job, env.node_id, env.managed, env.is_chief, env.multi_worker) == ("mnist", "gpu-02", True, False,
                                                                                     True)
    assert env.backup_path("fit") == "/shared/ckpt/fit"
    assert env.workers == ("10.0.0.0:2222", "10.0.0.1:2222")


def test_tf_config_alone_gives_rank_and_world() -> None:
    env = TrainerEnvironment.from_env({"TF_CONFIG": tf_config(0, workers=3)})
    assert (env.rank, env.world_size, env.is_chief) == (0, 3, True)


def test_with_a_chief_job_worker_zero_is_not_the_chief() -> None:
    assert not TrainerEnvironment.from_env({"TF_CONFIG": tf_config(0, chief=True)}).is_chief
    chief = TrainerEnvironment.from_env({"TF_CONFIG": tf_config(0, chief=True, task_type="chief")})
    assert (chief.is_chief, chief.rank, chief.world_size) == (True, 0, 3)
    assert TrainerEnvironment.from_env({"TF_CONFIG": tf_config(1, chief=True)}).rank == 2


@pytest.mark.parametrize("environ, fragment", [
    ({"TF_CONFIG": "{not json"}, "TF_CONFIG is not valid JSON"),
    ({"TF_CONFIG": "[]"}, "TF_CONFIG must be a JSON object"),
    ({"TF_CONFIG": tf_config(2)}, "TF_CONFIG task index 2 is outside the 2 worker addresses"),
    ({"TF_CONFIG": tf_config(0, task_type="evaluator")},
     "TF_CONFIG task must be {'type': 'worker', 'chief' or 'ps', 'index': N}, got {'type': 'evaluator'"),
    ({"TF_CONFIG": tf_config(0, task_type="ps")}, "TF_CONFIG task type 'ps' needs a 'ps' job in the cluster"),
    ({"TF_CONFIG": tf_config(0), "TFELASTIC_RANK": "1", "TFELASTIC_WORLD_SIZE": "2"},
     "disagrees with TFELASTIC_RANK=1"),
    ({"TFELASTIC_RANK": "x"}, "TFELASTIC_RANK='x' is not an integer"),
    ({"TFELASTIC_RANK": "2", "TFELASTIC_WORLD_SIZE": "2"}, "TFELASTIC_RANK=2 is not below TFELASTIC_WORLD_SIZE=2"),
    ({"TFELASTIC_WORLD_SIZE": "0"}, "TFELASTIC_WORLD_SIZE=0 is below 1"),
])
def test_inconsistent_environments_name_the_variable(environ: dict[str, str], fragment: str) -> None:
    with pytest.raises(TrainerEnvironmentError, match=re.escape(fragment)):
        TrainerEnvironment.from_env(environ)


def test_collective_comes_from_the_argument_then_the_environment() -> None:
    assert parse_collective(None, {}) == "AUTO"
    assert parse_collective(None, {"TFELASTIC_COLLECTIVE": "ring"}) == "RING"
    assert parse_collective("nccl", {"TFELASTIC_COLLECTIVE": "ring"}) == "NCCL"
    with pytest.raises(TrainerEnvironmentError, match="TFELASTIC_COLLECTIVE='mpi' is not one of AUTO, RING, NCCL"):
        parse_collective(None, {"TFELASTIC_COLLECTIVE": "mpi"})


def fake_tensorflow(legacy_at_import: bool | None, keras_version: str = "2.21.0") -> ModuleType:
    tf = SimpleNamespace(keras=SimpleNamespace(__version__=keras_version))
    if legacy_at_import is not None:
        tf._tf_uses_legacy_keras = legacy_at_import
    return cast(ModuleType, tf)


def test_the_guard_sets_the_variable_when_tensorflow_is_not_imported_yet() -> None:
    environ: dict[str, str] = {}
    ensure_legacy_keras(environ, {})
    assert environ == {"TF_USE_LEGACY_KERAS": "1"}


def test_the_guard_refuses_a_variable_that_selects_keras_3() -> None:
    with pytest.raises(KerasVersionError, match=re.escape("TF_USE_LEGACY_KERAS='0' makes tf.keras Keras 3")):
        ensure_legacy_keras({"TF_USE_LEGACY_KERAS": "0"}, {})


def test_the_guard_refuses_tensorflow_imported_before_the_variable() -> None:
    modules = {"tensorflow": fake_tensorflow(legacy_at_import=False)}
    with pytest.raises(KerasVersionError, match="TensorFlow was imported before TF_USE_LEGACY_KERAS=1 was set"):
        check_keras({"TF_USE_LEGACY_KERAS": "1"}, modules)
    with pytest.raises(KerasVersionError, match="TensorFlow was imported with TF_USE_LEGACY_KERAS unset"):
        check_keras({}, modules)


def test_the_guard_accepts_tensorflow_imported_with_tf_keras() -> None:
    check_keras({"TF_USE_LEGACY_KERAS": "1"}, {"tensorflow": fake_tensorflow(legacy_at_import=True)})


def test_the_guard_asks_tf_keras_when_tensorflow_has_no_flag() -> None:
    check_keras({}, {"tensorflow": fake_tensorflow(None, keras_version="2.15.0")})
    with pytest.raises(KerasVersionError, match=re.escape("tf.keras resolves to Keras 3")):
        check_keras({}, {"tensorflow": fake_tensorflow(None, keras_version="3.15.1")})


def test_a_keras_3_model_is_refused_by_its_module() -> None:
    keras3_model: Any = type("Sequential", (), {"__module__": "keras.src.models.sequential"})()
    with pytest.raises(KerasVersionError, match="Build it with tf_keras"):
        check_model(keras3_model)
    tf_keras_model: Any = type("Sequential", (), {"__module__": "tf_keras.src.engine.sequential"})()
    check_model(tf_keras_model)


@pytest.mark.parametrize("environment", [
    TrainerEnvironment(rank=1, world_size=3, generation=4, restart_count=2, backup_dir="/shared/b",
                       progress_socket="/run/p.sock", job="mnist", node_id="gpu-02", task_type="worker", task_index=1,
                       workers=("10.0.0.1:2222", "10.0.0.2:2222", "10.0.0.3:2222")),
    TrainerEnvironment(rank=0, world_size=2, task_type="chief", task_index=0,
                       workers=("10.0.0.9:1", "10.0.0.1:2"), has_chief_job=True),
    TrainerEnvironment(),
    TrainerEnvironment(rank=0, world_size=4, task_type="chief", task_index=0, has_chief_job=True,
                       workers=("10.0.0.9:1", "10.0.0.3:3", "10.0.0.4:4"), ps=("10.0.0.2:2",), backup_dir="/b"),
    TrainerEnvironment(rank=2, world_size=5, task_type="ps", task_index=1, has_chief_job=True,
                       workers=("10.0.0.9:1", "10.0.0.4:4", "10.0.0.5:5"), ps=("10.0.0.2:2", "10.0.0.3:3")),
    TrainerEnvironment(rank=4, world_size=5, task_type="worker", task_index=1, has_chief_job=True, generation=2,
                       workers=("10.0.0.9:1", "10.0.0.4:4", "10.0.0.5:5"), ps=("10.0.0.2:2", "10.0.0.3:3")),
], ids=["worker", "chief-job", "alone", "ps-chief", "ps-ps", "ps-worker"])
def test_what_the_agent_writes_is_what_the_trainer_reads(environment: TrainerEnvironment) -> None:
    assert TrainerEnvironment.from_env(environment.to_env()) == environment


def test_the_agents_tf_config_lists_every_worker_in_rank_order() -> None:
    env = TrainerEnvironment(rank=1, world_size=2, task_type="worker", task_index=1,
                             workers=("10.0.0.1:2222", "10.0.0.2:3333")).to_env()
    assert json.loads(env["TF_CONFIG"]) == {"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:3333"]},
                                            "task": {"type": "worker", "index": 1}}
    assert (env["TFELASTIC_RANK"], env["TFELASTIC_WORLD_SIZE"]) == ("1", "2")


CHIEF_ADDRESS, PS_ADDRESSES, WORKER_ADDRESSES = "10.0.0.9:1", ("10.0.1.1:2", "10.0.1.2:2"), (
    "10.0.2.1:3", "10.0.2.2:3", "10.0.2.3:3")


def ps_job_environment(task_type: str, index: int) -> TrainerEnvironment:
    """What an agent would write for one task of a job of 1 chief, 2 ps and 3 workers, read back."""
    rank = {"chief": 0, "ps": 1 + index, "worker": 3 + index}[task_type]
    written = TrainerEnvironment(rank=rank, world_size=6, task_type=task_type, task_index=index, has_chief_job=True,
                                 workers=(CHIEF_ADDRESS, *WORKER_ADDRESSES), ps=PS_ADDRESSES).to_env()
    return TrainerEnvironment.from_env(written)


def test_a_parameter_server_jobs_tf_config_has_the_three_jobs() -> None:
    env = ps_job_environment("worker", 2).to_env()
    assert json.loads(env["TF_CONFIG"]) == {
        "cluster": {"chief": [CHIEF_ADDRESS], "ps": list(PS_ADDRESSES), "worker": list(WORKER_ADDRESSES)},
        "task": {"type": "worker", "index": 2}}
    assert (env["TFELASTIC_RANK"], env["TFELASTIC_WORLD_SIZE"]) == ("5", "6")


def test_ranks_of_a_parameter_server_job_are_chief_then_ps_then_workers() -> None:
    tasks = [("chief", 0), ("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1), ("worker", 2)]
    environments = [ps_job_environment(t, i) for t, i in tasks]
    assert [e.rank for e in environments] == list(range(6))
    assert {e.world_size for e in environments} == {6}
    assert [(e.is_chief, e.serves_only) for e in environments] == [(True, False)] + [(False, True)] * 5
    assert all(e.parameter_server_job and e.has_chief_job for e in environments)


def test_tf_config_alone_gives_a_parameter_server_tasks_rank() -> None:
    """TensorFlow's own TF_CONFIG, without the TFELASTIC_* variables: the rank follows from the task."""
    config = {"cluster": {"worker": list(WORKER_ADDRESSES), "ps": list(PS_ADDRESSES), "chief": [CHIEF_ADDRESS]},
              "task": {"type": "ps", "index": 1}}
    env = TrainerEnvironment.from_env({"TF_CONFIG": json.dumps(config)})
    assert (env.rank, env.world_size, env.task_type, env.task_index) == (2, 6, "ps", 1)
    assert env.cluster == {"chief": [CHIEF_ADDRESS], "ps": list(PS_ADDRESSES), "worker": list(WORKER_ADDRESSES)}


def test_a_mirrored_job_serves_nothing_and_has_no_ps() -> None:
    for environ in ({}, {"TF_CONFIG": tf_config(1)}, {"TF_CONFIG": tf_config(0, chief=True)}):
        env = TrainerEnvironment.from_env(environ)
        assert (env.parameter_server_job, env.serves_only, env.ps) == (False, False, ())
        assert "ps" not in env.cluster


def ps_config(task: dict[str, Any], **cluster: Any) -> dict[str, str]:
    jobs = {"chief": [CHIEF_ADDRESS], "ps": list(PS_ADDRESSES), "worker": list(WORKER_ADDRESSES)}
    jobs.update(cluster)
    return {"TF_CONFIG": json.dumps({"cluster": {k: v for k, v in jobs.items() if v is not None}, "task": task})}


@pytest.mark.parametrize("environ, fragment", [
    (ps_config({"type": "ps", "index": 2}), "TF_CONFIG task index 2 is outside the 2 ps addresses"),
    (ps_config({"type": "ps", "index": 0}, chief=None),
     "TF_CONFIG with a 'ps' job needs exactly one 'chief' and at least one 'worker' address, got 0 and 3"),
    (ps_config({"type": "chief", "index": 0}, chief=["10.0.0.8:1", CHIEF_ADDRESS]),
     "needs exactly one 'chief' and at least one 'worker' address, got 2 and 3"),
    (ps_config({"type": "chief", "index": 0}, worker=[]),
     "needs exactly one 'chief' and at least one 'worker' address, got 1 and 0"),
    (ps_config({"type": "ps", "index": 0}, ps="10.0.1.1:2"), "TF_CONFIG cluster jobs must be lists of 'host:port'"),
    (ps_config({"type": "ps", "index": 0}, ps=[2222]), "TF_CONFIG cluster jobs must be lists of 'host:port'"),
    (ps_config({"type": "ps", "index": 0}, ps=[]), "TF_CONFIG task type 'ps' needs a 'ps' job in the cluster"),
    ({**ps_config({"type": "worker", "index": 0}), "TFELASTIC_RANK": "1", "TFELASTIC_WORLD_SIZE": "6"},
     "TF_CONFIG (task 3 of 6) disagrees with TFELASTIC_RANK=1"),
    ({**ps_config({"type": "ps", "index": 0}), "TFELASTIC_RANK": "1", "TFELASTIC_WORLD_SIZE": "4"},
     "TF_CONFIG (task 1 of 6) disagrees with TFELASTIC_RANK=1 and TFELASTIC_WORLD_SIZE=4"),
])
def test_inconsistent_parameter_server_configs_are_refused(environ: dict[str, str], fragment: str) -> None:
    with pytest.raises(TrainerEnvironmentError, match=re.escape(fragment)):
        TrainerEnvironment.from_env(environ)


@pytest.mark.parametrize("kwargs", [
    {"workers": (CHIEF_ADDRESS, *WORKER_ADDRESSES)},  # no chief job
    {"workers": (CHIEF_ADDRESS,), "has_chief_job": True},  # no worker
])
def test_an_agent_cannot_write_a_parameter_server_cluster_without_chief_and_worker(kwargs: dict[str, Any]) -> None:
    with pytest.raises(TrainerEnvironmentError, match="needs a chief and at least one worker"):
        TrainerEnvironment(ps=PS_ADDRESSES, **kwargs)
