"""zoom: a code unreadable in the view and readable at full resolution, the reference trajectory,
the answer and trajectory rewards on each case, totality, and `tasks show` saving every image."""

from __future__ import annotations

import colorsys
import itertools
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from vlmrl.errors import VlmrlError
from vlmrl.tasks import Example, Task, get_task
from vlmrl.tasks import inspect as task_inspect
from vlmrl.tasks.shapes import RGB
from vlmrl.tools import ToolCall, Trajectory, Turn
from vlmrl.tasks.zoom import text_color

TASK = get_task("zoom", seed=0)
HAND = Example(images=[Image.new("RGB", (112, 112), "white")], originals=[Image.new("RGB", (448, 448), "white")],
               prompt="", answer="47",
               meta={"code": "47", "box": [100, 100, 140, 124], "original_size": [448, 448]})
RIGHT = "<think>The red tag reads 47.</think> <answer>47</answer>"


def hue(rgb) -> float:
    return colorsys.rgb_to_hsv(*(v / 255 for v in rgb))[0] * 360


def pixels(image: Image.Image) -> list[tuple[int, int, int]]:
    return [image.getpixel((x, y)) for y in range(image.height) for x in range(image.width)]


def call(box, name: str = "zoom", **extra) -> Turn:
    arguments = {"box": box, **extra}
    text = f"<think>zoom</think>\n<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
    return Turn(role="assistant", text=text, call=ToolCall(name=name, arguments=arguments))


def result(error: str | None = None) -> Turn:
    if error is not None:
        return Turn(role="tool", text=f"error: {error}", error=error)
    return Turn(role="tool", text="", images=[Image.new("RGB", (64, 64))])


def answer(text: str = RIGHT) -> Turn:
    return Turn(role="assistant", text=text)


def trajectory(*turns: Turn, cut: bool = False) -> dict[str, float]:
    return TASK.score_trajectory(HAND, Trajectory(turns=list(turns), cut=cut))


def expected(accuracy: float, fmt: float, zoom: float, charge: float, calls: int, errors: int) -> dict:
    return {"accuracy": accuracy, "format": fmt, "zoom": zoom, "charge": pytest.approx(charge), "calls": calls,
            "errors": errors, "total": pytest.approx(accuracy + 0.5 * fmt + 0.5 * zoom - charge)}


# --- the images --------------------------------------------------------------------------------

@pytest.mark.parametrize("split, digits", [("train", 2), ("test", 2), ("ood", 3)])
def test_one_tag_of_the_named_colour_among_distractors_nothing_overlapping(split, digits):
    for idx in range(40):
        example = TASK.example(idx, split)
        meta = example.meta
        code, color, (x1, y1, x2, y2) = meta["code"], meta["color"], meta["box"]
        assert example.answer == code and len(code) == digits and code.isdigit() and code[0] != "0"
        assert f"small {color} tag" in example.prompt and f"{digits}-digit code" in example.prompt
        assert "112x112 downscaled view of a 448x448 image" in example.prompt
        assert '<tool_call>\n{"name": "zoom", "arguments": {"box": [0, 0, 224, 224]}}\n</tool_call>' in example.prompt
        assert 20 <= y2 - y1 <= 26 and x2 - x1 > y2 - y1
        others = meta["distractors"]
        assert len(others) == 2 and len({color, *(d["color"] for d in others)}) == 3
        assert len({code, *(d["code"] for d in others)}) == 3 and all(len(d["code"]) == digits for d in others)
        assert color in ("red", "green", "blue", "yellow", "purple")
        boxes = [meta["box"]] + [d["box"] for d in others] + [[x, y, x + s, y + s] for _, _, x, y, s in meta["shapes"]]
        assert len(meta["shapes"]) == 3
        for i, (a1, b1, a2, b2) in enumerate(boxes):  # gap 4 apart and from the border
            assert 4 <= a1 and a2 + 4 <= 448 and 4 <= b1 and b2 + 4 <= 448
            for c1, d1, c2, d2 in boxes[i + 1:]:
                assert a2 + 4 <= c1 or c2 + 4 <= a1 or b2 + 4 <= d1 or d2 + 4 <= b1
        assert (meta["view_side"], meta["image_size"], meta["original_size"]) == (112, [112, 112], [448, 448])


def test_the_view_is_the_original_downscaled():
    for idx in range(5):
        example = TASK.example(idx)
        assert len(example.images) == 1 and len(example.originals) == 1
        assert example.image.size == (112, 112) and example.originals[0].size == (448, 448)
        assert example.image.tobytes() == example.originals[0].resize((112, 112), Image.Resampling.BOX).tobytes()


@pytest.mark.parametrize("split", ["train", "ood"])
def test_the_code_is_a_blob_in_the_view_and_fills_the_tag_in_the_original(split):
    for idx in range(60):
        example = TASK.example(idx, split)
        meta = example.meta
        x1, y1, x2, y2 = meta["box"]
        # In the view the whole tag is at most 6.5 x 16 pixels, its digits smaller still ...
        assert (y2 - y1) / 4 <= 6.5 and (x2 - x1) / 4 <= 16
        # ... but it keeps its colour: the mean over the tag in the view has the tag's hue.
        view = pixels(example.image.crop((x1 // 4, y1 // 4, x2 // 4, y2 // 4)))
        mean = [sum(p[k] for p in view) / len(view) for k in range(3)]
        assert abs((hue(mean) - hue(RGB[meta["color"]]) + 180) % 360 - 180) < 2
        # At full resolution the tag is its colour and the digits stand out, 13 px or taller.
        crop = example.originals[0].crop((x1, y1, x2, y2))
        ink = text_color(meta["color"])
        tag_share = sum(p == RGB[meta["color"]] for p in pixels(crop)) / (crop.width * crop.height)
        rows = [y for y in range(crop.height) for x in range(crop.width)
                if sum(abs(a - b) for a, b in zip(crop.getpixel((x, y)), ink)) < 60]
        assert tag_share >= 0.5 and len(rows) >= 0.06 * crop.width * crop.height
        assert max(rows) - min(rows) + 1 >= 13 and max(rows) - min(rows) + 1 >= 0.6 * crop.height


def test_tag_colours_are_far_apart_in_hue():
    hues = sorted(hue(RGB[c]) for c in TASK.params.colors)
    gaps = [b - a for a, b in itertools.pairwise(hues)] + [hues[0] + 360 - hues[-1]]
    assert min(gaps) >= 40


# --- the reference trajectory ------------------------------------------------------------------

def reference_trajectory(example: Example) -> Trajectory:
    first, last = example.meta["reference_turns"]
    request = json.loads(first.split("<tool_call>\n")[1].split("\n</tool_call>")[0])
    box = request["arguments"]["box"]
    crop = example.originals[0].crop(tuple(box))
    return Trajectory(turns=[Turn("assistant", first, call=ToolCall(request["name"], request["arguments"])),
                             Turn("tool", "", images=[crop]), Turn("assistant", last)])


@pytest.mark.parametrize("split", ["train", "test", "ood"])
def test_the_reference_trajectory_calls_zoom_on_the_tag_and_scores_the_maximum(split):
    for idx in range(50):
        example = TASK.example(idx, split)
        meta = example.meta
        first, last = meta["reference_turns"]
        assert last == example.reference_completion == (f"<think>The {meta['color']} tag reads {meta['code']}."
                                                        f"</think> <answer>{meta['code']}</answer>")
        assert first.startswith(f"<think>The {meta['color']} tag is near the ")
        box = json.loads(first.split("<tool_call>\n")[1].split("\n</tool_call>")[0])["arguments"]["box"]
        x1, y1, x2, y2 = meta["box"]
        pad = (y2 - y1) // 2
        assert box == [max(0, x1 - pad), max(0, y1 - pad), min(448, x2 + pad), min(448, y2 + pad)]
        others = [d["box"] for d in meta["distractors"]] + [[x, y, x + s, y + s] for _, _, x, y, s in meta["shapes"]]
        for c1, d1, c2, d2 in others:  # the zoom shows the target alone
            assert box[2] <= c1 or c2 <= box[0] or box[3] <= d1 or d2 <= box[1]
        scores = TASK.score_trajectory(example, reference_trajectory(example))
        assert scores == {"accuracy": 1.0, "format": 1.0, "zoom": 1.0, "charge": 0.0, "calls": 1.0,
                          "errors": 0.0, "total": 2.0}


def test_position_words():
    words = {TASK.example(i).meta["reference_turns"][0].split(" is near the ")[1].split(".")[0] for i in range(200)}
    assert words == {"top left", "top", "top right", "left", "centre", "right", "bottom left", "bottom",
                     "bottom right"}


# --- the answer reward -------------------------------------------------------------------------

@pytest.mark.parametrize("text, accuracy, fmt", [
    (RIGHT, 1.0, 1.0),
    ("<think>x</think>\n<answer>  47 \n</answer>\n", 1.0, 1.0),     # whitespace around is fine
    ("<answer>47</answer>", 1.0, 0.0),                              # no think block
    ("<think>x</think> <answer>48</answer>", 0.0, 1.0),             # wrong code
    ("<think>x</think> <answer>047</answer>", 0.0, 1.0),            # not exactly the code
    ("<think>x</think> <answer>4 7</answer>", 0.0, 0.0),
    ("<think>x</think> <answer>The code is 47</answer>", 0.0, 0.0),
    ("<think>x</think> <answer>47 48</answer>", 0.0, 0.0),          # stuffed
    ("<think>x</think> <answer>\u0664\u0667</answer>", 0.0, 0.0),  # Arabic-Indic digits are not ASCII
    ("<think>x</think> <answer>47</answer><answer>47</answer>", 0.0, 0.0),
    ("<think>x</think> <answer><answer>47</answer></answer>", 0.0, 0.0),
    ("<think>x</think> <answer>47</answer> and more", 1.0, 0.0),
    ("<think>x</think> <answer> </answer>", 0.0, 0.0),
    ("47", 0.0, 0.0),
    ("", 0.0, 0.0),
])
def test_answer_reward(text, accuracy, fmt):
    assert TASK.score(HAND, text) == {"accuracy": accuracy, "format": fmt, "total": accuracy + 0.5 * fmt}


def test_a_distractor_code_or_the_view_guess_scores_no_accuracy():
    for idx in range(30):
        example = TASK.example(idx)
        for other in example.meta["distractors"]:
            scores = TASK.score(example, f"<think>x</think> <answer>{other['code']}</answer>")
            assert scores == {"accuracy": 0.0, "format": 1.0, "total": 0.5}


# --- the trajectory reward ---------------------------------------------------------------------

TARGET_ZOOM = [90, 90, 150, 134]
WRONG_ZOOM = [300, 300, 360, 340]
QUARTERS = [[0, 0, 224, 224], [224, 0, 448, 224], [0, 224, 224, 448], [224, 224, 448, 448]]


@pytest.mark.parametrize("turns, scores", [
    ((call(TARGET_ZOOM), result(), answer()), expected(1, 1, 1, 0.0, 1, 0)),
    ((call(WRONG_ZOOM), result(), answer()), expected(1, 1, 0, 0.0, 1, 0)),          # the wrong tag
    ((call(WRONG_ZOOM), result(), call(TARGET_ZOOM), result(), answer()), expected(1, 1, 1, 0.0, 2, 0)),
    ((answer(),), expected(1, 1, 0, 0.0, 0, 0)),                                       # no call
    ((answer("<think>x</think> <answer>48</answer>"),), expected(0, 1, 0, 0.0, 0, 0)),
    ((call(TARGET_ZOOM), result(), answer("<think>x</think> <answer>48</answer>")), expected(0, 1, 1, 0.0, 1, 0)),
    ((call(TARGET_ZOOM), result()) * 5 + (answer(),), expected(1, 1, 1, 0.3, 5, 0)),    # 3 calls beyond 2
    ((call(TARGET_ZOOM), result()) * 30 + (answer(),), expected(1, 1, 1, 1.0, 30, 0)),  # charge capped
    ((call(TARGET_ZOOM), result(), call("bad"), result("bad_arguments"), Turn("assistant", "<tool_call>{"),
      result("malformed"), answer()), expected(1, 1, 1, 0.2, 2, 2)),                   # 2 failed calls
    ((call(TARGET_ZOOM), result("timeout"), answer()), expected(1, 1, 0, 0.1, 1, 1)),  # it never ran
    ((call(TARGET_ZOOM),), expected(0, 0, 0, 0.0, 1, 0)),                               # cut before the result
    ((call([0, 0, 448, 448]), result(), answer()), expected(1, 1, 0, 0.0, 1, 0)),     # whole image: too big
    ((call([0, 0, 224, 224]), result(), answer()), expected(1, 1, 1, 0.0, 1, 0)),     # a quarter: allowed
    ((call([0, 0, 225, 224]), result(), answer()), expected(1, 1, 0, 0.0, 1, 0)),     # a bit more than that
    ((call([104, 100, 140, 124]), result(), answer()), expected(1, 1, 1, 0.0, 1, 0)),  # 90% of the tag
    ((call([105, 100, 140, 124]), result(), answer()), expected(1, 1, 0, 0.0, 1, 0)),  # 87.5%
    ((call([-50, -50, 150, 150]), result(), answer()), expected(1, 1, 1, 0.0, 1, 0)),  # clipped to the image
    ((call(TARGET_ZOOM, name="crop"), result(), answer()), expected(1, 1, 1, 0.0, 1, 0)),
    ((call(TARGET_ZOOM, name="rotate"), result(), answer()), expected(1, 1, 0, 0.0, 1, 0)),
    ((call(TARGET_ZOOM, image=1), result(), answer()), expected(1, 1, 0, 0.0, 1, 0)),  # another image
    ((call(TARGET_ZOOM, image=0), result(), answer()), expected(1, 1, 1, 0.0, 1, 0)),
    ((), expected(0, 0, 0, 0.0, 0, 0)),                                               # no turns
    (sum(((call(q), result()) for q in QUARTERS), ()) + (answer(),), expected(1, 1, 1, 0.2, 4, 0)),  # tiling
    (sum(((call([x, y, x + 112, y + 112]), result()) for x in range(0, 448, 112) for y in range(0, 448, 112)), ())
     + (answer(),), expected(1, 1, 0, 1.0, 16, 0)),  # 16 tiles, none holding 90% of the tag: charge only
])
def test_trajectory_reward(turns, scores):
    assert trajectory(*turns) == scores


@pytest.mark.parametrize("box", [
    ["90", "90", "150", "134"], [90, 90, 150], [90, 90, 150, 134, 1], [True, 90, 150, 134], [90, 90, 150, None],
    [90, 90, float("nan"), 134], [90, 90, float("inf"), 134], [-10 ** 400, -10 ** 400, 10 ** 400, 10 ** 400],
    [150, 134, 90, 90], [[90, 90], [150, 134]], "90, 90, 150, 134", None, {"x1": 90}, 7,
])
def test_boxes_that_are_not_four_numbers_earn_no_zoom_and_stay_finite(box):
    assert trajectory(call(box), result(), answer()) == expected(1, 1, 0, 0.0, 1, 0)


def test_garbage_trajectories_score_finite_numbers():
    # Deliberately ill-typed: None names and arguments, lists for dicts, turns that are not Turns.
    garbage: list = [ToolCall(name=None, arguments=None), ToolCall(name="zoom", arguments=[1, 2]),
                     ToolCall(name="zoom", arguments={"box": TARGET_ZOOM, "image": True}), "not a call"]
    turns: list = [Turn("assistant", "x", call=g) for g in garbage] + [3, None, Turn("tool", None, error=5)]
    values: list = [Trajectory(turns=turns), Trajectory(turns=None), Trajectory(turns="abc"), None, 3,
                    Trajectory(turns=[Turn("assistant", None)])]
    for value in values:
        scores = TASK.score_trajectory(HAND, value)
        assert scores["accuracy"] == 0.0 and scores["zoom"] == 0.0
        assert all(math.isfinite(v) for v in scores.values()) and -1.0 <= scores["total"] <= 2.0


def test_other_tasks_score_a_trajectory_by_its_final_text():
    task = get_task("shapes", rubric="strict")
    example = task.example(0)
    final = example.reference_completion
    turns = [Turn("assistant", "look", call=ToolCall("zoom", {"box": [0, 0, 9, 9]})), result(), answer(final)]
    assert task.score_trajectory(example, Trajectory(turns=turns)) == task.score(example, final)
    assert task.score_trajectory(example, Trajectory()) == task.score(example, "")


# --- totality ----------------------------------------------------------------------------------

FRAGMENTS = ["<think>", "</think>", "<answer>", "</answer>", "47", "4", "7", " ", "\n", "<tool_call>",
             "</tool_call>", "-1", "1e400", "9" * 30, "\u0664"]
texts = st.lists(st.one_of(st.text(max_size=12), st.sampled_from(FRAGMENTS)), max_size=12).map("".join)
EXAMPLES = [HAND] + [TASK.example(i, split) for i in range(2) for split in ("train", "ood")]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8)
numbers = st.integers() | st.floats() | st.integers(min_value=-500, max_value=500)
arguments = json_values | st.fixed_dictionaries({"box": st.lists(numbers, max_size=5) | json_values},
                                                optional={"image": json_values})
calls = st.builds(ToolCall, name=st.sampled_from(["zoom", "crop", "other"]) | st.text(max_size=4),
                  arguments=arguments)
turns = st.builds(Turn, role=st.sampled_from(["assistant", "tool", "user"]), text=texts,
                  call=st.none() | calls, error=st.none() | st.sampled_from(["malformed", "timeout"]))
trajectories = st.builds(Trajectory, turns=st.lists(turns, max_size=8), cut=st.booleans())


@settings(max_examples=200, deadline=None)
@given(text=texts, example=st.sampled_from(EXAMPLES))
def test_answer_scores_are_total_and_in_range(text, example):
    scores = TASK.score(example, text)
    assert set(scores) == {"accuracy", "format", "total"}
    assert all(math.isfinite(v) for v in scores.values())
    assert scores["accuracy"] in (0.0, 1.0) and scores["format"] in (0.0, 1.0) and 0.0 <= scores["total"] <= 1.5


@settings(max_examples=300, deadline=None)
@given(value=trajectories, example=st.sampled_from(EXAMPLES))
def test_trajectory_scores_are_total_and_in_range(value, example):
    scores = TASK.score_trajectory(example, value)
    assert set(scores) == {"accuracy", "format", "zoom", "charge", "calls", "errors", "total"}
    assert all(math.isfinite(v) for v in scores.values())
    assert scores["accuracy"] in (0.0, 1.0) and scores["zoom"] in (0.0, 1.0) and 0.0 <= scores["charge"] <= 1.0
    assert -1.0 <= scores["total"] <= 2.0


# --- parameters and `tasks show` ---------------------------------------------------------------

def test_parameters_change_the_images():
    task = get_task("zoom", image_size=672, view_side=96, digits=1, ood_digits=4, distractor_tags=0,
                    distractor_shapes=0, tag_min=30, tag_max=30, colors="blue")
    example = task.example(0)
    assert example.image.size == (96, 96) and example.originals[0].size == (672, 672)
    assert len(example.answer) == 1 and example.meta["color"] == "blue" and example.meta["distractors"] == []
    assert example.meta["shapes"] == [] and example.meta["box"][3] - example.meta["box"][1] == 30
    assert len(task.example(0, "ood").answer) == 4 and "96x96 downscaled view of a 672x672 image" in example.prompt


@pytest.mark.parametrize("params, message", [
    ({"digits": 3}, "digits and ood_digits in 1..6 and different"),
    ({"digits": 7}, "digits and ood_digits in 1..6"),
    ({"view_side": 500}, "view_side <= image_size"),
    ({"colors": "red,blue", "distractor_tags": 2}, "more than distractor_tags=2"),
    ({"colors": "red,red"}, "colors must be distinct names"),
    ({"colors": "pink"}, "colors must be distinct names"),
    ({"tag_min": 30, "tag_max": 20}, "need 8 <= tag_min <= tag_max"),
    ({"tag_max": 10 ** 20}, "need 8 <= tag_min <= tag_max <= image_size, got 20, 100000000000000000000"),  # was an OSError from FreeType
    ({"distractor_shapes": 8}, "do not fit"),
    ({"call_cost": -0.1}, "must be >= 0"),
    ({"max_zoom_area": 0}, "max_zoom_area and min_cover must be in"),
    ({"min_cover": 1.5}, "max_zoom_area and min_cover must be in"),
])
def test_bad_parameters_are_one_line_errors(params, message):
    with pytest.raises(VlmrlError, match=message):
        get_task("zoom", **params)


def test_show_task_saves_the_view_and_the_original(tmp_path):
    text = task_inspect.show_task("zoom", {}, split="test", n=1, out_dir=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["zoom_test_0.png", "zoom_test_0_original.png",
                                                          "zoom_test_0_tool_0.png"]  # the reference zoom's image
    example = TASK.example(0, "test")
    assert f"image: 112x112 -> {tmp_path / 'zoom_test_0.png'}" in text
    assert f"original: 448x448 -> {tmp_path / 'zoom_test_0_original.png'}" in text
    assert "reference turns (a tool runs between them):" in text and '"name": "zoom"' in text
    assert Image.open(tmp_path / "zoom_test_0.png").convert("RGB").tobytes() == example.image.tobytes()
    saved = Image.open(tmp_path / "zoom_test_0_original.png").convert("RGB")
    assert saved.tobytes() == example.originals[0].tobytes()


class TwoImages(Task):
    """Two images shown; the first original is the first image, the second a larger version."""

    name = "two_images"

    def _example(self, idx, split):
        first, second = Image.new("RGB", (8, 8), "red"), Image.new("RGB", (8, 6), "blue")
        return Example(images=[first, second], originals=[first.copy(), Image.new("RGB", (16, 12), "blue")],
                       prompt="<answer></answer>", answer="x", reference_completion="x")

    def score(self, example, completion):
        return {"accuracy": 1.0, "total": 1.0}


def test_show_task_saves_every_image_and_the_originals_that_differ(tmp_path, monkeypatch):
    monkeypatch.setattr(task_inspect, "get_task", lambda name, **params: TwoImages())
    text = task_inspect.show_task("two_images", {}, n=1, out_dir=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "two_images_train_0.png", "two_images_train_0_1.png", "two_images_train_0_original_1.png"]
    assert f"image: 8x8 -> {tmp_path / 'two_images_train_0.png'}" in text
    assert f"image 1: 8x6 -> {tmp_path / 'two_images_train_0_1.png'}" in text
    assert f"original 1: 16x12 -> {tmp_path / 'two_images_train_0_original_1.png'}" in text
    assert Image.open(tmp_path / "two_images_train_0_original_1.png").size == (16, 12)
    assert "reference turns" not in text
    assert "image: 8x8\nimage 1: 8x6\noriginal 1: 16x12" in task_inspect.show_task("two_images", {}, n=1)


# --- the coarse zoom (call_style=window) ---------------------------------------------------------

@pytest.mark.parametrize("split", ["train", "test", "ood"])
def test_window_style_references_pick_a_window_holding_the_tag_and_score_the_maximum(split):
    from vlmrl.tools import ToolContext, zoom_window
    from vlmrl.tools.image_tools import window_box

    task = get_task("zoom", seed=0, call_style="window")
    for idx in range(30):
        example = task.example(idx, split)
        first, last = example.meta["reference_turns"]
        request = json.loads(first.split("<tool_call>\n")[1].split("\n</tool_call>")[0])
        assert request["name"] == "zoom_window" and "zoom_window" in example.prompt
        window = request["arguments"]["window"]
        x1, y1, x2, y2 = window_box(448, 448, window)
        box = example.meta["box"]
        assert x1 <= box[0] and y1 <= box[1] and box[2] <= x2 and box[3] <= y2  # the tag lies in the window
        crop = zoom_window(ToolContext(example.originals, max_side=224), window)
        turns = [Turn("assistant", first, call=ToolCall(request["name"], request["arguments"])),
                 Turn("tool", "", images=[crop]), Turn("assistant", last)]
        assert task.score_trajectory(example, Trajectory(turns=turns)) == {
            "accuracy": 1.0, "format": 1.0, "zoom": 1.0, "charge": 0.0, "calls": 1.0, "errors": 0.0, "total": 2.0}
    assert trajectory(call(None, name="zoom_window", window=9), result(), answer())["zoom"] == 0.0  # no such window
    with pytest.raises(VlmrlError, match="call_style must be box or window"):
        get_task("zoom", call_style="grid")


# --- the board of panels (layout=panels, the demo's) ---------------------------------------------

PANELS = dict(layout="panels", distractor_shapes=0, digits=1, ood_digits=2, view_side=56, tag_min=48, tag_max=56)


@pytest.mark.parametrize("split", ["train", "test", "ood"])
def test_panels_put_each_tag_alone_in_a_shaded_panel(split):
    from vlmrl.tasks.zoom import PANEL_SHADES, panel_box

    task = get_task("zoom", seed=0, **PANELS)
    for idx in range(20):
        example = task.example(idx, split)
        boxes = [example.meta["box"]] + [d["box"] for d in example.meta["distractors"]]
        panels = []
        for box in boxes:
            inside = [p for p in range(4) if all(a <= b for a, b in zip(panel_box(p, 448)[:2], box[:2]))
                      and all(b <= a for a, b in zip(panel_box(p, 448)[2:], box[2:]))]
            assert len(inside) == 1
            panels.append(inside[0])
        assert len(set(panels)) == 3 and example.meta["shapes"] == []
        original = example.originals[0]
        for panel in set(range(4)) - set(panels):  # an empty panel is its shade, all over
            shade = PANEL_SHADES[panel]
            assert set(pixels(original.crop(panel_box(panel, 448)).resize((8, 8)))) == {(shade, shade, shade)}
        assert example.image.size == (56, 56)


@pytest.mark.parametrize("call_style, tool", [("window", "zoom_window"), ("box", "zoom")])
def test_panels_reference_zooms_on_the_targets_panel_and_scores_the_maximum(call_style, tool):
    from vlmrl.tools import BUILTIN_TOOLS, ToolContext
    from vlmrl.tasks.zoom import PANEL_NAMES, panel_box, panel_of

    task = get_task("zoom", seed=0, call_style=call_style, **PANELS)
    for idx in range(20):
        example = task.example(idx, "test")
        first, last = example.meta["reference_turns"]
        request = json.loads(first.split("<tool_call>\n")[1].split("\n</tool_call>")[0])
        panel = panel_of(example.meta["box"], 448)
        assert f"in the {PANEL_NAMES[panel]} panel" in first and request["name"] == tool
        expected_arguments = {"window": [0, 2, 6, 8][panel]} if tool == "zoom_window" else {"box": panel_box(panel, 448)}
        assert request["arguments"] == expected_arguments
        crop = BUILTIN_TOOLS[tool](ToolContext(example.originals, max_side=168), **request["arguments"])
        assert crop.size == (168, 168)
        turns = [Turn("assistant", first, call=ToolCall(tool, request["arguments"])), Turn("tool", "", images=[crop]),
                 Turn("assistant", last)]
        assert task.score_trajectory(example, Trajectory(turns=turns))["total"] == 2.0


def test_panel_geometry():
    from vlmrl.tasks.zoom import panel_box, panel_of, panel_window

    assert [panel_box(p, 448) for p in range(4)] == [[0, 0, 224, 224], [224, 0, 448, 224], [0, 224, 224, 448],
                                                     [224, 224, 448, 448]]
    assert [panel_of(b, 448) for b in ([10, 10, 60, 60], [300, 20, 350, 70], [0, 400, 40, 440], [230, 230, 448, 448])] \
        == [0, 1, 2, 3]
    assert [panel_window(p) for p in range(4)] == [0, 2, 6, 8]


def test_without_instructions_the_prompt_only_names_the_tag():
    example = get_task("zoom", seed=0, instructions=False, **PANELS).example(0)
    assert example.prompt == f"Read the 1-digit code of the {example.meta['color']} tag."
    assert "<tool_call>" in get_task("zoom", seed=0, **PANELS).example(0).prompt


@pytest.mark.parametrize("params, message", [
    ({"layout": "grid"}, "layout must be one of free, panels"),
    ({"layout": "panels"}, "need distractor_tags <= 3 and distractor_shapes=0"),
    ({"layout": "panels", "distractor_shapes": 0, "distractor_tags": 4}, "need distractor_tags <= 3"),
    ({"layout": "panels", "distractor_shapes": 0, "tag_min": 200, "tag_max": 220}, "does not fit a 224 px panel"),
])
def test_bad_panel_parameters_are_one_line_errors(params, message):
    with pytest.raises(VlmrlError, match=message):
        get_task("zoom", **params)


def test_a_hint_says_where_the_tag_is():
    from vlmrl.tasks.zoom import PANEL_NAMES, panel_of

    for idx in range(10):
        example = get_task("zoom", seed=0, instructions=False, hint=True, **PANELS).example(idx)
        panel = PANEL_NAMES[panel_of(example.meta["box"], 448)]
        assert example.prompt == f"Read the 1-digit code of the {example.meta['color']} tag, in the {panel} panel."
        assert example.meta["reference_turns"][0].startswith(f"<think>The {example.meta['color']} tag is in the "
                                                             f"{panel} panel.</think>")
    free = get_task("zoom", seed=0, hint=True).example(0)
    assert f"tag, near the {free.meta['reference_turns'][0].split('near the ')[1].split('.')[0]}, holds" in free.prompt
    assert "tag in it holds a 2-digit code" in get_task("zoom", seed=0).example(0).prompt


# --- codes of patterns (symbols=patterns, the demo's) ----------------------------------------------

PATTERN_BOARD = dict(PANELS, symbols="patterns", distractor_tags=3, tag_min=80, tag_max=104)


def test_pattern_masks_are_half_coloured_in_every_period_block():
    from vlmrl.tasks.zoom import PATTERNS, pattern_mask

    masks = {name: pattern_mask(name, 16, 16, 8) for name in PATTERNS}
    assert masks["horizontal"][:4].all() and not masks["horizontal"][4:8].any()  # rows 0-3 on, 4-7 off
    assert masks["vertical"][:, :4].all() and not masks["vertical"][:, 4:8].any()
    assert masks["checkered"][0, 0] and not masks["checkered"][0, 4] and masks["checkered"][4, 4]
    assert masks["diagonal"][0, 3] and not masks["diagonal"][0, 4] and masks["diagonal"][3, 0] and not masks["diagonal"][2, 2]
    for mask in masks.values():  # every 8 x 8 window, wherever it starts, is half coloured
        assert {int(mask[y:y + 8, x:x + 8].sum()) for y in range(9) for x in range(9)} == {32}
    assert len({m.tobytes() for m in masks.values()}) == 4


FREE_PATTERNS = dict(symbols="patterns", digits=1, ood_digits=2)  # 448 px, 112 px view: a 4 px grid


@pytest.mark.parametrize("params, grid", [(PATTERN_BOARD, 8), (FREE_PATTERNS, 4)])
@pytest.mark.parametrize("split, n", [("train", 1), ("test", 1), ("ood", 2)])
def test_the_view_is_the_same_whatever_the_patterns(split, n, params, grid):
    """Tags on the view's grid, stripes half a view pixel wide: the box filter leaves a flat tint, so
    the view of a board does not depend on its codes at all; the original shows them plainly."""
    from vlmrl.tasks.zoom import PATTERNS

    task = get_task("zoom", seed=0, **params)
    side = 448 // grid
    for idx in range(8):
        example = task.example(idx, split)
        meta = example.meta
        tags = [[meta["color"], meta["code"], *meta["box"]]] + [[d["color"], d["code"], *d["box"]]
                                                                for d in meta["distractors"]]
        assert all(v % grid == 0 for tag in tags for v in tag[2:]) and len(meta["code"].split()) == n
        assert len({tag[1] for tag in tags}) == len(tags) and all(w in PATTERNS for t in tags for w in t[1].split())
        recoded = [[c, " ".join(PATTERNS[(PATTERNS.index(w) + 1) % 4] for w in code.split()), *box]
                   for c, code, *box in tags]
        other = task._draw(recoded, meta["shapes"])
        assert other.tobytes() != example.originals[0].tobytes()
        assert other.resize((side, side), Image.Resampling.BOX).tobytes() == example.image.tobytes()
        x1, y1, x2, y2 = meta["box"]
        r, g, b = RGB[meta["color"]]
        tint = (round((r + 255) / 2), round((g + 255) / 2), round((b + 255) / 2))
        inside = example.image.crop((x1 // grid, y1 // grid, x2 // grid, y2 // grid))
        assert all(max(abs(a - t) for a, t in zip(px, tint)) <= 1 for px in pixels(inside))


def test_pattern_answers_and_prompts():
    task = get_task("zoom", seed=0, instructions=False, hint=True, **PATTERN_BOARD)
    example = task.example(0)
    code, color = example.meta["code"], example.meta["color"]
    assert example.prompt.startswith(f"Name the pattern of the {color} tag, in the ")
    assert example.reference_completion == f"<think>The {color} tag shows {code}.</think> <answer>{code}</answer>"
    assert task.score(example, example.reference_completion) == {"accuracy": 1.0, "format": 1.0, "total": 1.5}
    assert task.score(example, f"<think>x</think> <answer> {code.upper()} </answer>")["accuracy"] == 1.0
    other = example.meta["distractors"][0]["code"]
    assert task.score(example, f"<think>x</think> <answer>{other}</answer>") == {"accuracy": 0.0, "format": 1.0,
                                                                                   "total": 0.5}
    assert task.score(example, "<think>x</think> <answer>stripes</answer>")["format"] == 0.0
    assert task.score(example, "<think>x</think> <answer></answer>")["format"] == 0.0
    ood = task.example(0, "ood")
    assert ood.prompt.startswith(f"Name the 2 patterns, left to right, of the {ood.meta['color']} tag")
    full = get_task("zoom", seed=0, **PATTERN_BOARD).example(0).prompt
    assert "is filled with a pattern (horizontal, vertical, checkered or diagonal), too fine to see here" in full
    assert "give the pattern inside <answer> </answer>" in full


@pytest.mark.parametrize("params, message", [
    ({"view_side": 64}, "image_size must be view_side times an even number"),
    ({"view_side": 149, "image_size": 447}, "image_size must be view_side times an even number"),
    ({"tag_min": 8, "tag_max": 8, "view_side": 28, "digits": 1, "ood_digits": 2}, "need tag_min >= 16"),
    ({"symbols": "letters"}, "symbols must be one of digits, patterns"),
    ({"ood_digits": 3}, r"a tag is 3 squares wide: lower digits or ood_digits"),
])
def test_bad_pattern_parameters_are_one_line_errors(params, message):
    with pytest.raises(VlmrlError, match=message):
        get_task("zoom", **{"symbols": "patterns", "digits": 1, "ood_digits": 2, **params})
