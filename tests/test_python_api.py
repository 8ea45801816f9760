"""The Python API (docs/python.md): the page's example runs as written; a config from Python is
refused as the command line refuses it; the result objects; a second run in a finished folder."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import vlmrl
from vlmrl.cli import main
from vlmrl.config import Config, RolloutConfig, TrainConfig, save_config
from vlmrl.errors import VlmrlError
from vlmrl.tasks import get_task

ROOT = Path(__file__).resolve().parents[1]


def fast(model: str, out: Path) -> dict:
    """A 2-step run of the tiny model on shapes, as a dict of dotted keys."""
    return {"model.name_or_path": model, "model.device": "cpu", "output_dir": str(out),
            "rollout.prompts_per_step": 2, "rollout.group_size": 2, "rollout.generation_batch_size": 2,
            "rollout.max_new_tokens": 4, "train.steps": 2, "train.micro_batch_size": 4, "train.save_every": 2,
            "train.trackers": [], "sft.batch_size": 2}


def test_import_vlmrl_loads_no_torch_and_offers_the_api_on_first_use():
    code = "import sys, vlmrl; assert 'torch' not in sys.modules, 'import vlmrl loaded torch'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0
    from vlmrl.training import api

    assert (vlmrl.train, vlmrl.sft, vlmrl.evaluate, vlmrl.RunResult) == (api.train, api.sft, api.evaluate, api.RunResult)
    with pytest.raises(AttributeError, match="has no attribute 'trian'"):
        vlmrl.trian


def test_the_example_of_the_python_page_runs_as_written(tmp_path, monkeypatch, capsys):
    """The page's one python block, run in a module of its own (its reward function is found by its
    import path, as a notebook's `__main__:fn` is) from an empty folder."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "python.md").read_text(), re.S)
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    page = types.ModuleType("python_page_example")
    monkeypatch.setitem(sys.modules, page.__name__, page)
    exec(compile(blocks[0], "docs/python.md", "exec"), page.__dict__)
    out = capsys.readouterr().out
    assert "last step: 2 reward" in out
    assert re.search(r"^refused: output_dir runs/python-api/grpo already holds a run .* resume=true continues it",
                     out, re.M)
    assert "resumed to step 3" in out
    assert "held-out accuracy:" in out and (tmp_path / page.evaluation.path).is_file()
    assert page.evaluation.summary["n"] == 4  # the 4 held-out rows, not more
    assert page.result.final_model == Path("runs/python-api/grpo/final")
    assert type(page.model).__name__ == "Qwen2_5_VLForConditionalGeneration"


@pytest.mark.parametrize("override, built, message", [
    ("rollout.group_size=1", lambda: Config(rollout=RolloutConfig(group_size=1)), "rollout.group_size must be >= 2"),
    ("rollout.temperature=0", lambda: Config(rollout=RolloutConfig(temperature=0.0)),
     "rollout.temperature must be in [0.001, 100]"),
    ("train.lr=-1", lambda: Config(train=TrainConfig(lr=-1.0)), "train.lr must be >= 0"),
])
def test_a_bad_config_is_the_same_one_line_error_from_python_and_the_command_line(
        override, built, message, tiny_model_dir, tmp_path, capsys):
    from vlmrl.training.trainer import train as train_loop

    where = [f"model.name_or_path={tiny_model_dir}", f"output_dir={tmp_path / 'run'}"]
    assert main(["train", *where, override]) == 2
    cli_line = capsys.readouterr().err.strip().removeprefix("error: ")
    assert message in cli_line
    config = built()  # a Config built in Python, which nothing checked when it was made
    config.model.name_or_path, config.output_dir = tiny_model_dir, str(tmp_path / "run")
    for call in (lambda: vlmrl.train(None, [*where, override]),
                 lambda: vlmrl.train(config),
                 lambda: train_loop(config)):  # the loop itself, below the API
        with pytest.raises(VlmrlError) as error:
            call()
        assert str(error.value) == cli_line
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_configs_as_a_yaml_path_a_mapping_or_a_config_are_the_same_run(tmp_path):
    from vlmrl.training.api import run_inputs

    expected = Config()
    expected.train.steps, expected.rollout.group_size, expected.output_dir = 7, 4, "runs/x"
    save_config(expected, tmp_path / "c.yaml")
    sources = [expected, tmp_path / "c.yaml", str(tmp_path / "c.yaml"),
               {"train": {"steps": 7}, "rollout.group_size": 4, "output_dir": "runs/x"},
               {"train": {"steps": 3}, "train.steps": 7, "rollout": {"group_size": 4}, "output_dir": "runs/x"}]
    for source in sources:
        assert run_inputs(source, None, None, None, None)[0] == expected
    overridden, _ = run_inputs(None, ["train.steps=7", "rollout.group_size=4", "output_dir=runs/x"], None, None, None)
    assert overridden == expected
    assert run_inputs(None, {"train.steps": 7, "rollout.group_size": 4, "output_dir": "runs/x"}, None, None,
                      None)[0] == expected
    with pytest.raises(VlmrlError, match="unknown config key 'train.stepz'; did you mean train.steps"):
        run_inputs({"train.stepz": 3}, None, None, None, None)


def test_a_task_built_in_python_is_the_run_task_and_named_in_its_config():
    from vlmrl.training.api import run_inputs

    task = get_task("shapes", seed=3, max_count=4, targets="circle,square")
    config, given = run_inputs({"seed": 3}, None, task, None, None)
    assert given is task
    assert config.task.name == "shapes" and config.task.params == {"max_count": 4, "targets": ["circle", "square"]}
    with pytest.raises(VlmrlError, match="the task's seed 3 is not the run's seed 0"):
        run_inputs(None, None, task, None, None)


def test_train_and_sft_return_the_run_folder_the_final_model_and_the_last_metrics(tiny_model_dir, tmp_path):
    warm = vlmrl.sft(fast(tiny_model_dir, tmp_path / "sft"), {"task.params.max_count": 2})
    assert isinstance(warm, vlmrl.RunResult)
    assert warm.run_dir == tmp_path / "sft" and warm.final_model == tmp_path / "sft" / "final"
    assert (warm.final_model / "config.json").is_file()
    assert warm.metrics["step"] == 2 and "loss" in warm.metrics
    assert warm.config.task.params == {"max_count": 2}

    result = vlmrl.train(fast(str(warm.final_model), tmp_path / "grpo"))
    assert result.metrics["step"] == 2 and {"reward", "accuracy", "loss"} <= set(result.metrics)
    evaluation = vlmrl.evaluate(result, "shapes", params={"max_count": 2}, n=3)
    assert isinstance(evaluation, vlmrl.EvalResult)
    assert evaluation.summary["n"] == 3 and len(evaluation.examples) == 3
    assert evaluation.path == tmp_path / "grpo" / "final" / "eval_shapes_test.json" and evaluation.path.is_file()


def test_a_second_run_in_a_finished_folder_is_refused_from_python_and_the_command_line(
        tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    config = fast(tiny_model_dir, run)
    first = vlmrl.train(config)
    metrics = (run / "metrics.jsonl").read_text()
    with pytest.raises(VlmrlError, match=rf"^output_dir {re.escape(str(run))} already holds a run \(a final model, "
                                         r"checkpoints, metrics\) and resume is false: resume=true continues it"):
        vlmrl.train(config)
    assert main(["train", *[f"{key}={value}" for key, value in config.items()]]) == 2
    assert "already holds a run" in capsys.readouterr().err
    with pytest.raises(VlmrlError, match="already holds a run"):
        vlmrl.sft(config)
    assert (run / "metrics.jsonl").read_text() == metrics  # nothing started over, nothing appended

    more = vlmrl.train(config, {"resume": True, "train.steps": 3})  # resume=true continues it
    assert more.metrics["step"] == 3 and first.metrics["step"] == 2
    assert [line.count('"step": ') for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 1, 1]


def test_a_run_stopped_before_its_first_step_may_start_again(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    save_config(Config(), run / "config.yaml")  # what a run stopped by its preflight leaves
    (run / "metrics.jsonl").write_text("")
    assert vlmrl.train(fast(tiny_model_dir, run), {"train.steps": 1}).metrics["step"] == 1


def test_the_refusal_says_whether_the_run_can_be_resumed(tmp_path):
    from vlmrl.safety.resume import check_fresh_start

    (tmp_path / "final").mkdir()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(VlmrlError, match=r"holds a run \(a final model, metrics\) and resume is false: it has no "
                                         r"checkpoint to continue from: choose another output_dir, or remove this one"):
        check_fresh_start(tmp_path)
    (tmp_path / "checkpoints" / "step_000001").mkdir(parents=True)
    with pytest.raises(VlmrlError, match=r"\(a final model, checkpoints, metrics\) and resume is false: resume=true "
                                         r"continues it \(raise train.steps to train longer\)"):
        check_fresh_start(tmp_path)


# --------------------------------------------------------------------------- reward functions with a weight and a label


def always_right(completions, **kwargs):
    """A reward of this module's top level that pays 1 for every completion."""
    return [1.0] * len(completions)


def square_rows() -> "datasets.Dataset":
    import datasets
    from PIL import Image

    colours = ["red", "blue"] * 2
    return datasets.Dataset.from_dict({"question": ["What colour?"] * 4, "answer": colours,
                                       "image": [Image.new("RGB", (28, 28), c) for c in colours]})


@pytest.mark.parametrize("entry", [
    {"name": always_right, "weight": 2, "label": "accuracy"},
    vlmrl.Reward(always_right, weight=2, label="accuracy"),
])
def test_a_reward_function_takes_a_weight_and_a_label_as_a_named_reward_does(entry, tiny_model_dir, tmp_path):
    result = vlmrl.train(fast(tiny_model_dir, tmp_path / "run"), {"train.steps": 1}, dataset=square_rows(),
                         rewards=[entry])
    assert result.metrics["accuracy"] == 1.0  # logged as accuracy: the progress bar's and the result's
    assert result.metrics["reward"] == 2.0  # weighted by 2 in the total
    assert [(r.name, r.weight, r.label) for r in result.config.rewards] == [
        (f"{__name__}:always_right", 2.0, "accuracy")]  # saved as its import path, with its weight and label
    assert "label: accuracy" in (result.run_dir / "config.yaml").read_text()


@pytest.mark.parametrize("call", [
    lambda config, data: vlmrl.sft(config | {"rewards": [{"name": always_right, "weight": "heavy"}]}, dataset=data),
    lambda config, data: vlmrl.train(config, dataset=data, rewards=[{"name": always_right, "weight": "heavy"}]),
    lambda config, data: vlmrl.train(config, dataset=data, rewards=[vlmrl.Reward(always_right, weight="heavy")]),
])
def test_a_bad_reward_entry_is_refused_before_anything_runs(call, tmp_path):
    config = {"output_dir": str(tmp_path / "run"), "model.name_or_path": str(tmp_path / "no-model")}
    with pytest.raises(VlmrlError, match=r"^rewards\[0\]\.weight must be a number; got 'heavy'$"):
        call(config, square_rows())
    assert not (tmp_path / "run").exists()
    with pytest.raises(VlmrlError, match=r"^rewards\[0\]\.weight must be a number; got 'heavy'$"):
        vlmrl.evaluate(tmp_path / "no-model", square_rows(), rewards=[{"name": always_right, "weight": "heavy"}])


# --------------------------------------------------------------------------- arguments of the wrong type


class DataFrame:
    """Stands for pandas' (named by its module, as a user's would be): the checks never import pandas."""

    __module__ = "pandas.core.frame"


@pytest.mark.parametrize("call, message", [
    (lambda: vlmrl.train(None, dataset=DataFrame()), "vlmrl.train: dataset= takes a datasets.Dataset or DatasetDict, "
     "or the path of a data file or folder; got a pandas DataFrame: give datasets.Dataset.from_pandas(df)"),
    (lambda: vlmrl.sft(None, dataset=[{"question": "q", "answer": "a"}]), "vlmrl.sft: dataset= takes a datasets.Dataset "
     "or DatasetDict, or the path of a data file or folder; got list [{'answer': 'a', 'question': 'q'}]: give "
     "datasets.Dataset.from_list(rows)"),
    (lambda: vlmrl.train(None, dataset=7), "vlmrl.train: dataset= takes a datasets.Dataset or DatasetDict, or the path "
     "of a data file or folder; got int 7"),
    (lambda: vlmrl.train(["train.steps=2"]), "vlmrl.train: config= takes a vlmrl Config, a mapping, a YAML file's path "
     "or None; got list ['train.steps=2']"),
    (lambda: vlmrl.train(None, 5), "vlmrl.train: overrides= takes a mapping of dotted keys or a list of key=value "
     "texts; got int 5"),
    (lambda: vlmrl.train(None, "train.steps=2"), "vlmrl.train: overrides= takes a mapping of dotted keys or a list of "
     "key=value texts; got the text 'train.steps=2'"),
    (lambda: vlmrl.train(None, [("train.steps", 2)]), "vlmrl.train: overrides= takes a mapping of dotted keys or a "
     "list of key=value texts; got a list holding tuple ('train.steps', 2)"),
    (lambda: vlmrl.train(None, task="shapes"), "vlmrl.train: task= takes a vlmrl.tasks.Task (a task's name goes in the "
     "config: task.name); got the text 'shapes'"),
    (lambda: vlmrl.sft(None, task=DataFrame()), "vlmrl.sft: task= takes a vlmrl.tasks.Task (data goes in dataset=); "
     "got a pandas DataFrame"),
    (lambda: vlmrl.train(None, rewards=3), "vlmrl.train: rewards= takes a list of rewards (names, functions, {name, "
     "weight, label, kwargs} mappings, vlmrl.Reward) or one of them; got int 3"),
    (lambda: vlmrl.evaluate(3, "shapes"), "vlmrl.evaluate: model= takes a model or run folder (a path or hub id) "
     "or a RunResult; got int 3"),
    (lambda: vlmrl.evaluate("m", DataFrame()), "vlmrl.evaluate: task= takes a task's name, a Task, a "
     "datasets.Dataset or DatasetDict, or None (the run's task); got a pandas DataFrame: give "
     "datasets.Dataset.from_pandas(df)"),
    (lambda: vlmrl.evaluate("m", "shapes", params=["max_count=2"]), "vlmrl.evaluate: params= takes a mapping of task "
     "parameters; got list ['max_count=2']"),
    (lambda: vlmrl.evaluate("m", "shapes", split=1), "vlmrl.evaluate: split= takes a split's name (train, test, ...); "
     "got int 1"),
    (lambda: vlmrl.evaluate("m", "shapes", n="4"), "vlmrl.evaluate: n= takes a whole number >= 1; got the text '4'"),
    (lambda: vlmrl.evaluate("m", "shapes", settings={"k": 8}), "vlmrl.evaluate: settings= takes an EvalSettings; got "
     "dict {'k': 8}"),
    (lambda: vlmrl.evaluate("m", "shapes", out_dir=1), "vlmrl.evaluate: out_dir= takes a folder's path; got int 1"),
])
def test_an_argument_of_the_wrong_type_is_one_line_naming_it(call, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(VlmrlError) as error:
        call()
    assert str(error.value) == message
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_rewards_given_as_one_reward_or_a_text_are_a_list():
    from vlmrl.training.api import checked_rewards

    assert [r.name for r in checked_rewards("format", "vlmrl.train")] == ["format"]  # not f, o, r, m, a, t
    assert [r.name for r in checked_rewards("accuracy, format", "vlmrl.train")] == ["accuracy", "format"]
    assert [r.name for r in checked_rewards(always_right, "vlmrl.train")] == [f"{__name__}:always_right"]
    assert [r.label for r in checked_rewards({"name": "format", "label": "form"}, "vlmrl.train")] == ["form"]
    assert checked_rewards(None, "vlmrl.train") is None


def test_a_dataset_given_as_a_path_is_the_dataset_task_reading_it():
    from vlmrl.training.api import run_inputs

    config, task = run_inputs(None, None, None, "data/rows.jsonl", None)
    assert task is None and (config.task.name, config.task.params) == ("dataset", {"path": "data/rows.jsonl"})


def needs_a_column(completions, difficulty, **kwargs):
    """A reward that reads a column the test's data does not have."""
    return [0.0] * len(completions)


def test_a_reward_that_cannot_run_on_the_data_is_refused_by_sft_before_it_trains(tmp_path, tiny_model_dir):
    """A notebook warmed up with sft, then had train refuse the rewards of the same config."""
    config = {"output_dir": str(tmp_path / "run"), "model.name_or_path": tiny_model_dir,
              "rewards": [{"name": needs_a_column, "label": "accuracy"}]}
    with pytest.raises(VlmrlError, match=r"^reward 'accuracy' needs 'difficulty', which is neither a keyword vlmrl "
                                         r"passes .* nor a column of the data"):
        vlmrl.sft(config, dataset=square_rows())
    assert not (tmp_path / "run").exists()
