"""Assemble the report: one HTML file with its style, script, plots, images and data inline.

The page fetches nothing, so it works from disk and offline, and its Content-Security-Policy says
so: only the page's own style and script run (allowed by hash) and images come only from data:
URIs. Python escapes every string it writes into the HTML; the rollout viewer's data sits in a
JSON block with <, > and & escaped, and the script puts it on the page as text. A completion
holding <script> is shown as text, and were an escaping mistake ever to slip in, the policy would
still refuse to run the injected script (and say so in the browser console).
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import math
from html import escape
from importlib import resources
from pathlib import Path

from vlmrl import __version__
from vlmrl.disk import output_file, write_text
from vlmrl.report.charts import build_charts, constant_metrics, final_value, is_accuracy_like, is_heldout_accuracy
from vlmrl.report.diagnosis import diagnose
from vlmrl.report.rollouts import MAX_GROUPS, MAX_STEPS, rollout_data
from vlmrl.report.rundir import RunDir, read_run_dir
from vlmrl.report.svg import render_chart

MAX_EVAL_ROWS = 40
"""Most numbers shown per eval file (accuracy-like ones first; of a `vlmrl eval` file, its results)."""
MAX_ALARM_ROWS = 200
"""Most alarms listed (the first ones; the count is always shown)."""


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the HTML report of `run_dir` to `out` (default RUN_DIR/report.html); returns its path."""
    run = read_run_dir(run_dir)
    path = Path(out) if out is not None else run.path / "report.html"
    output_file(path, "the report")  # a bad --out in one line, before the page is made
    return write_text(path, "the report", render_page(run))  # whole or not at all


def render_page(run: RunDir) -> str:
    """The whole page as one string."""
    name = run.path.resolve().name
    style = static_text("report.css")
    script = static_text("viewer.js")
    policy = (f"default-src 'none'; img-src data:; style-src '{csp_hash(style)}'; "
              f"script-src '{csp_hash(script)}'")
    viewer_data = json_for_script(rollout_data(run))  # first: it counts skipped lines for the footer
    sections = [("diagnosis", "Why not improving?", _diagnosis_section(run)),
                ("metrics", "Metrics", _metrics_section(run)), ("rollouts", "Rollouts", _rollouts_section(run)),
                ("evals", "Evaluation", _evals_section(run)), ("alarms", "Alarms", _alarms_section(run)),
                ("config", "Config", _config_section(run))]  # (anchor, link text, HTML; "" when absent)
    nav = "".join(f'<a href="#{anchor}">{label}</a>' for anchor, label, html in sections if html)
    return f"""{document_head(f"{name} · vlmrl report", policy, style)}
<body>
<main>
<header>
<h1>{escape(name)}</h1>
<div class="where">{escape(str(run.path.resolve()))}</div>
<p class="setup">{_setup_line(run.config)}</p>
{_tiles(run)}
</header>
<nav>{nav}</nav>
{"".join(html for _, _, html in sections)}
<footer>Written by vlmrl {escape(__version__)} on {datetime.datetime.now():%Y-%m-%d %H:%M}.
{_skipped_note(run)}</footer>
</main>
<script type="application/json" id="rollout-data">{viewer_data}</script>
<script>{script}</script>
</body>
</html>
"""


def document_head(title: str, policy: str, style: str) -> str:
    """From the doctype to </head>: charset, the Content-Security-Policy, viewport, title, inline style."""
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{policy}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(title)}</title>
<style>{style}</style>
</head>"""


def json_for_script(value) -> str:
    """JSON safe inside a <script> element: <, > and & escaped, so no string can close the block."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def static_text(name: str) -> str:
    """A file of report/static/ (style, script), to inline in a page."""
    return (resources.files("vlmrl.report") / "static" / name).read_text(encoding="utf-8")


def csp_hash(text: str) -> str:
    """A CSP source that allows exactly this inline style or script."""
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")


# --------------------------------------------------------------------------- header


def _setup_line(config: dict) -> str:
    """Task, model and the algorithm's main knobs, from config.yaml (escaped)."""
    def get(section: str, key: str):
        part = config.get(section)
        return part.get(key) if isinstance(part, dict) else None

    facts = [("task", get("task", "name")), ("model", get("model", "name_or_path")),
             ("prompts/step", get("rollout", "prompts_per_step")), ("G", get("rollout", "group_size")),
             ("lr", get("train", "lr")), ("beta", get("algorithm", "beta")),
             ("clip", _pair(get("algorithm", "eps_low"), get("algorithm", "eps_high"))),
             ("advantage", get("algorithm", "advantage_scale")), ("ratio", get("algorithm", "ratio_level")),
             ("aggregation", get("algorithm", "aggregation"))]
    shown = [f"{label} <b>{escape(str(value))}</b>" for label, value in facts if value is not None]
    return " · ".join(shown) if shown else "no config.yaml"


def _pair(low, high) -> str | None:
    return None if low is None or high is None else f"{low}/{high}"


def _tiles(run: RunDir) -> str:
    """The run at a glance: steps, final reward and accuracy, held-out accuracy, KL, time, alarms."""
    steps = [r["step"] for r in run.metrics if isinstance(r.get("step"), (int, float))]
    tiles = []
    if steps:
        tiles.append(("steps logged", f"{max(steps):g}", f"{len(steps)} rows in metrics.jsonl", ""))
    for key, label in [("reward", "reward"), ("accuracy", "train accuracy"), ("kl", "KL")]:
        found = final_value(run.metrics, key)
        if found is not None:
            value, count = found
            tiles.append((label, f"{value:.3g}", f"mean of the last {count} logged steps", ""))
    eval_keys = [k for r in run.metrics for k in r if is_heldout_accuracy(k)]
    if eval_keys:
        found = final_value(run.metrics, eval_keys[0])
        if found is not None:
            tiles.append((escape(eval_keys[0]), f"{found[0]:.3g}", "latest held-out evaluation", ""))
    seconds = sum(r["seconds"] for r in run.metrics if isinstance(r.get("seconds"), (int, float)))
    if seconds:
        tiles.append(("time", _duration(seconds), "sum of the per-step seconds", ""))
    if run.alarms:
        tiles.append(("alarms", str(len(run.alarms)), "see Alarms below", "alarm"))
    items = "".join(f'<li class="{css}" title="{escape(hint)}"><span class="label">{label}</span>'
                    f'<span class="value">{value}</span></li>' for label, value, hint, css in tiles)
    return f'<ul class="tiles">{items}</ul>'


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


# --------------------------------------------------------------------------- sections


def _metrics_section(run: RunDir) -> str:
    marks = [(float(a["step"]), str(a.get("kind", "alarm"))) for a in run.alarms
             if isinstance(a.get("step"), (int, float))]
    charts = build_charts(run.metrics, marks)
    body = ("".join(render_chart(chart) for chart in charts) if charts
            else '<p class="empty">metrics.jsonl has no rows yet.</p>')
    constants = constant_metrics(run.metrics)
    listed = " · ".join(f"{escape(key)} <b>{value:.4g}</b>" for key, value in constants.items())
    still = f'<p class="constants">Constant throughout: {listed}</p>' if constants else ""
    note = "faint: every step; solid: trailing mean" + ("; dashed red: alarms" if marks else "")
    return (f'<section id="metrics"><h2>Metrics <span class="note">{note}</span></h2>'
            f'<div class="charts">{body}</div>{still}</section>')


def _diagnosis_section(run: RunDir) -> str:
    """The "why is RL not improving" panel: each check of diagnosis.py with the run's value, its
    threshold, the verdict and the settings to change; "" for a run that is not GRPO."""
    findings = diagnose(run.metrics, run.config)
    if not findings:
        return ""
    fired = [f for f in findings if f.fired]
    if fired:
        summary = f"{len(fired)} of {len(findings)} checks fired; the first is the likeliest reason."
    else:
        summary = ("No check fired: the batch carries a signal the update can use. If accuracy still stays "
                   "flat, give it more steps, a higher train.lr, or more prompts per step (rollout.prompts_per_step).")
    rows = "".join(
        f'<tr class="{escape(f.verdict.replace("/", ""))}"><td class="verdict">{escape(f.verdict)}</td>'
        f"<td>{escape(f.title)}</td><td class=\"num\">{escape(f.value)}</td><td>{escape(f.threshold)}</td>"
        f"<td>{escape(f.message)}</td><td class=\"levers\">{'<br>'.join(escape(k) for k in f.levers)}</td></tr>"
        for f in findings)
    return (f'<section id="diagnosis"><h2>Why is RL not improving? <span class="note">checks of metrics.jsonl, '
            f'last third of the steps; see docs/training.md</span></h2><p class="summary">{escape(summary)}</p>'
            "<table><tr><th>verdict</th><th>check</th><th>value</th><th>threshold</th><th>diagnosis</th>"
            f"<th>levers</th></tr>{rows}</table></section>")


def _rollouts_section(run: RunDir) -> str:
    total = len(run.rollout_files)
    if total > MAX_STEPS:
        note = f"{MAX_STEPS} of {total} logged steps, evenly spaced; up to {MAX_GROUPS} groups each"
    else:
        note = f"{total} logged steps; up to {MAX_GROUPS} groups each; best first"
    return (f'<section id="rollouts"><h2>Rollouts <span class="note">{note}</span></h2>'
            '<div id="viewer"><noscript>The rollout viewer needs JavaScript.</noscript></div></section>')


def _evals_section(run: RunDir) -> str:
    if not run.evals:
        return ""
    blocks = []
    for name, content in run.evals.items():
        if isinstance(content, str):
            blocks.append(f'<div><h3>{escape(name)}</h3><p class="note">{escape(content)}</p></div>')
            continue
        results = content.get("results") if isinstance(content, dict) else None  # `vlmrl eval` files
        numbers = flatten_numbers(results if isinstance(results, dict) else content)
        numbers.sort(key=lambda pair: not is_accuracy_like(pair[0]))  # accuracy first, order kept
        rows = "".join(f'<tr class="{"accuracy" if is_accuracy_like(k) else ""}"><td>{escape(k)}</td>'
                       f'<td class="num">{v:.4g}</td></tr>' for k, v in numbers[:MAX_EVAL_ROWS])
        more = (f'<p class="note">and {len(numbers) - MAX_EVAL_ROWS} more numbers</p>'
                if len(numbers) > MAX_EVAL_ROWS else "")
        table = f"<table>{rows}</table>" if rows else '<p class="note">no numbers</p>'
        blocks.append(f"<div><h3>{escape(name)}</h3>{table}{more}</div>")
    return f'<section id="evals"><h2>Evaluation</h2><div class="evals">{"".join(blocks)}</div></section>'


def flatten_numbers(value, prefix: str = "") -> list[tuple[str, float]]:
    """(dotted key, number) for every number in nested JSON objects; lists are left out."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [(prefix or "value", float(value))] if math.isfinite(value) else []
    if isinstance(value, dict):
        return [pair for key, item in value.items()
                for pair in flatten_numbers(item, f"{prefix}.{key}" if prefix else str(key))]
    return []


def _alarms_section(run: RunDir) -> str:
    if not run.alarms:
        return ""
    rows = "".join(f'<tr><td class="num">{escape(str(a.get("step", "")))}</td>'
                   f'<td class="kind">{escape(str(a.get("kind", "")))}</td>'
                   f'<td>{escape(str(a.get("message", "")))}</td></tr>' for a in run.alarms[:MAX_ALARM_ROWS])
    more = (f'<p class="note">and {len(run.alarms) - MAX_ALARM_ROWS} more in alarms.jsonl</p>'
            if len(run.alarms) > MAX_ALARM_ROWS else "")
    return (f'<section id="alarms"><h2>Alarms <span class="note">{len(run.alarms)} raised</span></h2>'
            f"<table><tr><th>step</th><th>kind</th><th>message</th></tr>{rows}</table>{more}</section>")


def _config_section(run: RunDir) -> str:
    body = (f'<details open><summary>config.yaml</summary><pre class="config">{escape(run.config_text)}</pre></details>'
            if run.config_text is not None else '<p class="empty">No config.yaml in the run directory.</p>')
    return f'<section id="config"><h2>Config</h2>{body}</section>'


def _skipped_note(run: RunDir) -> str:
    if not run.skipped_lines:
        return ""
    return f"{run.skipped_lines} unreadable JSONL lines were skipped (a run still writing?)."
