"""shapes: countable images, the chapter and strict rubrics on each hack, and totality."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from vlmrl.errors import VlmrlError
from vlmrl.tasks import Example, get_task
from vlmrl.tasks.shapes import RGB, SHAPE_COLORS, closest_pair

CHAPTER, STRICT = get_task("shapes"), get_task("shapes", rubric="strict")
HAND = Example(image=Image.new("RGB", (8, 8)), prompt="", answer="3", meta={"count": 3, "target": "circle"})


@pytest.mark.parametrize("split, low, high", [("train", 1, 5), ("test", 1, 5), ("ood", 6, 7)])
def test_every_shape_is_drawn_apart_and_counted(split, low, high):
    task = get_task("shapes", seed=3)
    gap = task.params.gap
    for idx in range(40):
        example = task.example(idx, split)
        meta, shapes = example.meta, example.meta["shapes"]
        assert low <= meta["count"] <= high and example.answer == str(meta["count"])
        assert meta["count"] == meta["counts"][meta["target"]]
        assert len(shapes) == sum(meta["counts"].values())
        assert {kind: sum(s[0] == kind for s in shapes) for kind in meta["counts"]} == meta["counts"]
        for i, (_, x, y, size) in enumerate(shapes):
            assert gap <= x and x + size + gap <= 168 and gap <= y and y + size + gap <= 168
            for _, x2, y2, size2 in shapes[i + 1:]:
                assert x + size + gap <= x2 or x2 + size2 + gap <= x or y + size + gap <= y2 or y2 + size2 + gap <= y
        for kind, x, y, size in shapes:  # the centre of each shape has its colour
            assert example.image.getpixel((x + size // 2, y + size * 2 // 3)) == RGB[SHAPE_COLORS[kind]]
        assert f"How many {meta['target']}s are in the image?" in example.prompt


def test_targets_restrict_the_question_and_all_kinds_are_drawn():
    task = get_task("shapes", targets="triangle")
    for idx in range(10):
        meta = task.example(idx).meta
        assert meta["target"] == "triangle" and all(meta["counts"][k] >= 1 for k in ("circle", "square", "triangle"))


def test_without_distractors_only_the_asked_about_kind_is_drawn():
    task = get_task("shapes", distractors=False)
    for idx in range(10):
        meta = task.example(idx).meta
        others = [k for k in ("circle", "square", "triangle") if k != meta["target"]]
        assert all(meta["counts"][k] == 0 for k in others) and 1 <= meta["counts"][meta["target"]] <= 5
        assert {s[0] for s in meta["shapes"]} == {meta["target"]} and len(meta["shapes"]) == meta["count"]


def test_without_distractors_larger_shapes_fit():
    """Only the asked-about kind needs room: the demo's large circles pass, OOD counts included."""
    task = get_task("shapes", distractors=False, min_size=0.17, max_size=0.2)
    assert task.example(0, "ood").meta["count"] in (6, 7)
    with pytest.raises(VlmrlError, match="do not fit"):
        get_task("shapes", min_size=0.17, max_size=0.2)  # with the other kinds drawn too


# --- chapter rubric ----------------------------------------------------------------------------

@pytest.mark.parametrize("text, correct, describes, reasoning", [
    ("<think> I count the blue circles: 1, 2, 3. </think> so the answer is 3", 1.0, 1.0, 1.0),
    ("3", 1.0, 0.0, 0.0),
    ("There are 3 circular shapes in total.", 1.0, 1.0, 1.0),
    ("I see 3 squares, so 4", 0.0, 0.0, 1.0),                        # last number decides
    ("<answer>1 2 3 4 5 6 7</answer>", 0.0, 0.0, 0.0),              # stuffed: the last is 7
    ("<think>circles</think><answer> </answer>", 0.0, 1.0, 0.0),     # empty answer
    ("totally 3 squarely", 1.0, 0.0, 0.0),                          # keywords are whole words
    ("", 0.0, 0.0, 0.0),
])
def test_chapter_rubric(text, correct, describes, reasoning):
    scores = CHAPTER.score(HAND, text)
    assert scores == {"correct": correct, "describes_shape": describes, "reasoning": reasoning,
                      "accuracy": correct, "total": pytest.approx(correct + 0.5 * describes + 0.2 * reasoning)}


# --- strict rubric -----------------------------------------------------------------------------

@pytest.mark.parametrize("text, fmt, accuracy", [
    ("<think> three blue circles </think> <answer> 3 </answer>", 1.0, 1.0),
    ("<answer>3</answer>", 0.0, 1.0),                                        # no think block
    ("<think> x </think> <answer> 1 2 3 </answer>", 1.0, 0.0),              # many numbers
    ("<think> x </think> <answer> The answer is 3 </answer>", 1.0, 0.0),    # buried in text
    ("<think> x </think> <answer> three </answer>", 1.0, 0.0),
    ("<think> x </think> <answer>   </answer>", 0.0, 0.0),                  # blank answer
    ("<think> x </think> <answer>3</answer><answer>3</answer>", 0.0, 0.0),  # repeated
    ("<think> x </think> <answer><answer>3</answer></answer>", 0.0, 0.0),   # nested
    ("<think> x </think> <answer>3</answer> 3", 0.0, 1.0),                  # trailing text
    ("3", 0.0, 0.0),                                                        # outside the tags
    ("<think> the answer is 3 </think>", 0.0, 0.0),
])
def test_strict_rubric(text, fmt, accuracy):
    assert STRICT.score(HAND, text) == {"format": fmt, "accuracy": accuracy, "total": fmt + accuracy}


# --- totality ----------------------------------------------------------------------------------

FRAGMENTS = ["<think>", "</think>", "<answer>", "</answer>", "3", "7", " ", "circle", "blue", "so", "total",
             "-1", "1e400", "9" * 30, "\n"]
texts = st.lists(st.one_of(st.text(max_size=12), st.sampled_from(FRAGMENTS)), max_size=12).map("".join)
EXAMPLES = [HAND] + [CHAPTER.example(i, split) for i in range(2) for split in ("train", "ood")]


@settings(max_examples=200, deadline=None)
@given(text=texts, example=st.sampled_from(EXAMPLES))
def test_scores_are_total_and_in_range(text, example):
    chapter, strict = CHAPTER.score(example, text), STRICT.score(example, text)
    assert set(chapter) == {"correct", "describes_shape", "reasoning", "accuracy", "total"}
    assert set(strict) == {"format", "accuracy", "total"}
    for scores, top in ((chapter, 1.7), (strict, 2.0)):
        assert all(math.isfinite(v) for v in scores.values())
        assert scores["accuracy"] in (0.0, 1.0) and 0.0 <= scores["total"] <= top + 1e-9


def test_closest_pair_is_the_nearest_centres_of_the_asked_kind():
    shapes = [("circle", 0, 0, 10), ("square", 12, 0, 10), ("circle", 30, 40, 10), ("circle", 0, 20, 20)]
    # circle centres (5, 5), (35, 45), (10, 30): nearest (5, 5)-(10, 30) = sqrt(25 + 625)
    assert closest_pair(shapes, "circle") == pytest.approx(math.sqrt(650))
    assert closest_pair(shapes, "square") == math.inf  # one square: no pair
    assert closest_pair([], "triangle") == math.inf


def test_a_perfect_teacher_is_always_right():
    task = get_task("shapes", seed=3, targets=["circle"], distractors=False)
    for i in range(50):
        ex = task.example(i)
        assert ex.meta["teacher_count"] == ex.meta["count"] and task.score(ex, ex.reference_completion)["accuracy"] == 1


def test_a_weak_teacher_counts_the_most_crowded_images_one_short():
    params = dict(targets=["circle"], distractors=False, min_size=0.17, max_size=0.2, rubric="strict")
    task = get_task("shapes", seed=0, teacher_error=0.3, **params)
    examples = [task.example(i, split) for split in ("train", "test") for i in range(400)]
    wrong = [ex for ex in examples if ex.meta["teacher_count"] != ex.meta["count"]]
    right = [ex for ex in examples if ex.meta["teacher_count"] == ex.meta["count"]]
    assert 0.25 <= len(wrong) / len(examples) <= 0.35  # the share asked, on unseen indices of both splits
    assert all(ex.meta["teacher_count"] == ex.meta["count"] - 1 for ex in wrong)
    assert all(ex.meta["count"] >= 2 for ex in wrong)  # one shape is never miscounted

    def distance(ex):
        return closest_pair([tuple(s) for s in ex.meta["shapes"]], ex.meta["target"])

    assert max(map(distance, wrong)) < min(map(distance, right))  # systematic: the crowded ones, all of them
    for ex in wrong:  # the gold answer and the reward stay exact: imitation is paid nothing for the error
        score = task.score(ex, ex.reference_completion)
        assert ex.answer == str(ex.meta["count"]) and score["format"] == 1 and score["accuracy"] == 0
    same = get_task("shapes", seed=0, teacher_error=0.3, **params)  # another worker, straight to example 399
    assert same.example(399, "test").reference_completion == examples[-1].reference_completion
    images = [ex.image.tobytes() for ex in examples[:20]]
    assert images == [get_task("shapes", seed=0, **params).example(i).image.tobytes() for i in range(20)]


def test_teacher_error_must_be_a_share():
    with pytest.raises(VlmrlError, match=r"teacher_error must be in \[0, 1\), got 1.0"):
        get_task("shapes", teacher_error=1.0)
