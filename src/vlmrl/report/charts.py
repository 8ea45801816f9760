"""Which charts a run gets: its metrics.jsonl keys sorted into named panels, the rest by prefix.

Every numeric key is plotted somewhere, whatever the trainer logs now or later. Known keys go to
fixed panels (reward components, accuracy with held-out eval/*, KL on a log scale, lengths, time,
loss, clipping, held-out rewards and blind-image drops); every other key joins the keys that share
its prefix (`adv/mean`, `adv/std` -> "adv"), or gets a chart of its own. Such a chart whose lines
never move (a constant learning rate, a fixed group count) becomes one line of text instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from vlmrl.report.svg import Chart, Series

ACCURACY_WORDS = ("acc", "pass@", "correct", "solved")
"""An eval/* key holding one of these is an accuracy and goes beside the training accuracy."""


def is_accuracy_like(key: str) -> bool:
    return any(word in key.lower() for word in ACCURACY_WORDS)


def is_heldout_accuracy(key: str) -> bool:
    """eval/test/accuracy, eval/ood/pass@1, eval/test/blank/accuracy; not eval/*/reward/accuracy
    (a reward component) nor eval/*/drop (a difference of accuracies)."""
    return key.startswith("eval/") and is_accuracy_like(key) and "/reward/" not in key and not key.endswith("/drop")


PANELS: list[tuple[str, Callable[[str], bool], dict]] = [
    ("Reward (mean over completions; per component)",
     lambda k: k == "reward" or k.startswith("reward/"), {}),
    ("Accuracy: training samples and held-out eval",
     lambda k: k == "accuracy" or is_heldout_accuracy(k), {"unit_range": True}),
    ("KL to the reference (log scale)", lambda k: k == "kl" or k.startswith("kl/"), {"log_y": True}),
    ("Completion length (tokens)",
     lambda k: k.startswith(("completion_length", "length/")) or k.endswith("/completion_tokens"), {}),
    ("Truncated share of completions", lambda k: k == "truncated" or k.endswith("/truncated"),
     {"unit_range": True}),
    ("Time per step (s)", lambda k: k == "seconds" or k.startswith("time/"), {}),
    ("Loss", lambda k: k in ("loss", "pg_loss") or k.startswith("loss/"), {}),
    ("Clipped share of tokens", lambda k: k.startswith("clip"), {"unit_range": True}),
    ("Held-out reward (per component)", lambda k: k.startswith("eval/") and "/reward/" in k, {}),
    ("Held-out accuracy lost without the real image (or, with videos, the frames' order)",
     lambda k: k.startswith("eval/") and k.endswith("/drop"), {}),
]
"""(title, which keys, options): the fixed panels, in page order."""


def metric_series(rows: list[dict]) -> dict[str, Series]:
    """key -> its finite numeric values against "step", keys in order of first appearance."""
    series: dict[str, Series] = {}
    for row in rows:
        step = row.get("step")
        if not is_number(step):
            continue
        for key, value in row.items():
            if key != "step" and is_number(value):
                line = series.setdefault(key, Series(key, [], []))
                line.steps.append(float(step))
                line.values.append(float(value))
    return series


def build_charts(rows: list[dict], marks: list[tuple[float, str]] = ()) -> list[Chart]:
    """The fixed panels that have data, then one chart per remaining prefix or lone key."""
    series = metric_series(rows)
    charts, taken = [], set()
    for title, matches, options in PANELS:
        keys = [k for k in series if matches(k)]
        if not keys:
            continue
        taken.update(keys)
        lines = [series[k] for k in keys]
        unit = options.get("unit_range") and all(0 <= v <= 1 for s in lines for v in s.values)
        charts.append(Chart(title, lines, log_y=options.get("log_y", False),
                            y_range=(0.0, 1.0) if unit else None, marks=list(marks)))
    by_prefix: dict[str, list[Series]] = {}
    for key, line in series.items():
        if key not in taken:
            by_prefix.setdefault(key.rsplit("/", 1)[0], []).append(line)
    charts += [Chart(prefix, lines, marks=list(marks)) for prefix, lines in by_prefix.items()
               if not all(is_constant(line) for line in lines)]
    return charts


def constant_metrics(rows: list[dict]) -> dict[str, float]:
    """Keys outside the fixed panels whose value never changed: listed by value, not charted."""
    series = metric_series(rows)
    in_panels = {k for k in series for _, matches, _ in PANELS if matches(k)}
    by_prefix: dict[str, list[Series]] = {}
    for key, line in series.items():
        if key not in in_panels:
            by_prefix.setdefault(key.rsplit("/", 1)[0], []).append(line)
    return {line.name: line.values[0] for lines in by_prefix.values()
            if all(is_constant(line) for line in lines) for line in lines}


def is_constant(line: Series) -> bool:
    return len(line.values) > 1 and max(line.values) == min(line.values)


def final_value(rows: list[dict], key: str) -> tuple[float, int] | None:
    """Mean of `key` over the last tenth of the steps that logged it (at least 1), and that count."""
    values = [float(r[key]) for r in rows if is_number(r.get(key))]
    if not values:
        return None
    last = values[-max(1, len(values) // 10):]
    return sum(last) / len(last), len(last)


def is_number(value) -> bool:
    """A finite int or float (not a bool): a value a chart can draw."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
