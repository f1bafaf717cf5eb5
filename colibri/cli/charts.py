"""SVG charts for `colibri report` and the live page of `colibri serve`: a layer × expert heat
map with its colour scale, and line charts whose axes carry ticks and values. Every cell and
line has a `<title>`, which a browser shows on hover. Plain strings, no library, nothing to
fetch."""

from __future__ import annotations

import html
import math

import numpy as np

COLOURS = ("#1f5fbf", "#c0392b", "#27ae60")
LEGEND_STEPS = 8  # boxes in the heat map's colour scale


def nice_ticks(low: float, high: float, most: int = 6) -> list[float]:
    """At most `most` round values (1, 2 or 5 times a power of ten apart) from `low` to `high`."""
    span = high - low
    if not span > 0:
        return [low]
    raw = span / max(most - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9)
    return [round(k * step, 12) for k in range(first, math.floor(high / step + 1e-9) + 1)]


def _tick_text(value: float) -> str:
    return f"{value:.12g}"


def shade(count, top) -> int:
    """The red and green of a cell chosen `count` times out of a most-chosen `top` (blue is
    255): log-scaled, lighter for fewer."""
    return round(255 - 215 * float(np.log1p(count) / max(np.log1p(top), 1e-9)))


def heat_svg(layers: list[int], counts: np.ndarray, ident: str = "heat-map", width: int = 860,
             height: int = 460) -> str:
    """`counts` [layer, expert] as a heat map: a row per MoE layer, numbered; experts along
    the bottom with ticks; the colour scale at the right."""
    counts = np.asarray(counts)
    rows, experts = counts.shape if counts.size else (len(layers), 0)
    cell_w, cell_h = max(2, width // max(experts, 1)), max(3, height // max(rows, 1))
    left, bottom = 44, cell_h * rows
    top_count = int(counts.max()) if counts.size else 0
    parts = [f'<rect x="{left}" y="0" width="{cell_w * experts}" height="{bottom}" fill="white" stroke="#ccc"/>']
    for i, layer in enumerate(layers):
        for e in np.flatnonzero(counts[i]):
            s = shade(counts[i, e], top_count)
            parts.append(f'<rect x="{left + e * cell_w}" y="{i * cell_h}" width="{cell_w}" height="{cell_h}" '
                         f'fill="rgb({s},{s},255)"><title>layer {layer} expert {e}: {counts[i, e]}</title></rect>')
    font = min(cell_h, 10)
    parts += [f'<text x="{left - 4}" y="{i * cell_h + (cell_h + font) // 2}" font-size="{font}" text-anchor="end">'
              f'{layer}</text>' for i, layer in enumerate(layers) if rows <= 64 or i % 4 == 0]
    parts.append(f'<text x="10" y="{bottom // 2}" font-size="11" transform="rotate(-90 10 {bottom // 2})" '
                 f'text-anchor="middle">layer</text>')
    for e in nice_ticks(0, max(experts - 1, 0), 12):
        x = left + (int(e) + 0.5) * cell_w
        parts.append(f'<line class="tick" x1="{x:.1f}" x2="{x:.1f}" y1="{bottom}" y2="{bottom + 4}" stroke="#000"/>'
                     f'<text x="{x:.1f}" y="{bottom + 15}" font-size="10" text-anchor="middle">{int(e)}</text>')
    parts.append(f'<text x="{left}" y="{bottom + 30}" font-size="11">expert 0 .. {experts - 1} →</text>')
    legend_x = left + cell_w * experts + 16
    parts.append(_colour_scale(legend_x, top_count))
    return (f'<svg id="{ident}" width="{legend_x + 80}" height="{bottom + 36}" role="img" '
            f'aria-label="routing heat map: layer by expert">{"".join(parts)}</svg>')


def _colour_scale(x: int, top: int) -> str:
    """The heat map's legend: boxes from 1 choice to `top`, log-spaced, each titled."""
    if top < 1:
        return f'<text x="{x}" y="12" font-size="10">no choices</text>'
    values = sorted({max(1, round(math.exp(math.log(top) * k / (LEGEND_STEPS - 1)))) for k in range(LEGEND_STEPS)})
    parts = [f'<g class="colour-scale"><text x="{x}" y="10" font-size="10">choices</text>']
    for k, value in enumerate(reversed(values)):
        s = shade(value, top)
        y = 16 + 14 * k
        parts.append(f'<rect x="{x}" y="{y}" width="14" height="14" fill="rgb({s},{s},255)" stroke="#ccc">'
                     f'<title>{value} choices</title></rect>'
                     f'<text x="{x + 18}" y="{y + 11}" font-size="10" text-anchor="start">{value}</text>')
    return "".join(parts) + "</g>"


def line_svg(ident: str, series: list[tuple[str, list]], y_label: str, x_label: str, x_values: list | None = None,
             level: float | None = None, width: int = 900, height: int = 220) -> str:
    """A line chart of series (name, values; None leaves a gap) over `x_values` (default:
    their index), with ticked, numbered axes and a legend; `level`, a dashed reference line."""
    count = max((len(values) for _, values in series), default=0)
    xs = list(range(count)) if x_values is None else list(x_values)
    known = [v for _, values in series for v in values if v is not None]
    y_top = max(known + [level or 0]) or 1.0  # an empty or all-zero chart still has a 0..1 axis
    y_ticks = nice_ticks(0, y_top, 5)
    y_top = max(y_top, y_ticks[-1])
    x_low, x_high = (min(xs), max(xs)) if xs else (0, 1)
    left, right, top, bottom = 56, 16, 24, height - 34

    def x_at(x) -> float:
        fx = (x - x_low) / (x_high - x_low) if x_high > x_low else 0.5
        return round(left + (width - left - right) * fx, 1)

    def y_at(y) -> float:
        return round(bottom - (bottom - top) * y / y_top, 1)

    parts = [f'<line x1="{left}" y1="{bottom}" x2="{width - right}" y2="{bottom}" stroke="#000"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#000"/>']
    for v in y_ticks:
        y = y_at(v)
        parts.append(f'<line class="tick" x1="{left - 4}" x2="{width - right}" y1="{y}" y2="{y}" stroke="#eee"/>'
                     f'<text x="{left - 6}" y="{y + 3:.1f}" font-size="10" text-anchor="end">{_tick_text(v)}</text>')
    for v in nice_ticks(x_low, x_high, 10) if xs else []:
        x = x_at(v)
        parts.append(f'<line class="tick" x1="{x}" x2="{x}" y1="{bottom}" y2="{bottom + 4}" stroke="#000"/>'
                     f'<text x="{x}" y="{bottom + 15}" font-size="10" text-anchor="middle">{_tick_text(v)}</text>')
    for k, (name, values) in enumerate(series):
        runs = [[]]  # stretches without a gap
        for x, v in zip(xs, values):
            if v is None:
                runs.append([])
            else:
                runs[-1].append((x_at(x), y_at(v)))
        for points in filter(None, runs):
            if len(points) == 1:  # a point between two gaps: a dot, or it would not show
                (x, y), = points
                parts.append(f'<circle cx="{x}" cy="{y}" r="2.5" fill="{COLOURS[k % 3]}"><title>{html.escape(name)}'
                             f'</title></circle>')
                continue
            line = " ".join(f"{x},{y}" for x, y in points)
            parts.append(f'<polyline fill="none" stroke="{COLOURS[k % 3]}" stroke-width="1.5" points="{line}">'
                         f'<title>{html.escape(name)}</title></polyline>')
        parts.append(f'<rect x="{left + 10 + 200 * k}" y="4" width="10" height="10" fill="{COLOURS[k % 3]}"/>'
                     f'<text x="{left + 24 + 200 * k}" y="13" font-size="11">{html.escape(name)}</text>')
    if not known:
        parts.append(f'<text x="{(left + width - right) // 2}" y="{(top + bottom) // 2}" font-size="11" '
                     f'text-anchor="middle" fill="#888">no points yet</text>')
    if level is not None:
        y = y_at(level)
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y}" y2="{y}" stroke="#888" stroke-dasharray="4 3"/>')
    parts.append(f'<text x="12" y="{(top + bottom) // 2}" font-size="11" text-anchor="middle" '
                 f'transform="rotate(-90 12 {(top + bottom) // 2})">{html.escape(y_label)}</text>'
                 f'<text x="{(left + width - right) // 2}" y="{height - 4}" font-size="11" text-anchor="middle">'
                 f'{html.escape(x_label)}</text>')
    return (f'<svg id="{ident}" width="{width}" height="{height}" role="img" aria-label="{html.escape(y_label)} '
            f'by {html.escape(x_label)}">{"".join(parts)}</svg>')
