"""Metrics sinks: metrics.jsonl, real TensorBoard event files read back with TensorBoard's own
reader, and the choice of W&B / trackio (not installed here: their error path, and fakes)."""

from __future__ import annotations

import json
import math
import sys
import types

import pytest

from vlmrl.config import load_config, to_dict
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
        self.init, self.logged, self.finished, self.id = None, [], False, "run-id-1"

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



def test_the_run_s_files_go_to_the_log_thread_and_wandb_and_trackio_stay_on_the_main_thread(tmp_path, monkeypatch):
    """`log_files` (what the session's log thread calls) writes metrics.jsonl alone; `log_main` (the
    main thread) sends to W&B and trackio alone: wandb.log is not thread-safe."""
    wandb_run, trackio_run = _FakeRun(), _FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=wandb_run.start))
    monkeypatch.setitem(sys.modules, "trackio", types.SimpleNamespace(
        init=trackio_run.start, log=trackio_run.log, finish=trackio_run.finish))
    run_dir = tmp_path / "run"
    with build_trackers(_config("train.trackers=[wandb, trackio]"), run_dir) as trackers:
        trackers.log_files({"step": 1, "reward": 0.5})
        assert wandb_run.logged == trackio_run.logged == []
        trackers.log_main({"step": 1, "reward": 0.5})
    assert wandb_run.logged == trackio_run.logged == [(1, {"reward": 0.5})]
    assert read_metrics(run_dir / "metrics.jsonl") == [{"step": 1, "reward": 0.5}]

class _FakeWandb(types.ModuleType):
    """A `wandb` module that records every call made to it, in order."""

    def __init__(self, run_id: str):
        super().__init__("wandb")
        self.calls: list[tuple] = []
        self.run_id = run_id

    def init(self, **arguments):
        self.calls.append(("init", arguments))
        return types.SimpleNamespace(id=self.run_id, finish=lambda: self.calls.append(("finish",)),
                                     log=lambda values, step: self.calls.append(("log", values, step)))

    def Image(self, image):  # noqa: N802 - wandb's name
        self.calls.append(("Image", image.size, image.getpixel((0, 0))))
        return ("wandb.Image", image.size)

    def Table(self, columns, data):  # noqa: N802 - wandb's name
        self.calls.append(("Table", columns, data))
        return ("wandb.Table", len(data))


def test_wandb_gets_a_completions_table_and_a_resumed_run_continues_its_own_run(tmp_path, monkeypatch):
    from PIL import Image

    fake = _FakeWandb("abc123")
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = _config("train.trackers=[wandb]", "train.tracker_project=p")
    run_dir = tmp_path / "run-3"
    red, blue = Image.new("RGB", (4, 2), "red"), Image.new("RGB", (3, 3), "blue")
    rows = [{"step": 2, "group": 0, "image": red, "images": [red], "prompt": "How many?", "answer": "3",
             "completion": "<answer>3</answer>", "rewards": {"accuracy": 1.0, "format": 0.0, "total": 1.0},
             "advantage": 0.5, "truncated": False, "length": 5},
            {"step": 2, "group": 1, "image": blue, "images": [blue], "prompt": "Which?", "answer": "B",
             "completion": "A", "rewards": {"accuracy": 0.0, "format": None, "total": 0.0},
             "advantage": -0.5, "truncated": True, "length": 1}]
    with build_trackers(config, run_dir) as trackers:
        trackers.log({"step": 2, "reward": 0.5})
        trackers.log_rollouts(2, rows)
    init = {"project": "p", "name": "run-3", "dir": str(run_dir), "config": to_dict(config)}
    assert fake.calls == [
        ("init", init),
        ("log", {"reward": 0.5}, 2),
        ("Image", (4, 2), (255, 0, 0)), ("Image", (3, 3), (0, 0, 255)),
        ("Table", ["step", "group", "prompt", "image", "completion", "answer", "reward", "advantage", "accuracy",
                   "format"],
         [[2, 0, "How many?", ("wandb.Image", (4, 2)), "<answer>3</answer>", "3", 1.0, 0.5, 1.0, 0.0],
          [2, 1, "Which?", ("wandb.Image", (3, 3)), "A", "B", 0.0, -0.5, 0.0, None]]),
        ("log", {"completions": ("wandb.Table", 2)}, 2),
        ("finish",)]
    assert (run_dir / "wandb_run_id").read_text() == "abc123\n"

    fake.calls.clear()
    with build_trackers(config, run_dir, resume_step=2) as trackers:  # resumed: the same W&B run
        trackers.log({"step": 3, "reward": 0.25})
    assert fake.calls == [("init", {**init, "id": "abc123", "resume": "allow"}), ("log", {"reward": 0.25}, 3),
                          ("finish",)]

    fake.calls.clear()
    fake.run_id = "new456"
    build_trackers(config, run_dir).close()  # a fresh run in the folder: a new W&B run, its id kept
    assert fake.calls == [("init", init), ("finish",)]
    assert (run_dir / "wandb_run_id").read_text() == "new456\n"


def test_a_training_run_sends_its_completions_table_every_log_rollouts_every_steps(tmp_path, tiny_model_dir,
                                                                                   letter_task, monkeypatch):
    import importlib.machinery

    from vlmrl.training.trainer import train

    fake = _FakeWandb("run-9")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # found by check_trackers
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = train(load_config(None, [f"model.name_or_path={tiny_model_dir}", "model.device=cpu",
                                   "task.name=letter_task:LetterTask", f"output_dir={tmp_path / 'run'}",
                                   "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=3",
                                   "train.micro_batch_size=4", "train.steps=2", "train.trackers=[wandb]",
                                   "train.log_rollouts_every=2", "train.save_every=0"]))
    kinds = [(call[0], call[2] if call[0] == "log" else None) for call in fake.calls if call[0] != "Image"]
    assert kinds == [("init", None), ("log", 1), ("Table", None), ("log", 2), ("log", 2), ("finish", None)]
    table = next(call for call in fake.calls if call[0] == "Table")
    saved = [json.loads(line) for line in (run / "rollouts" / "step_000002.jsonl").read_text().splitlines()]
    assert [row[4] for row in table[2]] == [row["completion"] for row in saved]  # the completions written
    assert [row[6] for row in table[2]] == [row["rewards"]["total"] for row in saved]
    assert sum(call[0] == "Image" for call in fake.calls) == 4
