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

from tfelastic.daemon.rendezvous.api import RestartReason
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
class Mark:
    at: float
    kind: str  # quarantined, readmitted, drained
    node: str
    detail: str


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
    marks: tuple[Mark, ...]
    lanes: tuple[Lane, ...]
    nodes_not_drawn: int
    curve: tuple[GoodputPoint, ...]
    window: float  # the rolling window's length in seconds
    totals: dict[str, float]


def lay_out(doc: dict[str, Any], min_share: float = MIN_SHARE) -> Timeline:
    """``doc``: what ``report --json`` prints (``at``: when it was read). Consecutive generations shorter than
    ``min_share`` of the whole are drawn together, their categories added up."""
    spans = _spans(doc["generations"], float(doc.get("at") or 0.0))
    segments = tuple(s for group in _groups(spans, min_share) for s in _segments(group))
    start = spans[0].start if spans else float(doc.get("at") or 0.0)
    end = spans[-1].end if spans else start
    marks = tuple(Mark(float(m["at"]), str(m["kind"]), str(m["node"]), str(m["detail"]))
                  for m in doc.get("marks", ()))
    lanes, not_drawn = _lanes(spans, marks, {n["node_id"]: n.get("role") or "" for n in doc.get("nodes", ())})
    window = rolling_window(end - start)
    goodput = doc.get("goodput") or {}
    return Timeline(str(doc["job"]), str(doc["state"]), start, end, bool(spans) and not spans[-1].ended, spans,
                    segments, tuple(r for span in spans if (r := _restart(span)) is not None), marks, lanes,
                    not_drawn, goodput_curve(segments, start, end, window),
                    window, dict(goodput.get("seconds") or {}))


def rolling_window(wall: float) -> float:
    """The last hour once the job is four hours long; a quarter of a shorter job (at least a minute)."""
    return HOUR if wall >= 4 * HOUR else max(60.0, wall / 4)


def _spans(lines: list[dict[str, Any]], now: float) -> tuple[Span, ...]:
    spans = []
    for i, line in enumerate(lines):
        start = float(line["formed_at"])
        seconds = {c: max(0.0, float(line["seconds"].get(c, 0.0))) for c in ORDER}
        # A line's seconds add up to its span: the next formation, or now for the last (the end of a job that ended).
        end = float(lines[i + 1]["formed_at"]) if i + 1 < len(lines) else start + sum(seconds.values())
        if i + 1 == len(lines) and not line["ended"]:
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
        if groups[-1] and groups[-1][-1].end - groups[-1][0].start >= least:
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


def _lanes(spans: tuple[Span, ...], marks: tuple[Mark, ...],
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


def goodput_curve(segments: tuple[Segment, ...], start: float, end: float,
                  window: float) -> tuple[GoodputPoint, ...]:
    """Goodput sampled at CURVE_POINTS times: since the start, and over the last ``window`` seconds."""
    if end <= start:
        return ()
    trained = Trained(segments)
    return tuple(trained.goodput_at(start + (end - start) * k / CURVE_POINTS, start, window)
                 for k in range(1, CURVE_POINTS + 1))


class Trained:
    """The training seconds up to any moment, in O(log segments)."""

    def __init__(self, segments: tuple[Segment, ...]) -> None:
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

    def goodput_at(self, t: float, start: float, window: float) -> GoodputPoint:
        since = max(start, t - window)
        return GoodputPoint(t, self.until(t) / (t - start) if t > start else 0.0,
                            (self.until(t) - self.until(since)) / (t - since) if t > since else 0.0)
