"""The report as one self-contained HTML file: the ledger and faults as tables and the
timeline (steps over time, with faults, pauses, restarts and checkpoints marked) as an
inline SVG, so the file opens anywhere with no script and no network.

Markup lives in ``templates/report.html.j2``, rendered by Jinja with autoescaping: job,
node and event texts come from the cluster and are never trusted as markup. This module
only lays the chart out (coordinates, and which side of its line a label goes so that it
stays inside the picture).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

import jinja2

from coordinator.ctl.report_model import ESTIMATES, Report

W, H = 960, 400
LEFT, RIGHT, TOP, BOTTOM = 72, 20, 20, 130  # margins: axis names left, marker labels below
X_TICKS = 5
LABEL_ROWS = 6  # marker labels are staggered over this many rows so neighbours stay legible
FONT_PX = 10  # marker labels' size
CHAR_PX = 0.62 * FONT_PX  # a generous average glyph width of a sans-serif font
COLOURS = {
    "job.paused": "#d97706",
    "job.resumed": "#059669",
    "job.checkpointed": "#2563eb",
    "job.recovering": "#dc2626",
    "job.restarted": "#7c3aed",
    "job.failed": "#dc2626",
}
FAULT = "#b91c1c"  # any condition's opening or closing, node loss, XID
TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("coordinator.ctl", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


@dataclass
class Tick:
    x: float
    y: float
    text: str
    anchor: str = "middle"


@dataclass
class Mark:
    kind: str
    t: float
    title: str
    colour: str
    x: float
    line_end: float
    label_x: float
    label_y: float
    anchor: str


@dataclass
class Chart:
    width: int = W
    height: int = H
    left: int = LEFT
    right: int = W - RIGHT
    top: int = TOP
    base: float = H - BOTTOM  # the x axis's y
    font_px: int = FONT_PX
    ticks: list[Tick] = field(default_factory=list)
    pauses: list[tuple[float, float]] = field(default_factory=list)  # x and width
    points: str = ""
    marks: list[Mark] = field(default_factory=list)


def html(r: Report, price: float | None) -> str:
    return TEMPLATES.get_template("report.html.j2").render(
        r=r,
        price=price,
        ledger=[*r.ledger.items(), ("total", sum(r.ledger.values()))],
        chart=chart(r),
        estimates=ESTIMATES,
    )


def chart(r: Report) -> Chart | None:
    """The timeline's layout; None when there is nothing to draw."""
    times = [t for t, _ in r.steps] + [m.t for m in r.markers]
    if not times:
        return None
    t0, t1 = min(times), max(times)
    top = max([s for _, s in r.steps] + [r.target_steps, 1])
    c = Chart()

    def x(t: float) -> float:
        return LEFT + (t - t0) / max(t1 - t0, 1e-9) * (c.right - LEFT)

    def y(step: float) -> float:
        return c.base - step / top * (c.base - TOP)

    c.ticks = [Tick(LEFT - 6, y(s) + 4, str(s), "end") for s in sorted({0, top // 2, top})]
    for i in range(X_TICKS):
        t = t0 + (t1 - t0) * i / (X_TICKS - 1)
        anchor = "start" if i == 0 else "end" if i == X_TICKS - 1 else "middle"
        c.ticks.append(Tick(x(t), c.base + 14, _clock(t), anchor))
    c.pauses = [(x(start), x(end) - x(start)) for start, end in r.pauses]
    c.points = " ".join(f"{x(t):.1f},{y(s):.1f}" for t, s in r.steps)
    for i, m in enumerate(r.markers):
        lx, ly = x(m.t), c.base + 30 + (i % LABEL_ROWS) * 13
        fits_right = lx + 3 + len(m.kind) * CHAR_PX <= W - 2
        c.marks.append(
            Mark(
                kind=m.kind,
                t=m.t,
                title=f"{_clock(m.t)} {m.kind}: {m.label}",
                colour=COLOURS.get(m.kind, FAULT if not m.kind.startswith("job.") else "#6b7280"),
                x=lx,
                line_end=ly - 10,
                label_x=lx + 3 if fits_right else lx - 3,
                label_y=ly,
                anchor="start" if fits_right else "end",
            )
        )
    return c


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S")
