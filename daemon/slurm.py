"""SLURM: ``srun tfelastic run -- python train.py`` needs no other configuration.

Inside a job step (SLURM_JOB_ID and SLURM_PROCID set), the values that flags or the TOML file leave out come from
SLURM's environment, the variables TensorFlow's ``SlurmClusterResolver`` reads: the job name, this task's node id,
the node count, the rendezvous endpoint, the token file, and the trainer's GPUs. Explicit values always win; SLURM
values win over the built-in defaults. docs/configuration.md#slurm documents every rule.

Pure code: it reads a mapping of environment variables, never ``os.environ``, and touches the file system only
through the ``exists`` callable it is given (is the default token file there).
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable, Mapping
from itertools import product
from typing import Any

from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.options import default_of

DISABLE_ENV = "TFELASTIC_NO_SLURM"  # =1: ignore SLURM, like --no-slurm

# Rendezvous ports 29500-29999: 29500 + (JOB_ID mod 100) * 5 + (STEP_ID mod 5). Jobs whose ids differ by less
# than 100 (those likely to run at the same time) and the first 5 steps of a job never share a port on a node.
PORT_BASE = 29500
PORT_JOBS = 100
PORT_STEPS = 5

TOKEN_PATH = ".tfelastic/token"  # under $HOME, which SLURM clusters share across nodes
METRICS_PORT = default_of("metrics_port")  # under SLURM, task i of a node serves /metrics on this port + i
MAX_HOSTS = 65536  # a typo like node[1-99999999] must fail, not fill the memory

# AgentConfig fields this module may fill, in the order the start log line lists them.
FIELDS = ("job", "node_id", "min_nodes", "max_nodes", "rendezvous", "token_file", "metrics_port", "env")


class SlurmError(ConfigError):
    pass


# ------------------------------------------------------------------------------------------------ SLURM's syntax


def expand_hostlist(text: str) -> list[str]:
    """``node[01-03,07],gpu-a[1-2]`` -> node01 node02 node03 node07 gpu-a1 gpu-a2, in SLURM's order.

    Commas inside brackets separate ranges; the low bound's width sets the zero padding; several brackets in one
    name expand to every combination, the leftmost varying slowest (``r[1-2]n[1-2]``: r1n1 r1n2 r2n1 r2n2), as
    SLURM does. Raises ValueError that names the problem.
    """
    if not text:
        raise ValueError("the host list is empty")
    hosts: list[str] = []
    for name in _split_outside_brackets(text):
        pieces = [[literal] if literal else _expand_ranges(ranges) for literal, ranges in _pieces(name)]
        count = 1
        for piece in pieces:
            count *= len(piece)
        if len(hosts) + count > MAX_HOSTS:
            raise ValueError(f"{text!r} expands to more than {MAX_HOSTS} hosts")
        hosts.extend("".join(combination) for combination in product(*pieces))
    return hosts


def _split_outside_brackets(text: str) -> list[str]:
    names, depth, start = [], 0, 0
    for position, char in enumerate(text):
        if char.isspace():
            raise ValueError(f"{text!r} has whitespace at position {position}; SLURM host lists have none")
        if char == "[":
            if depth:
                raise ValueError(f"{text!r}: '[' at position {position} is inside another bracket")
            depth = 1
        elif char == "]":
            if not depth:
                raise ValueError(f"{text!r}: ']' at position {position} closes no bracket")
            depth = 0
        elif char == "," and not depth:
            names.append(text[start:position])
            start = position + 1
    if depth:
        raise ValueError(f"{text!r}: a '[' is never closed")
    names.append(text[start:])
    for name in names:
        if not name:
            raise ValueError(f"{text!r} has an empty host name (two commas in a row, or one at an end)")
    return names


def _pieces(name: str) -> list[tuple[str, str]]:
    """``n[1-2]x[3]`` -> [("n", ""), ("", "1-2"), ("x", ""), ("", "3")]: literals and bracket contents."""
    return [(literal, ranges) for literal, ranges in re.findall(r"([^\[]+)|\[([^\]]*)\]", name)]


def _expand_ranges(text: str) -> list[str]:
    """``01-03,7`` -> 01 02 03 7 (the bracket's content; also SLURM's GPU id lists)."""
    numbers: list[str] = []
    for part in text.split(","):
        match = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", part)
        if match is None:
            raise ValueError(f"{part!r} in [{text}] is not a number or a range like 01-04")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"range {part!r} in [{text}] runs backwards; write it low-high")
        if len(numbers) + int(high) - int(low) >= MAX_HOSTS:
            raise ValueError(f"range {part!r} in [{text}] has more than {MAX_HOSTS} numbers")
        numbers.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return numbers


def expand_tasks_per_node(text: str) -> list[int]:
    """``2(x3),1`` -> [2, 2, 2, 1]: tasks on each node of the node list, in its order."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"([0-9]+)(?:\(x([0-9]+)\))?", part)
        if match is None:
            raise ValueError(f"{part!r} in {text!r} is not COUNT or COUNT(xREPEAT), e.g. 2(x3)")
        count, repeat = int(match.group(1)), int(match.group(2) or 1)
        if count < 1 or repeat < 1:
            raise ValueError(f"{part!r} in {text!r}: counts and repeats must be at least 1")
        if len(counts) + repeat > MAX_HOSTS:
            raise ValueError(f"{text!r} lists more than {MAX_HOSTS} nodes")
        counts.extend([count] * repeat)
    return counts


def expand_gpu_ids(text: str) -> list[str]:
    """``0,1`` or ``0-3``: a list of GPU ids as SLURM writes them."""
    if not text:
        raise ValueError("the GPU list is empty")
    return [str(int(n)) for n in _expand_ranges(text)]


def parse_gpus_per_task(text: str) -> int:
    """``2``, ``a100:2`` or ``a100:1,v100:1`` (--gpus-per-task) -> the GPU count."""
    total = 0
    for part in text.split(","):
        count = part.rpartition(":")[2]
        if not (count.isascii() and count.isdigit()) or int(count) < 1:
            raise ValueError(f"{part!r} in {text!r} is not [TYPE:]COUNT with COUNT at least 1")
        total += int(count)
    return total


def rendezvous_port(job_id: int, step_id: int) -> int:
    return PORT_BASE + (job_id % PORT_JOBS) * PORT_STEPS + step_id % PORT_STEPS


# ------------------------------------------------------------------------------------------------ the job step


def disabled(environ: Mapping[str, str]) -> bool:
    return environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no")


class SlurmStep:
    """This task's view of its SLURM job step. ``complete`` fills the fields that explicit settings left out.

    Each value is derived only when it is needed, so a variable SLURM did not set is an error only when nothing
    explicit replaces it.
    """

    def __init__(self, environ: Mapping[str, str], exists: Callable[[str], bool] = os.path.exists) -> None:
        self._env = environ
        self._exists = exists
        self.note = ""  # one line for the start log: what came from SLURM

    @classmethod
    def detect(cls, environ: Mapping[str, str], *, off: bool = False,
               exists: Callable[[str], bool] = os.path.exists) -> SlurmStep | None:
        """The step this process runs in; None outside SLURM, or when --no-slurm or TFELASTIC_NO_SLURM say so."""
        if off or disabled(environ) or not environ.get("SLURM_JOB_ID") or not environ.get("SLURM_PROCID"):
            return None
        return cls(environ, exists)

    # The variables

    def _first(self, *names: str) -> tuple[str, str]:
        """(name, value) of the first variable of ``names`` that is set; SlurmError naming them all if none is."""
        for name in names:
            value = self._env.get(name, "")
            if value:
                return name, value
        raise SlurmError(f"{' / '.join(names)}: not set in this SLURM job step; start tfelastic with srun (one "
                         "task per agent), or give this value explicitly (a flag or the TOML key), or --no-slurm")

    def _int(self, name: str, *, default: int | None = None) -> int:
        if default is not None and not self._env.get(name):
            return default
        value = self._first(name)[1]
        if not (value.isascii() and value.isdigit()):
            raise SlurmError(f"{name}: {value!r} is not a non-negative integer; SLURM sets it to one")
        return int(value)

    def _parsed(self, parse: Callable[[str], Any], *names: str) -> tuple[str, Any]:
        name, value = self._first(*names)
        try:
            return name, parse(value)
        except ValueError as e:
            raise SlurmError(f"{name}: {e}") from None

    def job_id(self) -> int:
        return self._int("SLURM_JOB_ID")

    def step_id(self) -> int:
        return self._int("SLURM_STEP_ID", default=0)  # absent in a batch script: not a step of its own

    def local_id(self) -> int:
        return self._int("SLURM_LOCALID")

    def num_tasks(self) -> tuple[str, int]:
        name, value = self._first("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        count = self._int(name)
        if count < 1:
            raise SlurmError(f"{name}: {value!r}: a step has at least 1 task")
        return name, count

    def nodes(self) -> tuple[str, list[str]]:
        name, hosts = self._parsed(expand_hostlist, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        return name, hosts

    def tasks_per_node(self) -> tuple[str, list[int]] | None:
        if not (self._env.get("SLURM_STEP_TASKS_PER_NODE") or self._env.get("SLURM_TASKS_PER_NODE")):
            return None
        name, counts = self._parsed(expand_tasks_per_node, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
        nodes_name, hosts = self.nodes()
        if len(counts) != len(hosts):
            raise SlurmError(f"{name}: {self._env[name]!r} counts tasks on {len(counts)} nodes, but {nodes_name} "
                             f"lists {len(hosts)}: {','.join(hosts[:8])}{'...' if len(hosts) > 8 else ''}")
        return name, counts

    # The derived values: (value, the variables it came from)

    def job_name(self) -> tuple[str, str]:
        # Not the step: a requeued job, or a later srun of the same job, resumes from the same backup directory.
        return f"slurm-{self.job_id()}", "SLURM_JOB_ID"

    def node_count(self) -> tuple[int, str]:
        name, count = self.num_tasks()
        return count, name

    def several_tasks_per_node(self) -> bool:
        counts = self.tasks_per_node()
        if counts is not None:
            return max(counts[1]) > 1
        return self.num_tasks()[1] > len(self.nodes()[1])

    def node_id(self) -> tuple[str, str]:
        _, node = self._first("SLURMD_NODENAME")
        if not self.several_tasks_per_node():
            return node, "SLURMD_NODENAME"
        return f"{node}-{self.local_id()}", "SLURMD_NODENAME, SLURM_LOCALID"

    def rendezvous(self) -> tuple[Endpoint, str]:
        name, hosts = self.nodes()
        endpoint = Endpoint(hosts[0], rendezvous_port(self.job_id(), self.step_id()))
        return endpoint, f"{name}, SLURM_JOB_ID, SLURM_STEP_ID"

    def metrics_port(self) -> tuple[int, str]:
        return (METRICS_PORT or 0) + self.local_id(), "SLURM_LOCALID"

    def default_token_file(self, rendezvous: Endpoint) -> tuple[str, str]:
        """$HOME/.tfelastic/token. Never a token made from the job's public values: anyone could compute it."""
        home = self._env.get("HOME") or os.path.expanduser("~")
        path = os.path.join(home, TOKEN_PATH)
        if not self._exists(path):
            folder = os.path.dirname(path)
            raise SlurmError(
                f"--token-file: the rendezvous {rendezvous} is not loopback, so a shared token is required, and "
                f"the SLURM default token file {path} does not exist; create it once (the home directory is "
                f"shared by the nodes): (umask 077 && mkdir -p {shlex.quote(folder)} && openssl rand -hex 32 > "
                f"{shlex.quote(path)}), or give a token file (--token-file, TOML rendezvous.token_file)")
        return path, "$HOME"

    def trainer_gpus(self) -> tuple[str, str] | None:
        """CUDA_VISIBLE_DEVICES for the trainer when SLURM named this task's GPUs but did not set it.

        GPU_DEVICE_ORDINAL first: SLURM sets it to what it would put in CUDA_VISIBLE_DEVICES (relative to a device
        cgroup). The global ids of SLURM_STEP_GPUS/SLURM_JOB_GPUS are right only without one. When the list holds
        more than --gpus-per-task GPUs, task SLURM_LOCALID takes its own slice, as SlurmClusterResolver does.
        """
        names = ("GPU_DEVICE_ORDINAL", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS")
        if not any(self._env.get(name) for name in names):
            return None
        name, ids = self._parsed(expand_gpu_ids, *names)
        if not self._env.get("SLURM_GPUS_PER_TASK"):
            return ",".join(ids), name
        per_task = self._parsed(parse_gpus_per_task, "SLURM_GPUS_PER_TASK")[1]
        if len(ids) <= per_task:
            return ",".join(ids), name
        local = self.local_id()
        mine = ids[local * per_task:(local + 1) * per_task]
        if len(mine) < per_task:
            raise SlurmError(f"{name}: {self._env[name]!r} has {len(ids)} GPUs, too few for task SLURM_LOCALID="
                             f"{local} with SLURM_GPUS_PER_TASK={per_task}; set CUDA_VISIBLE_DEVICES for the "
                             "trainer (TOML job.env) or fix the allocation")
        return ",".join(mine), f"{name}, SLURM_GPUS_PER_TASK, SLURM_LOCALID"

    # Filling a configuration

    def complete(self, explicit: dict[str, Any]) -> dict[str, Any]:
        """``explicit`` (AgentConfig field -> value, from flags or the file) with SLURM's values for the fields it
        lacks. Records the start log line in ``note``."""
        values = dict(explicit)
        found: list[str] = []

        def fill(field: str, derive: Callable[[], tuple[Any, str]]) -> None:
            if field not in values:
                value, source = derive()
                values[field] = value
                found.append(f"{field}={value} ({source})")

        fill("job", self.job_name)
        fill("node_id", self.node_id)
        fill("min_nodes", self.node_count)
        fill("max_nodes", self.node_count)
        fill("rendezvous", self.rendezvous)
        if not values["rendezvous"].is_loopback():
            fill("token_file", lambda: self.default_token_file(values["rendezvous"]))
        if METRICS_PORT is not None and self.several_tasks_per_node():  # one port per task on a node
            fill("metrics_port", self.metrics_port)
        found.extend(self._fill_gpus(values))
        given = [field for field in FIELDS if field in explicit]
        self.note = (f"SLURM job {self.job_id()} step {self.step_id()}, task {self._env['SLURM_PROCID']}: "
                     f"from SLURM: {', '.join(found) or 'nothing'}; given explicitly: {', '.join(given) or 'nothing'}")
        return values

    def _fill_gpus(self, values: dict[str, Any]) -> list[str]:
        env = dict(values.get("env", ()))
        if "CUDA_VISIBLE_DEVICES" in env:
            return []
        if "CUDA_VISIBLE_DEVICES" in self._env:
            return [f"CUDA_VISIBLE_DEVICES={self._env['CUDA_VISIBLE_DEVICES']} (kept as set)"]
        gpus = self.trainer_gpus()
        if gpus is None:
            return []
        env["CUDA_VISIBLE_DEVICES"] = gpus[0]
        values["env"] = tuple(sorted(env.items()))
        return [f"CUDA_VISIBLE_DEVICES={gpus[0]} ({gpus[1]})"]
