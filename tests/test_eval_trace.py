"""A record names the row it came from, and `vlmrl eval` of a run evaluates it as the run ran.

- rollout logs, eval records and the report's rollout viewer carry the example's split and idx, and
  for a data file's row its row, source split and the data's own id (report/rollout_log.py `trace_of`);
- `vlmrl eval RUN_DIR` (its final/, a checkpoint) takes the run's task, rewards and generation
  settings from its config.yaml, a flag given winning (evaluation/eval_settings.py `resolve_run_eval`),
  and `vlmrl.evaluate(run_dir)` does the same;
- eval refuses tools on a family whose tool rollouts are off, as the preflight refuses them in training;
- `vlmrl.EvalSettings` is offered by the package.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from PIL import Image

import vlmrl
from vlmrl.cli import main
from vlmrl.errors import VlmrlError
from vlmrl.evaluation.eval_settings import resolve_run_eval, run_config_of
from vlmrl.report.rollout_log import trace_of
from vlmrl.tasks import Example, get_task

ROOT = Path(__file__).resolve().parents[1]
RUN_MAX_NEW_TOKENS = 5  # not EvalSettings' 128: an eval that takes the run's shows it


def row_id(split: str, i: int) -> str:
    return f"{split}-{i:03d}"


def write_data(folder: Path) -> Path:
    """train.jsonl (6 rows) and test.jsonl (4 rows) with an `id` column, question, answer, image."""
    folder.mkdir()
    for split, count in (("train", 6), ("test", 4)):
        rows = []
        for i in range(count):
            Image.new("RGB", (28, 28), (40 * i, 90, 0)).save(folder / f"{split}{i}.png")
            rows.append({"id": row_id(split, i), "question": f"{split} question {i}?", "answer": str(i),
                         "image": f"{split}{i}.png"})
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory, tiny_model_dir) -> Path:
    """A 1-step GRPO run on a dataset with an id column, its rollouts logged, two rewards."""
    from vlmrl.config import load_config
    from vlmrl.training.trainer import train

    root = tmp_path_factory.mktemp("traced")
    data = write_data(root / "data")
    config = load_config(None, [
        f"model.name_or_path={tiny_model_dir}", "model.device=cpu", "task.name=dataset", f"task.params.path={data}",
        "task.params.verifier=exact", f"output_dir={root / 'run'}", "rollout.prompts_per_step=2", "rollout.group_size=2",
        f"rollout.max_new_tokens={RUN_MAX_NEW_TOKENS}", "rollout.generation_batch_size=4", "train.micro_batch_size=4",
        "train.steps=1", "train.log_rollouts_every=1", "train.trackers=[]", "eval.every=0", "algorithm.beta=0",
        "rewards=[accuracy, format]"])
    return train(config)


def question_index(prompt: str, split: str) -> int:
    return int(re.search(rf"{split} question (\d+)\?", prompt).group(1))


# ---------------------------------------------------------------- A5: a record names its row


def test_trace_of_names_the_row_the_split_and_the_datas_id():
    procedural = get_task("shapes").example(3, split="test")
    assert trace_of(procedural) == {"split": "test", "idx": 3}
    row = Example(prompt="q", answer="1", meta={"idx": 9, "split": "test", "row": 4, "source_split": "train",
                                                "columns": {"id": None, "uid": 17, "idx": "x", "answer": "1"}})
    assert trace_of(row) == {"split": "test", "idx": 9, "row": 4, "source_split": "train", "id": 17}
    row.meta["columns"] = {"idx": "item-4"}  # the last of ID_COLUMNS when the others are absent
    assert trace_of(row)["id"] == "item-4"


def test_the_datas_id_column_reaches_the_example_and_the_rewards(tmp_path):
    from vlmrl.rewards.score import batch_keywords

    task = get_task("dataset", path=str(write_data(tmp_path / "data")))
    example = task.example(0, split="test")
    assert example.meta["columns"]["id"] == row_id("test", question_index(example.prompt, "test"))
    assert batch_keywords([example], ["x"], [None], [[1]])["id"] == [example.meta["columns"]["id"]]


def test_a_rollout_log_and_the_report_name_the_row_and_the_id_of_each_prompt(traced_run):
    from vlmrl.report.page import write_report

    rows = [json.loads(line) for line in (traced_run / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:
        i = question_index(row["prompt"], "train")
        assert (row["split"], row["source_split"], row["row"], row["id"]) == ("train", "train", i, row_id("train", i))
        assert isinstance(row["idx"], int)
        assert get_task("dataset", path=str(traced_run.parent / "data")).example(row["idx"], "train").meta["row"] == i

    page = write_report(traced_run).read_text()
    data = json.loads(re.search(r'id="rollout-data">(.*?)</script>', page, re.DOTALL).group(1))
    groups = data["steps"][0]["groups"]
    assert len(groups) == 2
    for group in groups:
        i = question_index(group["prompt"], "train")
        assert group["source"] == f"row {i} of train · id {row_id('train', i)}"
    assert 'group.source' in page  # the viewer shows it


# ---------------------------------------------------------------- A6: eval of a run takes the run's settings


def saved_eval(folder: Path) -> dict:
    return json.loads((folder / "eval.json").read_text())


def test_eval_of_a_run_folder_takes_its_task_rewards_and_length(traced_run, tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["eval", str(traced_run), "--n", "2", "--k", "0", "--no-blind", "--device", "cpu",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"from the run's {traced_run / 'config.yaml'}: model {traced_run / 'final'}; task dataset (" in printed
    assert f"rewards accuracy, format; max_new_tokens {RUN_MAX_NEW_TOKENS}" in printed
    saved = saved_eval(out)
    settings = saved["settings"]
    assert settings["model"] == str(traced_run / "final")
    assert (settings["task"], settings["task_params"]["path"]) == ("dataset", str(traced_run.parent / "data"))
    assert settings["task_params"]["verifier"] == "exact"
    assert settings["max_new_tokens"] == RUN_MAX_NEW_TOKENS
    assert [reward["name"] for reward in settings["rewards"]] == ["accuracy", "format"]
    assert {"reward/accuracy", "reward/format"} <= {f"reward/{name}" for name in saved["results"]["rewards"]}
    for record in saved["examples"]:  # A5: the eval record names its row and id too
        i = question_index(record["prompt"], "test")
        assert (record["split"], record["source_split"], record["row"], record["id"]) == (
            "test", "test", i, row_id("test", i))


def test_a_flag_wins_over_the_run(traced_run, tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["eval", str(traced_run / "final"), "--n", "2", "--k", "0", "--no-blind", "--device", "cpu",
                 "--max-new-tokens", "3", "--reward", "format", "--out", str(out), "verifier=number"]) == 0
    printed = capsys.readouterr().out
    assert "max_new_tokens" not in printed.split("\n")[0] and "rewards" not in printed.split("\n")[0]
    settings = saved_eval(out)["settings"]
    assert settings["max_new_tokens"] == 3 and [r["name"] for r in settings["rewards"]] == ["format"]
    assert settings["task_params"]["verifier"] == "number"  # on top of the run's parameters
    assert settings["task_params"]["path"] == str(traced_run.parent / "data")

    assert main(["eval", str(traced_run), "--task", "shapes", "--n", "2", "--k", "0", "--no-blind",
                 "--device", "cpu", "--out", str(out)]) == 0  # another task: none of the run's parameters
    settings = saved_eval(out)["settings"]
    assert settings["task"] == "shapes" and "path" not in settings["task_params"]
    assert settings["max_new_tokens"] == RUN_MAX_NEW_TOKENS


def test_the_run_of_a_model_folder_is_found_from_the_run_its_final_or_a_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "config.yaml").write_text("task:\n  name: shapes\n  params: {max_count: 3}\nrollout:\n  max_new_tokens: 7\n"
                                     "seed: 4\n")
    assert run_config_of(run) == (run / "config.yaml", run / "final")
    assert run_config_of(run / "final") == (run / "config.yaml", run / "final")
    step = run / "checkpoints" / "step_000002"
    assert run_config_of(step) == (run / "config.yaml", step)
    (run / "config.resumed.yaml").write_text("task:\n  name: shapes\nrollout:\n  max_new_tokens: 9\n")
    assert run_config_of(step) == (run / "config.resumed.yaml", step)  # the latest config
    resolved = resolve_run_eval(step, None, {}, {})
    assert (resolved.task, resolved.params, resolved.values["max_new_tokens"]) == ("shapes", {"seed": 0}, 9)
    (run / "config.resumed.yaml").write_text("rollout:\n  max_new_tokenz: 9\n")  # a config vlmrl cannot read
    with pytest.raises(VlmrlError, match=r"^the run's .*config.resumed.yaml cannot be read \(.*max_new_tokenz.*\): "
                                         r"name the task \(--task NAME\) and its settings$"):
        resolve_run_eval(step, None, {}, {})
    assert resolve_run_eval(step, "shapes", {"max_count": 2}, {}).values == {}
    assert "cannot be read" in capsys.readouterr().err
    assert run_config_of(tmp_path) is None
    with pytest.raises(VlmrlError, match=r"^name a task \(--task NAME\): .* is not a vlmrl run folder"):
        resolve_run_eval(tmp_path, None, {}, {})
    assert main(["eval", str(tmp_path), "--n", "1"]) == 2


def test_vlmrl_evaluate_of_a_run_folder_takes_its_task_and_settings(traced_run, tmp_path):
    result = vlmrl.evaluate(traced_run, n=2, out_dir=tmp_path / "eval")
    settings = json.loads(result.path.read_text())["settings"]
    assert (settings["task"], settings["max_new_tokens"]) == ("dataset", RUN_MAX_NEW_TOKENS)
    assert [r["name"] for r in settings["rewards"]] == ["accuracy", "format"]
    assert {"row", "id", "source_split"} <= set(result.examples[0])
    result = vlmrl.evaluate(traced_run, n=2, out_dir=tmp_path / "eval", settings=vlmrl.EvalSettings(max_new_tokens=2),
                            rewards=["format"])
    settings = json.loads(result.path.read_text())["settings"]
    assert settings["max_new_tokens"] == 2 and [r["name"] for r in settings["rewards"]] == ["format"]


# ---------------------------------------------------------------- B18: tools where a family has them off


def test_eval_refuses_tools_on_a_family_whose_tool_rollouts_are_off(tiny_model_factory, tmp_path, capsys):
    from vlmrl.models.support import FAMILIES

    reason = FAMILIES["llava_onevision"].tool_rollouts
    assert reason is not None
    model = tiny_model_factory("llava_onevision")
    assert main(["eval", model, "--task", "shapes", "--tools", "zoom", "--n", "1", "--k", "0", "--no-blind",
                 "--device", "cpu", "--out", str(tmp_path / "eval")]) == 2
    err = capsys.readouterr().err  # above the line: the model's loading bars
    assert err.splitlines()[-1] == (f"error: tools ['zoom']: tool rollouts are off for this model ({reason}); "
                                    "evaluate it without tools (--tools alone)")
    assert "Traceback" not in err and err.count("error:") == 1
    assert not (tmp_path / "eval" / "eval.json").exists()


# ---------------------------------------------------------------- A8: vlmrl.EvalSettings


def test_eval_settings_are_offered_by_the_package_and_shown_in_the_python_page():
    from vlmrl import EvalSettings
    from vlmrl.evaluation.eval_settings import EvalSettings as Defined

    assert EvalSettings is Defined is vlmrl.EvalSettings and "EvalSettings" in vlmrl.__all__
    assert "from vlmrl import EvalSettings" in (ROOT / "docs" / "python.md").read_text()
