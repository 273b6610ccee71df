"""The job's goodput ledger (pure): where every second of the job went, from its first formation to its end, in
categories that add up to the wall time (docs/goodput.md defines them). Goodput is ``training / wall``.

Fed by the coordinator's events (formed, restarting, stopped, finished) and the chief's progress reports. Between
two reports, the trainer's own save and phase time is ``checkpoint`` and ``other``, the rest is split by steps into
``training`` (past the furthest step reached) and ``redone``; start-up runs to the chief's first step past the
one it resumed at; once the chief reports its training done, the rest is ``other`` (evaluation, export, exit).

Invariants: every second is in exactly one category and one generation's line (a line runs from its formation to
the next one's); what :meth:`GoodputLedger.export` writes for a successor changes only when the activity does, never
per report, and a successor splits the open interval by steps at its first report.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tfelastic.daemon.rendezvous.api import GenerationSummary, GoodputView, TimelineMark, WorkerProgress

CATEGORIES = ("training", "redone", "startup", "checkpoint", "detection", "stopping", "waiting", "other")
BADPUT = tuple(c for c in CATEGORIES if c != "training")
MAX_GENERATIONS = 200  # lines kept for the report; the totals count every generation
MEMBERS_LISTED = 16  # a line names its first members; it counts them all
MAX_MARKS = 200  # the most recent quarantines, readmissions and drains the timeline marks
MARK_DETAIL_CHARS = 512  # what a mark keeps of its detail
MARK_KINDS = ("quarantined", "readmitted", "drained")

Clock = Callable[[], float]


def _zero() -> dict[str, float]:
    return dict.fromkeys(CATEGORIES, 0.0)


@dataclass
class GenerationLine:
    """One generation in the job's timeline."""

    generation: int
    formed_at: float  # on the coordinator's clock (wall-clock seconds once exported)
    size: int
    members: tuple[str, ...]  # the first MEMBERS_LISTED, in rank order
    restored_step: int | None = None  # where its chief resumed (its first report that counts)
    startup_seconds: float | None = None  # formation to its first report of a step past restored_step
    steps_redone: int = 0
    ended: str = ""  # why it ended ("" while it runs)
    seconds: dict[str, float] = field(default_factory=_zero)  # every category, while it was the last formed
    reached_step: int | None = None  # the furthest step its chief reported (None before its first report)

    def badput(self) -> float:
        return sum(self.seconds[c] for c in BADPUT)

    def to_dict(self, wall_offset: float) -> dict[str, Any]:
        return {"generation": self.generation, "formed_at": self.formed_at + wall_offset, "size": self.size,
                "members": list(self.members),
                "restored_step": self.restored_step, "startup_seconds": self.startup_seconds,
                "steps_redone": self.steps_redone, "ended": self.ended, "seconds": dict(self.seconds),
                "reached_step": self.reached_step}

    @classmethod
    def from_dict(cls, doc: dict[str, Any], wall_offset: float) -> GenerationLine:
        return cls(int(doc["generation"]), float(doc["formed_at"]) - wall_offset, int(doc["size"]),
                   tuple(str(m) for m in doc["members"]),
                   None if doc["restored_step"] is None else int(doc["restored_step"]),
                   None if doc["startup_seconds"] is None else float(doc["startup_seconds"]),
                   int(doc["steps_redone"]), str(doc["ended"]),
                   {c: float(doc["seconds"].get(c, 0.0)) for c in CATEGORIES},
                   None if doc.get("reached_step") is None else int(doc["reached_step"]))  # an older one's: absent

    def summary(self, wall_offset: float) -> GenerationSummary:
        return GenerationSummary(self.generation, self.formed_at + wall_offset, self.size, self.members,
                                 self.restored_step, self.startup_seconds, self.steps_redone, self.ended,
                                 self.seconds, self.reached_step)


@dataclass(frozen=True)
class Mark:
    """A node's event on the job's timeline that no generation's line records: quarantined, readmitted, drained."""

    at: float  # on the coordinator's clock (wall-clock seconds once exported)
    kind: str  # one of MARK_KINDS
    node: str
    detail: str

    def to_list(self, wall_offset: float) -> list[Any]:
        return [self.at + wall_offset, self.kind, self.node, self.detail]


@dataclass(frozen=True)
class ChiefReport:
    """What the ledger needs of a report of the chief: its step, and its save and phase seconds so far in this
    generation (the agent adds them up)."""

    step: int
    save_seconds: float = 0.0
    other_seconds: float = 0.0
    at: float | None = None  # when the agent read it (on the coordinator's clock); None: now
    done: bool = False  # the chief's training is complete: what follows is not training

    @classmethod
    def of(cls, progress: WorkerProgress) -> ChiefReport:
        return cls(progress.step, progress.save_seconds, progress.other_seconds, progress.reported_at,
                   progress.training_done)


def ledger_of_export(doc: dict[str, Any], now_wall: float) -> GoodputLedger:
    """An exported ledger (read from etcd, with no coordinator to ask) as of ``now_wall``, its open interval counted
    in its category: wall-clock times throughout."""
    book = GoodputLedger(lambda: now_wall)
    book.take_over(doc, 0.0)
    return book


class GoodputLedger:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self.totals = _zero()
        self.lines: deque[GenerationLine] = deque(maxlen=MAX_GENERATIONS)
        self.marks: deque[Mark] = deque(maxlen=MAX_MARKS)
        self._activity: str | None = None  # the category time goes to now; None before the first formation
        self._since = 0.0  # when the open interval started
        self.furthest_step = -1  # the furthest step the job reached
        self.steps_redone = 0  # every generation's, the lines dropped from the timeline too
        self._last: ChiefReport | None = None  # the chief's last report of this generation
        # After a failure: from when detection was counted (the report the decision followed), that report, and the
        # decision's time; a later report of the chief's read before the fault moves time back to training.
        self._undated: tuple[float, ChiefReport, float] | None = None
        self._exported: dict[str, Any] = self._export_now(0.0)  # as the last change of activity left it

    # ------------------------------------------------------------------------------------------------ events

    def formed(self, generation: int, members: Iterable[str]) -> None:
        now = self._close()
        self._undated = None  # a late report of the last generation's chief would land in this one's line
        members = tuple(members)
        self.lines.append(GenerationLine(generation, now, len(members), members[:MEMBERS_LISTED]))
        self._open("startup", now)
        self._last = None

    def reported(self, report: ChiefReport) -> None:
        """A progress report of the current generation's chief."""
        if self._activity not in ("startup", "training", "other"):
            return
        now = self._clock() if report.at is None else min(self._clock(), max(self._since, report.at))
        line = self.lines[-1]
        line.reached_step = max(report.step, line.reached_step if line.reached_step is not None else report.step)
        if self._activity == "startup":
            self._start_up(line, report, now)
        else:
            self._split(report, now)
            self._since, self._last = now, report
            self.furthest_step = max(self.furthest_step, report.step)
        if report.done and self._activity != "other":
            self._finish_training(line, report, now)
        elif not report.done and self._activity == "other":  # another fit trains on: the gap before it was other
            self._open("training", now)

    def _start_up(self, line: GenerationLine, report: ChiefReport, now: float) -> None:
        """A report during the start-up: the first sets where the chief resumed; the first past that step ends it."""
        if line.restored_step is None:
            line.restored_step = report.step
            line.steps_redone = max(0, self.furthest_step - report.step)
            self.steps_redone += line.steps_redone
            self._exported = self._export_now(0.0)  # a successor must not take a later report for the resume point
        if report.step <= line.restored_step:
            return
        self._end_start_up(line, report, now)
        self._open("training", now)

    def _end_start_up(self, line: GenerationLine, report: ChiefReport, now: float) -> None:
        line.startup_seconds = now - self._since
        self._add("startup", now - self._since)
        self._last = report
        self.furthest_step = max(self.furthest_step, report.step)

    def _finish_training(self, line: GenerationLine, report: ChiefReport, now: float) -> None:
        """The chief reported its training done: the time from here to its exit (evaluation, export, the
        teardown of its input pipeline) is ``other``. A generation that trained no step (it resumed at the end)
        ends its start-up here."""
        if self._activity == "startup":
            self._end_start_up(line, report, now)
        self._open("other", now)

    def reached(self, report: ChiefReport) -> None:
        """The chief's last report before its generation stopped, arriving after the restart decision: its step
        (its step mark) is the furthest reached; after a failure, the time up to when its agent read it (before the
        fault) was the chief's steps, not ``detection``."""
        undated = self._undated
        if undated is not None and report.at is not None and report.step > undated[1].step:
            since, last, decided = undated
            until = min(report.at, decided)
            if until > since:
                self._add("detection", -(until - since))  # at once: never below zero by a rounding of the shares
                for category, seconds in self._shares(last, report, until - since).items():
                    self._add(category, seconds)
                self._undated = (until, report, decided)  # a later reading dates the rest
        self.furthest_step = max(self.furthest_step, report.step)
        if self.lines:
            line = self.lines[-1]
            line.reached_step = max(report.step, line.reached_step if line.reached_step is not None else report.step)
        self._exported = self._export_now(0.0)

    def marked(self, kind: str, node: str, detail: str) -> None:
        """A node was quarantined, readmitted or drained: a mark on the timeline, at this moment."""
        self.marks.append(Mark(self._clock(), kind, node, detail[:MARK_DETAIL_CHARS]))
        self._exported = self._export_now(0.0)

    def restarting(self, reason: str, planned: bool) -> None:
        """The coordinator decided to restart: the time since the chief's last report is ``detection`` after a
        failure (the fault came after that report; :meth:`reached` may date it later), the last activity's after a
        planned restart."""
        if self._activity is None:
            return
        since, last = self._since, self._last
        dated = not planned and self._activity == "training"
        now = self._close(detection=not planned)
        self._undated = (since, last, now) if dated and last is not None else None
        self.lines[-1].ended = reason
        self._open("stopping", now)

    def blamed_instead(self, was: str, ended: str) -> None:
        """The last restart's record ``was`` names its root cause now (rendezvous/blame.py)."""
        if self.lines and self.lines[-1].ended == was:
            self.lines[-1].ended = ended
            self._exported = self._export_now(0.0)  # a successor takes the record over as it is now

    def stopped(self) -> None:
        """Every old worker is gone: waiting for the next formation."""
        if self._activity == "stopping":
            self._open("waiting", self._close())

    def finished(self, why: str) -> None:
        self._undated = None
        if self._activity is None:
            return
        now = self._close()
        if not self.lines[-1].ended:
            self.lines[-1].ended = why
        self._open(None, now)

    # ------------------------------------------------------------------------------------------------ reads

    def now_totals(self) -> dict[str, float]:
        """The totals with the open interval counted in, to this moment (its category so far)."""
        totals = dict(self.totals)
        if self._activity is not None:
            totals[self._open_category()] += max(0.0, self._clock() - self._since)
        return totals

    def lines_now(self) -> list[GenerationLine]:
        """The timeline, the open interval counted in the last line."""
        lines = [dataclasses.replace(line, seconds=dict(line.seconds)) for line in self.lines]
        if lines and self._activity is not None:
            lines[-1].seconds[self._open_category()] += max(0.0, self._clock() - self._since)
        return lines

    def view(self, wall_offset: float) -> GoodputView:
        """The ledger as status and report show it, to this moment, its times as wall-clock seconds."""
        return GoodputView(self.now_totals(), tuple(line.summary(wall_offset) for line in self.lines_now()),
                           self.steps_redone, tuple(TimelineMark(m.at + wall_offset, m.kind, m.node, m.detail)
                                                    for m in self.marks))

    def goodput(self) -> float | None:
        totals = self.now_totals()
        wall = sum(totals.values())
        return totals["training"] / wall if wall > 0 else None

    # ------------------------------------------------------------------------------------------- internals

    def _open(self, activity: str | None, now: float) -> None:
        self._activity, self._since = activity, now
        self._exported = self._export_now(0.0)

    def _open_category(self) -> str:
        """Where the open interval goes if it closed now: a training interval without a report is training or
        redone as its last report was."""
        activity = self._activity
        assert activity is not None
        if activity == "training" and self._last is not None and self._last.step < self.furthest_step:
            return "redone"
        return activity

    def _close(self, *, detection: bool = False) -> float:
        """Adds the open interval to its category (or to detection) and returns now."""
        now = self._clock()
        if self._activity is not None:
            category = "detection" if detection and self._activity in ("training", "other") \
                else self._open_category()
            self._add(category, now - self._since)
        return now

    def _split(self, report: ChiefReport, now: float) -> None:
        assert self._last is not None
        shares = self._shares(self._last, report, max(0.0, now - self._since))
        if self._activity == "other":  # past the end of training: its saves are still saves, the rest is not steps
            shares["other"] += shares.pop("training", 0.0) + shares.pop("redone", 0.0)
        for category, seconds in shares.items():
            self._add(category, seconds)

    def _shares(self, last: ChiefReport, report: ChiefReport, elapsed: float) -> dict[str, float]:
        """Where ``elapsed`` seconds between two reports went: the trainer's saves and phases, then the rest by
        steps, past the furthest step (training) or below it (redone)."""
        saves = min(elapsed, max(0.0, report.save_seconds - last.save_seconds))
        other = min(elapsed - saves, max(0.0, report.other_seconds - last.other_seconds))
        rest = elapsed - saves - other
        steps = report.step - last.step
        if steps <= 0:
            return {"checkpoint": saves, "other": other,
                    "redone" if last.step < self.furthest_step else "training": rest}
        redone = min(steps, max(0, self.furthest_step - last.step))
        return {"checkpoint": saves, "other": other, "redone": rest * redone / steps,
                "training": rest * (steps - redone) / steps}

    def _add(self, category: str, seconds: float) -> None:
        """Adds ``seconds`` (a negative number takes them back) to the totals and the last line."""
        if seconds == 0:
            return
        self.totals[category] += seconds
        if self.lines:
            self.lines[-1].seconds[category] += seconds

    # ------------------------------------------------------------------------------------------- durability

    def export(self, wall_offset: float) -> dict[str, Any]:
        """The ledger for the durable state, as the last change of activity left it, with times as wall-clock
        seconds (``wall_offset``: wall clock minus this clock)."""
        doc = dict(self._exported)
        doc["since"] += wall_offset
        doc["lines"] = [{**line, "formed_at": line["formed_at"] + wall_offset} for line in doc["lines"]]
        doc["marks"] = [[mark[0] + wall_offset, *mark[1:]] for mark in doc["marks"]]
        return doc

    def _export_now(self, wall_offset: float) -> dict[str, Any]:
        last = self._last
        return {"totals": dict(self.totals), "activity": self._activity, "since": self._since + wall_offset,
                "furthest_step": self.furthest_step, "steps_redone": self.steps_redone,
                "last": None if last is None else [last.step, last.save_seconds, last.other_seconds],
                "lines": [line.to_dict(wall_offset) for line in self.lines],
                "marks": [mark.to_list(wall_offset) for mark in self.marks]}

    def take_over(self, doc: dict[str, Any], wall_offset: float) -> None:
        """Continues a ledger a predecessor exported: its open interval goes on from where it started."""
        self.totals = {c: float(doc["totals"].get(c, 0.0)) for c in CATEGORIES}
        self.lines = deque((GenerationLine.from_dict(line, wall_offset) for line in doc["lines"]),
                           maxlen=MAX_GENERATIONS)
        self.marks = deque((Mark(float(at) - wall_offset, str(kind), str(node), str(detail))
                            for at, kind, node, detail in doc.get("marks", ())), maxlen=MAX_MARKS)
        activity = doc["activity"]
        self._activity = activity if activity in CATEGORIES or activity == "training" else None
        self._since = min(float(doc["since"]) - wall_offset, self._clock())
        self.furthest_step = int(doc["furthest_step"])
        self.steps_redone = int(doc.get("steps_redone", 0))
        self._undated = None  # not exported: a successor leaves a restart's detection as its predecessor counted it
        last = doc["last"]
        self._last = None if last is None else ChiefReport(int(last[0]), float(last[1]), float(last[2]))
        self._exported = self._export_now(0.0)
