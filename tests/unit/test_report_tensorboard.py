"""``report --tensorboard``: the ledger's scalars, read back with TensorBoard's own reader, written without
TensorFlow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tfelastic.daemon.commands import OperatorError
from tfelastic.daemon.report_tensorboard import SUFFIX, write_scalars
from tfelastic.daemon.timeline import lay_out

from tests.unit.test_timeline import T0, three_generations

pytest.importorskip("tensorboard")
ROOT = Path(__file__).resolve().parents[2]
# Run in a process of its own in which an import of TensorFlow fails: TensorBoard's reader would otherwise import
# it (seconds), and the writer is shown to need none.
WITHOUT_TENSORFLOW = "import sys; sys.modules['tensorflow'] = None\n"
# An import of TensorFlow is refused and recorded: EventFileWriter tries one (and goes on without it), this writer
# must not even try.
REFUSING_TENSORFLOW = """
import sys
asked = []
class RefuseTensorFlow:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "tensorflow":
            asked.append(name)
            raise ImportError(name)
        return None
sys.meta_path.insert(0, RefuseTensorFlow())
"""
READ_BACK = """
import json, sys
from tensorboard.backend.event_processing import event_accumulator
accumulator = event_accumulator.EventAccumulator(sys.argv[1])
accumulator.Reload()
print(json.dumps({tag: [(e.wall_time, e.step, e.value) for e in accumulator.Scalars(tag)]
                  for tag in accumulator.Tags()["scalars"]}))
"""


def scalars(directory: Path) -> dict[str, list[tuple[float, int, float]]]:
    result = subprocess.run([sys.executable, "-c", WITHOUT_TENSORFLOW + READ_BACK, str(directory)],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return {tag: [tuple(point) for point in points] for tag, points in json.loads(result.stdout).items()}


def test_the_scalars_are_read_back_at_each_generations_end_against_wall_time_and_step(tmp_path: Path) -> None:
    write_scalars(lay_out(three_generations()), tmp_path)
    found = scalars(tmp_path)
    goodput = found["tfelastic/goodput"]
    assert [(at, step) for at, step, _ in goodput] == [(T0 + 64, 100), (T0 + 104, 200), (T0 + 127, 300)]
    assert goodput[-1][2] == pytest.approx(100 / 127)
    assert goodput[0][2] == pytest.approx(50 / 64)
    assert [v for _, _, v in found["tfelastic/seconds/startup"]] == [5.0, 9.0, 12.0]
    assert [v for _, _, v in found["tfelastic/restarts/worker_exit"]] == [1.0, 1.0, 1.0]
    assert [(step, v) for _, step, v in found["tfelastic/restarts/scale_up"]] == [(200, 1.0), (300, 1.0)]
    assert {f"tfelastic/seconds/{c}" for c in ("training", "redone", "waiting")} <= set(found)
    assert "tfelastic/goodput_window" in found


def test_a_second_report_replaces_its_own_event_file_and_nothing_else(tmp_path: Path) -> None:
    theirs = tmp_path / "events.out.tfevents.1.host"
    theirs.write_bytes(b"")
    ours_before = tmp_path / f"events.out.tfevents.1.otherhost{SUFFIX}"  # an earlier run's, of another second
    ours_before.write_bytes(b"")
    written = write_scalars(lay_out(three_generations()), tmp_path)
    assert sorted(tmp_path.iterdir()) == sorted([theirs, written]) and written.name.endswith(SUFFIX)


def test_each_generations_goodput_is_its_own_not_the_drawings() -> None:
    """Ten short generations drawn as one run: their scalars still come from each one's own seconds."""
    from tfelastic.daemon.report_tensorboard import points

    from tests.unit.test_timeline import line, report_doc

    lines = [line(g, T0 + 2 * (g - 1), ["a"], "node_lost: a", startup=1, training=1) for g in range(1, 11)]
    lines.append(line(11, T0 + 20, ["a"], "", training=10_000))
    values = [v["tfelastic/goodput"] for _, _, v in points(lay_out(report_doc(lines)))]
    assert values[:10] == pytest.approx([0.5] * 10)


def test_a_file_where_the_directory_should_be_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "tb").write_text("")
    with pytest.raises(OperatorError, match=r"report --tensorboard .*tb: not a directory"):
        write_scalars(lay_out(three_generations()), tmp_path / "tb")


def test_the_writer_needs_no_tensorflow(tmp_path: Path) -> None:
    script = (REFUSING_TENSORFLOW + "from pathlib import Path\n"
              "from tests.unit.test_timeline import three_generations\n"
              "from tfelastic.daemon.report_tensorboard import write_scalars\n"
              "from tfelastic.daemon.timeline import lay_out\n"
              f"write_scalars(lay_out(three_generations()), Path({str(tmp_path)!r}))\n"
              "assert not asked, asked\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert len(scalars(tmp_path)["tfelastic/goodput"]) == 3
