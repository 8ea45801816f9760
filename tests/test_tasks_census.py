"""The census task: deterministic scenes of many small shapes, some touching; the answer is the true count;
the reference trajectory's own tool outputs give it; the weak teacher is wrong exactly where shapes touch;
rewards are total; and the prototype's fact (notes/vision-tools.md) holds again on these scenes."""

from __future__ import annotations

import math
import re
import statistics

import numpy as np
import pytest

from vlmrl.errors import VlmrlError
from vlmrl.tasks import get_task
from vlmrl.tasks.inspect import show_task
from vlmrl.tools import BUILTIN_TOOLS, ToolContext, ToolLimits, Trajectory, Turn, parse_tool_call, run_tool
from vlmrl.tools.cv_tools import PALETTE, find_regions

TASK = get_task("census", seed=3)


def digest(example) -> tuple:
    return (example.prompt, example.answer, example.image.tobytes(), example.originals[0].tobytes(),
            tuple(example.meta["reference_turns"]))


def test_examples_are_deterministic_from_seed_split_and_index():
    again = get_task("census", seed=3)
    assert digest(TASK.example(5, "train")) == digest(again.example(5, "train"))
    assert digest(TASK.example(5, "ood")) == digest(again.example(5, "ood"))
    assert digest(TASK.example(5, "train")) != digest(TASK.example(6, "train"))
    assert digest(TASK.example(5, "train")) != digest(get_task("census", seed=4).example(5, "train"))
    # example 40 made alone equals example 40 made after the others
    made = [TASK.example(i, "test") for i in range(41)]
    assert digest(made[40]) == digest(get_task("census", seed=3).example(40, "test"))


@pytest.mark.parametrize("kind", ["circle", "square", "triangle"])
def test_the_answer_is_the_true_count_of_the_shapes_drawn(kind):
    task = get_task("census", seed=1, kind=kind)
    size = task.params.shape_size
    for i in range(12):
        example = task.example(i, "train")
        meta, pixels = example.meta, np.asarray(example.originals[0])
        drawn = {colour: 0 for colour in task.params.colours}
        for colour, corners in meta["groups"]:
            drawn[colour] += len(corners)
            for x, y in corners:  # each shape is there: the middle of its lower half has its colour
                assert tuple(pixels[y + 3 * size // 4, x + size // 2]) == PALETTE[colour]
        assert drawn == meta["counts"]
        counts = [meta["counts"][c] for c in meta["asked"]]
        expected = counts[0] - counts[1] if meta["question"] == "difference" else counts[0]
        assert example.answer == str(expected) and expected > 0
        assert example.images[0].size == (112, 112) and example.originals[0].size == (448, 448)


def areas_from(text: str) -> list[int]:
    """The areas find_objects' text lists, in its order."""
    return [int(a) for a in re.findall(r" area (\d+)$", text, flags=re.M)]


def test_the_reference_trajectory_s_tool_outputs_lead_to_the_answer():
    """Run the reference calls as SFT runs them; the areas listed, each rounded to shapes of one shape's
    area, give the count, and the reference's last turn says it (and scores the maximum)."""
    touching = 0
    for i in range(16):
        example = TASK.example(i, "test")
        turns, meta = example.meta["reference_turns"], example.meta
        assert len(turns) == len(meta["asked"]) + 1
        context = ToolContext(images=example.originals)
        totals = []
        for colour, turn in zip(meta["asked"], turns):
            call = parse_tool_call(turn)
            assert call.name == "find_objects" and call.arguments == {"colour": colour}
            result = run_tool(call, BUILTIN_TOOLS, context, ToolLimits())
            assert result.error is None and len(result.images) == 1
            areas = areas_from(result.text)
            assert len(areas) == meta["regions"][colour]
            touching += len(areas) < meta["counts"][colour]
            totals.append(sum(max(1, round(a / meta["single_area"])) for a in areas))
        from_tools = totals[0] - totals[1] if meta["question"] == "difference" else totals[0]
        assert str(from_tools) == example.answer
        assert turns[-1].endswith(f"<answer>{example.answer}</answer>") and example.reference_completion == turns[-1]
        assert TASK.score(example, turns[-1]) == {"accuracy": 1.0, "format": 1.0, "total": 1.5}
    assert touching >= 4  # the raw region count was not the answer in several of them


def test_the_weak_teacher_trusts_the_region_count_and_is_wrong_exactly_where_shapes_touch():
    weak = get_task("census", seed=3, teacher="regions")
    wrong = right = 0
    for i in range(40):
        example, exact = weak.example(i, "train"), TASK.example(i, "train")
        assert digest(example)[:4] == digest(exact)[:4]  # the same scene, question and gold answer
        meta = example.meta
        lost = [meta["counts"][c] - meta["regions"][c] for c in meta["asked"]]
        touches = lost[0] != lost[1] if meta["question"] == "difference" else lost[0] > 0
        said = re.search(r"<answer>(-?\d+)</answer>", example.reference_completion).group(1)
        assert (said != example.answer) == touches
        assert weak.score(example, example.reference_completion)["accuracy"] == float(not touches)
        colour, n = meta["asked"][0], meta["regions"][meta["asked"][0]]
        assert f"{colour}: {n} regions; 0 of 2 circles: {n} + 0 = {n}; 0 of 3: {n} + 0 = {n}." in example.reference_completion
        wrong, right = wrong + touches, right + (not touches)
    assert wrong >= 10 and right >= 5


def test_the_weak_teacher_reads_its_share_of_touching_regions_by_area():
    """teacher_reads=1 is the exact teacher; in between, some touching regions are read and some not, the
    same ones for the same example; the scene and the gold answer never change."""
    every = get_task("census", seed=3, teacher="regions", teacher_reads=1.0)
    half = get_task("census", seed=3, teacher="regions", teacher_reads=0.5)
    read = missed = 0
    for i in range(40):
        exact = TASK.example(i, "train")
        assert every.example(i, "train").meta["reference_turns"] == exact.meta["reference_turns"]
        example = half.example(i, "train")
        assert digest(example)[:4] == digest(exact)[:4]
        assert example.meta["reference_turns"] == half.example(i, "train").meta["reference_turns"]
        said = int(re.search(r"<answer>(-?\d+)</answer>", example.reference_completion).group(1))
        meta = example.meta
        if meta["question"] == "count" and meta["regions"][meta["asked"][0]] < meta["count"]:
            read, missed = read + (said == meta["count"]), missed + (said != meta["count"])
    assert read >= 2 and missed >= 2


def test_the_total_reading_divides_measure_s_total_area_by_one_shape_s():
    """reading=total: the reference calls measure on each colour asked about; its total area over one shape's,
    rounded, is the count, and the last turn says it ("blue: total area 882 px / 148 px = 6."); the weak teacher says the region
    count instead ("blue: 5 regions.") where shapes touch, except its share teacher_reads; the scenes are those of
    a task whose layouts pass both readings' checks (the same rng)."""
    total = get_task("census", seed=3, reading="total")
    weak = get_task("census", seed=3, reading="total", teacher="regions", teacher_reads=0.5)
    touching = read = missed = 0
    for i in range(24):
        example = total.example(i, "test")
        meta, turns = example.meta, example.meta["reference_turns"]
        assert weak.example(i, "test").prompt == example.prompt and weak.example(i, "test").answer == example.answer
        context, totals = ToolContext(images=example.originals), []
        for colour, turn in zip(meta["asked"], turns):
            call = parse_tool_call(turn)
            assert call.name == "measure" and call.arguments == {"colour": colour}
            result = run_tool(call, BUILTIN_TOOLS, context, ToolLimits())
            regions, area = map(int, re.match(r"(\d+) \w+ regions? .*total area (\d+) px", result.text).groups())
            assert regions == meta["regions"][colour]
            touching += regions < meta["counts"][colour]
            count = max(1, math.floor(area / meta["single_area"] + 0.5))
            assert f"{colour}: total area {area} px / {meta['single_area']} px = {count}." in turns[-1]
            totals.append(count)
        assert str(totals[0] - totals[1] if meta["question"] == "difference" else totals[0]) == example.answer
        assert total.score(example, turns[-1])["total"] == 1.5
        said = weak.example(i, "test")
        if meta["question"] == "count" and meta["regions"][meta["asked"][0]] < meta["count"]:
            hit = said.reference_completion.endswith(f"<answer>{example.answer}</answer>")
            assert hit == (f"{meta['asked'][0]}: {meta['regions'][meta['asked'][0]]} regions." not in said.reference_completion)
            read, missed = read + hit, missed + (not hit)
    assert touching >= 4 and read >= 1 and missed >= 1
    assert "measure gives the count" in get_task("census", reading="total").example(0, "train").prompt


def test_the_ood_split_asks_about_more_shapes_than_training_shows():
    for i in range(8):
        meta = TASK.example(i, "ood").meta
        assert 10 <= meta["counts"][meta["asked"][0]] <= 14
        assert max(TASK.example(i, "train").meta["counts"].values()) <= 8


def test_train_and_test_are_disjoint():
    train = {digest(TASK.example(i, "train"))[3] for i in range(30)}
    assert not train & {digest(TASK.example(i, "test"))[3] for i in range(30)}


GARBAGE = ["", "<answer>", "<answer>5</answer>", "<think>x</think> <answer> 7 </answer>",
           "<think>x</think> <answer>seven</answer>", "<think></think><answer>1e400</answer>",
           "<answer>99999999999999999999</answer>", "<answer>-3</answer><answer>3</answer>", "\udcff" * 5,
           "<think>a</think> <answer>５</answer>", "<tool_call>{}</tool_call>", "x" * 10_000]


@pytest.mark.parametrize("text", GARBAGE)
def test_rewards_are_total_on_any_string(text):
    example = TASK.example(0, "train")
    scores = TASK.score(example, text)
    assert set(scores) == {"accuracy", "format", "total"}
    assert all(math.isfinite(v) for v in scores.values()) and 0 <= scores["total"] <= 1.5
    trajectory = TASK.score_trajectory(example, Trajectory([Turn("assistant", text), Turn("tool", text, error="raised")]))
    assert trajectory == scores and TASK.score_trajectory(example, Trajectory())["total"] == 0.0


def test_right_and_wrong_answers_are_scored():
    example = TASK.example(2, "test")
    n = int(example.answer)
    assert TASK.score(example, f"<think>x</think> <answer> {n} </answer>")["total"] == 1.5
    assert TASK.score(example, f"<think>x</think> <answer>{n + 1}</answer>") == {"accuracy": 0.0, "format": 1.0,
                                                                                "total": 0.5}
    assert TASK.score(example, f"the answer is {n}")["total"] == 0.0


def test_the_prototype_fact_raw_regions_are_rarely_exact_and_area_rounding_fixes_most():
    """notes/vision-tools.md: the raw component count of one colour was exact in a minority of scenes, and
    rounding each component's area over the median single-shape area fixed most. Measured here on 200 count
    scenes at the defaults: raw 22.5%, median rounding 76.5%; one shape's own area (the prompt's): 100%."""
    task = get_task("census", seed=0, questions=["count"])
    raw = median = 0
    for i in range(200):
        example = task.example(i, "train")
        colour, count = example.meta["asked"][0], example.meta["count"]
        areas = [r.area for r in find_regions(example.originals[0], colour)[0]]
        middle = statistics.median(areas)
        raw += len(areas) == count
        median += sum(max(1, round(a / middle)) for a in areas) == count
        assert sum(max(1, round(a / example.meta["single_area"])) for a in areas) == count
    assert raw / 200 < 0.35 and median / 200 > 0.7


@pytest.mark.parametrize("params, message", [
    ({"colours": ["red", "pink"]}, "colours must be at least 2 distinct names"),
    ({"colours": ["red"]}, "colours must be at least 2 distinct names"),
    ({"overlap": 0.6}, "overlap must be in 0.05..0.4"),
    ({"teacher": "oracle"}, "teacher must be one of exact, regions"),
    ({"reading": "median"}, "reading must be one of regions, total"),
    ({"teacher_reads": 1.5, "teacher": "regions"}, "teacher_reads must be in .0, 1.,"),
    ({"teacher_reads": 0.5}, "teacher_reads is the weak teacher's"),
    ({"questions": ["ratio"]}, "questions must be names from count, difference"),
    ({"ood_max": 60, "image_size": 224}, "do not fit a 224 px image"),
    ({"max_count": 10}, "need max_count < ood_min"),
    ({"min_count": 4, "max_count": 4}, "a difference question needs two colours of different counts"),
])
def test_bad_parameters_are_refused_in_one_line(params, message):
    with pytest.raises(VlmrlError, match=message) as error:
        get_task("census", **params)
    assert "\n" not in str(error.value)


def test_tasks_show_draws_the_scene_and_the_tool_outputs(tmp_path):
    text = show_task("census", {"questions": "[count]"}, split="test", n=1, out_dir=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["census_test_0.png", "census_test_0_original.png",
                                                          "census_test_0_tool_0.png"]
    example = get_task("census", questions=["count"]).example(0, "test")
    colour = example.meta["asked"][0]
    assert f"tool result of turn [0]:\n    {example.meta['regions'][colour]} {colour} regions in box" in text
    assert f"tool image: 448x448 -> {tmp_path / 'census_test_0_tool_0.png'}" in text
    assert "reference score: accuracy=1.000, format=1.000, total=1.500" in text
