"""The report as one self-contained HTML file: the ledger and faults as tables and the
timeline (steps over time, with faults, pauses, restarts and checkpoints marked) as an
inline SVG drawn here, so the file opens anywhere with no script and no network."""

from __future__ import annotations

from datetime import UTC, datetime
from html import escape

from coordinator.ctl.report_model import ESTIMATES, Report

W, H = 960, 380
LEFT, RIGHT, TOP, BOTTOM = 60, 20, 20, 110  # margins; labels of markers go below
COLOURS = {
    "job.paused": "#d97706",
    "job.resumed": "#059669",
    "job.checkpointed": "#2563eb",
    "job.recovering": "#dc2626",
    "job.restarted": "#7c3aed",
    "job.failed": "#dc2626",
}
FAULT = "#b91c1c"  # any condition's opening or closing, node loss, XID


def html(r: Report, price: float | None) -> str:
    rows = "".join(
        f"<tr><td>{escape(b)}</td><td>{v / 3600:.4f}</td>"
        + ("" if price is None else f"<td>{v / 3600 * price:.4f}</td>")
        + "</tr>"
        for b, v in [*r.ledger.items(), ("total", sum(r.ledger.values()))]
    )
    faults = "".join(
        f"<tr><td>{escape(f.key)}</td><td>{escape(f.what)}</td><td>{escape(f.reaction)}</td>"
        f"<td>{f.cost_gpu_s / 3600:.4f}</td>"
        f"<td>{'n/a' if f.saved_gpu_s is None else f'{f.saved_gpu_s / 3600:.4f}'}</td></tr>"
        for f in r.faults
    )
    cost = "" if price is None else f"<th>cost at {price:g} / GPU-h</th>"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Report {escape(r.job)}</title>
<style>body{{font:14px sans-serif;margin:2em}}td,th{{padding:2px 10px;text-align:left}}
table{{border-collapse:collapse}}tr:nth-child(even){{background:#f3f4f6}}</style></head>
<body><h1>Job {escape(r.job)}</h1>
<p>{escape(r.state)}, step {r.step}/{r.target_steps}, {r.world_size} GPUs,
{r.step_time_s:.3f} s a productive step</p>
{svg(r)}
<h2>Goodput ledger</h2>
<table><tr><th>bucket</th><th>GPU-h</th>{cost}</tr>{rows}</table>
<h2>Faults</h2>
<table><tr><th>fault</th><th>what</th><th>reaction</th><th>cost GPU-h</th>
<th>saved GPU-h (estimate)</th></tr>{faults}</table>
<p><em>{escape(ESTIMATES)}</em></p>
</body></html>
"""


def svg(r: Report) -> str:
    times = [t for t, _ in r.steps] + [m.t for m in r.markers]
    if not times:
        return "<p>No history to draw.</p>"
    t0, t1 = min(times), max(times)
    top = max([s for _, s in r.steps] + [r.target_steps, 1])

    def x(t: float) -> float:
        return LEFT + (t - t0) / max(t1 - t0, 1e-9) * (W - LEFT - RIGHT)

    def y(step: float) -> float:
        return H - BOTTOM - step / top * (H - TOP - BOTTOM)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        f'viewBox="0 0 {W} {H}" role="img" aria-label="steps over time">',
        f'<line x1="{LEFT}" y1="{y(0):.1f}" x2="{W - RIGHT}" y2="{y(0):.1f}" stroke="#999"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{y(0):.1f}" stroke="#999"/>',
        f'<text x="{LEFT - 6}" y="{TOP + 4}" text-anchor="end" font-size="11">{top}</text>',
        f'<text x="{LEFT - 6}" y="{y(0):.1f}" text-anchor="end" font-size="11">0</text>',
        f'<text x="{LEFT}" y="{y(0) + 14:.1f}" font-size="11">{_clock(t0)}</text>',
        f'<text x="{W - RIGHT}" y="{y(0) + 14:.1f}" text-anchor="end" font-size="11">'
        f"{_clock(t1)}</text>",
    ]
    for start, end in r.pauses:
        parts.append(
            f'<rect class="pause" x="{x(start):.1f}" y="{TOP}" width="{x(end) - x(start):.1f}" '
            f'height="{y(0) - TOP:.1f}" fill="#fde68a" opacity="0.5"/>'
        )
    points = " ".join(f"{x(t):.1f},{y(s):.1f}" for t, s in r.steps)
    parts.append(f'<polyline class="steps" points="{points}" fill="none" stroke="#111"/>')
    for i, m in enumerate(r.markers):
        colour = COLOURS.get(m.kind, FAULT if not m.kind.startswith("job.") else "#6b7280")
        lx, ly = x(m.t), y(0) + 28 + (i % 6) * 13  # staggered so neighbours stay legible
        parts.append(
            f'<g class="marker" data-kind="{escape(m.kind)}" data-time="{m.t:.3f}">'
            f"<title>{escape(_clock(m.t))} {escape(m.kind)}: {escape(m.label)}</title>"
            f'<line x1="{lx:.1f}" y1="{TOP}" x2="{lx:.1f}" y2="{ly - 10:.1f}" stroke="{colour}" '
            'stroke-dasharray="3,2"/>'
            f'<text x="{lx:.1f}" y="{ly:.1f}" font-size="10" fill="{colour}">'
            f"{escape(m.kind)}</text></g>"
        )
    parts.append("</svg>")
    return "\n".join(parts)


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S")
