"""Metrics sinks: metrics.jsonl, real TensorBoard event files read back with TensorBoard's own
reader, and the choice of W&B / trackio (not installed here: their error path, and fakes)."""

from __future__ import annotations

import json
import math
import sys
import types

import pytest

from vlmrl.config import load_config
from vlmrl.errors import VlmrlError
from vlmrl.report.tracking import MetricsLog, TensorBoardSink, TrackioSink, WandbSink, build_trackers, read_metrics


def _config(*overrides: str):
    return load_config(None, ["train.trackers=[]", *overrides])


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard itself reads the event files in `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_event_files_hold_every_finite_number(tmp_path):
    trackers = build_trackers(_config("train.trackers=[tensorboard]"), tmp_path)
    with trackers:
        for step in (1, 2, 3):
            trackers.log({"step": step, "reward": 0.5 * step, "reward/format": 1.0, "kl": None,
                          "loss": math.nan if step == 2 else -0.25, "groups_drawn": 8, "note": "text"})
    scalars = _scalars(tmp_path / "tensorboard")
    assert set(scalars) == {"reward", "reward/format", "loss", "groups_drawn"}
    assert scalars["reward"] == [(1, 0.5), (2, 1.0), (3, 1.5)]
    assert scalars["loss"] == [(1, -0.25), (3, -0.25)]  # NaN left out, not written as NaN
    assert scalars["groups_drawn"] == [(1, 8.0), (2, 8.0), (3, 8.0)]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[1]["loss"] is None and rows[0]["note"] == "text"


def test_resume_purges_later_steps_and_a_fresh_run_starts_clean(tmp_path):
    config = _config("train.trackers=[tensorboard]")
    with build_trackers(config, tmp_path) as trackers:
        for step in (1, 2, 3, 4):
            trackers.log({"step": step, "reward": float(step)})
    with build_trackers(config, tmp_path, resume_step=2) as trackers:  # resumed from step 2's checkpoint
        for step in (3, 4):
            trackers.log({"step": step, "reward": 10.0 * step})
    assert _scalars(tmp_path / "tensorboard")["reward"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert [r["reward"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1.0, 2.0, 30.0, 40.0]

    with build_trackers(config, tmp_path) as trackers:  # a fresh run in the same folder
        trackers.log({"step": 1, "reward": -1.0})
    assert _scalars(tmp_path / "tensorboard")["reward"] == [(1, -1.0)]


def test_trackers_are_chosen_by_config(tmp_path):
    assert [type(s) for s in build_trackers(_config(), tmp_path).sinks] == [MetricsLog]
    assert not (tmp_path / "tensorboard").exists()
    default = build_trackers(load_config(), tmp_path)
    assert [type(s) for s in default.sinks] == [MetricsLog, TensorBoardSink]  # the default
    default.close()
    with pytest.raises(VlmrlError, match=r"train.trackers\[1\] must be one of tensorboard, wandb or trackio; got 'tb'"):
        _config("train.trackers=[tensorboard, tb]")


@pytest.mark.parametrize("name, written", [("wandb", "[wandb]"), ("trackio", "[trackio]"), ("wandb", "wandb")])
def test_asking_for_a_tracker_that_is_not_installed_is_a_clear_error(name, written, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError
    with pytest.raises(VlmrlError) as error:  # `train.trackers=wandb` too: a list of one, not a type repr
        build_trackers(_config(f"train.trackers={written}"), tmp_path)
    assert str(error.value) == (f"train.trackers asks for {name}, but {name} is not installed: "
                                f"`pip install {name}`, or remove {name} from train.trackers")


class _FakeRun:
    """Records what a tracker was told."""

    def __init__(self):
        self.init, self.logged, self.finished = None, [], False

    def start(self, **arguments):
        self.init = arguments
        return self

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


def test_wandb_and_trackio_get_the_numbers_by_step(tmp_path, monkeypatch):
    wandb_run, trackio_run = _FakeRun(), _FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=wandb_run.start))
    monkeypatch.setitem(sys.modules, "trackio", types.SimpleNamespace(
        init=trackio_run.start, log=trackio_run.log, finish=trackio_run.finish))
    config = _config("train.trackers=[wandb, trackio, wandb]", "train.tracker_project=vlm-tests")
    run_dir = tmp_path / "run-7"
    with build_trackers(config, run_dir) as trackers:
        assert [type(s) for s in trackers.sinks] == [MetricsLog, WandbSink, TrackioSink]  # each once
        trackers.log({"step": 5, "reward": 0.75, "kl": None, "phase": "train"})
    assert wandb_run.init["project"] == "vlm-tests" and wandb_run.init["name"] == "run-7"
    assert wandb_run.init["dir"] == str(run_dir) and wandb_run.init["config"]["train"]["trackers"] == [
        "wandb", "trackio", "wandb"]
    assert trackio_run.init["project"] == "vlm-tests" and trackio_run.init["name"] == "run-7"
    assert wandb_run.logged == trackio_run.logged == [(5, {"reward": 0.75})]
    assert wandb_run.finished and trackio_run.finished
    assert json.loads((run_dir / "metrics.jsonl").read_text())["phase"] == "train"
