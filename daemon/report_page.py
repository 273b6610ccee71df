"""``tfelastic report --html``: the job's timeline as one self-contained page (pure: a laid-out timeline in, a
string out). SVG drawn here, with no script: a plotting library would add megabytes of script to every page
(Plotly's is 3.5 MB) or tens of megabytes to the install (matplotlib), and draw no more than these few shapes.
The page's Content-Security-Policy lets it load nothing: no script, style sheet, font or image from anywhere.

Every text from the coordinator (node ids, reasons, details) is escaped and bounded. The timeline is drawn to a
fixed width, the whole job at once (consecutive generations too short to see are drawn together, their
categories added up), each generation's categories in one strip that every node's lane shows
where the node was a member; the tables below it scroll (docs/goodput.md, "The report as a picture").
"""

from __future__ import annotations

import html
import time
from typing import Any

from tfelastic.daemon.rendezvous.bounds import SHOWN_DETAIL_CHARS, printable
from tfelastic.daemon.status import duration, render_report_rows
from tfelastic.daemon.timeline import ORDER, Lane, Restart, Timeline

COLOURS = {"training": "#2ca02c", "redone": "#ff7f0e", "startup": "#1f77b4", "checkpoint": "#9467bd",
           "other": "#8c564b", "detection": "#d62728", "stopping": "#7b1010", "waiting": "#b0b0b0"}
RESTART_COLOURS = {"fault": "#d62728", "planned": "#17becf", "end": "#000000"}
# Apart from every category's colour, so that a diamond shows on any lane.
MARK_COLOURS = {"quarantined": "#e6007e", "readmitted": "#00e0a0", "drained": "#ffd400"}
TIMELINE_BACKGROUND = "#fbfaf2"  # the timeline's own: tests/browser.py finds the drawing in a screenshot by it
LABEL_CHAR_PX = 6.5  # about what a character of an 11 px label takes
WIDTH = 1200  # the drawing, in CSS pixels
LABEL_WIDTH = 150  # the lanes' names
LANE_HEIGHT = 18
LANE_LABEL_CHARS = 24  # a lane's name beside it
RESTART_LABEL_CHARS = 20  # a restart's reason above the lanes
RESTART_LABELS = 40  # restarts labelled on the timeline itself (all of them have a tooltip and a table row)
CURVE_HEIGHT = 160
_TICKS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800,
          604800)
CSP = "default-src 'none'; style-src 'unsafe-inline'"
STYLE = """
body { font: 13px sans-serif; margin: 16px; color: #222; }
h1 { font-size: 18px; } h2 { font-size: 15px; margin-top: 24px; }
table { border-collapse: collapse; } td, th { padding: 2px 8px; text-align: left; border-bottom: 1px solid #eee; }
.scroll { max-height: 420px; overflow: auto; border: 1px solid #ddd; display: inline-block; }
.legend span { display: inline-block; margin-right: 14px; }
.swatch { display: inline-block; width: 12px; height: 12px; vertical-align: middle; margin-right: 4px; }
svg text { font: 11px sans-serif; }
"""


def render_page(timeline: Timeline, doc: dict[str, Any]) -> str:
    """``doc``: what ``report --json`` prints, for the totals and the per-generation table."""
    goodput = doc.get("goodput")
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        f"<title>tfelastic report: {_text(timeline.job)}</title><style>{STYLE}</style></head><body>",
        f'<h1 id="title">job {_text(timeline.job)}: {_text(timeline.state)}'
        + (f" ({_text(doc['reason'])})" if doc.get("reason") else "") + "</h1>",
        f"<p>{_summary(timeline, goodput)}</p>",
        "<h2>Timeline</h2>", _legend(timeline), _timeline_svg(timeline),
        "<h2>Goodput over time</h2>", _curve_svg(timeline),
        "<h2>Badput by category</h2>", _categories_table(timeline),
        "<h2>Generations</h2>", _generations_table(doc),
        "<h2>Restarts</h2>", _restarts_table(timeline),
        "<h2>Quarantines, readmissions, drains</h2>", _marks_table(timeline),
        "</body></html>", ""])


def _text(value: object, limit: int = SHOWN_DETAIL_CHARS) -> str:
    """Text from the coordinator, bounded, made printable, then escaped."""
    return html.escape(printable(str(value), limit), quote=True)


def _clock(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(at))


def _summary(timeline: Timeline, goodput: dict[str, Any] | None) -> str:
    ratio = "" if not goodput or goodput.get("ratio") is None else \
        f"goodput {100 * goodput['ratio']:.1f}% of {duration(goodput['wall_seconds'])}; "
    still = "still running, as of " if timeline.running else "from "
    listed = f"{len(timeline.spans)} generation(s)" if not timeline.not_listed else \
        (f"generations {timeline.spans[0].generation}-{timeline.spans[-1].generation} drawn (the first "
         f"{timeline.not_listed}, which the ledger no longer lists, are counted in the totals and the goodput)")
    return (f"{ratio}{listed}, {len(timeline.restarts)} restart(s) or end(s); "
            f"{still}{_clock(timeline.start)} to {_clock(timeline.end)}")


def _legend(timeline: Timeline) -> str:
    items = [f'<span data-legend="{c}"><i class="swatch" style="background:{COLOURS[c]}"></i>{c}</span>'
             for c in ORDER]
    items += [f'<span><i class="swatch" style="background:{RESTART_COLOURS[k]}"></i>{k}</span>'
              for k in ("fault", "planned", "end")]
    items += [f'<span><i class="swatch" style="background:{MARK_COLOURS[k]};transform:rotate(45deg)"></i>{k}</span>'
              for k in MARK_COLOURS]
    return f'<div class="legend">{"".join(items)}</div>'


class _Scale:
    def __init__(self, start: float, end: float) -> None:
        self.start, self.length = start, max(end - start, 1e-9)

    def x(self, at: float) -> float:
        return LABEL_WIDTH + (WIDTH - LABEL_WIDTH) * (at - self.start) / self.length


def _timeline_svg(timeline: Timeline) -> str:
    scale = _Scale(timeline.start, timeline.end)
    lanes_top = 40
    height = lanes_top + LANE_HEIGHT * (len(timeline.lanes) + 1) + 10
    parts = [f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
             f'style="background:{TIMELINE_BACKGROUND}">',
             *_ticks(scale, timeline, height), "<defs>", _strip(timeline, scale)]
    parts += [_lane_clip(i, lane, scale) for i, lane in enumerate(timeline.lanes)]
    parts += ["</defs>", f'<text x="4" y="{lanes_top + 13}">job</text>',
              f'<use href="#strip" y="{lanes_top}"/>']
    for i, lane in enumerate(timeline.lanes):
        y = lanes_top + LANE_HEIGHT * (i + 1)
        parts += [f'<text x="4" y="{y + 13}" data-lane="{_text(lane.node)}">{_lane_name(lane)}</text>',
                  f'<g transform="translate(0,{y})" clip-path="url(#lane{i})"><use href="#strip"/></g>']
    if timeline.nodes_not_drawn:
        parts.append(f'<text x="4" y="{height - 2}">and {timeline.nodes_not_drawn} more node(s)</text>')
    parts += _restart_marks(timeline, scale, lanes_top, height)
    parts += _node_marks(timeline, scale, lanes_top)
    parts.append("</svg>")
    return "\n".join(parts)


def _lane_name(lane: Lane) -> str:
    """The node id, shortened where it must be; its task in full."""
    role = f" ({lane.role})" if lane.role else ""
    return _text(lane.node, max(8, LANE_LABEL_CHARS - len(role))) + _text(role, LANE_LABEL_CHARS)


def _restart_marks(timeline: Timeline, scale: _Scale, top: int, height: int) -> list[str]:
    """A triangle and a line per restart; a label where there is room for it (each has a tooltip and a row in the
    table of restarts). Many restarts: a tick each above the lanes, no line or label."""
    few = len(timeline.restarts) <= RESTART_LABELS
    marks, free_from = [], 0.0  # where the last label drawn ends
    for restart in timeline.restarts:
        x = scale.x(restart.at)
        label_width = LABEL_CHAR_PX * min(len(restart.reason), RESTART_LABEL_CHARS)
        # Near the right edge a label ends at its mark; one that would overlap the last is left out.
        left = x + 3 if x + 3 + label_width <= WIDTH else x - 3 - label_width
        labelled = few and left >= free_from
        if labelled:
            free_from = left + label_width + 4
        marks.append(_restart_mark(restart, scale, top, height if few else top - 8, labelled,
                                   anchor="start" if left > x else "end"))
    return marks


def _node_marks(timeline: Timeline, scale: _Scale, top: int) -> list[str]:
    """A diamond per quarantine, readmission or drain on its node's lane, within the drawn time (the table lists
    every mark the ledger keeps, also those from before its first listed generation)."""
    lane_of = {lane.node: i for i, lane in enumerate(timeline.lanes)}
    shapes = []
    for mark in timeline.marks:
        if mark.node not in lane_of or not timeline.start <= mark.at <= timeline.end:
            continue
        x, mid = scale.x(mark.at), top + LANE_HEIGHT * (lane_of[mark.node] + 1) + LANE_HEIGHT / 2
        shapes.append(f'<path data-mark="{_text(mark.kind)}" d="M{x:.1f} {mid - 7:.1f}l6 7-6 7-6-7z" '
                      f'fill="{MARK_COLOURS.get(mark.kind, "#000")}" stroke="#fff">'
                      f"<title>{_text(mark.node)} {_text(mark.kind)} at {_clock(mark.at)}: "
                      f"{_text(mark.detail)}</title></path>")
    return shapes


def _strip(timeline: Timeline, scale: _Scale) -> str:
    """Every generation's categories, once: the job's row and every lane show it."""
    rects = [f'<rect data-generation="{s.generation}" data-last-generation="{s.last_generation}" '
             f'data-category="{s.category}" x="{scale.x(s.start):.2f}" y="1" '
             f'width="{max(scale.x(s.end) - scale.x(s.start), 0.3):.2f}" height="{LANE_HEIGHT - 2}" '
             f'fill="{COLOURS[s.category]}"><title>{_generations(s.generation, s.last_generation)}: {s.category} '
             f"{_short(s.end - s.start)}</title></rect>" for s in timeline.segments]
    return '<g id="strip">' + "".join(rects) + "</g>"


def _generations(first: int, last: int) -> str:
    return f"generation {first}" if first == last else f"generations {first}-{last}"


def _lane_clip(i: int, lane: Lane, scale: _Scale) -> str:
    rects = "".join(f'<rect x="{scale.x(a):.2f}" y="0" width="{max(scale.x(b) - scale.x(a), 0.3):.2f}" '
                    f'height="{LANE_HEIGHT}"/>' for a, b in lane.runs)
    return f'<clipPath id="lane{i}">{rects}</clipPath>'


def _ticks(scale: _Scale, timeline: Timeline, height: int) -> list[str]:
    span = timeline.end - timeline.start
    step = next((t for t in _TICKS if span / t <= 10), max(_TICKS[-1], span / 10))  # a span of centuries: 10
    first = (int(timeline.start // step) + 1) * step
    ticks = []
    at = float(first)
    while at <= timeline.end:
        x = scale.x(at)
        label = time.strftime("%H:%M:%S" if step < 86400 else "%m-%d %H:%M", time.localtime(at))
        ticks += [f'<line x1="{x:.1f}" y1="30" x2="{x:.1f}" y2="{height}" stroke="#ddd"/>',
                  f'<text x="{x:.1f}" y="12" text-anchor="middle">{label}</text>']
        at += step
    return ticks


def _restart_mark(restart: Restart, scale: _Scale, top: int, height: int, labelled: bool, anchor: str) -> str:
    x, colour = scale.x(restart.at), RESTART_COLOURS[restart.kind]
    label_x = x + 3 if anchor == "start" else x - 3
    label = f'<text x="{label_x:.1f}" y="{top - 4}" fill="{colour}" text-anchor="{anchor}">' \
            f"{_text(restart.reason, RESTART_LABEL_CHARS)}</text>" if labelled else ""
    cause = f": {_text(restart.cause)}" if restart.cause else ""
    return (f'<g data-restart="{restart.generation}" data-kind="{restart.kind}">'
            f'<line x1="{x:.1f}" y1="{top - 14}" x2="{x:.1f}" y2="{height}" stroke="{colour}" stroke-width="1.5"/>'
            f'<path d="M{x - 5:.1f} {top - 20}h10l-5 7z" fill="{colour}"/>{label}'
            f"<title>generation {restart.generation} ended at {_clock(restart.at)} ({restart.kind}): "
            f"{_text(restart.reason)}{cause}</title></g>")


def _curve_svg(timeline: Timeline) -> str:
    scale = _Scale(timeline.start, timeline.end)
    bottom = 10 + CURVE_HEIGHT

    def y(ratio: float) -> float:
        return bottom - CURVE_HEIGHT * min(max(ratio, 0.0), 1.0)

    def path(values: list[tuple[float, float]]) -> str:
        return "M" + " L".join(f"{scale.x(at):.1f} {y(r):.1f}" for at, r in values) if values else ""

    parts = [f'<svg id="goodput" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{bottom + 30}">']
    for ratio in (0.0, 0.25, 0.5, 0.75, 1.0):
        parts += [f'<line x1="{LABEL_WIDTH}" y1="{y(ratio):.1f}" x2="{WIDTH}" y2="{y(ratio):.1f}" stroke="#eee"/>',
                  f'<text x="{LABEL_WIDTH - 6}" y="{y(ratio) + 4:.1f}" text-anchor="end">{100 * ratio:.0f}%</text>']
    parts += [f'<path data-curve="cumulative" d="{path([(p.at, p.cumulative) for p in timeline.curve])}" '
              f'fill="none" stroke="{COLOURS["training"]}" stroke-width="2"/>',
              f'<path data-curve="window" d="{path([(p.at, p.window) for p in timeline.curve])}" '
              f'fill="none" stroke="#555" stroke-width="1" stroke-dasharray="4 3"/>',
              f'<text x="{LABEL_WIDTH}" y="{bottom + 22}">solid: since the job started; dashed: over the last '
              f"{duration(timeline.window)} (one point every {_short(_every(timeline))})</text>", "</svg>"]
    return "\n".join(parts)


def _short(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 60 else duration(seconds)


def _every(timeline: Timeline) -> float:
    return (timeline.end - timeline.start) / max(len(timeline.curve), 1)


def _categories_table(timeline: Timeline) -> str:
    wall = sum(timeline.totals.values()) or 1.0
    rows = [f'<tr data-total="{c}"><td><i class="swatch" style="background:{COLOURS[c]}"></i>{c}</td>'
            f"<td>{duration(s)}</td><td>{100 * s / wall:.1f}%</td></tr>"
            for c, s in sorted(timeline.totals.items(), key=lambda cs: -cs[1]) if c in COLOURS]
    return "<table><tr><th>category</th><th>time</th><th>share</th></tr>" + "".join(rows) + "</table>"


def _generations_table(doc: dict[str, Any]) -> str:
    header, *rows = render_report_rows(doc["generations"])
    cells = "".join(f"<th>{_text(h)}</th>" for h in header)
    body = "".join(f'<tr data-row="{g["generation"]}">' + "".join(f"<td>{_text(c)}</td>" for c in row) + "</tr>"
                   for g, row in zip(doc["generations"], rows, strict=True))
    return f'<div class="scroll"><table><tr>{cells}</tr>{body}</table></div>'


def _restarts_table(timeline: Timeline) -> str:
    if not timeline.restarts:
        return "<p>none</p>"
    rows = "".join(f"<tr><td>{_clock(r.at)}</td><td>{r.generation}</td><td>{r.kind}</td>"
                   f"<td>{_text(r.reason)}</td><td>{_text(r.cause)}</td></tr>" for r in timeline.restarts)
    return ('<div class="scroll"><table><tr><th>decided</th><th>generation</th><th>kind</th><th>reason</th>'
            f"<th>cause</th></tr>{rows}</table></div>")


def _marks_table(timeline: Timeline) -> str:
    if not timeline.marks:
        return "<p>none</p>"
    rows = "".join(f"<tr><td>{_clock(m.at)}</td><td>{_text(m.node)}</td><td>{_text(m.kind)}</td>"
                   f"<td>{_text(m.detail)}</td></tr>" for m in timeline.marks)
    return ('<div class="scroll"><table><tr><th>at</th><th>node</th><th>event</th><th>detail</th></tr>'
            f"{rows}</table></div>")
