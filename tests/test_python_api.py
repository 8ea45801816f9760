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
