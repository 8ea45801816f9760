"""Where metrics go: `metrics.jsonl` in the run directory always, plus the trackers asked for.

Every destination is a sink with two methods, `log(metrics)` (one step's numbers, the step under
the key "step") and `close()`. `build_trackers(config, run_dir, resume_step)` returns them all
behind one `Trackers` object:

- metrics.jsonl: always. On resume the file is cut back to the checkpoint's step, so a resumed
  run's log reads exactly like an uninterrupted one; a torn line (a crash's cut-short or NUL-padded
  tail) is dropped with a warning (`read_log`).
- tensorboard: event files in RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR`); on resume the
  steps after the checkpoint are purged, as in metrics.jsonl.
- wandb: a W&B run named after the run directory, its id kept in RUN_DIR/wandb_run_id so that a
  resumed run continues its own W&B run (`wandb.init(id=..., resume="allow")`) instead of opening a
  new one; every `train.log_rollouts_every` steps a `completions` table (step, group, prompt, image as
  a `wandb.Image`, completion, answer, reward, advantage and every reward component), as TRL logs it.
- wandb, trackio: imported only when asked for; asked for and not installed is a VlmrlError.

A sink may also have `log_rollouts(step, rows)` (rows of report/rollout_log.py `rollout_rows`,
images still PIL images); `Trackers.log_rollouts` calls it on the sinks that have it.

A sink whose `MAIN_THREAD` is true is called on the main thread (`Trackers.log_main`): W&B
(`wandb.log` is not thread-safe, wandb/wandb#1824) and trackio (it documents no calls from a second
thread). The run's own files (metrics.jsonl, TensorBoard's events) may be written on the session's
log thread (`Trackers.log_files`, training/log_writer.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
from pathlib import Path
from typing import Protocol

from vlmrl.config import Config, saved_dict
from vlmrl.disk import writing
from vlmrl.errors import VlmrlError, warn


class MetricsLog:
    """Append-only JSONL of per-step metrics."""

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [row for row in read_log(self.path) if (row.get("step") or 0) <= resume_step]
            self.path.write_text("".join(json.dumps(row) + "\n" for row in kept))

    def log(self, metrics: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in metrics.items()}
        with writing("metrics", self.path), self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")

    def close(self) -> None:
        """Nothing to do: every line is written when logged."""


def read_log(path: Path) -> list[dict]:
    """The rows of a run's JSONL log (metrics.jsonl, alarms.jsonl) that a resume keeps. A line that
    is not a JSON object (cut short, NUL bytes or other bytes that are not UTF-8: what a crash or a
    full disk leaves at the end of a file being appended to) is dropped with a warning naming it."""
    rows, torn = [], []
    for number, raw in enumerate(Path(path).read_bytes().split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8")) if b"\0" not in raw else None
        except ValueError:  # UnicodeDecodeError is one
            row = None
        if isinstance(row, dict):
            rows.append(row)
        else:
            torn.append(number)
    if torn:
        where = f"line {torn[0]}" if len(torn) == 1 else f"lines {', '.join(map(str, torn))}"
        warn(f"{path}: dropped {where}, not a whole JSON row (cut short by the interrupted run, NUL bytes or "
             "not UTF-8)")
    return rows


def read_metrics(path: Path) -> list[dict]:
    """All rows of a metrics.jsonl."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------- trackers

TRACKERS = ("tensorboard", "wandb", "trackio")
"""Names accepted in `train.trackers`, besides metrics.jsonl which is always written."""


class Sink(Protocol):
    """One destination of per-step metrics."""

    def log(self, metrics: dict) -> None:
        """One step's metrics; `metrics["step"]` is the step."""

    def close(self) -> None:
        """Flush and release whatever the sink holds open."""


class Trackers:
    """All sinks of a run: `log` and `close` go to each, in order. Also a context manager."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def log(self, metrics: dict) -> None:
        for sink in self.sinks:
            sink.log(metrics)

    def log_files(self, metrics: dict) -> None:
        """`log` to the sinks that write the run's own files (metrics.jsonl, TensorBoard), in order."""
        for sink in self.sinks:
            if not getattr(sink, "MAIN_THREAD", False):
                sink.log(metrics)

    def log_main(self, metrics: dict) -> None:
        """`log` to the sinks that stay on the main thread (W&B, trackio), in order."""
        for sink in self.sinks:
            if getattr(sink, "MAIN_THREAD", False):
                sink.log(metrics)

    def log_rollouts(self, step: int, rows: list[dict]) -> None:
        """One step's completions (rollout_log.rollout_rows) to the sinks that show them (W&B's table)."""
        for sink in self.sinks:
            if hasattr(sink, "log_rollouts"):
                sink.log_rollouts(step, rows)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def build_trackers(config: Config, run_dir: Path, resume_step: int | None = None) -> Trackers:
    """metrics.jsonl plus every tracker in `config.train.trackers`; call on the main process only.

    `resume_step` is the checkpoint's step when resuming (None for a fresh run): logs past it are
    dropped so a resumed run reads like an uninterrupted one.
    """
    run_dir = Path(run_dir)
    sinks: list[Sink] = [MetricsLog(run_dir / "metrics.jsonl", resume_step=resume_step)]
    for name in dict.fromkeys(config.train.trackers):  # in order, each once
        if name == "tensorboard":
            sinks.append(TensorBoardSink(run_dir / "tensorboard", resume_step=resume_step))
        elif name == "wandb":
            sinks.append(WandbSink(config.train.tracker_project, run_dir, saved_dict(config), resume_step))
        elif name == "trackio":
            sinks.append(TrackioSink(config.train.tracker_project, run_dir.name, saved_dict(config)))
        else:
            raise unknown_tracker(name)
    return Trackers(sinks)


def scalars(metrics: dict) -> dict[str, float]:
    """The finite numbers of a metrics row, without the step (None, NaN and text are left out)."""
    return {key: float(value) for key, value in metrics.items()
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value)}


def unknown_tracker(name: str) -> VlmrlError:
    return VlmrlError(f"unknown tracker {name!r} in train.trackers; choose from {', '.join(TRACKERS)}")


def not_installed(name: str) -> VlmrlError:
    return VlmrlError(f"train.trackers asks for {name}, but {name} is not installed: "
                      f"`pip install {name}`, or remove {name} from train.trackers")


def check_trackers(names: list[str]) -> None:
    """VlmrlError for a tracker that is unknown or not installed, without importing it."""
    for name in names:
        if name not in TRACKERS:
            raise unknown_tracker(name)
        if importlib.util.find_spec(name) is None:  # each tracker's package is named as the tracker
            raise not_installed(name)


def import_tracker(name: str, module: str):
    """Import a tracker's module, or say in one line how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise not_installed(name) from None


class TensorBoardSink:
    """TensorBoard event files in `folder`, one scalar per metric (tags like `reward/format`)."""

    def __init__(self, folder: Path, resume_step: int | None = None):
        summary = import_tracker("tensorboard", "torch.utils.tensorboard")
        folder = Path(folder)
        if resume_step is None and folder.is_dir():  # a fresh run starts a fresh log, as metrics.jsonl
            for old in folder.glob("events.out.tfevents.*"):
                old.unlink()
        purge = None if resume_step is None else resume_step + 1  # readers drop older events >= it
        self.writer = summary.SummaryWriter(log_dir=str(folder), purge_step=purge, flush_secs=10)

    def log(self, metrics: dict) -> None:
        step = int(metrics["step"])
        for tag, value in scalars(metrics).items():
            self.writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


WANDB_RUN_ID = "wandb_run_id"
"""The file in the run directory holding the id of its W&B run."""
ROLLOUT_COLUMNS = ("step", "group", "prompt", "image", "completion", "answer", "reward", "advantage")
"""The first columns of W&B's completions table; every reward component follows."""


class WandbSink:
    """A Weights & Biases run named after the run directory, its files under RUN_DIR/wandb; a resumed
    run (`resume_step` given) continues the W&B run whose id RUN_DIR/wandb_run_id holds."""

    MAIN_THREAD = True  # wandb.log is not thread-safe (wandb/wandb#1824)

    def __init__(self, project: str, run_dir: Path, config: dict, resume_step: int | None = None):
        self.wandb = import_tracker("wandb", "wandb")
        id_file = Path(run_dir) / WANDB_RUN_ID
        saved = id_file.read_text().strip() if resume_step is not None and id_file.is_file() else ""
        continued = {"id": saved, "resume": "allow"} if saved else {}
        self.run = self.wandb.init(project=project, name=Path(run_dir).name, dir=str(run_dir), config=config,
                                   **continued)
        with writing("the W&B run id", id_file):
            id_file.write_text(f"{self.run.id}\n")

    def log(self, metrics: dict) -> None:
        self.run.log(scalars(metrics), step=int(metrics["step"]))

    def log_rollouts(self, step: int, rows: list[dict]) -> None:
        """The step's completions as a `completions` table, each prompt's first image a wandb.Image."""
        components = list(dict.fromkeys(name for row in rows for name in row["rewards"] if name != "total"))
        data = [[row["step"], row["group"], row["prompt"],
                 self.wandb.Image(row["image"]) if row["image"] is not None else None, row["completion"],
                 row["answer"], row["rewards"].get("total"), row["advantage"],
                 *(row["rewards"].get(name) for name in components)] for row in rows]
        table = self.wandb.Table(columns=[*ROLLOUT_COLUMNS, *components], data=data)
        self.run.log({"completions": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioSink:
    """A trackio run (local dashboard: `trackio show`) named after the run directory."""

    MAIN_THREAD = True  # trackio documents no calls from a second thread

    def __init__(self, project: str, name: str, config: dict):
        self.trackio = import_tracker("trackio", "trackio")
        self.trackio.init(project=project, name=name, config=config)

    def log(self, metrics: dict) -> None:
        self.trackio.log(scalars(metrics), step=int(metrics["step"]))

    def close(self) -> None:
        self.trackio.finish()
