"""Whether the kernel's OOM killer killed a worker: the ``oom_kill`` count of its memory cgroup.

A trainer killed by the OOM killer dies of SIGKILL and prints nothing, so its output cannot tell it from any other
SIGKILL. The kernel counts its kills per memory cgroup: ``oom_kill`` in ``memory.events`` (cgroup v2: processes
of the cgroup killed by any OOM killer) or in ``memory.oom_control`` (v1). A worker's count is read when it starts
as the trainer and when it ends (:class:`OomCount`): a SIGKILL while the count rose is an out-of-memory kill. Under
systemd the cgroup is the unit's, which holds the agent, its trainer and its standby: a kill of another process
of the unit in the same life counts too (rare: the kernel picks the process using the most memory). Where no
memory cgroup can be read, the system-wide count in ``/proc/vmstat`` stands in.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
MOUNTINFO = Path("/proc/self/mountinfo")
VMSTAT = Path("/proc/vmstat")
READ_LIMIT = 64 * 1024  # the files are a few lines; /proc/vmstat about 5 KB


def _read(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(READ_LIMIT).decode("ascii", "replace")
    except OSError:
        return None


def _count(text: str | None) -> int | None:
    """The ``oom_kill N`` line of a counter file."""
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def _mounts() -> tuple[Path | None, Path | None, str]:
    """Where cgroup v2 and v1's memory hierarchy are mounted, and the v1 mount's root within its hierarchy."""
    unified = memory = None
    memory_root = "/"
    for line in (_read(MOUNTINFO) or "").splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fstype, _, options = line.partition(" - ")[2].partition(" ")
        if fstype == "cgroup2" and unified is None:
            unified = Path(fields[4])
        elif fstype == "cgroup" and "memory" in options.split()[-1].split(","):
            memory, memory_root = Path(fields[4]), fields[3]
    return unified, memory, memory_root


def counter_file(pid: int) -> Path | None:
    """The file that counts the OOM kills of ``pid``'s memory cgroup, if one can be read."""
    unified, memory, memory_root = _mounts()
    candidates = []
    for line in (_read(Path(f"/proc/{pid}/cgroup")) or "").splitlines():
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "" and path.startswith("/") and unified is not None:
            candidates.append(unified / path.lstrip("/") / "memory.events")
        elif "memory" in controllers.split(",") and memory is not None:
            relative = path[len(memory_root):] if path.startswith(memory_root) else path
            candidates.append(memory / relative.lstrip("/") / "memory.oom_control")
    return next((c for c in candidates if _count(_read(c)) is not None), None)


@dataclass
class OomCount:
    """A worker's OOM-kill count from its start as the trainer."""

    path: Path  # a cgroup's counter, or /proc/vmstat
    start: int

    @classmethod
    def of(cls, pid: int) -> OomCount | None:
        path = counter_file(pid) or VMSTAT
        start = _count(_read(path))
        return cls(path, start) if start is not None else None

    def killed_since(self) -> bool:
        """Whether the count rose since the start."""
        now = _count(_read(self.path))
        return now is not None and now > self.start
