"""The OOM-kill count of a process's memory cgroup (daemon/worker/oom.py), read from this machine's own files;
tests/integration/test_agent_robustness.py has a real OOM kill."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tfelastic.daemon.worker import oom


def test_a_count_is_the_oom_kill_line_of_either_cgroup_file() -> None:
    assert oom._count("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n") == 3  # v1's memory.oom_control
    assert oom._count("low 0\nhigh 0\nmax 2\noom 2\noom_kill 1\noom_group_kill 0\n") == 1  # v2's memory.events
    assert oom._count("oom_kill x\n") is None and oom._count(None) is None


def test_this_process_has_a_count_that_does_not_rise_by_itself() -> None:
    count = oom.OomCount.of(os.getpid())
    assert count is not None  # a memory cgroup's file, or /proc/vmstat
    assert count.path.name in {"memory.events", "memory.oom_control", "vmstat"}
    assert not count.killed_since()


def test_the_v1_memory_hierarchy_is_found_under_a_mount_of_a_cgroup_of_its_own(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A container's mount of its own memory cgroup: the path in /proc/PID/cgroup is relative to the mount's root."""
    group = tmp_path / "memory"
    group.mkdir()
    (group / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"35 31 0:32 /kubepods/pod1 {group} rw,relatime - cgroup cgroup rw,memory\n")
    proc = tmp_path / "proc" / "42"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("4:memory:/kubepods/pod1\n0::/\n")
    monkeypatch.setattr(oom, "MOUNTINFO", mountinfo)
    real_read = oom._read
    monkeypatch.setattr(oom, "_read", lambda p: real_read(proc / "cgroup" if p == Path("/proc/42/cgroup") else p))
    assert oom.counter_file(42) == group / "memory.oom_control"
