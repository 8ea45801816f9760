"""Rewards as functions (rewards/): the built-ins, the one importer, the batched TRL-style call and its
checks, GDPO's normalize_then_sum, the checks before step 1, and a reward service on the loopback."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from http_servers import LocalServer, Request, json_answer

from vlmrl import grpo
from vlmrl.config import load_config
from vlmrl.errors import VlmrlError
from vlmrl.imports import load_object
from vlmrl.rewards import builtin
from vlmrl.rewards.checks import check_rewards
from vlmrl.rewards.http import ServiceDown
from vlmrl.rewards.reward import Reward, build_rewards, resolve
from vlmrl.rewards.score import RewardError, score_batch
from vlmrl.rollout.scoring import score_completions
from vlmrl.tasks import Example, get_task


def said(*texts: str) -> list[list[dict]]:
    return [[{"role": "assistant", "content": t}] for t in texts]


def example(answer: str = "3", prompt: str = "How many?", **columns) -> Example:
    return Example(image=None, prompt=prompt, answer=answer, meta={"idx": 0, "split": "train", "columns": columns})


def entries(*items) -> list:
    return load_config(None, [f"rewards={json.dumps(list(items))}"]).rewards


# --------------------------------------------------------------------------- the built-ins


def test_builtin_rewards_score_the_final_answer_against_the_gold_one():
    texts = said("<answer>3</answer>", "<answer>4</answer>", "no tag 3", "<answer>$\\frac{6}{2}$</answer>")
    assert builtin.accuracy(texts, ["3"] * 4) == [1.0, 0.0, 0.0, 1.0]
    assert builtin.number(said("<answer>about 3.0 cm</answer>", "<answer>3.5</answer>"), ["3", "3"]) == [1.0, 0.0]
    assert builtin.number(said("<answer>3</answer>"), ["three"]) == [None]  # a gold answer with no number
    assert builtin.choice(said("<answer>B. 45°</answer>", "<answer>(C)</answer>"), ["B", "B"]) == [1.0, 0.0]
    assert builtin.choice(said("<answer>B</answer>"), ["45"]) == [None]
    assert builtin.exact(said("<answer> New  York</answer>", "<answer>new york</answer>"), ["New York"] * 2) == [1.0, 0.0]
    assert builtin.exact(said("<answer>new york</answer>"), ["New York"], case_sensitive=False) == [1.0]
    assert builtin.iou(said("<answer>[0, 0, 10, 10]</answer>", "<answer>none</answer>"), ["[0, 0, 10, 5]"] * 2) == [0.5, 0.0]
    assert builtin.edit_similarity(said("<answer>abcd</answer>"), ["abce"]) == [0.75]
    assert builtin.format(said("<think>x</think> <answer>1</answer>", "<answer>1</answer>")) == [1.0, 0.0]
    assert builtin.length(said("a" * 25, "a" * 200), max_chars=100) == [0.75, 0.0]
    assert builtin.accuracy(said("so \\boxed{\\frac{1}{2}}"), ["0.5"], extract="boxed") == [1.0]
    assert builtin.accuracy(said("<answer>3</answer>"), [""]) == [None]  # no gold answer: does not apply


# --------------------------------------------------------------------------- the importer


def test_one_importer_reads_modules_and_files_relative_to_a_folder(tmp_path):
    (tmp_path / "mine.py").write_text("def brevity(completions):\n    return [1.0 for _ in completions]\n")
    function = load_object("mine.py:brevity", "reward", base_dir=tmp_path)
    assert function(said("x")) == [1.0]
    assert load_object(f"{tmp_path}/mine.py:brevity", "reward") is function  # one module per file
    assert load_object("vlmrl.rewards.builtin:format", "reward") is builtin.format
    with pytest.raises(VlmrlError, match=r"reward 'nothere.py:f': the file .*nothere.py does not exist"):
        load_object("nothere.py:f", "reward", base_dir=tmp_path)
    with pytest.raises(VlmrlError, match=r"reward 'mine.py:missing': mine.py has no 'missing'"):
        load_object("mine.py:missing", "reward", base_dir=tmp_path)
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(VlmrlError, match=r"cannot import the file of reward 'broken.py:f': RuntimeError: boom"):
        load_object("broken.py:f", "reward", base_dir=tmp_path)


def test_a_task_given_as_a_file_is_loaded_by_the_same_importer(tmp_path):
    (tmp_path / "my_task.py").write_text(
        "from vlmrl.tasks import Task\nclass Mine(Task):\n    name = 'mine'\n")
    assert get_task(f"{tmp_path}/my_task.py:Mine").name == "mine"


def test_a_reward_file_in_a_config_is_read_from_the_config_folder(tmp_path):
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "run.yaml").write_text("rewards:\n  - accuracy\n  - {name: my_rewards.py:brevity, weight: 0.1}\n"
                                     "algorithm: {reward_aggregation: normalize_then_sum}\n")
    config = load_config(folder / "run.yaml")
    assert [(r.name, r.weight) for r in config.rewards] == [
        ("accuracy", 1.0), (f"{folder.resolve()}/my_rewards.py:brevity", 0.1)]
    assert config.algorithm.reward_aggregation == "normalize_then_sum"


def test_unknown_and_badly_given_rewards_are_one_line_each(tmp_path):
    with pytest.raises(VlmrlError, match=r"unknown reward 'acuracy'; did you mean accuracy\?"):
        build_rewards(entries("acuracy"))
    with pytest.raises(VlmrlError, match=r"reward 'length' takes no argument max_words \(kwargs\); it takes "
                                         r"completions, max_chars"):
        build_rewards(entries({"name": "length", "kwargs": {"max_words": 3}}))
    with pytest.raises(VlmrlError, match=r"two rewards are logged as accuracy"):
        build_rewards(entries("accuracy", "accuracy"))


# --------------------------------------------------------------------------- the batched call and its checks


def test_a_trl_style_function_gets_the_batch_and_the_data_columns_as_keywords(tmp_path):
    seen = {}

    def wants_solution(completions, solution, **kwargs):
        seen.update(kwargs, solution=solution, completions=completions)
        return [float(builtin.completion_text(c) == s) for c, s in zip(completions, solution)]

    rewards = [resolve("format", 0.5), Reward("right", wants_solution, 1.0, None, ("completions", "solution"),
                                              "wants_solution")]
    examples = [example(solution="12"), example(solution="13")]
    components = score_batch(rewards, examples, ["12", "12"])
    assert components == {"format": [0.0, 0.0], "right": [1.0, 0.0]}
    assert seen["solution"] == ["12", "13"] and seen["answer"] == ["3", "3"]
    assert seen["prompts"][0] == [{"role": "user", "content": "How many?"}]
    assert seen["completions"][1] == [{"role": "assistant", "content": "12"}]
    assert seen["examples"] == examples and seen["trajectories"] == [None, None]
    assert seen["completion_ids"] == [None, None]  # no token ids given here (a rollout gives them)


def test_a_config_kwarg_is_not_overridden_by_a_column_of_the_same_name():
    reward = resolve("length", kwargs={"max_chars": 4})
    assert score_batch([reward], [example(max_chars=100)], ["ab"]) == {"length": [0.5]}


@pytest.mark.parametrize("answer, message", [
    ([1.0], r"reward 'bad' \(bad\) returned 1 values for 2 completions \| prompt: 'How many\?'"),
    ([1.0, float("nan")], r"reward 'bad' \(bad\) must give one finite number.*got nan for completion 'two'"),
    (1.0, r"reward 'bad' \(bad\) must return a list with one value per completion; got float"),
    (ZeroDivisionError("x"), r"reward 'bad' \(bad\) failed: ZeroDivisionError: x \| prompt: 'How many\?' \| "
                             r"completion: 'one'"),
    ([None, 1.0], r"no reward applies to this completion \(each of bad gave None\) \| prompt: 'How many\?' \| "
                  r"completion: 'one'"),
])
def test_every_wrong_answer_of_a_reward_is_a_reward_error_naming_it(answer, message):
    def bad(completions):
        if isinstance(answer, Exception):
            raise answer
        return answer

    with pytest.raises(RewardError, match=message):
        score_batch([Reward("bad", bad, 1.0, frozenset({"completions"}), (), "bad")], [example(), example()], ["one", "two"])


def test_weights_none_and_gdpo_normalize_then_sum_give_the_hand_computed_total():
    rollout = SimpleNamespace(rows=[example("2")] * 4, texts=["<answer>2</answer>", "<answer>1</answer>",
                                                             "<answer>2</answer>" + "x" * 50, "x" * 100])
    rewards = build_rewards(entries("accuracy", {"name": "length", "weight": 0.5, "kwargs": {"max_chars": 100}}))
    # accuracy: 1, 0, 1, 0 ; length: 1 - len/100 = 0.82, 0.82, 0.32, 0.0
    summed = score_completions(rewards, rollout, "sum", group_size=4)
    assert torch.allclose(summed["total"], torch.tensor([1.41, 0.41, 1.16, 0.0]))
    assert torch.allclose(summed["length"], torch.tensor([0.82, 0.82, 0.32, 0.0]))
    gdpo = score_completions(rewards, rollout, "normalize_then_sum", group_size=2)
    # groups of 2: accuracy (1, 0) -> (1, -1) twice; length (0.82, 0.82) -> (0, 0), (0.32, 0) -> (1, -1)
    assert torch.allclose(gdpo["total"], torch.tensor([1.0, -1.0, 1.5, -1.5]), atol=1e-4)


def test_normalize_then_sum_leaves_out_rewards_that_do_not_apply():
    components = torch.tensor([[1.0, 3.0, float("nan"), 5.0]])  # (K=1, N=4), one group
    total = grpo.combine_rewards(components, torch.tensor([2.0]), 4, aggregation="normalize_then_sum")
    # mean 3, population std sqrt(8/3) over the three that apply; None counts 0
    std = (8 / 3) ** 0.5
    assert torch.allclose(total, torch.tensor([-4 / std, 0.0, 0.0, 4 / std]), atol=1e-4)


def test_the_task_alone_logs_its_own_components_and_beside_others_its_total_as_task():
    task = get_task("shapes")
    ex = task.example(0)
    rollout = SimpleNamespace(rows=[ex], texts=[ex.reference_completion])
    alone = score_completions(build_rewards([], task), rollout)
    assert set(alone) == set(task.score(ex, ex.reference_completion))
    beside = score_completions(build_rewards(entries("task", {"name": "length", "weight": 0.0}), task), rollout)
    assert float(beside["task"]) == float(alone["total"]) == float(beside["total"])
    assert float(beside["accuracy"]) == 1.0 and "length" in beside


# --------------------------------------------------------------------------- before step 1


class FloatTask:
    """A task written the TRL way: score() gives one float."""

    name = "floaty"

    def score(self, example, completion):
        return 1.0


def test_a_task_score_that_returns_a_float_is_refused_before_step_1():
    with pytest.raises(VlmrlError, match=r"the score\(\) of task 'floaty' must return a dict of reward components "
                                         r"with 'total' \(and 'accuracy'\); it returned float 1.0"):
        check_rewards(build_rewards([], FloatTask()), FloatTask(), [example()])


def test_a_reward_needing_a_column_the_data_lacks_is_refused_before_step_1(tmp_path):
    (tmp_path / "r.py").write_text("def needs(completions, solution, **kwargs):\n    return [1.0] * len(completions)\n")
    rewards = build_rewards(entries({"name": f"{tmp_path}/r.py:needs"}))
    check_rewards(rewards, None, [example(solution="3")])  # the column is there: passes
    with pytest.raises(VlmrlError, match=r"reward 'needs' needs 'solution', which is neither a keyword vlmrl passes "
                                         r"\(prompts, .*\) nor a column of the data \(the data has hint\)"):
        check_rewards(rewards, None, [example(hint="x")])


def test_a_gold_answer_a_verifier_cannot_read_is_refused_before_step_1():
    check_rewards(build_rewards(entries("number", "accuracy")), None, [example("3")])
    with pytest.raises(VlmrlError, match=r"reward 'number' cannot read it as the gold answer of train example 0 "
                                         r"\('three'\)"):
        check_rewards(build_rewards(entries("number")), None, [example("three")])


def test_the_early_checks_refuse_a_float_score_task_in_one_line(tmp_path, tiny_model_dir):
    (tmp_path / "floaty.py").write_text(
        "from PIL import Image\nfrom vlmrl.tasks import Example, Task\n"
        "class Floaty(Task):\n    name = 'floaty'\n"
        "    def _example(self, idx, split):\n"
        "        return Example(image=Image.new('RGB', (28, 28)), prompt='a?', answer='a', meta={'idx': idx})\n"
        "    def score(self, example, completion):\n        return 1.0\n")
    from vlmrl.safety.early_checks import check_before_loading
    config = load_config(None, [f"model.name_or_path={tiny_model_dir}", f"task.name={tmp_path}/floaty.py:Floaty"])
    with pytest.raises(VlmrlError, match=r"the score\(\) of task 'floaty' must return a dict"):
        check_before_loading(config, "train")


# --------------------------------------------------------------------------- a reward service


class Service(LocalServer):
    """A reward service on the loopback: answers `{"rewards": [len(answer) ...]}`, or fails the first
    `fail` calls after `ok_first` with HTTP 500; records every request."""

    def __init__(self, fail: int = 0, ok_first: int = 0):
        self.fail, self.ok_first = fail, ok_first
        super().__init__(self.answer)
        self.url = self.address("/score")

    def answer(self, request: Request):
        if self.ok_first < len(self.requests) <= self.ok_first + self.fail:
            return 500, {}, b""
        return json_answer({"rewards": [float(len(a)) for a in request.json["answer"]]})


@pytest.fixture
def service():
    made = []

    def start(fail: int = 0, ok_first: int = 0) -> Service:
        made.append(Service(fail, ok_first))
        return made[-1]

    yield start
    for s in made:
        s.close()


def test_a_reward_service_gets_the_batch_as_json_and_retries_after_a_failure(service):
    server = service(fail=1)
    reward = resolve(server.url, kwargs={"retries": 2, "backoff_s": 0.01, "timeout_s": 5})
    components = score_batch([reward], [example("12", hint="h"), example("3", hint="i")], ["a", "b"])
    assert components == {"127.0.0.1:" + server.url.split(":")[2].split("/")[0]: [2.0, 1.0]}
    assert len(server.requests) == 2  # one failure, one retry
    sent = server.requests[-1].json
    assert sent["answer"] == ["12", "3"] and sent["hint"] == ["h", "i"]
    assert sent["completions"][0] == [{"role": "assistant", "content": "a"}] and "images" not in sent


def test_a_reward_service_that_stays_down_raises_and_never_scores_zero(service):
    server = service(fail=100)
    reward = resolve(server.url, kwargs={"retries": 2, "backoff_s": 0.01})
    with pytest.raises(RewardError, match=r"failed: ServiceDown: reward service http://127.0.0.1:\d+/score failed 3 "
                                          r"times .*HTTP Error 500"):
        score_batch([reward], [example()], ["a"])
    assert len(server.requests) == 3
    with pytest.raises(VlmrlError, match="unknown setting tries"):
        resolve(server.url, kwargs={"tries": 2})


def test_a_reward_service_that_does_not_answer_in_time_is_a_failure():
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts the connection, never answers
    try:
        reward = resolve(f"http://127.0.0.1:{silent.getsockname()[1]}/",
                         kwargs={"retries": 0, "timeout_s": 0.2})
        with pytest.raises(RewardError, match=r"ServiceDown: .* failed 1 times \(timeout 0.2 s\); last: .*timed out"):
            score_batch([reward], [example()], ["a"])
    finally:
        silent.close()
    assert isinstance(ServiceDown("x"), VlmrlError)


# --------------------------------------------------------------------------- in a run


def run_config(run, model_dir: str, *extra: str):
    return load_config(None, [f"model.name_or_path={model_dir}", "model.device=cpu", "task.name=letter_task:SolutionTask",
                              f"output_dir={run}", "rollout.prompts_per_step=2", "rollout.group_size=2",
                              "rollout.max_new_tokens=6", "rollout.generation_batch_size=4", "train.micro_batch_size=4",
                              "algorithm.beta=0", "train.log_rollouts_every=0", "train.trackers=[]", "eval.every=0",
                              *extra])


def test_a_run_trains_on_a_reward_list_and_logs_each_reward_by_name(tmp_path, tiny_model_dir, letter_task, capsys):
    from vlmrl.training.trainer import train
    from vlmrl.report.tracking import read_metrics

    (tmp_path / "mine.py").write_text("def solution_length(completions, solution, **kwargs):\n"
                                      "    return [float(len(s)) for s in solution]\n"
                                      "def tokens(completion_ids):\n"
                                      "    return [float(len(ids)) for ids in completion_ids]\n")
    rewards = json.dumps(["format", {"name": f"{tmp_path}/mine.py:solution_length", "weight": 0.5}, "task",
                          {"name": f"{tmp_path}/mine.py:tokens", "weight": 0}])
    run = train(run_config(tmp_path / "run", tiny_model_dir, "train.steps=2", f"rewards={rewards}",
                           "algorithm.reward_aggregation=normalize_then_sum"))
    rows = read_metrics(run / "metrics.jsonl")
    assert len(rows) == 2
    # prompts 0, 1 then 2, 3: solutions "$1$", "$11$" then "$111$", "$1$" (two completions each)
    assert [r["reward/solution_length"] for r in rows] == [3.5, 4.0]
    assert all({"reward/format", "reward/task", "reward/share", "accuracy"} <= set(r) for r in rows)
    assert [r["reward/tokens"] for r in rows] == [r["completion_length"] for r in rows]
    assert (f"preflight: rewards    format x1, solution_length x0.5 ({tmp_path}/mine.py:solution_length), "
            f"task x1 (the score() of task 'solution'), tokens x0 ({tmp_path}/mine.py:tokens); "
            "total = GDPO normalize_then_sum") in capsys.readouterr().out


def test_a_reward_service_that_goes_down_stops_the_run_with_a_checkpoint(tmp_path, tiny_model_dir, letter_task,
                                                                           service):
    from vlmrl.training.trainer import train

    server = service(fail=100, ok_first=1)  # step 1 scores, then the service is down
    rewards = json.dumps([{"name": server.url, "kwargs": {"retries": 1, "backoff_s": 0.01}}])
    with pytest.raises(VlmrlError, match=r"a reward failed at step 2: reward '127.0.0.1:\d+' \(http://.*\) failed: "
                                         r"ServiceDown: .* failed 2 times .*; stopped with a checkpoint of step 1 in "
                                         r".*step_000001"):
        train(run_config(tmp_path / "run", tiny_model_dir, "train.steps=3", f"rewards={rewards}"))
    assert (tmp_path / "run" / "checkpoints" / "step_000001").is_dir()
    assert len(server.requests) == 3


def test_trl_reward_functions_run_unchanged(tmp_path, tiny_model_dir, letter_task):
    pytest.importorskip("trl.rewards")
    from vlmrl.training.trainer import train
    from vlmrl.report.tracking import read_metrics

    rewards = json.dumps(["trl.rewards:accuracy_reward", "trl.rewards:think_format_reward"])
    run = train(run_config(tmp_path / "run", tiny_model_dir, "train.steps=1", f"rewards={rewards}"))
    row = read_metrics(run / "metrics.jsonl")[0]
    assert row["reward/accuracy_reward"] == 0.0 and row["reward/think_format_reward"] == 0.0


def test_trl_accuracy_reward_reads_the_solution_column_of_a_trl_dataset(tmp_path):
    """TRL's datasets name their answer column `solution` and TRL's `accuracy_reward` reads it by that
    name: the column reaches the rewards under its own name too (not only as `answer`)."""
    pytest.importorskip("trl.rewards")
    from PIL import Image

    Image.new("RGB", (8, 8), "red").save(tmp_path / "a.png")
    rows = [{"prompt": "<image>How many?", "images": ["a.png"], "solution": gold} for gold in ("3", "\\frac{1}{2}")]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = get_task("dataset", path=str(tmp_path / "train.jsonl"), shuffle=False, test_fraction=0)
    examples = [task.example(i, "train") for i in range(2)]
    assert [e.meta["columns"]["solution"] for e in examples] == ["3", "\\frac{1}{2}"]
    rewards = build_rewards(entries("trl.rewards:accuracy_reward"), task)
    check_rewards(rewards, task, examples)  # before: "needs 'solution', which is neither a keyword ... nor a column"
    scores = score_batch(rewards, examples, ["The answer is $\\boxed{3}$.", "$\\boxed{0.7}$"])
    assert scores["accuracy_reward"] == [1.0, 0.0]


def test_a_reward_function_given_from_python_is_kept_as_its_import_path():
    from reward_helpers import shout  # a reward defined at the top level of a module

    from vlmrl.config import Config, save_config

    config = Config(rewards=[shout, {"name": "format", "weight": 0.5}])
    assert [r.name for r in config.rewards] == ["reward_helpers:shout", "format"]
    reward = build_rewards(config.rewards)[0]
    assert reward.fn.spec == "reward_helpers:shout"  # run by that name in the reward worker (contain.py)
    assert score_batch([reward], [example()], ["LOUD"]) == {"shout": [1.0]}
    with pytest.raises(VlmrlError, match=r"rewards\[0\]: a reward function given from Python must be defined at the "
                                         r"top level of a module"):
        Config(rewards=[lambda completions: completions])
    with pytest.raises(VlmrlError, match=r"unknown config key 'rewards\[0\].wieght'; did you mean rewards\[0\].weight"):
        Config(rewards=[{"name": "format", "wieght": 2}])


@pytest.mark.parametrize("override, message", [
    ("rewards=[{name: length, weight: x}]", r"^rewards\[0\].weight must be a number; got 'x'$"),
    ("rewards=[3]", r"^rewards\[0\] must be a reward name, a mapping with name/weight/kwargs/label, a vlmrl.Reward or a "
                    r"function; got 3$"),
    ("rewards=[{name: length, weight: .nan}]", r"^reward length: weight must be finite; got nan$"),
])
def test_a_rewards_list_from_the_command_line_is_read_or_refused_in_one_line(override, message):
    assert [r.name for r in load_config(None, ["rewards=accuracy,format"]).rewards] == ["accuracy", "format"]
    with pytest.raises(VlmrlError, match=message):
        load_config(None, [override])


def test_in_run_evaluation_scores_with_the_rewards_list_and_a_verifier_is_the_accuracy(tmp_path, tiny_model_dir,
                                                                                     letter_task):
    from vlmrl.training.trainer import train
    from vlmrl.report.tracking import read_metrics

    (tmp_path / "mine.py").write_text("def chars(completions, **kwargs):\n"
                                      "    return [float(len(c[0]['content'])) for c in completions]\n")
    rewards = json.dumps(["exact", {"name": f"{tmp_path}/mine.py:chars", "weight": 0.1}])
    run = train(run_config(tmp_path / "run", tiny_model_dir, "train.steps=1", f"rewards={rewards}", "eval.every=1",
                           "eval.n=2", "eval.max_new_tokens=5"))
    row = read_metrics(run / "metrics.jsonl")[0]
    assert row["accuracy"] == row["reward/exact"]  # training: the first built-in verifier is the accuracy
    saved = json.loads((run / "evals" / "step_000001_test.json").read_text())
    lengths = [float(len(r["completion"])) for r in saved["examples"]]
    assert [r["scores"]["chars"] for r in saved["examples"]] == lengths
    assert [r["scores"]["accuracy"] for r in saved["examples"]] == [r["scores"]["exact"] for r in saved["examples"]]
    assert row["eval/test/reward/chars"] == pytest.approx(sum(lengths) / 2)
    assert row["eval/test/accuracy"] == row["eval/test/reward/exact"]
    assert "eval/test/reward/task" not in row  # the verifier measures correctness: the task's score is not added
