"""The offline CV tools (tools/cv_tools.py): find_objects' regions, boxes in original pixels, areas and
shape classes on hand-drawn scenes, the set-of-marks image, measure's numbers on hand-computed cases,
every bad input as an error turn through the real run_tool path, and determinism."""

from __future__ import annotations

import math
import re

import pytest
from PIL import Image, ImageDraw

from vlmrl.tasks.shapes import RGB
from vlmrl.tools import ToolCall, ToolContext, ToolLimits, cv_tools, parse_tool_call, resolve_tools, run_tool
from vlmrl.tools.builtin import BUILTIN_TOOLS
from vlmrl.tools.cv_tools import PALETTE, find_objects, measure

BLUE, GREEN, RED, YELLOW = RGB["blue"], RGB["green"], RGB["red"], RGB["yellow"]


def scene(scale: int = 1) -> Image.Image:
    """448*scale square, white: two blue discs of diameter 21*scale, a green 20x20 square (x scale), two
    red discs that touch (one region), a yellow triangle. PIL fills (x0, y0, x1, y1) inclusive."""
    s = scale
    image = Image.new("RGB", (448 * s, 448 * s), "white")
    draw = ImageDraw.Draw(image)
    draw.ellipse((40 * s, 50 * s, 61 * s - 1, 71 * s - 1), fill=BLUE)  # box [40, 50, 61, 71] * s
    draw.ellipse((300 * s, 60 * s, 321 * s - 1, 81 * s - 1), fill=BLUE)  # box [300, 60, 321, 81] * s
    draw.rectangle((200 * s, 200 * s, 220 * s - 1, 220 * s - 1), fill=GREEN)  # box [200, 200, 220, 220] * s
    draw.ellipse((100 * s, 300 * s, 131 * s - 1, 331 * s - 1), fill=RED)  # two discs of 31 touching:
    draw.ellipse((130 * s, 300 * s, 161 * s - 1, 331 * s - 1), fill=RED)  # box [100, 300, 161, 331] * s
    draw.polygon([(350 * s, 400 * s), (400 * s, 400 * s), (375 * s, 350 * s)], fill=YELLOW)
    return image


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


TOOLS = resolve_tools(["find_objects", "measure", "zoom"])


def run(name: str, context: ToolContext, **arguments):
    """The call through run_tool, as the rollout runs it."""
    return run_tool(call(name, **arguments), TOOLS, context, ToolLimits())


def rows(text: str) -> list[tuple[int, str, str, list[int], int]]:
    """(id, colour, shape, box, area) of every listed region."""
    found = re.findall(r"^(\d+) (\w+) (\w+) box \[(\d+), (\d+), (\d+), (\d+)\] area (\d+)$", text, re.M)
    return [(int(i), c, s, [int(x1), int(y1), int(x2), int(y2)], int(a)) for i, c, s, x1, y1, x2, y2, a in found]


# --------------------------------------------------------------------------- find_objects


def test_find_objects_lists_each_region_in_reading_order_with_its_box_area_and_shape():
    result = run("find_objects", ToolContext([scene()]))
    assert result.error is None
    assert result.text.splitlines()[0] == ("5 regions in box [0, 0, 448, 448] of image 0 (448x448); boxes [x1, y1, x2, "
                                            "y2] and areas in the original image's pixels")
    found = rows(result.text)
    assert [(i, c, s, b) for i, c, s, b, _ in found] == [
        (1, "blue", "circle", [40, 50, 61, 71]),
        (2, "blue", "circle", [300, 60, 321, 81]),
        (3, "green", "square", [200, 200, 220, 220]),
        (4, "red", "other", [100, 300, 161, 331]),  # the touching discs: one region, not a circle
        (5, "yellow", "triangle", [350, 350, 401, 401]),
    ]
    areas = [a for *_, a in found]
    assert areas[2] == 400
    assert areas[0] == pytest.approx(math.pi * 10.5 ** 2, rel=0.05)
    assert areas[3] == pytest.approx(2 * math.pi * 15.5 ** 2, rel=0.05)  # about twice one disc's
    assert areas[4] == pytest.approx(50 * 50 / 2, rel=0.05)


def test_a_colour_and_a_shape_narrow_the_list():
    context = ToolContext([scene()])
    assert [r[1:3] for r in rows(run("find_objects", context, colour="Blue").text)] == [("blue", "circle")] * 2
    assert [r[3] for r in rows(run("find_objects", context, shape="square").text)] == [[200, 200, 220, 220]]
    only = run("find_objects", context, colour="red", shape="circle")
    assert only.error is None and only.text.startswith("0 red circles in box [0, 0, 448, 448]") and rows(only.text) == []


def test_boxes_are_in_the_original_pixels_when_the_shown_image_is_downscaled():
    """An original twice as large, tools showing 224 px: boxes and areas in the original's pixels, the
    set-of-marks image 224 px, and zoom on a returned box shows exactly the region."""
    context = ToolContext([scene(scale=2)], max_side=224)
    result = run("find_objects", context)
    found = rows(result.text)
    assert [b for *_, b, _ in found][:3] == [[80, 100, 122, 142], [600, 120, 642, 162], [400, 400, 440, 440]]
    assert found[2][4] == 1600
    assert result.images[0].size == (224, 224)
    crop = run("zoom", context, box=found[2][3]).images[0]
    assert crop.getcolors() == [(224 * 224, GREEN)]


def test_a_box_limits_the_search_and_boxes_stay_in_the_whole_image_pixels():
    context = ToolContext([scene()])
    result = run("find_objects", context, box=[170, 150, 448, 448])
    assert result.text.startswith("2 regions in box [170, 150, 448, 448]")
    assert [r[3] for r in rows(result.text)] == [[200, 200, 220, 220], [350, 350, 401, 401]]
    assert result.images[0].size == (418, 448)  # the 278x298 box enlarged to max_side, as zoom does


def test_the_set_of_marks_image_draws_each_box_and_its_number():
    result = run("find_objects", ToolContext([scene()]), colour="green")
    marks = result.images[0]
    assert marks.size == (448, 448)
    assert marks.getpixel((199, 210)) == (0, 0, 0)  # the box's outline, 1 px outside the square
    assert marks.getpixel((210, 210)) == GREEN
    tag = marks.crop((195, 180, 215, 199))  # the white tag with "1" above the box
    assert (0, 0, 0) in {c for _, c in tag.getcolors()} and (255, 255, 255) in {c for _, c in tag.getcolors()}


def test_nothing_found_is_an_answer_with_the_image_not_an_error():
    result = run("find_objects", ToolContext([Image.new("RGB", (64, 48), "white")]))
    assert result.error is None
    assert result.text.splitlines()[0].startswith("0 regions in box [0, 0, 64, 48] of image 0")
    assert len(result.images) == 1


def test_the_list_is_bounded_and_says_how_many_more():
    image = Image.new("RGB", (448, 448), "white")
    draw = ImageDraw.Draw(image)
    for k in range(40):
        x, y = 10 + (k % 10) * 40, 10 + (k // 10) * 40
        draw.rectangle((x, y, x + 5, y + 5), fill=BLUE)
    text = run("find_objects", ToolContext([image])).text
    assert len(rows(text)) == cv_tools.MAX_LISTED == 30
    assert text.splitlines()[-1] == ("... and 10 more (ids 31 to 40): ask with a smaller box, a colour or a shape")


def test_too_many_regions_is_refused(monkeypatch):
    monkeypatch.setattr(cv_tools, "MAX_REGIONS", 1)
    result = run("find_objects", ToolContext([scene()]), colour="blue")
    assert result.error == "bad_arguments"
    assert result.text == "error: bad arguments for find_objects: the box holds more than 1 blue regions; ask with a smaller box"


def test_a_box_of_more_pixels_than_the_limit_is_an_error_turn_for_both_tools(monkeypatch):
    """The bound on a call's work (MAX_PIXELS, 4096 x 4096 in use): a box over it is the model's error turn, for
    find_objects and for measure (which finds the regions again), never a call that runs; one within it runs."""
    monkeypatch.setattr(cv_tools, "MAX_PIXELS", 100 * 100)
    message = "box [0, 0, 200, 100] holds 20000 pixels; the limit is 10000: ask with a smaller box"
    for name, arguments in (("find_objects", {}), ("measure", {"colour": "blue"}), ("measure", {"ids": [1]})):
        result = run(name, ToolContext([scene()]), box=[0, 0, 200, 100], **arguments)
        assert (result.error, result.text) == ("bad_arguments", f"error: bad arguments for {name}: {message}")
    assert run("find_objects", ToolContext([scene()]), box=[0, 0, 100, 100]).error is None


def test_opencv_is_a_core_dependency_pinned_below_5():
    """OpenCV 5.0 drops parts of the 4.x API: pyproject.toml's range for opencv-python-headless stops below 5,
    constraints-cpu.txt pins a 4.x inside that range, and the OpenCV the tools import is a 4.x."""
    import tomllib
    from pathlib import Path

    import cv2
    from packaging.requirements import Requirement
    from packaging.version import Version

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    [opencv] = [r for r in map(Requirement, project["dependencies"]) if r.name == "opencv-python-headless"]
    assert not opencv.specifier.contains("5.0.0.93") and not opencv.specifier.contains("5.0")
    pins = dict(line.split("==", 1) for line in (root / "constraints-cpu.txt").read_text().splitlines()
                if "==" in line and not line.lstrip().startswith("#"))
    pinned = Version(pins["opencv-python-headless"])
    assert pinned.major == 4 and opencv.specifier.contains(pinned)
    assert Version(cv2.__version__).major == 4


def test_the_same_call_gives_the_same_text_and_image_bytes():
    context = ToolContext([scene()], max_side=300)
    first, second = run("find_objects", context, box=[0, 0, 400, 420]), run("find_objects", context, box=[0, 0, 400, 420])
    assert first.text == second.text
    assert first.images[0].tobytes() == second.images[0].tobytes()
    assert run("measure", context, ids=[1, 3]).text == run("measure", context, ids=[1, 3]).text


# --------------------------------------------------------------------------- measure


def squares() -> ToolContext:
    """Two green 10x10 squares: box [20, 30, 30, 40] (centre (25, 35)) and [60, 60, 70, 70] (centre (65, 65));
    a red 40x10 bar across and a 10x40 one upright."""
    image = Image.new("RGB", (200, 150), "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle((20, 30, 29, 39), fill=GREEN)
    draw.rectangle((60, 60, 69, 69), fill=GREEN)
    draw.rectangle((100, 10, 139, 19), fill=RED)
    draw.rectangle((150, 50, 159, 89), fill=RED)
    return ToolContext([image])


def test_measure_gives_the_distance_and_direction_between_two_regions():
    text = run("measure", squares(), ids=[1, 2], colour="green").text
    assert text.splitlines() == [
        "measured in image 0's original pixels; angles in degrees counter-clockwise from +x (right)",
        "id 1: green square, area 100 px, box [20, 30, 30, 40], centre (25.0, 35.0), length 10.0 px, width 10.0 px, "
        "long side at 0.0 deg",
        "id 2: green square, area 100 px, box [60, 60, 70, 70], centre (65.0, 65.0), length 10.0 px, width 10.0 px, "
        "long side at 0.0 deg",
        "id 1 -> id 2: distance 50.0 px, direction -36.9 deg",  # (40, 30 down): 3-4-5
    ]


def test_measure_gives_the_length_and_angle_of_a_long_region():
    text = run("measure", squares(), ids=[1, 2], colour="red").text
    assert "id 1: red rectangle, area 400 px, box [100, 10, 140, 20], centre (120.0, 15.0), length 40.0 px, " \
           "width 10.0 px, long side at 0.0 deg" in text
    assert "id 2: red rectangle, area 400 px, box [150, 50, 160, 90], centre (155.0, 70.0), length 40.0 px, " \
           "width 10.0 px, long side at 90.0 deg" in text


def test_measure_gives_a_box_its_numbers_and_mixes_ids_and_boxes():
    text = run("measure", squares(), boxes=[[0, 0, 30, 40]], ids=[2], colour="green").text
    assert "box 2: box [0, 0, 30, 40], width 30 px, height 40 px, area 1200 px, diagonal 50.0 px, centre (15.0, 20.0)" in text
    assert "id 2 -> box 2: distance 67.3 px, direction 138.0 deg" in text  # (-50, 45 up) from (65, 65) to (15, 20)
    assert run("measure", squares(), boxes=[0, 0, 30, 40]).text.splitlines()[1].startswith("box 1: box [0, 0, 30, 40]")


def test_measure_without_ids_or_boxes_gives_the_area_statistics():
    text = run("measure", squares(), colour="green").text
    assert text == "2 green regions in box [0, 0, 200, 150]: total area 200 px, smallest 100 px, median 100 px, largest 100 px"
    areas = sorted(r[4] for r in rows(run("find_objects", ToolContext([scene()])).text))
    assert run("measure", ToolContext([scene()])).text == (
        f"5 regions in box [0, 0, 448, 448]: total area {sum(areas)} px, smallest {areas[0]} px, median {areas[2]} px, "
        f"largest {areas[-1]} px")


# --------------------------------------------------------------------------- bad inputs


BAD = [
    ("find_objects", {"box": [500, 500, 600, 600]}, "box [500, 500, 600, 600] is empty inside the 448x448 image"),
    ("find_objects", {"box": [30, 30, 20, 40]}, "it needs x2 > x1 and y2 > y1"),
    ("find_objects", {"box": [0, 0, float("nan"), 10]}, "box must be 4 numbers [x1, y1, x2, y2]; got nan in it"),
    ("find_objects", {"box": [0, 0, 10]}, "box must be 4 numbers"),
    ("find_objects", {"colour": "magenta"}, "unknown colour 'magenta'; known colours: red, green, blue, yellow, "
                                            "purple, orange, black, white, grey"),
    ("find_objects", {"colour": 3}, "colour must be a colour's name, one of red, green"),
    ("find_objects", {"shape": "hexagon"}, "shape must be one of circle, square, rectangle, triangle, other; got 'hexagon'"),
    ("find_objects", {"shape": 4}, "shape must be one of"),
    ("find_objects", {"image": 1}, "image must be a whole number from 0 to 0 (the example has 1 image); got 1"),
    ("find_objects", {"image": True}, "image must be a whole number"),
    ("measure", {"ids": [9]}, "id 9 is not among the 5 regions find_objects lists with these arguments"),
    ("measure", {"ids": ["1"]}, "id '1' is not among the 5 regions"),
    ("measure", {"ids": [], "boxes": []}, "give ids (from find_objects) or boxes"),
    ("measure", {"boxes": [[0, 0, float("inf"), 1]]}, "box must be 4 numbers [x1, y1, x2, y2]; got inf in it"),
    ("measure", {"boxes": [[0, 0, 1, 1]] * 9}, "measure takes at most 8 ids and boxes together; got 9"),
    ("measure", {"colour": "magenta"}, "unknown colour 'magenta'"),
    ("measure", {"boxes": [[0, 0, 5, 5]], "colour": 7}, "colour must be a colour's name"),
    ("measure", {"boxes": [[0, 0, 5, 5]], "box": [0, 0, float("nan"), 1]}, "got nan in it"),
    ("measure", {"image": -1}, "image must be a whole number from 0 to 0"),
]


@pytest.mark.parametrize("name, arguments, message", BAD)
def test_a_bad_input_is_an_error_turn_never_a_crash(name, arguments, message):
    result = run(name, ToolContext([scene()]), **arguments)
    assert result.error == "bad_arguments"
    assert result.text.startswith(f"error: bad arguments for {name}: ") and message in result.text, result.text
    assert "\n" not in result.text and result.images == []


def test_a_nan_the_model_writes_in_json_is_an_error_turn():
    call = parse_tool_call('<tool_call>{"name": "find_objects", "arguments": {"box": [NaN, 0, 10, 10]}}</tool_call>')
    result = run_tool(call, TOOLS, ToolContext([scene()]), ToolLimits())
    assert (result.error, result.text) == ("bad_arguments", "error: bad arguments for find_objects: box must be 4 "
                                                            "numbers [x1, y1, x2, y2]; got nan in it")


def test_an_unknown_argument_is_refused_before_the_call():
    result = run("find_objects", ToolContext([scene()]), color="blue", size=3)
    assert result.error == "bad_arguments" and "unexpected keyword argument" in result.text


# --------------------------------------------------------------------------- agreement with the rest


def test_the_palette_holds_the_colours_the_shape_tasks_draw_with():
    assert {name: PALETTE[name] for name in RGB} == RGB


def test_the_tools_are_built_in_and_run_in_the_process():
    assert BUILTIN_TOOLS["find_objects"] is find_objects and BUILTIN_TOOLS["measure"] is measure
