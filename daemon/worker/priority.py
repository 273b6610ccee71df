"""CPU priority: the agent runs ahead of its workers.

A trainer whose input pipeline saturates every core, or a standby importing TensorFlow beside it, competes with
its agent for the CPU. The agent needs little of it, but on time: a node whose heartbeats (every 0.5 s) stop for
``node_timeout`` (2 s) is lost, and the hang watch judges silences. So at its start, before its threads, the agent
lowers its own nice value by :data:`AGENT_LEAD`, where it may (CAP_SYS_NICE, or an RLIMIT_NICE that allows it: the
unit's ``LimitNICE=-5``), and every worker it starts (the trainer, the standby) runs at the nice value the agent
started with: the keeper sets it in the trainer's process before the exec (worker/keeper.py). Where the agent may
not lead, it says so once and everything runs at the one priority, as before.
"""

from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger("tfelastic.agent")

AGENT_LEAD = 5  # nice levels between the agent and its workers
_workers_priority: int | None = None  # the agent's nice value at its start, once it led


def lead_workers(lead: int = AGENT_LEAD) -> bool:
    """Lowers this process's nice value (every thread's) by ``lead``; the workers keep the one it had. True if it
    could."""
    global _workers_priority
    usual = os.getpriority(os.PRIO_PROCESS, 0)
    ahead = max(-20, usual - lead)
    try:
        _set_every_thread(ahead)
    except PermissionError as e:
        _set_every_thread(usual)  # the threads it did set go back: one priority for the whole agent
        log.info("the agent runs at its workers' CPU priority (nice %d): running ahead of them at %d was refused "
                 "(%s; RLIMIT_NICE allows down to %d): it needs CAP_SYS_NICE or LimitNICE=%d (the systemd unit has "
                 "it)", usual, ahead, e.strerror, 20 - resource.getrlimit(resource.RLIMIT_NICE)[0], ahead)
        _workers_priority = usual
        return False
    _workers_priority = usual
    log.info("CPU priority: the agent runs at nice %d, the processes it starts at %d", ahead, usual)
    return True


def workers_priority() -> int:
    """The nice value a worker runs at: the agent's at its start (this process's own where it never led)."""
    return _workers_priority if _workers_priority is not None else os.getpriority(os.PRIO_PROCESS, 0)


def _set_every_thread(priority: int) -> None:
    """On Linux a nice value is a thread's: a process's is set by setting each of its threads."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), priority)
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
