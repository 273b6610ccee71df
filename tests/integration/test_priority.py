"""The agent runs ahead of its workers (worker/priority.py): it lowers its own nice value where it may, the keeper
puts the trainer back at the agent's starting one, and an agent that may not lead says so and runs everything at
one priority. Real processes: a nice value is the kernel's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from tfelastic.daemon.worker import keeper
from tfelastic.daemon.worker.priority import AGENT_LEAD

pytestmark = [pytest.mark.integration, pytest.mark.quick]

# Leads, then reports its own nice value, the workers' and a new thread's (which inherits the creating one's).
LEADER = textwrap.dedent("""
    import logging, os, sys, threading
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    from tfelastic.daemon.worker.priority import lead_workers, workers_priority
    if sys.argv[1:] == ["unprivileged"]:  # nobody, without an RLIMIT_NICE: neither CAP_SYS_NICE nor a limit to use
        import resource
        resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
        os.setgroups([]); os.setgid(65534); os.setuid(65534)
    started = threading.Thread(target=threading.Event().wait, daemon=True)  # a thread from before the lead
    started.start()
    led = lead_workers()
    seen = []
    later = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, 0)))
    later.start(); later.join()
    print(led, os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, started.native_id),
          seen[0], workers_priority())
""")


def _usual() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)


def _lead(*args: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", LEADER, *args], capture_output=True, text=True, timeout=60,
                            check=True)
    return result.stdout.splitlines()


@pytest.mark.skipif(os.geteuid() != 0, reason="the lead needs root (or LimitNICE) here")
def test_the_agent_leads_with_every_thread_and_its_workers_keep_its_starting_priority() -> None:
    usual = _usual()
    ahead = max(-20, usual - AGENT_LEAD)
    lines = _lead()
    assert lines[-1].split() == ["True", *(str(n) for n in (ahead, ahead, ahead, usual))], lines
    assert f"CPU priority: the agent runs at nice {ahead}, the processes it starts at {usual}" in lines


@pytest.mark.skipif(os.geteuid() != 0, reason="becomes another user")
def test_an_agent_that_may_not_lead_says_how_to_and_runs_at_one_priority() -> None:
    usual = _usual()
    lines = _lead("unprivileged")
    assert lines[-1].split() == ["False", *(str(usual),) * 4], lines
    assert any("was refused (Permission denied; RLIMIT_NICE allows down to 20): it needs CAP_SYS_NICE or "
               "LimitNICE=" in line for line in lines), lines


def test_the_keeper_starts_the_trainer_at_the_priority_it_is_given() -> None:
    usual = _usual()
    lower = min(19, usual + 3)
    env = dict(os.environ, **{keeper.PRIORITY_ENV: str(lower), keeper.AGENT_PID_ENV: str(os.getpid())})
    result = subprocess.run([sys.executable, "-I", "-S", keeper.__file__, sys.executable, "-c",
                             "import os; print(os.getpriority(os.PRIO_PROCESS, 0), "
                             "os.environ.get('TFELASTIC_KEEPER_PRIORITY'))"],
                            capture_output=True, text=True, timeout=30, env=env, check=True)
    assert result.stdout.split() == [str(lower), "None"]  # and the variable is the keeper's alone
