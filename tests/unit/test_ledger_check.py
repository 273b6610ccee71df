"""The benchmarks' own counts beside the goodput ledger (bench/ledger_check.py): the steps the chiefs redid and the
seconds they spent on new steps, from the files the example's chief writes."""

from __future__ import annotations

from pathlib import Path

from bench.ledger_check import fresh_step_seconds, redone_from


def chief_files(tmp_path: Path, generations: dict[int, list[tuple[int, float]]]) -> None:
    for generation, rows in generations.items():
        (tmp_path / f"r.{generation}").write_text(f"{rows[-1][0]:20d}\n")
        (tmp_path / f"r.{generation}.times").write_text("".join(f"{step} {at:.6f}\n" for step, at in rows))


def test_only_steps_past_the_furthest_count_each_from_the_previous_steps_end(tmp_path: Path) -> None:
    chief_files(tmp_path, {1: [(1, 10.0), (2, 11.0), (3, 12.5), (4, 13.0), (5, 14.0)],  # 4 s after the first step
                           2: [(4, 20.0), (5, 21.0), (6, 22.0), (7, 22.5), (8, 24.0)]})  # resumed at 3: 6-8 new
    starts = [(1, 0), (2, 3)]
    assert fresh_step_seconds(starts, lambda g: tmp_path / f"r.{g}.times") == 4.0 + 1.0 + 0.5 + 1.5
    assert redone_from(starts, lambda g: tmp_path / f"r.{g}") == 2  # steps 4 and 5 again


def test_a_generation_killed_before_its_second_step_adds_nothing_and_a_torn_line_is_skipped(tmp_path: Path) -> None:
    chief_files(tmp_path, {1: [(1, 10.0), (2, 11.0)], 2: [(3, 30.0)]})
    (tmp_path / "r.3.times").write_text("3 40.0\n4 41.0\n5 4")  # killed while writing step 5's line
    starts = [(1, 0), (2, 2), (3, 2)]
    assert fresh_step_seconds(starts, lambda g: tmp_path / f"r.{g}.times") == 1.0 + 1.0
