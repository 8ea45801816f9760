"""grounding: boxes in image pixels, the reward of each hack, and totality."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from vlmrl.tasks import Example, get_task
from vlmrl.rewards.verify import iou
from vlmrl.tasks.shapes import RGB

TASK = get_task("grounding", seed=0)
HAND = Example(image=Image.new("RGB", (168, 168)), prompt="", answer="[10, 20, 40, 50]",
               meta={"box": [10, 20, 40, 50], "image_size": [168, 168]})


def score(answer: str, think: str = "<think> looking </think> ") -> dict[str, float]:
    return TASK.score(HAND, f"{think}<answer> {answer} </answer>")


@pytest.mark.parametrize("split", ["train", "test", "ood"])
def test_box_is_in_image_pixels_around_the_target(split):
    for idx in range(40):
        example = TASK.example(idx, split)
        x1, y1, x2, y2 = example.meta["box"]
        color, kind = example.meta["target"].split()
        assert example.answer == f"[{x1}, {y1}, {x2}, {y2}]" and f"the {color} {kind}" in example.prompt
        assert "168x168" in example.prompt and 0 <= x1 < x2 <= 168 and 0 <= y1 < y2 <= 168
        assert example.image.getpixel(((x1 + x2) // 2, (y1 + y2 * 2) // 3)) == RGB[color]
        others = [(c, k) for c, k, *_ in example.meta["shapes"][1:]]
        assert (color, kind) not in others  # the description names exactly one shape
        low, high = (5, 7) if split == "ood" else (2, 4)
        assert low <= example.meta["n_distractors"] <= high


def test_a_box_covering_the_whole_image_scores_low_on_every_example():
    for split in ("train", "ood"):
        for idx in range(100):
            example = TASK.example(idx, split)
            scores = TASK.score(example, "<think> everything </think> <answer> [0, 0, 168, 168] </answer>")
            assert scores["iou"] <= (37 / 168) ** 2 and scores["accuracy"] == 0.0


# --- the reward each case deserves -------------------------------------------------------------

def test_exact_box():
    assert score("[10, 20, 40, 50]") == {"iou": 1.0, "format": 1.0, "accuracy": 1.0, "total": 1.5}
    assert score("[10.0, 20.0, 40.0, 50.0]")["total"] == 1.5


def test_whole_image_box():
    scores = score("[0, 0, 168, 168]")
    assert scores["iou"] == pytest.approx(900 / 168 ** 2)
    assert scores["total"] == pytest.approx(0.5 + 900 / 168 ** 2) and scores["accuracy"] == 0.0


def test_half_shifted_box():
    scores = score("[25, 20, 55, 50]")  # overlap 15x30 = 450, union 1350
    assert scores == {"iou": pytest.approx(1 / 3), "format": 1.0, "accuracy": 0.0, "total": pytest.approx(1 / 3 + 0.5)}


def test_iou_of_one_half_is_accurate():
    assert iou([10, 20, 40, 50], [10, 20, 40, 80]) == 0.5
    assert score("[10, 20, 40, 80]")["accuracy"] == 1.0


@pytest.mark.parametrize("answer", [
    "[10, 20, 40, 50] [0, 0, 168, 168]",          # many boxes
    "[0, 0, 10, 10], [10, 20, 40, 50], [20, 20, 60, 60]",
    "[10, 20, 40, 50, 60]",                       # five numbers
    "10 20 40 50",                                # no brackets
    "[10, 20, 40, 50] and 7 more",                # extra numbers
    "",                                           # empty
    "   ",
])
def test_unparsable_answers_score_zero(answer):
    assert score(answer) == {"iou": 0.0, "format": 0.0, "accuracy": 0.0, "total": 0.0}


def test_inverted_box_parses_but_has_no_overlap():
    assert score("[40, 50, 10, 20]") == {"iou": 0.0, "format": 1.0, "accuracy": 0.0, "total": 0.5}


def test_right_box_outside_or_in_repeated_tags_scores_zero():
    zero = {"iou": 0.0, "format": 0.0, "accuracy": 0.0, "total": 0.0}
    assert TASK.score(HAND, "[10, 20, 40, 50]") == zero
    assert TASK.score(HAND, "<think> [10, 20, 40, 50] </think>") == zero
    assert TASK.score(HAND, "<answer>[10, 20, 40, 50]</answer><answer>[10, 20, 40, 50]</answer>") == zero
    assert TASK.score(HAND, "<answer><answer>[10, 20, 40, 50]</answer></answer>") == zero


def test_right_box_without_think_loses_only_the_format():
    assert score("[10, 20, 40, 50]", think="") == {"iou": 1.0, "format": 0.0, "accuracy": 1.0, "total": 1.0}


# --- totality ----------------------------------------------------------------------------------

FRAGMENTS = ["<think>", "</think>", "<answer>", "</answer>", "[10, 20, 40, 50]", "[", "]", ",", " ", "10",
             "-5", "1e400", "9" * 30, "[0, 0, 168, 168]", "\n"]
texts = st.lists(st.one_of(st.text(max_size=12), st.sampled_from(FRAGMENTS)), max_size=12).map("".join)
EXAMPLES = [HAND] + [TASK.example(i, split) for i in range(2) for split in ("train", "ood")]


@settings(max_examples=200, deadline=None)
@given(text=texts, example=st.sampled_from(EXAMPLES))
def test_score_is_total_and_in_range(text, example):
    scores = TASK.score(example, text)
    assert set(scores) == {"iou", "format", "accuracy", "total"}
    assert all(math.isfinite(v) for v in scores.values())
    assert scores["accuracy"] in (0.0, 1.0) and scores["format"] in (0.0, 1.0)
    assert 0.0 <= scores["iou"] <= 1.0 and 0.0 <= scores["total"] <= 1.5
