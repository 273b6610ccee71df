"""The timers of a rendezvous round: the last call, the join timeout and the scale-up settle delay. Pure: clock
readings come in as arguments, and :meth:`RoundTimers.deadlines` tells the coordinator when to look again."""

from __future__ import annotations

from tfelastic.daemon.rendezvous.api import RendezvousSettings


class RoundTimers:
    def __init__(self, settings: RendezvousSettings, now: float) -> None:
        self._settings = settings
        self._opened_at = now
        self._min_reached_at: float | None = None  # when min_nodes had joined, for the last call
        self._scale_up_at: float | None = None  # when a running job below max_nodes takes the waiting nodes in
        self._unfilled = False  # min_nodes are in, but they cannot fill a parameter-server job's tasks

    def open(self, now: float) -> None:
        """A new round: the join timeout counts from now, and the last call starts once min_nodes are in."""
        self._opened_at = now
        self._min_reached_at = None
        self._unfilled = False

    def below_min(self, now: float) -> bool:
        """Fewer than min_nodes are in: the last call starts again once they are back. True once the round
        has waited join_timeout for them."""
        self._min_reached_at = None
        return now - self._opened_at >= self._settings.join_timeout_seconds

    def last_call_over(self, now: float) -> bool:
        """min_nodes are in: the round may close once the last call has passed."""
        if self._min_reached_at is None:
            self._min_reached_at = now
        return now - self._min_reached_at >= self._settings.last_call_seconds

    def unfilled(self, now: float) -> bool:
        """min_nodes are in and the last call is over, but the nodes cannot fill the job's tasks (no chief, too few
        parameter servers): the round waits on the join timeout for a node that can. True once it has waited that
        long, as :meth:`below_min`."""
        self._unfilled = True
        return now - self._opened_at >= self._settings.join_timeout_seconds

    def schedule_scale_up(self, now: float) -> None:
        if self._scale_up_at is None:
            self._scale_up_at = now + self._settings.settle_seconds

    def cancel_scale_up(self) -> None:
        self._scale_up_at = None

    def scale_up_due(self, now: float) -> bool:
        """True once, when the settle delay has passed."""
        if self._scale_up_at is None or now < self._scale_up_at:
            return False
        self._scale_up_at = None
        return True

    def deadlines(self, *, round_open: bool) -> list[float]:
        """When a timer fires; the round's own only while one is open."""
        deadlines = [self._scale_up_at] if self._scale_up_at is not None else []
        if round_open:
            if self._min_reached_at is not None and not self._unfilled:
                deadlines.append(self._min_reached_at + self._settings.last_call_seconds)
            else:
                deadlines.append(self._opened_at + self._settings.join_timeout_seconds)
        return deadlines


class Reformation:
    """What the Joins say of the generation that ran before this coordinator, for one that starts without the job's
    state (no etcd: a restarted coordinator, another agent of the node taking the address over). The round after
    it is a re-formation, not a first formation: it closes once every member of that generation is back, or
    ``node_timeout`` after the first of them came back (a member not back by then is taken as lost), instead of
    waiting the last call for max_nodes. Only until this coordinator forms a generation of its own."""

    def __init__(self, node_timeout: float) -> None:
        self._node_timeout = node_timeout
        self.generation = 0
        self._world_size = 0
        self._ranks_back: set[int] = set()
        self._first_back_at: float | None = None

    def joined(self, generation: int, rank: int, world_size: int, now: float) -> None:
        """A Join from a member of ``generation`` (its rank there, and that generation's size)."""
        if generation <= 0 or world_size <= 0 or not 0 <= rank < world_size or generation < self.generation:
            return
        if generation > self.generation:
            self.generation, self._world_size, self._ranks_back, self._first_back_at = generation, world_size, \
                set(), now
        self._ranks_back.add(rank)

    def closes(self, now: float) -> bool:
        if self._first_back_at is None:
            return False
        return len(self._ranks_back) >= self._world_size or now - self._first_back_at >= self._node_timeout

    def deadline(self) -> float | None:
        return None if self._first_back_at is None else self._first_back_at + self._node_timeout

    def done(self) -> None:
        """This coordinator formed a generation: the next rounds are its own."""
        self._first_back_at = None
