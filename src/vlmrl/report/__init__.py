"""`vlmrl report RUN_DIR`: one self-contained HTML page that shows what a training run did.

A "why is RL not improving" panel (checks of the logged metrics, each with its verdict and the
settings to change), plots of every logged metric (reward components, train and held-out accuracy, KL on a log scale,
lengths, timings, ...), a rollout viewer (each logged step's prompts, their image beside the G
completions, best and worst marked, reward components and advantages), evaluation results,
alarms and the run's config. The file fetches nothing: it opens from disk, offline.

    rundir.py       read a run directory
    charts.py       which metrics go in which chart
    diagnosis.py    why RL is not improving: checks of metrics.jsonl, each a finding with its levers
    svg.py          draw a chart as inline SVG
    rollouts.py     the rollout viewer's data (capped steps and groups, images as data URIs)
    page.py         assemble and write the page (static/report.css, static/viewer.js inline)
    compare.py      the comparison page of a `vlmrl compare` study
    tracking.py     where metrics go: metrics.jsonl and the trackers asked for (TensorBoard, ...)
    rollout_log.py  the rollout log the trainer writes and the viewer reads

May import: config, disk, errors. Nothing from the model, rollout, training, safety or evaluation
folders: training writes metrics and rollouts here; the report only reads them back.
"""

from vlmrl.report.page import render_page, write_report

__all__ = ["render_page", "write_report"]
