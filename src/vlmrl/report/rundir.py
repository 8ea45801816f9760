"""Read a run directory as the report needs it, tolerating a run still being written.

Everything but metrics.jsonl or rollouts/ is optional: config.yaml, alarms.jsonl, the trainer's
evals/step_XXXXXX_<split>.json and the files `vlmrl eval` writes (eval_*.json in the run directory
or a folder in it, such as final/, and eval*/eval.json).
A line cut short by a run that is still writing is skipped and counted, not an error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from vlmrl.errors import VlmrlError
from vlmrl.urls import redact_text

ROLLOUT_FILE = re.compile(r"step_(\d+)\.jsonl")
TRAINER_EVAL_FILE = re.compile(r"step_(\d+)_(.+)\.json")


@dataclass
class RunDir:
    """What a run directory holds; rollout files are listed here and read only when embedded."""

    path: Path
    config_text: str | None = None
    """config.yaml as written, every URL in it redacted (None when missing)."""
    config: dict = field(default_factory=dict)
    """config.yaml parsed ({} when missing or unreadable)."""
    metrics: list[dict] = field(default_factory=list)
    """metrics.jsonl rows, in file order."""
    rollout_files: dict[int, Path] = field(default_factory=dict)
    """step -> rollouts/step_XXXXXX.jsonl, ascending steps."""
    evals: dict[str, object] = field(default_factory=dict)
    """eval file (path relative to the run directory) -> its parsed JSON, or the read error's text."""
    alarms: list[dict] = field(default_factory=list)
    """alarms.jsonl rows: step, kind, message."""
    skipped_lines: int = 0
    """JSONL lines that did not parse (usually the last line of a run still writing)."""


def read_run_dir(path: str | Path) -> RunDir:
    """The contents of run directory `path`; a VlmrlError when it is missing or holds no run."""
    path = Path(path)
    if not path.is_dir():
        raise VlmrlError(f"run directory {str(path)!r} " + ("is a file" if path.exists() else "does not exist"))
    run = RunDir(path=path)
    run.metrics = _read_jsonl(path / "metrics.jsonl", run)
    rollouts = path / "rollouts"
    if rollouts.is_dir():
        found = ((ROLLOUT_FILE.fullmatch(p.name), p) for p in rollouts.iterdir())
        run.rollout_files = dict(sorted((int(m.group(1)), p) for m, p in found if m))
    if not run.metrics and not run.rollout_files:
        raise VlmrlError(f"{str(path)!r} holds no metrics.jsonl rows and no rollouts/step_*.jsonl: "
                         "not a run directory, or a run that has not logged a step yet")
    config_file = path / "config.yaml"
    if config_file.is_file():
        run.config_text = redact_text(config_file.read_text(errors="replace"))  # a run of an older vlmrl saved URLs whole
        try:
            loaded = yaml.safe_load(run.config_text)
            run.config = loaded if isinstance(loaded, dict) else {}
        except yaml.YAMLError:
            run.config = {}
    for eval_file in eval_files(path):
        name = eval_file.relative_to(path).as_posix()
        try:
            run.evals[name] = json.loads(eval_file.read_text())
        except (OSError, ValueError) as error:
            run.evals[name] = f"could not read: {error}"
    run.alarms = _read_jsonl(path / "alarms.jsonl", run)
    return run


def eval_files(path: Path) -> list[Path]:
    """The newest evals/step_XXXXXX_<split>.json of each split (the trainer's; the history is in
    metrics.jsonl), then what `vlmrl eval` wrote: eval_*.json here or one folder down, eval*/eval.json."""
    newest: dict[str, tuple[int, Path]] = {}
    for file in (path / "evals").glob("step_*.json"):
        match = TRAINER_EVAL_FILE.fullmatch(file.name)
        if match and int(match.group(1)) >= newest.get(match.group(2), (-1, file))[0]:
            newest[match.group(2)] = (int(match.group(1)), file)
    by_hand = {*path.glob("eval_*.json"), *path.glob("*/eval_*.json"), *path.glob("eval*/eval.json")}
    return [file for _, file in sorted(newest.values())] + sorted(by_hand)


def read_rollout_rows(file: Path, run: RunDir) -> list[dict]:
    """The rows of one rollouts/step_XXXXXX.jsonl."""
    return _read_jsonl(file, run)


def read_jsonl(file: Path) -> tuple[list[dict], int]:
    """The object rows of a JSONL file ([] when missing), and how many lines were not one (a line
    cut off by a run still writing, say); blank lines are neither."""
    if not file.is_file():
        return [], 0
    rows, skipped = [], 0
    for line in file.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        else:
            skipped += 1
    return rows, skipped


def _read_jsonl(file: Path, run: RunDir) -> list[dict]:
    """Rows of a JSONL file ([] when missing); lines that do not parse add to run.skipped_lines."""
    rows, skipped = read_jsonl(file)
    run.skipped_lines += skipped
    return rows
