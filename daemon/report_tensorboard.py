"""``tfelastic report --tensorboard DIR``: the ledger as TensorBoard scalars, so that goodput shows beside the
loss in the user's own TensorBoard. Written with the ``tensorboard`` package alone (its event file writer and
protos, which need no TensorFlow): ``pip install 'tfelastic[report]'`` where it is missing.

A point at every generation's end (and at the report's moment for a running job), its wall time that moment and
its step the furthest training step the chief had reached by then, so that TensorBoard's STEP axis lines it up
with the trainer's own scalars and its WALL axis with the clock. Each run of the command replaces the event
files it wrote before in DIR (``*.tfelastic-report``), and touches no other file.
"""

from __future__ import annotations

import re
import socket
import time
from collections import Counter
from pathlib import Path

from tfelastic.daemon.commands import OperatorError
from tfelastic.daemon.timeline import ORDER, Timeline

SUFFIX = ".tfelastic-report"
TAG = "tfelastic"


def write_scalars(timeline: Timeline, directory: Path) -> Path:
    """Writes the event file; returns its path. TensorBoard's record writer and protos, not its EventFileWriter,
    which imports TensorFlow where it is installed (seconds) to offer remote file systems."""
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter
    except ImportError as e:
        raise OperatorError(f"report --tensorboard needs the tensorboard package ({e}): pip install "
                            "'tfelastic[report]'") from None
    _checked_directory(directory)
    earlier = list(directory.glob(f"events.out.tfevents.*{SUFFIX}"))
    path = directory / f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}{SUFFIX}"
    try:
        with path.open("xb") as file:
            records = RecordWriter(file)
            records.write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
            for at, step, values in points(timeline):
                summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)
                                                     for tag, value in values.items()])
                records.write(event_pb2.Event(wall_time=at, step=step, summary=summary).SerializeToString())
        for old in earlier:  # only once the new file is whole: a failed write leaves the last one
            old.unlink(missing_ok=True)
    except OSError as e:
        raise OperatorError(f"report --tensorboard {directory}: cannot write {path.name} ({e.strerror})") from None
    return path


def points(timeline: Timeline) -> list[tuple[float, int, dict[str, float]]]:
    """(wall time, step, {tag: value}) at each generation's end, and now for a running job: from each generation's
    own seconds (not the drawing's runs), the generations the ledger no longer lists counted in."""
    seconds, restarts = dict(timeline.not_listed_seconds), Counter[str]()
    step, found = 0, []
    ends = {r.generation: r for r in timeline.restarts}
    for span in timeline.spans:
        for category in ORDER:
            seconds[category] += span.seconds[category]
        if span.generation in ends and ends[span.generation].kind != "end":
            restarts[ends[span.generation].reason] += 1
        step = max(step, span.reached_step or 0)
        goodput = timeline.trained.goodput_at(span.end, timeline.window)
        values = {f"{TAG}/goodput": goodput.cumulative, f"{TAG}/goodput_window": goodput.window,
                  **{f"{TAG}/seconds/{c}": s for c, s in seconds.items()},
                  **{f"{TAG}/restarts/{_tag(r)}": float(n) for r, n in restarts.items()}}
        found.append((span.end, step, values))
    return found


def _tag(reason: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", reason)[:64] or "unknown"


def _checked_directory(directory: Path) -> None:
    if directory.exists() and not directory.is_dir():
        raise OperatorError(f"report --tensorboard {directory}: not a directory; name a directory (it is made if "
                            "missing)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OperatorError(f"report --tensorboard {directory}: cannot make it ({e.strerror})") from None
