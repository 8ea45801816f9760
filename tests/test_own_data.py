"""Your own data (docs/own-data.md): the bar charts of `vlmrl data bars` (data/bars.py), drawn from
(seed, split, idx) alone and read back by the dataset task in TRL's layout; the example's reward
file in TRL's call convention; and the page's commands run at tiny scale, so they never rot."""

from __future__ import annotations

import json
import re
import shlex
from collections import Counter
from pathlib import Path

import pytest

from vlmrl.cli import main
from vlmrl.data.bars import PALETTE, BarsParams, chart
from vlmrl.imports import load_object
from vlmrl.tasks import get_task

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "own-data.md"


def colour_pixels(image) -> Counter:
    """Pixels of each palette colour in a chart."""
    names = {rgb: name for name, rgb in PALETTE.items()}
    return Counter(names[p] for p in image.get_flattened_data() if p in names)


def test_a_chart_is_a_pure_function_of_seed_split_and_index():
    first = chart(0, "train", 0)
    assert first.colors == ["green", "blue", "purple", "orange"]
    assert first.heights == [0.48, 0.216, 0.591, 0.871]
    assert first.answer == "orange"
    assert first.solution() == "<think> The tallest bar is orange. </think> <answer> orange </answer>"
    assert first.coin == pytest.approx(0.6670289649937247)
    # bars 17 px wide on a 98 px plot: the tallest bar covers the most pixels, each bar its height
    assert colour_pixels(first.image) == {"orange": 85 * 17, "purple": 58 * 17, "green": 47 * 17, "blue": 21 * 17}
    again = chart(0, "train", 0)
    assert again.image.tobytes() == first.image.tobytes() and again.heights == first.heights
    assert chart(0, "test", 0).heights != first.heights and chart(1, "train", 0).heights != first.heights


def test_every_chart_has_one_tallest_bar_with_its_margin():
    params = BarsParams(bars=5, margin=0.2, image_size=96)
    for idx in range(200):
        drawn = chart(3, "train", idx, params)
        top, second = sorted(drawn.heights, reverse=True)[:2]
        assert len(set(drawn.colors)) == 5 and drawn.image.size == (96, 96)
        assert top - second >= 0.2 - 1e-3
        assert colour_pixels(drawn.image).most_common(1)[0][0] == drawn.answer


def test_data_bars_writes_trl_rows_the_dataset_task_reads(tmp_path, capsys):
    out = tmp_path / "bars"
    assert main(["data", "bars", str(out), "--n", "6", "--test", "3", "--seed", "2"]) == 0
    assert f"task.params.path={out}" in capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and len((out / "test.jsonl").read_text().splitlines()) == 3
    assert set(rows[0]) == {"prompt", "images", "answer", "solution", "colors", "heights"}
    assert rows[0]["prompt"] == "<image>Which colour is the tallest bar?" and rows[0]["images"] == ["images/train_000000.png"]
    task = get_task("dataset", path=str(out), verifier="exact", columns={"reference": "solution"})
    assert task.splits[:2] == ("train", "test")
    example = task.example(0, "test")  # served shuffled; find its chart by its colours
    drawn = next(chart(2, "test", i) for i in range(3) if chart(2, "test", i).colors == example.meta["columns"]["colors"])
    assert example.answer == drawn.answer
    assert example.reference_completion == drawn.solution()  # the SFT target: the worked solution
    # every column but the prompt and the images reaches the rewards, by its own name (as TRL passes them)
    assert example.meta["columns"] == {"answer": drawn.answer, "solution": drawn.solution(),
                                       "colors": drawn.colors, "heights": drawn.heights}
    assert example.image.tobytes() == drawn.image.tobytes()
    assert task.score(example, drawn.solution())["accuracy"] == 1.0


def test_a_weak_teacher_guesses_between_its_two_colours_in_train_only(tmp_path):
    out = tmp_path / "bars"
    assert main(["data", "bars", str(out), "--n", "60", "--test", "30", "teacher_confuses=red/orange"]) == 0
    for split, n in (("train", 60), ("test", 30)):
        rows = [json.loads(line) for line in (out / f"{split}.jsonl").read_text().splitlines()]
        drawn = [chart(0, split, i) for i in range(n)]
        assert [r["answer"] for r in rows] == [d.answer for d in drawn]  # the gold stays true
        said = {i: re.search(r"<answer> (\w+) </answer>", r["solution"]).group(1) for i, r in enumerate(rows)}
        wrong = {i: (drawn[i].answer, s) for i, s in said.items() if s != drawn[i].answer}
        if split == "test":
            assert wrong == {}
        else:  # the coin of each red or orange chart: wrong on about half of them, right elsewhere
            assert wrong == {4: ("red", "orange"), 5: ("orange", "red"), 11: ("red", "orange"), 12: ("red", "orange"),
                             29: ("red", "orange"), 32: ("red", "orange"), 33: ("orange", "red"), 39: ("red", "orange"),
                             58: ("orange", "red")}
            assert sum(d.answer in ("red", "orange") for d in drawn) == 24


@pytest.mark.parametrize("bad, message", [(["bars=9"], "bars must be in [2, 6]"), (["colour=red"], "unknown bars"),
                                          (["image_size=big"], "image_size must be an integer"),
                                          (["teacher_confuses=red/pink"], "teacher_confuses must be two colours"),
                                          (["--n", "0"], "--n must be in")])
def test_bad_chart_parameters_are_one_line(tmp_path, capsys, bad, message):
    assert main(["data", "bars", str(tmp_path / "bars"), *bad]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "bars" / "train.jsonl").exists()


def test_the_reward_file_scores_like_trl_calls_it():
    accuracy = load_object(f"{ROOT}/examples/own_data/reward.py:accuracy", "a reward")
    completions = [[{"role": "assistant", "content": text}] for text in
                   ("<think> x </think> <answer> Red </answer>", "<answer> blue </answer>", "red", "<answer>red</answer>")]
    assert accuracy(completions, answer=["red", "red", "red", ""], prompts=[None] * 4) == [1.0, 0.0, 0.0, None]


def page_commands() -> list[str]:
    """The `vlmrl ...` lines of the page's bash blocks, in order."""
    blocks = re.findall(r"```bash\n(.*?)```", PAGE.read_text(), re.DOTALL)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip().startswith("vlmrl ")]


TINY = {"tiny-model": [], "data": [], "eval": [],
        "sft": ["train.steps=2", "sft.batch_size=4", "train.micro_batch_size=4", "train.warmup_steps=0",
                "eval.every=0"],
        "train": ["train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2", "train.micro_batch_size=4",
                  "train.warmup_steps=0", "eval.every=0"]}
"""What each command of the page gets appended to run at tiny scale."""


def tiny(command: str) -> list[str]:
    """A page command at tiny scale: the tiny model, 16 + 8 charts, 2 steps, 4 evaluation examples."""
    args = shlex.split(command)[1:]
    scaled = {"--size": "tiny", "--n": "16" if args[0] == "data" else "4", "--test": "8"}
    args = [scaled.get(args[i - 1], arg) if i else arg for i, arg in enumerate(args)]
    args = [str(ROOT / arg) if arg.startswith("examples/") else arg for arg in args]
    return [*args, *TINY[args[0]]]


def test_the_pages_commands_run_at_tiny_scale(tmp_path, monkeypatch, capsys):
    commands = page_commands()
    assert [shlex.split(c)[1] for c in commands] == ["tiny-model", "data", "eval", "sft", "train", "eval", "eval"]
    monkeypatch.chdir(tmp_path)
    for command in commands:
        assert main(tiny(command)) == 0, command
    assert (f"preflight: rewards    accuracy x1 ({ROOT}/examples/own_data/reward.py:accuracy), format x0.5; "
            "total = weighted sum") in capsys.readouterr().out
    metrics = [json.loads(line) for line in (tmp_path / "runs/bars-grpo/metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "accuracy" in m]  # the reward named accuracy is the run's accuracy
    assert len(steps) == 2 and all("reward/format" in m for m in steps)
    for name in ("untrained", "sft", "grpo"):
        results = json.loads((tmp_path / f"runs/bars-eval/{name}/eval.json").read_text())["results"]
        assert results["n"] == 4 and set(results["blind"]) == {"blank", "shuffled"}
