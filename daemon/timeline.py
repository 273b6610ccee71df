"""The job's timeline, laid out (pure): from what ``tfelastic report --json`` prints (the ledger's generations, the
nodes' marks, the totals) to spans of time, category by category, a lane per node, the restarts and the marks,
and goodput over time. ``report --html`` draws it (daemon/report_page.py); ``report --tensorboard`` writes its
scalars (daemon/report_tensorboard.py).

The ledger keeps each generation's seconds by category, not every interval: within a generation the categories
are laid out in the order they mostly come (start-up, redone steps, training, its saves and phases, then the
detection of a fault, the stop, the wait for the next round). The boundaries between generations, the totals
and the cumulative goodput at each boundary are exact; where inside its generation a save fell is not.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from tfelastic.daemon.rendezvous.api import RestartReason, TimelineMark
from tfelastic.daemon.rendezvous.goodput import CATEGORIES

ORDER = ("startup", "redone", "training", "checkpoint", "other", "detection", "stopping", "waiting")
assert sorted(ORDER) == sorted(CATEGORIES)
MAX_LANES = 32  # nodes drawn a lane each; the others are counted
CURVE_POINTS = 240  # goodput over time, sampled evenly
MIN_SHARE = 1 / 150  # the shortest run of generations drawn apart: at most ~150 on the timeline
HOUR = 3600.0
_PLANNED = {r.value for r in RestartReason if not r.counts_against_budget}
_RESTARTS = {r.value for r in RestartReason}


@dataclass(frozen=True)
class Segment:
    """A category's time in a generation, or in a run of consecutive generations too short to draw one by one."""

    generation: int  # the first
    category: str
    start: float  # Unix time
    end: float
    last_generation: int  # the last (the same, unless aggregated)


@dataclass(frozen=True)
class Span:
    """A generation: from its formation to the next one's (or to now, or the job's end)."""

    generation: int
    start: float
    end: float
    size: int
    members: tuple[str, ...]
    ended: str  # the ledger's words: "REASON: detail", or "" while it runs
    restored_step: int | None
    reached_step: int | None
    steps_redone: int
    seconds: dict[str, float]


@dataclass(frozen=True)
class Restart:
    """Where a generation ended: a restart (a fault, or planned), or the job's end."""

    at: float  # the decision: the end of the detection that led to it
    generation: int
    reason: str  # worker_exit, node_lost, ..., or the job's final state (succeeded, failed)
    cause: str  # the rest of the ledger's words (which node, what it said)
    kind: str  # "fault", "planned" or "end"


@dataclass(frozen=True)
class Lane:
    node: str
    role: str  # its task in a parameter-server job (as status shows it now), else ""
    runs: tuple[tuple[float, float], ...]  # when it was a member, merged across consecutive generations


@dataclass(frozen=True)
class GoodputPoint:
    at: float
    cumulative: float  # training over the wall time from the job's start to here
    window: float  # the same over the last ``Timeline.window`` seconds


@dataclass(frozen=True)
class Timeline:
    job: str
    state: str
    start: float
    end: float
    running: bool
    spans: tuple[Span, ...]
    segments: tuple[Segment, ...]
    restarts: tuple[Restart, ...]
    marks: tuple[TimelineMark, ...]
    lanes: tuple[Lane, ...]
    nodes_not_drawn: int
    curve: tuple[GoodputPoint, ...]
    window: float  # the rolling window's length in seconds
    totals: dict[str, float]
    trained: Trained  # the training seconds to any moment, the generations the ledger no longer lists counted in
    not_listed: int  # generations before the first listed one (the ledger keeps the last MAX_GENERATIONS)
    not_listed_seconds: dict[str, float]  # theirs, by category: the totals less the listed generations' seconds


TERMINAL = ("succeeded", "failed")


def lay_out(doc: dict[str, Any], min_share: float = MIN_SHARE) -> Timeline:
    """``doc``: what ``report --json`` prints (``at``: when it was read). Consecutive generations shorter than
    ``min_share`` of the whole are drawn together, their categories added up; goodput over time is computed
    from each generation's own categories."""
    state = str(doc["state"])
    spans = _spans(doc["generations"], float(doc.get("at") or 0.0), running=state not in TERMINAL)
    segments = tuple(s for group in _groups(spans, min_share) for s in _segments(group))
    start = spans[0].start if spans else float(doc.get("at") or 0.0)
    end = spans[-1].end if spans else start
    marks = tuple(TimelineMark(float(m["at"]), str(m["kind"]), str(m["node"]), str(m["detail"]))
                  for m in doc.get("marks", ()))
    lanes, not_drawn = _lanes(spans, marks, {n["node_id"]: n.get("role") or "" for n in doc.get("nodes", ())})
    window = rolling_window(end - start)
    totals = dict((doc.get("goodput") or {}).get("seconds") or {})
    before = _not_listed_seconds(totals, spans)
    trained = Trained(tuple(s for span in spans for s in _segments([span])), start, before["training"],
                      sum(before.values()))
    return Timeline(str(doc["job"]), state, start, end, state not in TERMINAL, spans, segments,
                    _restarts(spans, state), marks, lanes, not_drawn, goodput_curve(trained, spans, window),
                    window, totals, trained, spans[0].generation - 1 if spans else 0, before)


def _not_listed_seconds(totals: dict[str, float], spans: tuple[Span, ...]) -> dict[str, float]:
    """The seconds by category of the generations the ledger counts in its totals but lists no more."""
    listed = {c: sum(span.seconds[c] for span in spans) for c in ORDER}
    return {c: max(0.0, float(totals.get(c, 0.0)) - listed[c]) for c in ORDER}


def _restarts(spans: tuple[Span, ...], state: str) -> tuple[Restart, ...]:
    """Each generation's end; a job that ended while no generation ran (it failed waiting) gets its end too."""
    found = [r for span in spans if (r := _restart(span)) is not None]
    if state in TERMINAL and spans and (not found or found[-1].kind != "end"):
        found.append(Restart(spans[-1].end, spans[-1].generation, state, "", "end"))
    return tuple(found)


def rolling_window(wall: float) -> float:
    """The last hour once the job is four hours long; a quarter of a shorter job (at least a minute)."""
    return HOUR if wall >= 4 * HOUR else max(60.0, wall / 4)


def _spans(lines: list[dict[str, Any]], now: float, *, running: bool) -> tuple[Span, ...]:
    spans = []
    for i, line in enumerate(lines):
        start = float(line["formed_at"])
        seconds = {c: max(0.0, float(line["seconds"].get(c, 0.0))) for c in ORDER}
        # A line's seconds add up to its span: the next formation, or now for the last (the end of a job that ended).
        end = float(lines[i + 1]["formed_at"]) if i + 1 < len(lines) else start + sum(seconds.values())
        if i + 1 == len(lines) and running:
            end = max(end, now)
        spans.append(Span(int(line["generation"]), start, max(start, end), int(line["size"]),
                          tuple(line["members"]), str(line["ended"]), line.get("restored_step"),
                          line.get("reached_step"), int(line["steps_redone"]), seconds))
    return tuple(spans)


def _groups(spans: tuple[Span, ...], min_share: float) -> list[list[Span]]:
    """Consecutive spans together until each group lasts ``min_share`` of the whole (the last may be shorter)."""
    if not spans:
        return []
    least = (spans[-1].end - spans[0].start) * min_share
    groups: list[list[Span]] = [[]]
    for span in spans:
        # A span long enough to see stands alone: merged, its categories would be laid out past a short one's fault.
        if groups[-1] and (groups[-1][-1].end - groups[-1][0].start >= least or span.end - span.start >= least):
            groups.append([])
        groups[-1].append(span)
    return groups


def _segments(group: list[Span]) -> list[Segment]:
    """The group's categories in ORDER, scaled to its time (the last line of a running job grows with the clock)."""
    start, end = group[0].start, group[-1].end
    seconds = {c: sum(span.seconds[c] for span in group) for c in ORDER}
    total = sum(seconds.values())
    scale = (end - start) / total if total > 0 else 0.0
    at, found = start, []
    for category in ORDER:
        length = seconds[category] * scale
        if length > 0:
            found.append(Segment(group[0].generation, category, at, at + length, group[-1].generation))
            at += length
    return found


def _restart(span: Span) -> Restart | None:
    if not span.ended:
        return None
    reason, _, cause = span.ended.partition(": ")
    kind = "planned" if reason in _PLANNED else "fault" if reason in _RESTARTS else "end"
    before = sum(span.seconds[c] for c in ORDER[:ORDER.index("stopping")])
    total = sum(span.seconds.values())
    at = span.start + (span.end - span.start) * (before / total if total > 0 else 1.0)
    return Restart(at, span.generation, reason, cause, kind)


def _lanes(spans: tuple[Span, ...], marks: tuple[TimelineMark, ...],
           roles: dict[str, str]) -> tuple[tuple[Lane, ...], int]:
    """A lane per node, in the order they first appear (members, then nodes only marked)."""
    runs: dict[str, list[list[float]]] = {}
    for span in spans:
        for node in span.members:
            node_runs = runs.setdefault(node, [])
            if node_runs and node_runs[-1][1] >= span.start:
                node_runs[-1][1] = span.end
            else:
                node_runs.append([span.start, span.end])
    for mark in marks:
        runs.setdefault(mark.node, [])
    lanes = tuple(Lane(node, roles.get(node, ""), tuple((a, b) for a, b in node_runs))
                  for node, node_runs in list(runs.items())[:MAX_LANES])
    return lanes, max(0, len(runs) - MAX_LANES)


def goodput_curve(trained: Trained, spans: tuple[Span, ...], window: float) -> tuple[GoodputPoint, ...]:
    """Goodput at CURVE_POINTS evenly spaced times and at every generation's end: since the start, and over the
    last ``window`` seconds."""
    if not spans or spans[-1].end <= spans[0].start:
        return ()
    start, end = spans[0].start, spans[-1].end
    times = sorted({*(start + (end - start) * k / CURVE_POINTS for k in range(1, CURVE_POINTS + 1)),
                    *(span.end for span in spans if span.end > start)})
    return tuple(trained.goodput_at(t, window) for t in times)


class Trained:
    """The training seconds up to any moment, in O(log segments); ``before_training`` and ``before_wall`` are those
    of generations the ledger counts but lists no more, before ``start``."""

    def __init__(self, segments: tuple[Segment, ...], start: float, before_training: float = 0.0,
                 before_wall: float = 0.0) -> None:
        self.start, self._before_training, self._before_wall = start, before_training, before_wall
        self._training = [s for s in segments if s.category == "training"]
        self._starts = [s.start for s in self._training]
        self._before = [0.0]  # the training seconds before each training segment
        for s in self._training:
            self._before.append(self._before[-1] + s.end - s.start)

    def until(self, t: float) -> float:
        i = bisect.bisect_right(self._starts, t) - 1
        if i < 0:
            return 0.0
        return self._before[i] + min(t, self._training[i].end) - self._training[i].start

    def goodput_at(self, t: float, window: float) -> GoodputPoint:
        """Since the job started (the generations no longer listed counted in), and over the last ``window``
        seconds of the listed ones."""
        wall = self._before_wall + t - self.start
        since = max(self.start, t - window)
        return GoodputPoint(t, (self._before_training + self.until(t)) / wall if wall > 0 else 0.0,
                            (self.until(t) - self.until(since)) / (t - since) if t > since else 0.0)
