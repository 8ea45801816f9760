"""Line charts as inline SVG, drawn in Python: no plotting library, no script, nothing to fetch.

A chart is a few named series of (step, value) points on one y axis, linear or log. Long, noisy
series are drawn twice, as TensorBoard does: the raw values faint, a trailing mean on top. Series
longer than MAX_POINTS are averaged into MAX_POINTS buckets first, so a 100k-step run makes a
chart of the same size as a 1k-step one. Every text that reaches the SVG is escaped here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

PALETTE = ("#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#6b6b6b", "#a6761d")
"""Okabe-Ito colours (told apart by colour-blind readers too), then two neutrals."""
MAX_POINTS = 600
"""Most points drawn per series; longer series are averaged in equal buckets of steps."""
SMOOTH_FROM = 40
"""Series with at least this many points get a trailing-mean line over their raw values."""

WIDTH, HEIGHT = 440, 220  # SVG user units; the figure scales to its column
LEFT, RIGHT, TOP, BOTTOM = 50, 12, 8, 24  # plot-area margins for tick labels


@dataclass
class Series:
    """One line: values at steps (same length, finite numbers)."""

    name: str
    steps: list[float]
    values: list[float]
    low: list[float] | None = None
    """With `high`: a band drawn behind the line at each step (e.g. the spread over seeds)."""
    high: list[float] | None = None
    colour: str | None = None
    """Its colour (the same thing in the same colour on every chart); None: the next of PALETTE."""

    @property
    def has_band(self) -> bool:
        return self.low is not None and self.high is not None


@dataclass
class Chart:
    """A titled set of series sharing one y axis."""

    title: str
    series: list[Series]
    log_y: bool = False
    """Log10 y axis (values <= 0 cannot be drawn and are counted in the caption)."""
    y_range: tuple[float, float] | None = None
    """Fixed y limits (e.g. 0..1 for accuracy); None fits the data."""
    marks: list[tuple[float, str]] = field(default_factory=list)
    """Vertical markers (step, label), e.g. alarms."""


def render_chart(chart: Chart) -> str:
    """`<figure>` with the caption, the SVG plot and a legend holding each series' last value."""
    hidden = 0
    drawn: list[tuple[Series, list[float], list[float]]] = []  # (series, xs, ys in axis space)
    for series in chart.series:
        pairs = [(x, y) for x, y in zip(series.steps, series.values) if not chart.log_y or y > 0]
        hidden += len(series.values) - len(pairs)
        if pairs:
            xs, ys = zip(*pairs)
            drawn.append((series, list(xs), [math.log10(y) if chart.log_y else y for y in ys]))
    caption = escape(chart.title)
    if hidden:
        caption += f' <span class="note">({hidden} value{"s" if hidden > 1 else ""} &le; 0 not drawn)</span>'
    if not drawn:
        return f'<figure class="chart"><figcaption>{caption}</figcaption><p class="empty">no values</p></figure>'

    x_lo, x_hi = _span([x for _, xs, _ in drawn for x in xs])
    if chart.y_range is not None and not chart.log_y:
        y_lo, y_hi = chart.y_range
        y_ticks = _linear_ticks(y_lo, y_hi)
    else:
        y_lo, y_hi = _span([y for _, _, ys in drawn for y in ys]
                           + [v for s, _, _ in drawn if s.has_band and not chart.log_y for v in s.low + s.high])
        y_lo, y_hi, y_ticks = _log_ticks(y_lo, y_hi) if chart.log_y else _nice(y_lo, y_hi)
    x_ticks = [x for x in _nice(x_lo, x_hi, count=5)[2] if x_lo <= x <= x_hi]  # axis ends at the data
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x_lo) / (x_hi - x_lo) * plot_w

    def py(y: float) -> float:
        return TOP + (1 - (y - y_lo) / (y_hi - y_lo)) * plot_h

    parts = [f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(chart.title)}">']
    for y in y_ticks:
        label = _log_label(y) if chart.log_y else _label(y, y_ticks)
        parts.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{py(y):.1f}" y2="{py(y):.1f}"/>'
                     f'<text class="tick" x="{LEFT - 6}" y="{py(y) + 3.5:.1f}" text-anchor="end">{label}</text>')
    for x in x_ticks:
        parts.append(f'<line class="grid" x1="{px(x):.1f}" x2="{px(x):.1f}" y1="{TOP}" y2="{TOP + plot_h}"/>'
                     f'<text class="tick" x="{px(x):.1f}" y="{HEIGHT - 8}" text-anchor="middle">'
                     f'{_label(x, x_ticks)}</text>')
    parts.append(f'<rect class="frame" x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}"/>')
    for step, label in chart.marks:
        if x_lo <= step <= x_hi:
            parts.append(f'<line class="mark" x1="{px(step):.1f}" x2="{px(step):.1f}" y1="{TOP}" '
                         f'y2="{TOP + plot_h}"><title>step {step:g}: {escape(label)}</title></line>')
    legend = []
    for index, (series, xs, ys) in enumerate(drawn):
        colour = series.colour or PALETTE[index % len(PALETTE)]
        if series.has_band and not chart.log_y:
            parts.append(_band_svg(series, colour, px, py))
        parts.append(_series_svg(series.name, xs, ys, colour, px, py, chart.log_y))
        last = series.values[-1]
        legend.append(f'<li><svg class="swatch" viewBox="0 0 10 10"><rect width="10" height="10" rx="2" '
                      f'fill="{colour}"/></svg>{escape(series.name)} <b>{_value(last)}</b></li>')
    parts.append("</svg>")
    return (f'<figure class="chart"><figcaption>{caption}</figcaption>{"".join(parts)}'
            f'<ul class="legend">{"".join(legend)}</ul></figure>')


def _series_svg(name: str, xs: list[float], ys: list[float], colour: str, px, py, log_y: bool) -> str:
    """Raw line (faint when smoothed), the trailing mean, or dots with tooltips for short series."""
    if len(xs) >= SMOOTH_FROM:
        window = max(2, round(len(xs) / 30))
        smooth = trailing_mean(ys, window)
        bx, by = bucket_means(xs, ys, MAX_POINTS)
        sx, sy = bucket_means(xs, smooth, MAX_POINTS)
        return (f'<path class="raw" d="{_path(bx, by, px, py)}" stroke="{colour}"/>'
                f'<path class="line" d="{_path(sx, sy, px, py)}" stroke="{colour}">'
                f'<title>{escape(name)}: mean of the last {window} steps</title></path>')
    dots = "".join(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.6" fill="{colour}"><title>'
                   f'{escape(name)} at step {x:g}: {_value(10 ** y if log_y else y)}</title></circle>'
                   for x, y in zip(xs, ys))
    return f'<path class="line" d="{_path(xs, ys, px, py)}" stroke="{colour}"/>{dots}'


def trailing_mean(values: list[float], window: int) -> list[float]:
    """values[i] replaced by the mean of values[max(0, i - window + 1) : i + 1]."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def bucket_means(xs: list[float], ys: list[float], most: int) -> tuple[list[float], list[float]]:
    """At most `most` points: consecutive points averaged in equal-count buckets (x and y)."""
    if len(xs) <= most:
        return xs, ys
    bx, by = [], []
    for b in range(most):
        lo, hi = b * len(xs) // most, (b + 1) * len(xs) // most
        bx.append(sum(xs[lo:hi]) / (hi - lo))
        by.append(sum(ys[lo:hi]) / (hi - lo))
    return bx, by


def _band_svg(series: Series, colour: str, px, py) -> str:
    """The band between a series' low and high, at most MAX_POINTS a side, as the lines."""
    xs_high, high = bucket_means(series.steps, series.high, MAX_POINTS)
    xs_low, low = bucket_means(series.steps, series.low, MAX_POINTS)
    return f'<path class="band" d="{_path(xs_high + xs_low[::-1], high + low[::-1], px, py)} Z" fill="{colour}"/>'


def _path(xs: list[float], ys: list[float], px, py) -> str:
    return "M" + "L".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys))


def _span(values: list[float]) -> tuple[float, float]:
    """min and max, pulled apart when equal so the axis has a length."""
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12 * max(1.0, abs(lo)):
        pad = abs(lo) * 0.1 or 1.0
        return lo - pad, hi + pad
    return lo, hi


def _nice(lo: float, hi: float, count: int = 4) -> tuple[float, float, list[float]]:
    """Limits widened to round numbers, and ticks at 1, 2 or 5 times a power of ten between them."""
    raw = (hi - lo) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    lo, hi = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    return lo, hi, _linear_ticks(lo, hi, step)


def _linear_ticks(lo: float, hi: float, step: float | None = None) -> list[float]:
    if step is None:
        return _nice(lo, hi)[2]
    n = round((hi - lo) / step)
    return [lo + i * step for i in range(n + 1)]


def _log_ticks(lo: float, hi: float) -> tuple[float, float, list[float]]:
    """Whole decades around [lo, hi] (log10 units); every second or third one when there are many."""
    lo, hi = math.floor(lo), math.ceil(hi)
    if hi == lo:
        hi += 1
    every = 1 if hi - lo <= 6 else (2 if hi - lo <= 12 else 3)
    return lo, hi, [float(k) for k in range(lo, hi + 1) if (k - lo) % every == 0]


def _label(value: float, ticks: list[float]) -> str:
    """A tick label with as many digits as it takes to tell the ticks apart: 0.25, 150k, 2.5e-7."""
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else 1.0
    largest = max(abs(t) for t in ticks) or 1.0
    if largest >= 1e5:
        scale, suffix = (1e6, "M") if largest >= 1e7 else (1e3, "k")
        return "0" if value == 0 else _label(value / scale, [t / scale for t in ticks]) + suffix
    if largest < 1e-2:
        if value == 0:
            return "0"
        digits = max(1, math.floor(math.log10(largest)) - math.floor(math.log10(step) + 1e-9) + 1)
        mantissa, exponent = f"{value:.{digits - 1}e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    return f"{value:.{decimals}f}"


def _log_label(exponent: float) -> str:
    k = int(exponent)
    return f"{10.0 ** k:g}" if -1 <= k <= 3 else f"1e{k}"


def _value(value: float) -> str:
    """A value for a legend or tooltip: 4 significant digits."""
    return f"{value:.4g}"
