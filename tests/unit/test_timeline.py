"""The job's timeline laid out (daemon/timeline.py) and drawn (daemon/report_page.py) from synthetic ledgers:
what the page must show, what it must never do (load anything, or carry a peer's markup), and its size at 500
generations."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
from tfelastic.daemon.rendezvous.goodput import CATEGORIES
from tfelastic.daemon.report_page import render_page
from tfelastic.daemon.timeline import CURVE_POINTS, MAX_LANES, ORDER, lay_out, rolling_window

T0 = 1_800_000_000.0


def line(generation: int, formed_at: float, members: list[str], ended: str, **seconds: float) -> dict[str, Any]:
    return {"generation": generation, "formed_at": formed_at, "size": len(members), "members": members,
            "restored_step": 0, "startup_seconds": seconds.get("startup"), "steps_redone": 3, "ended": ended,
            "badput_seconds": sum(s for c, s in seconds.items() if c != "training"),
            "seconds": {c: seconds.get(c, 0.0) for c in CATEGORIES}, "reached_step": 100 * generation}


def report_doc(lines: list[dict[str, Any]], marks: list[dict[str, Any]] | None = None, *,
               state: str = "running", at: float | None = None) -> dict[str, Any]:
    totals = {c: sum(g["seconds"][c] for g in lines) for c in CATEGORIES}
    wall = sum(totals.values())
    return {"job": "demo", "state": state, "reason": "", "source": "coordinator", "generations": lines,
            "marks": marks or [], "at": at if at is not None else T0 + wall,
            "goodput": {"ratio": totals["training"] / wall if wall else None, "wall_seconds": wall, "seconds": totals,
                        "steps_redone": 6, "badput": []}, "nodes": []}


def three_generations() -> dict[str, Any]:
    return report_doc([
        line(1, T0, ["a", "b"], "worker_exit: a: trainer was killed by SIGKILL",
             startup=5, training=50, checkpoint=5, detection=1, stopping=2, waiting=1),
        line(2, T0 + 64, ["a", "b", "c"], "scale_up: c joined", startup=4, redone=2, training=30, stopping=1,
             waiting=3),
        line(3, T0 + 104, ["b", "c"], "", startup=3, training=20),
    ], [{"at": T0 + 62, "kind": "quarantined", "node": "a", "detail": "node check failed: no GPU"}])


def test_the_spans_follow_the_formations_and_each_is_its_categories_in_order() -> None:
    timeline = lay_out(three_generations())
    assert [(s.generation, s.start, s.end) for s in timeline.spans] == [(1, T0, T0 + 64), (2, T0 + 64, T0 + 104),
                                                                          (3, T0 + 104, T0 + 127)]
    first = [s for s in timeline.segments if s.generation == 1]
    assert [s.category for s in first] == ["startup", "training", "checkpoint", "detection", "stopping", "waiting"]
    assert first[0].start == T0 and first[-1].end == T0 + 64
    assert all(a.end == pytest.approx(b.start) for a, b in itertools.pairwise(first))
    assert timeline.running and (timeline.start, timeline.end) == (T0, T0 + 127)


def test_a_running_jobs_last_generation_reaches_the_moment_of_the_report() -> None:
    doc = three_generations()
    doc["at"] = T0 + 140  # the ledger's seconds were read a little earlier
    timeline = lay_out(doc)
    assert timeline.spans[-1].end == T0 + 140
    assert timeline.segments[-1].end == pytest.approx(T0 + 140)


def test_restarts_are_placed_where_the_decision_fell_and_told_apart() -> None:
    restarts = lay_out(three_generations()).restarts
    assert [(r.generation, r.kind, r.reason) for r in restarts] == [(1, "fault", "worker_exit"),
                                                                     (2, "planned", "scale_up")]
    assert restarts[0].at == pytest.approx(T0 + 61)  # start-up, training, the save and the detection before it
    assert restarts[0].cause == "a: trainer was killed by SIGKILL"
    ended = report_doc([line(1, T0, ["a"], "succeeded: every trainer of generation 1 exited 0", training=10)],
                       state="succeeded")
    assert [(r.kind, r.reason) for r in lay_out(ended).restarts] == [("end", "succeeded")]
    assert not lay_out(ended).running


def test_a_lane_per_node_shows_when_it_was_a_member() -> None:
    timeline = lay_out(three_generations())
    runs = {lane.node: lane.runs for lane in timeline.lanes}
    assert runs == {"a": ((T0, T0 + 104),), "b": ((T0, T0 + 127),), "c": ((T0 + 64, T0 + 127),)}
    many = report_doc([line(1, T0, [f"n{i}" for i in range(16)], "node_lost: n0", training=5),
                       line(2, T0 + 5, [f"m{i}" for i in range(16)], "node_lost: m0", training=5),
                       line(3, T0 + 10, [f"k{i}" for i in range(16)], "", training=5)])
    wide = lay_out(many)
    assert len(wide.lanes) == MAX_LANES and wide.nodes_not_drawn == 48 - MAX_LANES


def test_goodput_over_time_is_exact_where_the_job_ends_and_the_window_is_a_quarter_of_a_short_job() -> None:
    doc = three_generations()
    timeline = lay_out(doc)
    assert len(timeline.curve) == CURVE_POINTS + 2  # and at the ends of generations 1 and 2
    at_ends = {p.at: p.cumulative for p in timeline.curve}
    assert at_ends[T0 + 64] == pytest.approx(50 / 64) and at_ends[T0 + 104] == pytest.approx(80 / 104)
    assert timeline.curve[-1].cumulative == pytest.approx(100 / 127)
    assert timeline.window == rolling_window(127.0) == 60.0
    last_minute = sum(min(s.end, T0 + 127) - max(s.start, T0 + 67) for s in timeline.segments
                      if s.category == "training" and s.end > T0 + 67)
    assert timeline.curve[-1].window == pytest.approx(last_minute / 60)
    assert rolling_window(5 * 3600) == 3600 and rolling_window(2 * 3600) == 1800


def test_the_page_shows_every_generation_restart_category_and_mark() -> None:
    doc = three_generations()
    page = render_page(lay_out(doc), doc)
    assert covered(page) == {1, 2, 3}
    for generation in (1, 2, 3):
        assert f'data-generation="{generation}" data-last-generation="{generation}"' in page
        assert f'data-row="{generation}"' in page
    assert re.findall(r'data-restart="(\d+)" data-kind="(\w+)"', page) == [("1", "fault"), ("2", "planned")]
    drawn = set(re.findall(r'<rect data-generation="\d+" data-last-generation="\d+" data-category="(\w+)"', page))
    assert drawn == {c for c in CATEGORIES if c != "other"}  # no line spent a second on other
    assert all(f'data-legend="{c}"' in page for c in ORDER)
    assert 'data-mark="quarantined"' in page and "node check failed: no GPU" in page
    assert "a: trainer was killed by SIGKILL" in page  # the restart's cause
    assert "still running" in page


def test_the_page_loads_nothing_and_carries_no_markup_of_a_peer() -> None:
    doc = three_generations()
    doc["job"] = "<script>alert(1)</script>"
    doc["generations"][0]["ended"] = 'worker_exit: "><img src=x onerror=alert(1)>'
    doc["marks"][0]["detail"] = "</title><script>alert(2)</script>"
    page = render_page(lay_out(doc), doc)
    assert "<script" not in page and "<img" not in page and "onerror=alert(1)>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert not re.search(r"""(src|href)=["']?(https?:|//)|<link|@import|url\((?!#)""", page)
    assert re.findall(r'href="([^"]*)"', page) == ["#strip"] * (1 + len(lay_out(doc).lanes))


def test_an_empty_ledger_draws_an_empty_page() -> None:
    doc = report_doc([], state="waiting", at=T0)
    doc["goodput"] = {"ratio": None, "wall_seconds": 0.0, "seconds": dict.fromkeys(CATEGORIES, 0.0),
                      "steps_redone": 0, "badput": []}
    page = render_page(lay_out(doc), doc)
    assert "job demo: waiting" in page and "data-generation" not in page


def covered(page: str) -> set[int]:
    """The generations the page's strip draws, one by one or within a run drawn together."""
    return {g for first, last in re.findall(r'data-generation="(\d+)" data-last-generation="(\d+)"', page)
            for g in range(int(first), int(last) + 1)}


def test_generations_too_short_to_see_are_drawn_together_with_their_categories_added_up() -> None:
    doc = report_doc([line(1, T0, ["a"], "node_lost: a", training=1000, waiting=10),
                      *(line(g, T0 + 1010 + 2 * (g - 2), ["a"], "node_lost: a", startup=1, training=1)
                        for g in range(2, 12)),
                      line(12, T0 + 1030, ["a"], "", training=970)])
    timeline = lay_out(doc, min_share=0.01)  # 20 s of 2000
    runs = sorted({(s.generation, s.last_generation) for s in timeline.segments})
    assert runs == [(1, 1), (2, 11), (12, 12)]
    short = {s.category: s.end - s.start for s in timeline.segments if s.generation == 2}
    assert short == {"startup": pytest.approx(10.0), "training": pytest.approx(10.0)}
    assert len(timeline.restarts) == 11  # each still marked


def test_500_generations_draw_in_a_bounded_page() -> None:
    lines = [line(g, T0 + 100 * (g - 1), [f"node-{(g + i) % 24}" for i in range(16)],
                  "node_lost: node-3: its session closed" if g < 500 else "",
                  startup=8, redone=4, training=70, checkpoint=6, other=2, detection=3, stopping=4, waiting=3)
             for g in range(1, 501)]
    doc = report_doc(lines, [{"at": T0 + 1000 * k, "kind": "drained", "node": "node-1", "detail": "maintenance"}
                             for k in range(40)])
    page = render_page(lay_out(doc), doc)
    assert covered(page) == set(range(1, 501))
    assert len(re.findall(r"data-restart=", page)) == 499 and len(re.findall(r'data-row="', page)) == 500
    assert page.count("<rect data-generation") <= 150 * len(ORDER)
    assert len(page.encode()) < 1_000_000, len(page.encode())


def test_a_long_generation_after_a_short_faulted_one_is_never_drawn_with_it() -> None:
    """Merged, the short one's detection was laid out after the long one's training, far from its restart."""
    doc = report_doc([line(1, T0, ["a"], "worker_exit: a: killed", startup=1, detection=1),
                      line(2, T0 + 2, ["a"], "", training=10_000)])
    timeline = lay_out(doc)
    assert sorted({(s.generation, s.last_generation) for s in timeline.segments}) == [(1, 1), (2, 2)]
    [detection] = [s for s in timeline.segments if s.category == "detection"]
    assert detection.end <= timeline.restarts[0].at + 1e-9


def test_goodput_counts_the_generations_the_ledger_no_longer_lists() -> None:
    """The ledger lists its last 200 generations and counts every one in its totals: the curve, the scalars and
    the page's summary say so instead of starting the job at the first listed one."""
    doc = report_doc([line(101, T0, ["a"], "", training=90, startup=10)])
    doc["goodput"]["seconds"] = dict(doc["goodput"]["seconds"], training=190.0, startup=210.0)  # 100 earlier ones
    timeline = lay_out(doc)
    assert timeline.not_listed == 100 and timeline.not_listed_seconds["startup"] == 200.0
    assert timeline.curve[-1].cumulative == pytest.approx(190 / 400)
    assert "generations 101-101 drawn (the first 100, which the ledger no longer lists" in render_page(timeline, doc)


def test_a_job_between_generations_is_still_running_and_one_that_failed_waiting_has_its_end() -> None:
    lines = three_generations()["generations"][:2]
    restarting = report_doc(lines, state="restarting")
    assert lay_out(restarting).running and "still running" in render_page(lay_out(restarting), restarting)
    failed = report_doc(lines, state="failed")
    timeline = lay_out(failed)
    assert not timeline.running
    assert [(r.generation, r.kind, r.reason) for r in timeline.restarts][-1] == (2, "end", "failed")


def test_marks_outside_the_drawn_time_are_listed_not_drawn() -> None:
    doc = three_generations()
    doc["marks"] = [{"at": T0 - 500, "kind": "quarantined", "node": "a", "detail": "before the first line"},
                    {"at": T0 + 10, "kind": "drained", "node": "b", "detail": "maintenance"}]
    page = render_page(lay_out(doc), doc)
    assert re.findall(r'data-mark="(\w+)"', page) == ["drained"] and "before the first line" in page


def test_restart_labels_never_overlap_and_stay_on_the_drawing() -> None:
    """Eight restarts in the last minute of a long job: one label fits; each has its tooltip and table row."""
    lines = [line(1, T0, ["a"], "worker_exit: a: killed", training=36_000)]
    lines += [line(g, T0 + 36_000 + 5 * (g - 2), ["a"], "worker_exit: a: killed" if g < 10 else "", startup=5)
              for g in range(2, 11)]
    page = render_page(lay_out(report_doc(lines)), report_doc(lines))
    labels = re.findall(r'<text x="([\d.]+)" y="\d+" fill="#d62728" text-anchor="(\w+)">worker_exit</text>', page)
    assert labels and len(labels) < 9 and len(re.findall(r"data-restart=", page)) == 9
    for x, anchor in labels:
        assert (float(x) + 6.5 * len("worker_exit") <= 1200) if anchor == "start" else float(x) <= 1200
