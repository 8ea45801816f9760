"""The comparison of a study's arms (study/compare.py): one self-contained HTML page and a Markdown table.

Per arm, over its seeds' runs (each run's metrics.jsonl):
- held-out accuracy: eval/<split>/accuracy at the run's last evaluation; mean +- the sample std over
  the seeds that have one (0 with one seed), and each seed's value;
- every other accuracy the runs logged at their evaluations (other splits, `eval/ood/accuracy`; the
  blind-image check, `eval/test/blank/accuracy`), mean +- std, one column each;
- the training wall clock: the sum of the steps' `seconds` (evaluation not counted), mean over seeds;
- curves of held-out accuracy, reward, KL, completion length and entropy against the step and against
  the wall clock (the seeds' mean cumulative seconds at that step): the mean over the seeds that
  reached the step as a line, their min..max as a band.
The page inlines its style and fetches nothing (the run report's stylesheet and CSP rule).
"""

from __future__ import annotations

import datetime
import statistics
from dataclasses import dataclass
from html import escape
from pathlib import Path

from vlmrl import __version__
from vlmrl.disk import writing
from vlmrl.report.charts import is_number
from vlmrl.report.page import csp_hash, document_head, static_text
from vlmrl.report.rundir import read_jsonl
from vlmrl.report.svg import PALETTE, Chart, Series, render_chart

CURVES = ("eval/{split}/accuracy", "reward", "kl", "completion_length", "entropy")
"""The metrics drawn per arm, against step and wall clock."""


@dataclass
class SeedRun:
    """One finished (or partial) run of an arm."""

    seed: int
    rows: list[dict]
    """Its metrics rows, one per step (those with a `step`)."""

    def values(self, key: str) -> dict[int, float]:
        """step -> value of `key` where it is a finite number."""
        return {int(row["step"]): float(row[key]) for row in self.rows if is_number(row.get(key))}

    def clock(self) -> dict[int, float]:
        """step -> training seconds up to and including it."""
        total, out = 0.0, {}
        for row in self.rows:
            total += float(row.get("seconds") or 0.0)
            out[int(row["step"])] = total
        return out

    def last(self, key: str) -> float | None:
        """The value of `key` at the last step that has one."""
        found = self.values(key)
        return found[max(found)] if found else None

    def final_accuracy(self, split: str) -> float | None:
        return self.last(f"eval/{split}/accuracy")


@dataclass
class ArmResult:
    """An arm's runs that have metrics, and the seeds that have none yet."""

    name: str
    runs: list[SeedRun]
    missing: list[int]

    def accuracies(self, split: str) -> list[float]:
        return [a for a in (run.final_accuracy(split) for run in self.runs) if a is not None]

    def curve(self, key: str, against_clock: bool, colour: str | None = None) -> Series | None:
        """Mean over seeds at each step (or the seeds' mean clock), with the seeds' min..max band."""
        per_seed = [run.values(key) for run in self.runs]
        clocks = [run.clock() for run in self.runs]
        steps = sorted({step for values in per_seed for step in values})
        if not steps:
            return None
        xs, mean, low, high = [], [], [], []
        for step in steps:
            at = [values[step] for values in per_seed if step in values]
            times = [clock[step] for clock in clocks if step in clock]
            xs.append(statistics.fmean(times) if against_clock and times else float(step))
            mean.append(statistics.fmean(at))
            low.append(min(at))
            high.append(max(at))
        return Series(self.name, xs, mean, low, high, colour)


def step_rows(path: Path) -> list[dict]:
    """The rows with a step of a metrics.jsonl ([] when missing); a line that does not parse (a run
    still writing it) is left out."""
    return [row for row in read_jsonl(path)[0] if isinstance(row.get("step"), int)]


def read_results(study, grid) -> list[ArmResult]:
    """Each arm's runs (`grid`: study.plan's runs) with the metrics they have written."""
    results = []
    for arm in study.arms:
        runs, missing = [], []
        for run in (r for r in grid if r.spec is arm):
            rows = step_rows(run.folder / "metrics.jsonl")
            if rows:
                runs.append(SeedRun(run.seed, rows))
            else:
                missing.append(run.seed)
        results.append(ArmResult(arm.name, runs, missing))
    return results


def _mean_std(values: list[float]) -> str:
    if not values:
        return "n/a"
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.1%} ± {spread:.1%}"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def other_accuracies(results: list[ArmResult], split: str) -> list[str]:
    """The held-out accuracies the runs logged besides eval/<split>/accuracy, sorted: other splits'
    and the blind-image check's (`eval/<split>/<kind>/accuracy`); not the reward component named
    accuracy (`eval/<split>/reward/accuracy`), which the accuracy itself already is."""
    keys = {key for arm in results for run in arm.runs for row in run.rows for key in row
            if key.startswith("eval/") and key.endswith("/accuracy") and "/reward/" not in key}
    return sorted(keys - {f"eval/{split}/accuracy"})


def header(results: list[ArmResult], split: str) -> list[str]:
    """The table's columns (`table_rows`)."""
    return HEADER[:3] + [key.removeprefix("eval/") for key in other_accuracies(results, split)] + HEADER[3:]


def table_rows(results: list[ArmResult], split: str) -> list[list[str]]:
    """The table: arm, runs, held-out accuracy mean ± std, the other accuracies' mean ± std, per seed,
    final reward, steps, wall clock."""
    rows, others = [], other_accuracies(results, split)
    for arm in results:
        per_seed = ", ".join(f"{run.seed}: {a:.1%}" for run in arm.runs if (a := run.final_accuracy(split)) is not None)
        rewards = [r for r in (run.last("reward") for run in arm.runs) if r is not None]
        ends = [max(run.clock().items()) for run in arm.runs]  # (last step, training seconds) per run
        clocks, steps = [seconds for _, seconds in ends], sorted({step for step, _ in ends})
        more = [_mean_std([a for a in (run.last(key) for run in arm.runs) if a is not None]) for key in others]
        rows.append([arm.name, f"{len(arm.runs)}" + (f" ({len(arm.missing)} missing)" if arm.missing else ""),
                     _mean_std(arm.accuracies(split)), *more, per_seed or "n/a",
                     f"{statistics.fmean(rewards):.3f}" if rewards else "n/a",
                     "/".join(map(str, steps)) or "n/a",
                     _duration(statistics.fmean(clocks)) if clocks else "n/a"])
    return rows


HEADER = ["arm", "runs", "held-out accuracy (mean ± std)", "per seed", "final reward", "steps", "training time"]


def markdown(columns: list[str], rows: list[list[str]]) -> str:
    """The table (`header`, `table_rows`) in Markdown."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def charts(results: list[ArmResult], split: str) -> list[Chart]:
    """Per curve metric: against step, then against wall clock (seconds)."""
    out = []
    for template in CURVES:
        key = template.format(split=split)
        for against_clock in (False, True):
            series = [s for s in (arm.curve(key, against_clock, PALETTE[i % len(PALETTE)])  # an arm's colour
                                  for i, arm in enumerate(results)) if s is not None]
            if series:
                axis = "training seconds" if against_clock else "step"
                out.append(Chart(f"{key} vs {axis}", series,
                                 y_range=(0.0, 1.0) if key.endswith("accuracy") else None))
    return out


def render(study, results: list[ArmResult], rows: list[list[str]]) -> str:
    """The comparison page as one string; `rows`: the table (`table_rows`)."""
    split, name = study.eval_split, Path(study.output_dir).name
    style = static_text("report.css")
    columns = "".join(f"<th>{escape(h)}</th>" for h in header(results, split))
    body = "".join("<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in row) + "</tr>"
                   for row in rows)
    figures = "".join(render_chart(chart) for chart in charts(results, split)) or '<p class="empty">no metrics yet</p>'
    seeds = ", ".join(map(str, study.seeds))
    warm = SeedRun(0, step_rows(Path(study.output_dir) / "warm_start" / "metrics.jsonl")).final_accuracy(split)
    start = f"; every arm starts from the warm start's {warm:.1%}" if warm is not None else ""
    head = document_head(f"{name} · vlmrl comparison", f"default-src 'none'; style-src '{csp_hash(style)}'", style)
    return f"""{head}
<body>
<main>
<header>
<h1>{escape(name)}</h1>
<div class="where">{escape(str(Path(study.output_dir).resolve()))}</div>
<p class="setup">{len(study.arms)} arms x seeds {escape(seeds)}; held-out accuracy = eval/{escape(split)}/accuracy
at each run's last evaluation (mean ± sample std over seeds){escape(start)}</p>
</header>
<section id="table"><h2>Arms</h2><table><tr>{columns}</tr>{body}</table></section>
<section id="curves"><h2>Curves <span class="note">line: mean over seeds; band: min..max over seeds</span></h2>
<div class="charts">{figures}</div></section>
<footer>Written by vlmrl {escape(__version__)} on {datetime.datetime.now():%Y-%m-%d %H:%M}.</footer>
</main>
</body>
</html>
"""


def write_comparison(study, grid) -> Path:
    """OUTPUT_DIR/compare.html and compare.md from the runs' metrics; returns the page."""
    results = read_results(study, grid)
    rows = table_rows(results, study.eval_split)
    root = Path(study.output_dir)
    page, table = root / "compare.html", root / "compare.md"
    with writing("the comparison", page):
        root.mkdir(parents=True, exist_ok=True)
        page.write_text(render(study, results, rows), encoding="utf-8")
        table.write_text(markdown(header(results, study.eval_split), rows), encoding="utf-8")
    return page
