"""The GPU acceptance kit: what tfelastic does around a GPU, checked on a machine with one (an H100 or H200 lent
for a few minutes), in one go of at most 8 minutes, from the working tree alone.

    python bench/gpu_kit.py [--gib 4] [--wheels .whl] [--out DIR] [--dry]

It prints ONE JSON summary on stdout (its progress goes to stderr) and exits 0 if every check passed, 1 if one
failed, 2 if it could not run. The checks (docs/benchmarks.md, "The GPU acceptance kit", says more):

* ``metrics_vs_nvidia_smi``: the GPU collector's readings against ``nvidia-smi --query-gpu`` at the same moment
  (each reading between two of nvidia-smi's, within the tolerance in the summary), under the stand-in trainers'
  load; a reading the driver does not support must be absent from ours too ("not supported");
* ``agent_metrics``: an agent's /metrics has the same GPU series, with the same labels and static values;
* ``health``: the collector's health verdict (XID events, uncorrectable ECC, retired pages, row remapping) agrees
  with nvidia-smi's counters;
* ``two_agents``: two agents on this machine supervise a stand-in trainer each (bench/gpu_standin_trainer.py:
  PyTorch, several GiB on the GPU, matrix products, progress reports through tfelastic.trainer.progress);
* ``standby_holds_no_gpu``: each agent's standby interpreter is ready, and NVML lists no process of it, while it
  lists the trainers (so NVML's pids are this machine's);
* ``kill_and_relaunch``: SIGKILL of one trainer: when NVML stops listing the old trainers, and the next
  generation starts only after that, with each agent's ``tfelastic_gpu_release_wait_seconds``, up to the next
  generation's first GPU step;
* ``node_check``: the node check's NVML health passes, and it says that its matmul cannot run without
  TensorFlow.

The machine has Python 3.12, PyTorch, nvidia-ml-py, grpcio, psutil, prometheus-client and protobuf, and no
TensorFlow and no network. tfelastic is not installed there: the kit imports it from a tree of symlinks in
build/gpu-kit (as tests/lint.sh builds one for mypy), for itself and for the agents. A module tfelastic needs
that the machine lacks, or has too old, is installed from the wheels in ``--wheels`` (default ``.whl``, carried
along; see docs/benchmarks.md) into build/gpu-kit/deps.

``--dry`` runs every step here, without a GPU: NVML is the FAKE of tests/nvml_fake.py (tests/gpu_kit_dry.py
shares it across processes and puts an nvidia-smi on it), the trainer is a CPU stand-in, and TensorFlow is hidden
as on the GPU machine. tests/integration/test_gpu_kit.py runs it, so that the kit cannot rot; its numbers say
nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STANDIN = ROOT / "bench" / "gpu_standin_trainer.py"
BUDGET_SECONDS = 450.0  # the kit's own deadline: 7.5 of the 8 minutes, the rest for start-up and the summary
POLL = 0.01  # how often the kit asks NVML whether the old trainers' memory is back
# What tfelastic imports that a machine may lack, by distribution: its floor is read from pyproject.toml.
IMPORTED_AS = {"grpcio": "grpc", "grpcio-health-checking": "grpc_health", "protobuf": "google.protobuf",
               "psutil": "psutil", "prometheus-client": "prometheus_client", "nvidia-ml-py": "pynvml"}
HIDDEN = ("tensorflow", "tf_keras", "keras")  # the dry mode hides these, as the GPU machine has none
NOT_CHECKED = (
    "TensorFlow on a GPU: the GPU machines have no TensorFlow and its GPU wheel is far larger than what can be "
    "carried there; the stand-in trainer is PyTorch",
    "NCCL and collectives across GPUs or nodes: one GPU, and the stand-in trainers do not communicate",
    "the hardened systemd unit's device access (systemd/tfelastic@.service): the machine runs no systemd for us",
    "a GPU that never gives memory back, XIDs, ECC errors and retired or remapped pages as they happen: a healthy "
    "GPU cannot show them (tests/unit/test_gpu_release.py and tests/unit/test_gpu_metrics.py, on the fake NVML)",
)

# nvidia-smi --query-gpu fields: those every driver of the last years knows, and those the kit asks about one by
# one first (an unknown field fails the whole query).
SMI_FIELDS = ("index", "uuid", "name", "driver_version", "memory.total", "memory.used", "utilization.gpu",
              "temperature.gpu", "power.draw", "clocks.sm")
SMI_OPTIONAL = ("memory.reserved", "power.draw.average", "power.draw.instant", "ecc.errors.corrected.volatile.total",
                "ecc.errors.uncorrected.volatile.total", "retired_pages.pending", "remapped_rows.pending",
                "remapped_rows.failure", "clocks_event_reasons.active", "clocks_throttle_reasons.active")
NOT_SUPPORTED = ("[N/A]", "N/A", "[Not Supported]", "Not Supported", "[Unknown Error]", "")
MIB = 2**20


@dataclass(frozen=True)
class Tolerance:
    """A reading agrees if it lies within ``absolute`` or ``relative`` (of nvidia-smi's) of the range of the two
    nvidia-smi readings taken just before and after it."""

    absolute: float
    relative: float = 0.0

    def allows(self, ours: float, before: float, after: float) -> bool:
        low, high = min(before, after), max(before, after)
        slack = max(self.absolute, self.relative * high)
        return low - slack <= ours <= high + slack

    def describe(self) -> str:
        return f"±{self.absolute:g}" + (f" or ±{self.relative:.0%}" if self.relative else "")


# Our metric, its factor to nvidia-smi's unit, nvidia-smi's fields (the first one supported that agrees wins: the
# memory used with or without the driver's reservation, the power as drawn, averaged or instant), the tolerance.
COMPARED: tuple[tuple[str, str, float, tuple[str, ...], Tolerance], ...] = (
    ("memory_total_mib", "tfelastic_gpu_memory_total_bytes", 1 / MIB, ("memory.total",), Tolerance(1)),
    ("memory_used_mib", "tfelastic_gpu_memory_used_bytes", 1 / MIB, ("memory.used", "memory.used+memory.reserved"),
     Tolerance(64)),
    ("utilization_percent", "tfelastic_gpu_utilization_ratio", 100, ("utilization.gpu",), Tolerance(20)),
    ("temperature_celsius", "tfelastic_gpu_temperature_celsius", 1, ("temperature.gpu",), Tolerance(3)),
    ("power_watts", "tfelastic_gpu_power_watts", 1, ("power.draw", "power.draw.average", "power.draw.instant"),
     Tolerance(30, 0.15)),
    ("sm_clock_mhz", "tfelastic_gpu_sm_clock_hertz", 1e-6, ("clocks.sm",), Tolerance(50, 0.05)),
    ("ecc_corrected_volatile", "tfelastic_gpu_ecc_errors_total:corrected", 1,
     ("ecc.errors.corrected.volatile.total",), Tolerance(0)),
    ("ecc_uncorrected_volatile", "tfelastic_gpu_ecc_errors_total:uncorrected", 1,
     ("ecc.errors.uncorrected.volatile.total",), Tolerance(0)),
)
UNDER_LOAD_PERCENT = 50  # two trainers running products back to back keep the GPU busier than this


class KitError(Exception):
    """The kit cannot go on (a missing module, no GPU, an agent that did not start): exit 2."""


def log(message: str) -> None:
    print(f"[gpu-kit {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Deadline:
    seconds: float
    started: float = field(default_factory=time.monotonic)

    def left(self, wanted: float) -> float:
        return max(0.0, min(wanted, self.started + self.seconds - time.monotonic()))


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    ends = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > ends:
            raise KitError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# ------------------------------------------------------------------------------------------- the environment


@dataclass
class Setup:
    """Where the run keeps its files, and how its processes import tfelastic."""

    run: Path
    pythonpath: list[str]
    dry: bool

    @property
    def holders(self) -> Path:
        return self.run / "holders"

    @property
    def events(self) -> Path:
        return self.run / "events.jsonl"

    def env(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(self.pythonpath), PYTHONUNBUFFERED="1")
        if self.dry:
            from tests.gpu_kit_dry import HOLDERS_ENV

            env[HOLDERS_ENV] = str(self.holders)
        return env


def prepare(kit: Path, wheels: Path, dry: bool) -> Setup:
    """In ``kit``: tfelastic importable from the tree, the modules it needs present (from ``wheels`` if need be),
    a fresh run directory; in the dry mode TensorFlow hidden, for the kit and every process it starts."""
    tree = kit / "py"
    (tree / "tfelastic").mkdir(parents=True, exist_ok=True)
    for package in ("daemon", "trainer"):
        _link(tree / "tfelastic" / package, ROOT / package)
    path = [str(tree)]
    missing = _missing_requirements(path)
    if missing:
        path.insert(0, str(_install(missing, wheels, kit / "deps")))
        still = _missing_requirements(path)
        if still:
            raise KitError(f"tfelastic needs {', '.join(still)}, which this Python lacks and {wheels} does not "
                           "provide: carry their wheels there (docs/benchmarks.md says how)")
    if dry:
        hider = kit / "no-tensorflow"
        hider.mkdir(parents=True, exist_ok=True)
        (hider / "sitecustomize.py").write_text(
            '"""The GPU kit\'s dry mode hides TensorFlow, as the GPU machine has none."""\nimport sys\n\n'
            f"sys.modules.update(dict.fromkeys({HIDDEN!r}))\n")
        sys.modules.update(dict.fromkeys(HIDDEN))  # type: ignore[arg-type]  # None: "not importable"
        path = [str(hider), *path, str(ROOT)]  # the repository's root: tests.gpu_kit_dry
    sys.path[:0] = [p for p in path if p not in sys.path]
    run = Path(tempfile.mkdtemp(prefix=time.strftime("run-%Y%m%d-%H%M%S-"), dir=kit))
    return Setup(run, path, dry)


def _link(link: Path, target: Path) -> None:
    """``link`` -> ``target``, replaced in one step if it points elsewhere (another kit may be running)."""
    if link.is_symlink() and link.resolve() == target.resolve():
        return
    temporary = link.with_name(f".{link.name}.{os.getpid()}")
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(target)
    os.replace(temporary, link)


# Run in a fresh interpreter with the kit's path: what this process imported already cannot mislead it.
_VERSIONS = """
import importlib, json, sys
from importlib import metadata
found = {}
for module, distribution in json.loads(sys.argv[1]):
    try:
        importlib.import_module(module)
        found[distribution] = metadata.version(distribution)
    except Exception:
        found[distribution] = None
print(json.dumps(found))
"""


def requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[tuple[str, str, str]]:
    """(module, distribution, lowest version) of what tfelastic imports that a machine may lack: the floors
    pyproject.toml declares (grpcio's and protobuf's are those of the generated code)."""
    import tomllib

    floors = {}
    for requirement in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        if found := re.match(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement):
            floors[found[1]] = found[2]
    return [(module, distribution, floors[distribution]) for distribution, module in IMPORTED_AS.items()]


def _missing_requirements(path: list[str]) -> list[str]:
    """The requirements a Python with ``path`` first on its own lacks, or has too old."""
    needed = requirements()
    pairs = json.dumps([[module, distribution] for module, distribution, _ in needed])
    done = subprocess.run([sys.executable, "-c", _VERSIONS, pairs], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)))
    if done.returncode != 0:
        raise KitError(f"cannot read this Python's modules: {done.stderr.strip()[-300:]}")
    found = json.loads(done.stdout)
    missing = []
    for _, distribution, lowest in needed:
        version = found[distribution]
        if version is None:
            missing.append(f"{distribution}>={lowest}")
        elif _version(version) < _version(lowest):
            missing.append(f"{distribution}>={lowest} (this Python has {version})")
    return missing


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _install(missing: list[str], wheels: Path, target: Path) -> Path:
    requirements = [m.split(" ")[0] for m in missing]
    if not wheels.is_dir():
        raise KitError(f"tfelastic needs {', '.join(missing)}, and there is no wheel directory {wheels}")
    log(f"installing {', '.join(requirements)} from {wheels} into {target}")
    shutil.rmtree(target, ignore_errors=True)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links",
                           str(wheels), "--target", str(target), *requirements], capture_output=True, text=True)
    if done.returncode != 0:
        raise KitError(f"pip could not install {', '.join(requirements)} from {wheels}: {done.stderr.strip()[-500:]}")
    return target


# ------------------------------------------------------------------------------------------------ NVML, smi


def collector(setup: Setup) -> Any:
    """The agent's GPU collector, in this process and uncached: it reads NVML when asked."""
    from tfelastic.daemon.metrics.gpu import GpuCollector

    if setup.dry:
        from tests.gpu_kit_dry import DryNvml

        return GpuCollector(nvml=DryNvml(str(setup.holders)), cache_seconds=0.0)
    return GpuCollector(cache_seconds=0.0)


def readings(gpus: Any) -> dict[str, dict[str, Any]]:
    """The collector's samples per GPU index: metric name (``name:type`` for ECC) -> value, and the labels."""
    found: dict[str, dict[str, Any]] = {}
    for family in gpus.collect():
        for sample in family.samples:
            if "gpu" not in sample.labels:
                continue
            gpu = found.setdefault(sample.labels["gpu"], {"labels": {}})
            key = sample.name + (f":{sample.labels['type']}" if "type" in sample.labels else "")
            if "reason" in sample.labels:
                gpu.setdefault("throttle", {})[sample.labels["reason"]] = sample.value
                continue
            gpu[key] = sample.value
            gpu["labels"].update(sample.labels)
    return found


class NvidiaSmi:
    def __init__(self, command: Sequence[str], env: dict[str, str]) -> None:
        self.command, self.env = list(command), env
        optional = list(SMI_OPTIONAL) if self._valid(SMI_OPTIONAL) else [f for f in SMI_OPTIONAL if self._valid([f])]
        self.fields = [*SMI_FIELDS, *optional]

    def _run(self, fields: Sequence[str]) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run([*self.command, f"--query-gpu={','.join(fields)}",
                                   "--format=csv,noheader,nounits"], capture_output=True, text=True, env=self.env,
                                  timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise KitError(f"cannot run {self.command[0]}: {e}") from e

    def _valid(self, fields: Sequence[str]) -> bool:
        """Whether this nvidia-smi knows every one of ``fields`` (an older one fails on a field it does not)."""
        return self._run(fields).returncode == 0

    def query(self) -> dict[str, dict[str, str]]:
        """nvidia-smi's readings per GPU index."""
        done = self._run(self.fields)
        if done.returncode != 0:
            raise KitError(f"nvidia-smi failed ({done.returncode}): {(done.stderr or done.stdout).strip()[:300]}")
        rows = csv.reader(done.stdout.strip().splitlines(), skipinitialspace=True)
        return {row[0]: dict(zip(self.fields, (v.strip() for v in row), strict=True)) for row in rows if row}


def smi_number(row: dict[str, str], spelled: str) -> float | None:
    """A field's value as a number (``a+b`` adds two fields); None where nvidia-smi does not give one."""
    total = 0.0
    for name in spelled.split("+"):
        value = row.get(name)
        if value is None or value in NOT_SUPPORTED:
            return None
        try:
            total += float(int(value, 16)) if value.startswith("0x") else float(value)
        except ValueError:
            return None
    return total


def compare(ours: dict[str, Any], before: dict[str, str], after: dict[str, str]) -> dict[str, Any]:
    """Each compared reading of one GPU: ours between nvidia-smi's two, within the tolerance."""
    fields: dict[str, Any] = {}
    for name, metric, factor, spellings, tolerance in COMPARED:
        value = ours.get(metric)
        mine = None if value is None else value * factor
        result: dict[str, Any] = {"ours": mine, "tolerance": tolerance.describe()}
        offered: list[tuple[str, float, float]] = []
        for spelled in spellings:
            b, a = smi_number(before, spelled), smi_number(after, spelled)
            if b is not None and a is not None:
                offered.append((spelled, b, a))
        if not offered:
            result["nvidia_smi"] = "not supported"
            # The driver does not say: ours may still (a newer NVML call than nvidia-smi's field), never the
            # other way round.
            result["ok"] = True
            result["note"] = "not supported by the driver" if mine is None else "nvidia-smi does not say"
        elif mine is None:
            result.update(nvidia_smi=offered[0][1], ok=False, note="the driver gives it, the collector does not")
        else:
            agreeing = [(s, b, a) for s, b, a in offered if tolerance.allows(mine, b, a)]
            spelled, b, a = (agreeing or offered)[0]
            result.update(nvidia_smi_field=spelled, nvidia_smi=[b, a], ok=bool(agreeing))
        fields[name] = result
    return fields


def metrics_vs_smi(gpus: Any, smi: NvidiaSmi, rounds: int = 3) -> dict[str, Any]:
    """``rounds`` times the collector between two nvidia-smi readings (each round's last is the next one's
    first). A reading agrees if it agrees in most rounds."""
    samples: list[dict[str, dict[str, Any]]] = []
    after = smi.query()
    for _ in range(rounds):
        before, ours, after = after, readings(gpus), smi.query()
        samples.append({index: compare(ours.get(index, {}), before[index], after.get(index, before[index]))
                        for index in before})
    per_gpu: dict[str, Any] = {}
    for index in samples[0]:
        fields = {}
        for name in samples[0][index]:
            seen = [s[index][name] for s in samples]
            agreed = sum(1 for s in seen if s["ok"])
            fields[name] = {**seen[-1], "agreed_rounds": f"{agreed}/{rounds}", "ok": agreed * 2 > rounds}
        utilization = fields["utilization_percent"].get("ours") or 0
        fields["under_load"] = {"ours": utilization, "at_least": UNDER_LOAD_PERCENT,
                                "ok": utilization >= UNDER_LOAD_PERCENT}
        per_gpu[index] = fields
    ok = all(f["ok"] for gpu in per_gpu.values() for f in gpu.values())
    return {"ok": ok, "gpus": per_gpu, "smi_fields": smi.fields,
            "failed": [f"GPU {i}: {n}" for i, gpu in per_gpu.items() for n, f in gpu.items() if not f["ok"]]}


def health(gpus: Any, smi: NvidiaSmi) -> dict[str, Any]:
    """The collector's health verdict against what nvidia-smi's counters say, and the XID events."""
    problems = gpus.health_problems()
    row_by_gpu = smi.query()
    smi_problems = []
    for index, row in row_by_gpu.items():
        uncorrected = smi_number(row, "ecc.errors.uncorrected.volatile.total")
        if uncorrected:
            smi_problems.append(f"GPU {index}: {uncorrected:.0f} uncorrectable ECC error(s)")
        for name in ("retired_pages.pending", "remapped_rows.pending", "remapped_rows.failure"):
            if row.get(name, "").lower() in ("yes", "1"):
                smi_problems.append(f"GPU {index}: {name}")
    ours = readings(gpus)
    xids = {index: ("not supported" if "tfelastic_gpu_xid_errors_total" not in gpu else
                    {"since_start": gpu["tfelastic_gpu_xid_errors_total"], "last": gpu["tfelastic_gpu_last_xid"]})
            for index, gpu in ours.items()}
    readings_by_gpu = {index: {name: row.get(name, "not queried") for name in (
        "ecc.errors.uncorrected.volatile.total", "retired_pages.pending", "remapped_rows.pending",
        "remapped_rows.failure")} for index, row in row_by_gpu.items()}
    return {"ok": bool(problems) == bool(smi_problems), "healthy": not problems and not smi_problems,
            "collector_problems": problems, "nvidia_smi_problems": smi_problems, "nvidia_smi": readings_by_gpu,
            "xid_events": xids, "note": "nvidia-smi has no XID field: the collector's XID count is reported, not "
                                        "compared"}


# --------------------------------------------------------------------------------------------- the agents


@dataclass
class Agent:
    node_id: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def metrics_url(self) -> str:
        found = wait_for(lambda: re.search(r"metrics on http://(\S+)/metrics", self.log()), 30,
                         f"agent {self.node_id}'s metrics address")
        return f"http://{found.group(1)}/metrics"

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.metrics_url(), timeout=10) as response:
            text = response.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def value(self, name: str, **labels: str) -> float | None:
        return self.scrape().get((name, tuple(sorted(labels.items()))))

    def tail(self, lines: int = 25) -> list[str]:
        return self.log().splitlines()[-lines:]


class Agents:
    """Two agents on this machine, one hosting the rendezvous, each supervising a stand-in trainer."""

    def __init__(self, setup: Setup, gib: float) -> None:
        from tfelastic.daemon.netutil import free_port

        self.setup, self.port = setup, free_port()
        device = "cpu" if setup.dry else "cuda"
        self.trainer = [sys.executable, str(STANDIN), "--events", str(setup.events), "--gib", str(gib),
                        "--device", device]
        self.agents: list[Agent] = []

    def start(self) -> None:
        host = self._start("a")
        wait_for(lambda: "hosting the coordinator" in host.log() or host.proc.poll() is not None, 60,
                 "agent a to host the rendezvous")
        if host.proc.poll() is not None:
            raise KitError(f"agent a exited with {host.proc.returncode}: {host.tail(10)}")
        self._start("b")

    def _start(self, node_id: str) -> Agent:
        entry = ["-m", "tests.gpu_kit_dry", "agent"] if self.setup.dry else ["-m", "tfelastic.daemon"]
        command = [sys.executable, *entry, "run", "--nodes", "2", "--rendezvous", f"127.0.0.1:{self.port}",
                   "--node-id", node_id, "--metrics-port", "0", "--metrics-linger", "0",
                   "--backup-dir", str(self.setup.run / "backup"), "--local-checkpoint-dir", "off",
                   "--stall-timeout", "off", "--", *self.trainer]
        log_path = self.setup.run / f"agent-{node_id}.log"
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=self.setup.env(),
                                    cwd=self.setup.run)
        agent = Agent(node_id, proc, log_path)
        self.agents.append(agent)
        return agent

    def events(self) -> list[dict[str, Any]]:
        if not self.setup.events.exists():
            return []
        return [json.loads(line) for line in self.setup.events.read_text().splitlines() if line.strip()]

    def generation(self, at_least: int, event: str) -> list[dict[str, Any]] | None:
        """The ``event`` of both ranks of the newest generation >= ``at_least`` that has both, else None."""
        found: dict[int, dict[int, dict[str, Any]]] = {}
        for e in self.events():
            if e["event"] == event and e["generation"] >= at_least:
                found.setdefault(e["generation"], {})[e["rank"]] = e
        complete = [g for g, ranks in found.items() if len(ranks) == 2]
        return list(found[max(complete)].values()) if complete else None

    def running(self) -> bool:
        """True, or KitError: an agent that exited before the checks are done ends the run."""
        for agent in self.agents:
            if agent.proc.poll() is not None:
                raise KitError(f"agent {agent.node_id} exited with {agent.proc.returncode}: {agent.tail(10)}")
        return True

    def stop(self) -> dict[str, int | None]:
        for agent in self.agents:
            if agent.proc.poll() is None:
                agent.proc.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for agent in self.agents:
            try:
                codes[agent.node_id] = agent.proc.wait(30)
            except subprocess.TimeoutExpired:
                agent.proc.kill()
                codes[agent.node_id] = agent.proc.wait()
        return codes


# ------------------------------------------------------------------------------------------------ the checks


def standby_pids(agents: Agents) -> list[int]:
    """The standby interpreters under the kit's agents (running daemon/worker/standby.py, not yet a trainer)."""
    import psutil
    from tfelastic.daemon.worker.warm import STANDBY_PATH as standby

    found = []
    for agent in agents.agents:
        with contextlib.suppress(psutil.Error):
            for process in psutil.Process(agent.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if process.cmdline()[1:2] == [standby]:  # PYTHON STANDBY_PATH; its keeper has it later
                        found.append(process.pid)
    return found


def listed_pids(gpus: Any) -> set[int]:
    return {p.pid for p in gpus.processes() or []}


def standby_check(agents: Agents, gpus: Any, deadline: Deadline) -> dict[str, Any]:
    wait_for(lambda: agents.running() and all(a.value("tfelastic_standby_ready") == 1.0 for a in agents.agents),
             deadline.left(120), "both agents' standby interpreters to be ready", interval=0.5)
    standbys = standby_pids(agents)
    trainers = {e["pid"] for e in agents.generation(1, "first_gpu_step") or []}
    listed = listed_pids(gpus)
    seen_trainers = sorted(trainers & listed)
    result = {"standby_pids": standbys, "trainer_pids": sorted(trainers), "nvml_pids": sorted(listed),
              "standbys_listed_by_nvml": sorted(set(standbys) & listed), "trainers_listed_by_nvml": seen_trainers}
    if len(standbys) != 2:
        return {**result, "ok": False, "note": f"expected a standby per agent, found {len(standbys)}"}
    if len(seen_trainers) != len(trainers):
        return {**result, "ok": False, "note": "NVML does not list the trainers' pids: its pids are not this "
                "machine's pid namespace (a container?), so neither this check nor the GPU release check can "
                "match a process here"}
    return {**result, "ok": not result["standbys_listed_by_nvml"],
            "note": "NVML lists the trainers and no standby: a standby holds no GPU context"}


def node_check(setup: Setup, gpus: Any, agents: Agents) -> dict[str, Any]:
    from tfelastic.daemon.agent.nodecheck import NO_TENSORFLOW, NodeCheck

    check = NodeCheck(str(setup.run / "node-check"), "gpu-kit", min_free_bytes=1,
                      gpu_problems=gpus.health_problems, gpu_count=lambda: gpus.utilization()[0])
    failure = check.run()
    skipped = check.matmul_skipped()  # NO_TENSORFLOW on the GPU machines
    agents_said = {a.node_id: {"passed": "node check passed" in a.log(),
                               "said_no_matmul": NO_TENSORFLOW in a.log() if skipped else "(it ran)"}
                   for a in agents.agents}
    ok = failure == "" and all(said["passed"] and said["said_no_matmul"] for said in agents_said.values())
    return {"ok": ok, "nvml_health": "passed" if failure == "" else failure,
            "matmul": skipped or "ran on every GPU and passed", "agents_first_check": agents_said}


def kill_and_relaunch(agents: Agents, gpus: Any, deadline: Deadline) -> dict[str, Any]:
    first = sorted(agents.generation(1, "first_gpu_step") or [], key=lambda e: e["rank"])
    generation = first[0]["generation"] + 1
    old = {e["pid"]: e for e in first}
    victim = first[0]["pid"]
    listed_before = listed_pids(gpus)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    log(f"killed the trainer pid {victim} (rank 0 of generation {generation - 1})")
    freed: dict[int, float] = {}
    ends = time.monotonic() + deadline.left(60)
    while len(freed) < len(old) and time.monotonic() < ends:
        listed = listed_pids(gpus)
        now = time.time()
        for pid in old:
            if pid not in listed and pid not in freed:
                freed[pid] = now
        time.sleep(POLL)
    started = wait_for(lambda: agents.running() and agents.generation(generation, "start"), deadline.left(120),
                       "the next generation to start")
    stepped = wait_for(lambda: agents.running() and agents.generation(generation, "first_gpu_step"),
                       deadline.left(180),
                       "the next generation's first GPU step")
    released_at = max(freed.values()) if len(freed) == len(old) else None
    next_start = min(e["time"] for e in started)
    waits = {a.node_id: {"count": a.value("tfelastic_gpu_release_wait_seconds_count"),
                         "sum_s": a.value("tfelastic_gpu_release_wait_seconds_sum")} for a in agents.agents}
    launches = {a.node_id: {start: a.value("tfelastic_worker_launches_total", start=start)
                            for start in ("warm", "cold")} for a in agents.agents}
    after_release = released_at is not None and next_start >= released_at - 2 * POLL
    result = {
        "killed_pid": victim, "old_trainers_listed_before": sorted(set(old) & listed_before),
        "kill_to_memory_free_s": {str(pid): round(freed[pid] - killed_at, 3) if pid in freed else None
                                  for pid in old},
        "kill_to_next_generation_start_s": round(next_start - killed_at, 3),
        "kill_to_next_first_gpu_step_s": round(max(e["time"] for e in stepped) - killed_at, 3),
        "next_generation": stepped[0]["generation"], "relaunch_after_release": after_release,
        "agents_release_wait": waits, "launches": launches,
    }
    problems = []
    if set(old) - listed_before:
        problems.append("NVML did not list every old trainer before the kill: nothing to wait for")
    if released_at is None:
        problems.append("NVML still lists an old trainer 60 s after the kill")
    if not after_release:
        problems.append("the next generation started before NVML stopped listing the old trainers")
    if any(not (w["count"] or 0) >= 1 for w in waits.values()):
        problems.append("an agent did not measure its GPU release wait")
    return {**result, "ok": not problems, "problems": problems}


def leftovers(setup: Setup, standbys: list[int]) -> list[int]:
    """Processes of the run still alive after the agents exited (trainers, standbys)."""
    import psutil

    marker = str(setup.events)
    alive = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = process.info["cmdline"] or []
        if process.info["pid"] in standbys or marker in cmdline:
            alive.append(process.info["pid"])
    return alive


# ------------------------------------------------------------------------------------------------- the run


@contextlib.contextmanager
def supervised(agents: Agents, summary: dict[str, Any]) -> Iterator[None]:
    """The agents stop however the checks end; their exit codes and, on a failure, their last lines go in the
    summary."""
    failed = True
    try:
        yield
        failed = any(not check["ok"] for check in summary["checks"].values())
    finally:
        summary["agents_exit_codes"] = agents.stop()
        if failed:
            summary["agents_log_tail"] = {a.node_id: a.tail() for a in agents.agents}


def run(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    deadline = Deadline(BUDGET_SECONDS)
    setup = prepare(Path(args.work), Path(args.wheels), args.dry)
    summary["run_dir"] = str(setup.run)
    gpus = collector(setup)
    smi = NvidiaSmi([sys.executable, "-m", "tests.gpu_kit_dry", "nvidia-smi"] if args.dry else ["nvidia-smi"],
                    setup.env())
    summary["machine"] = machine(smi, setup)
    checks: dict[str, Any] = summary["checks"]
    agents = Agents(setup, args.gib)
    with supervised(agents, summary):
        agents.start()
        log("agents started; waiting for both trainers' first GPU step")
        started = time.time()
        first = wait_for(lambda: agents.running() and agents.generation(1, "first_gpu_step"), deadline.left(240),
                         "generation 1's first GPU step on both ranks")
        summary["machine"]["trainer"] = {k: v for k, v in first[0].items() if k in ("torch", "cuda", "device")}
        checks["two_agents"] = {"ok": True, "first_gpu_step_s": round(max(e["time"] for e in first) - started, 3),
                                "held_bytes_per_trainer": first[0].get("held_bytes"),
                                "trainer_pids": sorted(e["pid"] for e in first)}
        log("comparing the GPU metrics with nvidia-smi under load")
        checks["metrics_vs_nvidia_smi"] = attempt(lambda: metrics_vs_smi(gpus, smi))
        checks["agent_metrics"] = attempt(lambda: agent_metrics(agents.agents[0], gpus))
        checks["health"] = attempt(lambda: health(gpus, smi))
        log("checking the standby interpreters")
        checks["standby_holds_no_gpu"] = attempt(lambda: standby_check(agents, gpus, deadline))
        checks["node_check"] = attempt(lambda: node_check(setup, gpus, agents))
        log("killing a trainer")
        checks["kill_and_relaunch"] = attempt(lambda: kill_and_relaunch(agents, gpus, deadline))
    standbys = checks["standby_holds_no_gpu"].get("standby_pids", [])
    ends = time.monotonic() + 10
    while (left := leftovers(setup, standbys)) and time.monotonic() < ends:
        time.sleep(0.2)
    checks["no_leftovers"] = {"ok": not left, "alive": left}


def attempt(check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A check's result; one that cannot finish (a timeout) failed, and the next ones still run."""
    try:
        return check()
    except KitError as e:
        return {"ok": False, "error": str(e)}


def machine(smi: NvidiaSmi, setup: Setup) -> dict[str, Any]:
    """The GPUs and driver nvidia-smi names; on a GPU machine, PyTorch as a separate interpreter sees it (this
    process never initialises CUDA)."""
    gpus = smi.query()
    if not gpus:
        raise KitError("nvidia-smi lists no GPU")
    found: dict[str, Any] = {"gpus": {i: {"name": r["name"], "uuid": r["uuid"]} for i, r in gpus.items()},
                             "driver": next(iter(gpus.values()))["driver_version"],
                             "python": sys.version.split()[0]}
    if not setup.dry:
        probe = "import json, torch; print(json.dumps([torch.__version__, torch.cuda.is_available()]))"
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        if done.returncode != 0 or not json.loads(done.stdout.strip().splitlines()[-1])[1]:
            raise KitError(f"the stand-in trainer needs PyTorch with CUDA: {(done.stderr or done.stdout)[-300:]}")
        found["torch"] = json.loads(done.stdout.strip().splitlines()[-1])[0]
    return found


def agent_metrics(agent: Agent, gpus: Any) -> dict[str, Any]:
    """The agent's /metrics against the collector here: the same GPU series, labels and static values (its
    dynamic readings are up to its cache's 5 s old, so they are shown, not compared)."""
    scraped = agent.scrape()
    ours = readings(gpus)
    theirs: dict[str, dict[str, float]] = {}
    labels: dict[str, dict[str, str]] = {}
    for (name, label_items), value in scraped.items():
        label_map = dict(label_items)
        if name.startswith("tfelastic_gpu_") and "gpu" in label_map and "reason" not in label_map:
            key = name + (f":{label_map['type']}" if "type" in label_map else "")
            theirs.setdefault(label_map["gpu"], {})[key] = value
            labels.setdefault(label_map["gpu"], {}).update(label_map)
    problems = []
    for index, mine in ours.items():
        series = {k for k in mine if k.startswith("tfelastic_")}
        if series != set(theirs.get(index, {})):
            problems.append(f"GPU {index}: series differ: {sorted(series ^ set(theirs.get(index, {})))}")
        for key in ("uuid", "name", "driver_version"):
            if mine["labels"].get(key) != labels.get(index, {}).get(key):
                problems.append(f"GPU {index}: label {key} differs")
        if mine.get("tfelastic_gpu_memory_total_bytes") != theirs.get(index, {}).get(
                "tfelastic_gpu_memory_total_bytes"):
            problems.append(f"GPU {index}: memory total differs")
    return {"ok": not problems, "problems": problems, "agent": agent.node_id,
            "agent_readings": theirs, "note": "the agent caches its readings for 5 s: dynamic values are shown only"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=None,
                        help="device memory each stand-in trainer holds (default 4; 0.0625 in the dry mode)")
    parser.add_argument("--wheels", default=str(ROOT / ".whl"), help="wheels of modules this Python lacks")
    parser.add_argument("--out", default="", help="also copy the summary and the agents' logs here")
    parser.add_argument("--work", default=str(ROOT / "build" / "gpu-kit"),
                        help="where the import tree, the wheels' installation and each run's files go")
    parser.add_argument("--dry", action="store_true", help="no GPU: the fake NVML and a CPU stand-in trainer")
    args = parser.parse_args(argv)
    if args.gib is None:
        args.gib = 0.0625 if args.dry else 4.0
    started = time.monotonic()
    summary: dict[str, Any] = {"kit": "tfelastic GPU acceptance kit (bench/gpu_kit.py)",
                               "mode": "dry: FAKE NVML, no GPU" if args.dry else "gpu", "ok": False, "checks": {},
                               "not_checked": list(NOT_CHECKED)}
    code = 1
    try:
        run(args, summary)
        failed = [name for name, check in summary["checks"].items() if not check["ok"]]
        summary.update(ok=not failed, failed=failed)
        code = 0 if not failed else 1
    except KitError as e:
        summary.update(ok=False, error=str(e))
        code = 2
    except Exception as e:  # a bug of the kit: the summary still comes, with where it failed
        summary.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc().splitlines())
        code = 2
    summary["elapsed_s"] = round(time.monotonic() - started, 1)
    text = json.dumps(summary, indent=1, default=str)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu-kit-summary.json").write_text(text + "\n")
        if "run_dir" in summary:
            for path in Path(summary["run_dir"]).glob("*.log"):
                shutil.copy(path, out / path.name)
    print(text, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
