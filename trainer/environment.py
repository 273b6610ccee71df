"""What the agent tells a trainer through its environment: the whole contract, both ways. Pure: importing this
module imports nothing heavy.

The agent builds ``TF_CONFIG`` and the ``TFELASTIC_*`` variables of every trainer it launches with
:meth:`TrainerEnvironment.to_env`; the trainer reads them back with :meth:`TrainerEnvironment.from_env`. Without an
agent (a plain ``python train.py``) none is set and ``from_env`` describes a single worker, so the same script runs
alone and under the daemon.

Two shapes of cluster: a mirrored job's (``worker``, and optionally one ``chief``: ranks in that order), and a
parameter-server job's (``chief``, ``ps``, ``worker``: the chief is rank 0, ps task ``i`` rank ``1 + i``, worker
task ``j`` rank ``1 + N + j`` with N parameter servers; the ps and worker tasks only serve, see
:mod:`tfelastic.trainer.ps`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TF_CONFIG_ENV = "TF_CONFIG"
JOB_ENV = "TFELASTIC_JOB"
NODE_ID_ENV = "TFELASTIC_NODE_ID"
RANK_ENV = "TFELASTIC_RANK"
WORLD_SIZE_ENV = "TFELASTIC_WORLD_SIZE"
GENERATION_ENV = "TFELASTIC_GENERATION"
RESTART_COUNT_ENV = "TFELASTIC_RESTART_COUNT"
BACKUP_DIR_ENV = "TFELASTIC_BACKUP_DIR"
PROGRESS_SOCKET_ENV = "TFELASTIC_PROGRESS_SOCKET"
COLLECTIVE_ENV = "TFELASTIC_COLLECTIVE"
LOCAL_CHECKPOINT_DIR_ENV = "TFELASTIC_LOCAL_CHECKPOINT_DIR"  # this node's fast tier of the job (snapshots.py)
RESTORE_STEP_ENV = "TFELASTIC_RESTORE_STEP"  # the step the coordinator chose; unset: none every member has
COLLECTIVES = ("AUTO", "RING", "NCCL")
CHIEF, PS, WORKER = "chief", "ps", "worker"  # TF_CONFIG's task types


class TrainerEnvironmentError(ValueError):
    """The environment a trainer was started with is inconsistent; the message names the variable."""


@dataclass(frozen=True)
class TrainerEnvironment:
    rank: int = 0
    world_size: int = 1
    generation: int = 0
    restart_count: int = 0
    backup_dir: str | None = None
    progress_socket: str | None = None
    job: str | None = None
    node_id: str | None = None
    task_type: str | None = None  # TF_CONFIG's task; None without TF_CONFIG
    task_index: int = 0
    workers: tuple[str, ...] = ()  # TF_CONFIG's cluster, chief first when there is a "chief" job
    has_chief_job: bool = False
    local_checkpoint_dir: str | None = None  # None: no fast tier (no agent, or the agent turned it off)
    restore_step: int | None = None  # the snapshot step every member of the generation can restore
    ps: tuple[str, ...] = ()  # TF_CONFIG's "ps" job: a parameter-server job (then has_chief_job is True)

    def __post_init__(self) -> None:
        if self.ps and (not self.has_chief_job or len(self.workers) < 2):
            raise TrainerEnvironmentError(
                f"a parameter-server cluster (ps {list(self.ps)}) needs a chief and at least one worker: "
                f"has_chief_job=True and workers=(chief, worker, ...), got has_chief_job={self.has_chief_job} and "
                f"workers={list(self.workers)}")

    @property
    def managed(self) -> bool:
        """Whether an agent launched this trainer."""
        return self.progress_socket is not None or self.generation > 0

    @property
    def is_chief(self) -> bool:
        """TensorFlow's rule: the "chief" task, or worker 0 when the cluster has no chief."""
        if self.task_type is None:
            return True
        if self.task_type == "chief":
            return True
        return self.task_type == "worker" and self.task_index == 0 and not self.has_chief_job

    @property
    def multi_worker(self) -> bool:
        return self.world_size > 1

    @property
    def parameter_server_job(self) -> bool:
        """Whether TF_CONFIG has a "ps" job: ParameterServerStrategy, with this task's role in ``task_type``."""
        return bool(self.ps)

    @property
    def serves_only(self) -> bool:
        """A ps or worker task of a parameter-server job: it runs a ``tf.distribute.Server`` and no training code
        (the chief dispatches the steps to it), and never exits by itself."""
        return self.parameter_server_job and self.task_type in (PS, WORKER)

    @property
    def cluster(self) -> dict[str, list[str]]:
        """TF_CONFIG's cluster (what ``tf.train.ClusterSpec`` takes), jobs in rank order; empty without one."""
        if not self.workers:
            return {}
        chief, workers = (self.workers[:1], self.workers[1:]) if self.has_chief_job else ((), self.workers)
        jobs = {CHIEF: list(chief), PS: list(self.ps), WORKER: list(workers)}
        # An empty "worker" job is kept (a chief alone): TensorFlow reads the job list as given.
        return {job: addresses for job, addresses in jobs.items() if addresses or job == WORKER}

    def backup_path(self, *parts: str, default_root: str = "tfelastic-backup") -> str:
        """A path under the agent's backup directory, or under ``./tfelastic-backup/JOB`` without an agent (the
        agent's own default), so that a standalone run and a daemon run lay checkpoints out the same way."""
        root = self.backup_dir or os.path.join(default_root, self.job or "default")
        return os.path.join(root, *parts)

    def to_env(self) -> dict[str, str]:
        """The variables an agent sets for this trainer; :meth:`from_env` reads them back."""
        env = {RANK_ENV: str(self.rank), WORLD_SIZE_ENV: str(self.world_size), GENERATION_ENV: str(self.generation),
               RESTART_COUNT_ENV: str(self.restart_count)}
        if self.workers:
            env[TF_CONFIG_ENV] = json.dumps({"cluster": self.cluster,
                                             "task": {"type": self.task_type or WORKER, "index": self.task_index}})
        for name, value in ((JOB_ENV, self.job), (NODE_ID_ENV, self.node_id), (BACKUP_DIR_ENV, self.backup_dir),
                            (PROGRESS_SOCKET_ENV, self.progress_socket),
                            (LOCAL_CHECKPOINT_DIR_ENV, self.local_checkpoint_dir)):
            if value:
                env[name] = value
        if self.restore_step is not None:
            env[RESTORE_STEP_ENV] = str(self.restore_step)
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TrainerEnvironment:
        env = os.environ if environ is None else environ
        cluster = _parse_tf_config(env.get(TF_CONFIG_ENV))
        rank = cluster.rank if cluster else 0
        world = cluster.size if cluster else 1
        rank = _int(env, RANK_ENV, rank, minimum=0)
        world = _int(env, WORLD_SIZE_ENV, world, minimum=1)
        if rank >= world:
            raise TrainerEnvironmentError(f"{RANK_ENV}={rank} is not below {WORLD_SIZE_ENV}={world}")
        if cluster and (cluster.rank != rank or cluster.size != world):
            raise TrainerEnvironmentError(
                f"TF_CONFIG (task {cluster.rank} of {cluster.size}) disagrees with {RANK_ENV}={rank} "
                f"and {WORLD_SIZE_ENV}={world}: the agent sets both; do not override one of them")
        return cls(
            rank=rank, world_size=world,
            generation=_int(env, GENERATION_ENV, 0, minimum=0),
            restart_count=_int(env, RESTART_COUNT_ENV, 0, minimum=0),
            backup_dir=env.get(BACKUP_DIR_ENV) or None,
            progress_socket=env.get(PROGRESS_SOCKET_ENV) or None,
            job=env.get(JOB_ENV) or None,
            node_id=env.get(NODE_ID_ENV) or None,
            task_type=cluster.task_type if cluster else None,
            task_index=cluster.task_index if cluster else 0,
            workers=cluster.workers if cluster else (),
            has_chief_job=cluster.has_chief if cluster else False,
            local_checkpoint_dir=env.get(LOCAL_CHECKPOINT_DIR_ENV) or None,
            restore_step=(_int(env, RESTORE_STEP_ENV, 0, minimum=0) if env.get(RESTORE_STEP_ENV) else None),
            ps=cluster.ps if cluster else (),
        )


def parse_collective(value: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The collective implementation: ``value``, else ``TFELASTIC_COLLECTIVE``, else AUTO (case-insensitive)."""
    env = os.environ if environ is None else environ
    name = value if value is not None else env.get(COLLECTIVE_ENV, "AUTO")
    upper = name.strip().upper()
    if upper not in COLLECTIVES:
        source = "collective" if value is not None else COLLECTIVE_ENV
        raise TrainerEnvironmentError(f"{source}={name!r} is not one of {', '.join(COLLECTIVES)} "
                                      "(AUTO lets TensorFlow choose: NCCL on GPUs, RING otherwise)")
    return upper


@dataclass(frozen=True)
class _Cluster:
    task_type: str
    task_index: int
    workers: tuple[str, ...]
    has_chief: bool
    ps: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return len(self.workers) + len(self.ps)

    @property
    def rank(self) -> int:
        """The chief, if any, first; then the parameter servers, if any; then the workers."""
        if self.task_type == CHIEF:
            return 0
        if self.task_type == PS:
            return 1 + self.task_index
        return self.task_index + (1 if self.has_chief else 0) + len(self.ps)


def _parse_tf_config(raw: str | None) -> _Cluster | None:
    if not raw:
        return None
    try:
        doc: Any = json.loads(raw)
    except json.JSONDecodeError as e:
        raise TrainerEnvironmentError(f"TF_CONFIG is not valid JSON ({e}): {raw[:200]!r}") from e
    if not isinstance(doc, dict):
        raise TrainerEnvironmentError(f"TF_CONFIG must be a JSON object, got {raw[:200]!r}")
    cluster, task = doc.get("cluster") or {}, doc.get("task") or {}
    if not cluster:
        return None  # TensorFlow treats a TF_CONFIG without a cluster as a single worker
    if not isinstance(cluster, dict) or not isinstance(task, dict):
        raise TrainerEnvironmentError(f"TF_CONFIG needs 'cluster' and 'task' objects, got {raw[:200]!r}")
    chief, workers, ps = cluster.get(CHIEF) or [], cluster.get(WORKER) or [], cluster.get(PS) or []
    if not all(isinstance(job, list) for job in (chief, workers, ps)) or not all(
            isinstance(a, str) for a in chief + workers + ps):
        raise TrainerEnvironmentError(f"TF_CONFIG cluster jobs must be lists of 'host:port' strings: {raw[:200]!r}")
    task_type, index = task.get("type"), task.get("index", 0)
    if task_type not in (CHIEF, WORKER, PS) or not isinstance(index, int) or isinstance(index, bool):
        raise TrainerEnvironmentError(f"TF_CONFIG task must be {{'type': 'worker', 'chief' or 'ps', 'index': N}}, "
                                      f"got {task!r}")
    if task_type == PS and not ps:
        raise TrainerEnvironmentError(f"TF_CONFIG task type 'ps' needs a 'ps' job in the cluster: {raw[:200]!r}")
    if ps and (len(chief) != 1 or not workers):
        # Ranks put the one chief first: ParameterServerStrategy runs its training loop there.
        raise TrainerEnvironmentError(f"TF_CONFIG with a 'ps' job needs exactly one 'chief' and at least one "
                                      f"'worker' address, got {len(chief)} and {len(workers)}: {raw[:200]!r}")
    size = {CHIEF: len(chief), WORKER: len(workers), PS: len(ps)}[task_type]
    if not 0 <= index < size:
        raise TrainerEnvironmentError(f"TF_CONFIG task index {index} is outside the {size} {task_type} addresses")
    return _Cluster(task_type, index, tuple(chief + workers), bool(chief), tuple(ps))


def _int(env: Mapping[str, str], name: str, default: int, *, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise TrainerEnvironmentError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise TrainerEnvironmentError(f"{name}={value} is below {minimum}")
    return value
