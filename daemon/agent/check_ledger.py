"""The node check's way to the coordinator (pure). A check is owed at the first Join of the process and when the
coordinator asks for one (CheckNode); once it has run, its result goes out in a checked Join, with what kept the
agent from listening for the coordinator's probe, and it stays owed until the coordinator answers the session
that carried it (a Join on a session that breaks first is sent again on the next one). A failure found outside
the check (GPUs that keep a stopped worker's memory) goes out the same way, in the next Join, beside the check's
own result when one is owed.
"""

from __future__ import annotations

import dataclasses
import logging

from tfelastic.daemon.rendezvous import api

log = logging.getLogger("tfelastic.agent")


class NodeCheckLedger:
    def __init__(self) -> None:
        self._owed = True
        self._result: str | None = None  # a check's result the coordinator has not answered yet ("": passed)
        self._found = ""  # a failure found outside the check, not answered yet
        self._sent_on: int | None = None  # the session whose Join carries it
        self._join: api.Join | None = None  # the checked Join, until the shell says whether it listens

    @property
    def must_run(self) -> bool:
        """The next Join must carry a check that has not run yet."""
        return self._owed and self._result is None

    @property
    def has_result(self) -> bool:
        """The next Join is a checked one: a check ran, or a failure was found, and no answer came yet."""
        return self._result is not None or bool(self._found)

    def asked(self) -> None:
        self._owed = True

    def ran(self, failure: str) -> None:
        self._owed, self._result = False, failure
        if failure:
            log.error("node check failed: %s", failure)

    def found(self, failure: str) -> None:
        """A failure found outside the check: the node is not fit either (a later one replaces it)."""
        log.error("node check failed: %s", failure)
        self._found = failure

    def composed(self, join: api.Join, session: int) -> None:
        """A checked Join waits for the probe listener: its answer completes the failure it carries."""
        self._join, self._sent_on = join, session

    def listening(self, problem: str) -> api.Join | None:
        """The shell listens on the Join's port, or ``problem`` says why it cannot (a failure of the check too):
        the Join to send, with every failure; None if none is waiting."""
        join, self._join = self._join, None
        if join is None:
            return None
        if problem:
            log.error("node check failed: %s", problem)
        failure = "; ".join(p for p in (self._result or "", self._found, problem) if p)
        return dataclasses.replace(join, check_failure=failure)

    def answered(self, session: int, message: api.CoordinatorMessage) -> None:
        """Any message but a heartbeat (which may have been on its way before the Join was read) answers it."""
        if self._sent_on == session and not isinstance(message, api.Heartbeat):
            self._result = self._sent_on = None
            self._found = ""
