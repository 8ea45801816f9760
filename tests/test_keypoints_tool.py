"""The `keypoints` model tool (tools/keypoints_tool.py, models/keypoint_model.py) on tiny ViTPose and SuperPoint
builds made offline.

The tiny ViTPose's first three keypoints (Nose, L_Eye, R_Eye) find the reddest, greenest and bluest patch of
what it sees, and the other 14 never score: coloured squares drawn at known places of an image are found
there, in the original image's pixels, through the box's widening to the input's aspect, its enlargement and
the warp, for wide and tall boxes (as exact as the model's patch). The warp and its inverse also equal the
processor's own functions. The tiny SuperPoint puts one point in each bright 8 x 8 cell of its input, at a
known place: its points in the original are known through the resize of non-square boxes. Also: batching
equal to one call at a time, the cache equal to no cache, bad arguments and a failing model as error turns,
a folder of another kind refused in one line, the preflight's count of its weights."""

from __future__ import annotations

import json
import math
import re
import shutil

import numpy as np
import pytest
from PIL import Image, ImageDraw

from vlmrl.errors import VlmrlError
from vlmrl.tools import ToolCall, ToolContext, ToolLimits, resolve_tools, run_tool
from vlmrl.tools import model_tools
from vlmrl.tools.keypoints_tool import KeypointsTool
from vlmrl.tools.model_tools import tool_model_folder

torch = pytest.importorskip("torch")

from vlmrl.models import keypoint_model  # noqa: E402
from vlmrl.models.keypoint_model import (COCO_KEYPOINTS, SUPERPOINT_CELL, TINY_SUPERPOINT, Points,  # noqa: E402
                                         decode_heatmaps)

COLOURS = {"Nose": (255, 0, 0), "L_Eye": (0, 255, 0), "R_Eye": (0, 0, 255)}
"""The colour each of the tiny ViTPose's three live keypoints finds."""


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """The tiny ViTPose (the default) and SuperPoint, built once through the command line, and their runners as
    the tool loads them (once per process)."""
    from vlmrl.cli import main

    out = {}
    for arch, extra in (("vitpose", []), ("superpoint", ["--arch", "superpoint"])):
        folder = tmp_path_factory.mktemp("keypoints") / arch
        assert main(["tiny-model", str(folder), "--tool", "keypoints", *extra]) in (0, None)
        assert json.loads((folder / "vlmrl_tiny.json").read_text())["arch"] == arch
        out[arch] = (str(folder), model_tools.loaded_model("keypoints", tool_model_folder("keypoints", str(folder))))
    return out


def run(tools, picture: Image.Image, **arguments):
    return run_tool(ToolCall("keypoints", arguments), tools, ToolContext([picture]), ToolLimits())


def listed(text: str) -> list[tuple[str, int, int, float]]:
    """(name, x, y, score) of each point line of keypoints' text, every line checked for its format."""
    rows = []
    for n, line in enumerate(text.splitlines()[1:], 1):
        match = re.fullmatch(rf"{n} (\S+) x (\d+) y (\d+) score (\d\.\d\d)", line)
        assert match, line
        rows.append((match[1], int(match[2]), int(match[3]), float(match[4])))
    return rows


def scene(size: tuple[int, int], squares: dict[str, tuple[int, int]], side: int = 12) -> tuple[Image.Image, dict]:
    """A black image of `size` with a `side`-pixel square of each keypoint's colour at its top-left corner, and
    each square's centre (pixel-centre coordinates)."""
    image = Image.new("RGB", size)
    draw = ImageDraw.Draw(image)
    centres = {}
    for name, (x, y) in squares.items():
        draw.rectangle((x, y, x + side - 1, y + side - 1), fill=COLOURS[name])
        centres[name] = (x + (side - 1) / 2, y + (side - 1) / 2)
    return image, centres


def patch_pixels(runner, box) -> float:
    """Original pixels per 8-pixel patch of the input ViTPose sees for `box`."""
    _, extent = runner.region(box)
    return float(8 * extent[0] / (runner.size[0] - 1))


# --------------------------------------------------------------------------- the model side


@pytest.mark.parametrize("box, squares, side", [
    ((20, 30, 140, 80), {"Nose": (30, 36), "L_Eye": (112, 56), "R_Eye": (70, 40)}, 24),  # wide: 12.6 px a patch
    ((60, 4, 100, 116), {"Nose": (64, 10), "L_Eye": (84, 96), "R_Eye": (70, 56)}, 12),  # tall: 8.8 px a patch
])
def test_vitpose_finds_each_colour_in_the_originals_pixels_through_the_box(models, box, squares, side):
    _, runner = models["vitpose"]
    image, centres = scene((160, 120), squares, side)
    [points] = runner.run([image], [(box,)])
    assert points.names == COCO_KEYPOINTS and len(points.edges) == 19
    tolerance = patch_pixels(runner, box) / 2 + 1
    for k, name in enumerate(("Nose", "L_Eye", "R_Eye")):
        assert np.abs(points.xy[k] - centres[name]).max() <= tolerance, (name, points.xy[k], centres[name])
        assert 0.5 < points.scores[k] < 0.875  # 0.873: a patch wholly of its colour
    assert (points.scores[3:] == -1).all()  # the 14 others never score


def test_vitpose_batched_equals_one_call_at_a_time(models):
    _, runner = models["vitpose"]
    first, _ = scene((160, 120), {"Nose": (30, 36), "L_Eye": (118, 62), "R_Eye": (74, 40)})
    second, _ = scene((90, 140), {"Nose": (10, 100), "L_Eye": (50, 20), "R_Eye": (60, 70)})
    calls = [(first, ((20, 30, 140, 80),)), (second, (None,)), (first, ((0, 0, 50, 120),))]
    together = runner.run([c for c, _ in calls], [a for _, a in calls])
    for (crop, args), batched in zip(calls, together):
        [alone] = runner.run([crop], [args])
        np.testing.assert_allclose(batched.xy, alone.xy, atol=1e-4)
        np.testing.assert_allclose(batched.scores, alone.scores, atol=1e-5)


def test_the_warp_and_the_way_back_are_the_processors():
    from transformers.models.vitpose.image_processing_pil_vitpose import (box_to_center_and_scale, get_warp_matrix,
                                                                          transform_preds)

    runner = keypoint_model.KeypointModel.__new__(keypoint_model.KeypointModel)
    runner.size, runner.rescale = (48, 64), 1.0
    runner.mean, runner.std = np.zeros(3, np.float32), np.ones(3, np.float32)
    for box in ((10, 20, 50, 40), (5, 5, 25, 95), (0, 0, 64, 48)):
        x1, y1, x2, y2 = box
        # the processor's box is COCO (x, y, w, h) with its centre read as a pixel centre: half a pixel up-left
        centre, scale = box_to_center_and_scale((x1 - 0.5, y1 - 0.5, x2 - x1, y2 - y1), 48, 64)
        mine_centre, extent = runner.region(box)
        np.testing.assert_allclose(mine_centre, centre, atol=1e-4)
        np.testing.assert_allclose(extent, scale * 200, rtol=1e-5)
        heat = np.array([[0.0, 0.0], [3.0, 7.0], [11.0, 15.0]])  # heatmap pixels of a 12 x 16 map
        theirs = transform_preds(heat, centre, scale, [16, 12])
        mine = mine_centre - extent / 2 + heat * extent / (np.array([12, 16]) - 1)
        np.testing.assert_allclose(mine, theirs, atol=1e-3)
        # one white pixel lands where the processor's warp matrix sends it
        matrix = get_warp_matrix(0, centre * 2.0, np.array([48, 64]) - 1.0, scale * 200)
        source = (round(centre[0]) + 2, round(centre[1]) - 3)
        image = Image.new("L", (100, 100))
        image.putpixel(source, 255)
        warped = runner.warped(image.convert("RGB"), box)[0]  # (H, W)
        row, column = np.unravel_index(warped.argmax(), warped.shape)
        expected = matrix @ np.array([*source, 1.0])
        assert abs(column - expected[0]) <= 0.5 + 1e-6 and abs(row - expected[1]) <= 0.5 + 1e-6


def test_heatmaps_decode_to_the_peak_of_a_gaussian_with_subpixel_precision():
    ys, xs = np.mgrid[0:16, 0:12]
    maps = np.stack([np.exp(-((xs - cx) ** 2 + (ys - cy) ** 2) / (2 * 2.0 ** 2)) * peak
                     for cx, cy, peak in ((4.3, 9.6, 0.9), (7.0, 3.0, 0.5))])[None]  # (1, 2, 16, 12)
    flat = np.full((1, 1, 16, 12), -1.0)
    coords, scores = decode_heatmaps(np.concatenate([maps, flat], axis=1))
    np.testing.assert_allclose(coords[0, :2], [[4.3, 9.6], [7.0, 3.0]], atol=0.05)
    assert scores[0, 0] == pytest.approx(maps[0, 0].max()) and scores[0, 1] == pytest.approx(0.5)
    assert coords[0, 2].tolist() == [0.0, 0.0] and scores[0, 2] == -1.0  # a flat map: no step


def superpoint_grid(box: tuple[int, int, int, int]) -> set[tuple[float, float]]:
    """Where the tiny SuperPoint's candidates of `box` lie in the original: each cell's (column 5, row 3) of the
    resized input, pixel centres mapped back through the resize; the model drops those within 4 pixels of
    its input's border."""
    height, width = TINY_SUPERPOINT
    sx, sy = (box[2] - box[0]) / width, (box[3] - box[1]) / height
    out = set()
    for cx in range(SUPERPOINT_CELL[0], width, 8):
        for cy in range(SUPERPOINT_CELL[1], height, 8):
            if 4 <= cx < width - 4 and 4 <= cy < height - 4:
                out.add((round(box[0] + (cx + 0.5) * sx - 0.5, 3), round(box[1] + (cy + 0.5) * sy - 0.5, 3)))
    return out


def test_superpoint_points_are_in_the_bright_cells_mapped_back_through_the_resize(models):
    _, runner = models["superpoint"]
    image = Image.new("RGB", (200, 100))
    ImageDraw.Draw(image).rectangle((60, 30, 119, 69), fill=(255, 255, 255))  # a white 60 x 40 block
    for box in ((0, 0, 200, 100), (40, 20, 140, 90)):
        [points] = runner.run([image], [(box,)])
        found = {(round(x, 3), round(y, 3)) for x, y in points.xy}
        assert found and found <= superpoint_grid(box)
        assert points.names == (None,) * len(found) and points.edges == ()
        assert np.all(points.scores > 0.5)
        # every point sits within one cell of the white block; cells wholly in the black have none
        cell = 8 * max((box[2] - box[0]) / TINY_SUPERPOINT[1], (box[3] - box[1]) / TINY_SUPERPOINT[0])
        for x, y in found:
            assert 60 - cell <= x <= 119 + cell and 30 - cell <= y <= 69 + cell


# --------------------------------------------------------------------------- the tool


@pytest.mark.parametrize("box, squares, side, size", [
    ([20, 30, 140, 80], {"Nose": (30, 36), "L_Eye": (112, 56), "R_Eye": (70, 40)}, 24, (200, 120)),
    ([60, 4, 100, 116], {"Nose": (64, 10), "L_Eye": (84, 96), "R_Eye": (70, 56)}, 12, (160, 120)),
])
def test_keypoints_lists_the_points_in_the_original_images_pixels(models, box, squares, side, size):
    folder, runner = models["vitpose"]
    tools = resolve_tools(["keypoints"], {"keypoints": folder})
    image, centres = scene(size, squares, side)
    # a larger red square beyond what the model sees of the box: a call that read the whole image would find it
    ImageDraw.Draw(image).rectangle((size[0] - 28, 90, size[0] - 1, 117), fill=COLOURS["Nose"])
    result = run(tools, image, box=box)
    assert result.error is None, result.text
    head, *_ = result.text.splitlines()
    assert head.startswith(f"3 keypoints in box {box} of image 0 ({size[0]}x{size[1]}); x, y: the pixel's column")
    rows = listed(result.text)
    assert sorted(name for name, *_ in rows) == ["L_Eye", "Nose", "R_Eye"]  # the 14 others never score
    assert [score for *_, score in rows] == sorted((score for *_, score in rows), reverse=True)
    tolerance = patch_pixels(runner, tuple(box)) / 2 + 1.5  # rounded to the pixel
    for name, x, y, score in rows:
        assert max(abs(x - centres[name][0]), abs(y - centres[name][1])) <= tolerance, (name, x, y)
        assert score > 0.5
    [overlay] = result.images
    assert max(overlay.size) == ToolContext([image]).max_side


def test_superpoint_through_the_tool_lists_its_grid_points_as_pixels(models):
    folder, _ = models["superpoint"]
    tools = resolve_tools(["keypoints"], {"keypoints": folder})
    image = Image.new("RGB", (200, 100))
    ImageDraw.Draw(image).rectangle((60, 30, 119, 69), fill=(255, 255, 255))
    result = run(tools, image, box=[40, 20, 140, 90])
    rows = listed(result.text)
    expected = {(math.floor(x + 0.5), math.floor(y + 0.5)) for x, y in superpoint_grid((40, 20, 140, 90))}
    assert rows and {(x, y) for _, x, y, _ in rows} <= expected
    assert {name for name, *_ in rows} == {"point"}


def test_a_turns_calls_in_one_forward_equal_one_at_a_time_and_the_cache_equals_no_cache(models, monkeypatch):
    folder = tool_model_folder("keypoints", models["vitpose"][0])
    first, _ = scene((160, 120), {"Nose": (30, 36), "L_Eye": (112, 56), "R_Eye": (70, 40)}, 16)
    second, _ = scene((90, 140), {"Nose": (10, 100), "L_Eye": (50, 20), "R_Eye": (60, 70)}, 16)
    calls = [(first, {"box": [20, 30, 140, 80]}), (second, {}), (first, {"box": [20, 30, 140, 80]}),
             (first, {"box": [0, 0, 80, 120]}), (second, {"box": [0, 60, 90, 140]})]
    batched, alone = KeypointsTool(folder), KeypointsTool(folder, cache_size=0)
    runner = model_tools.loaded_model("keypoints", folder)
    sizes = []
    monkeypatch.setattr(runner, "run", lambda crops, args, real=runner.run: sizes.append(len(crops)) or real(crops, args))
    batched.prefetch([(ToolContext([image.copy()]), arguments) for image, arguments in calls])
    assert sizes == [4]  # one forward for the four distinct calls
    for image, arguments in calls:
        a = batched(ToolContext([image.copy()]), **arguments)  # the same content in another object: from the cache
        b = alone(ToolContext([image]), **arguments)
        assert a[0] == b[0] and a[1].tobytes() == b[1].tobytes()
    assert sizes == [4] + [1] * 5 and batched.forwards == 1 and alone.forwards == 5
    assert (batched.calls, batched.computed, batched.cache_hits) == (5, 4, 1) and alone.cache_hits == 0


@pytest.mark.parametrize("arguments, words", [
    ({"box": [float("nan"), 0, 10, 10]}, "box must be 4 numbers"),
    ({"box": [500, 500, 600, 600]}, "is empty inside"),
    ({"box": 5}, "box must be 4 numbers"),
    ({"box": "the person"}, "box must be 4 numbers"),
    ({"image": 2}, "image must be a whole number"),
    ({"query": "person"}, "unexpected keyword argument 'query'"),
])
def test_bad_arguments_are_error_turns(models, arguments, words):
    tools = resolve_tools(["keypoints"], {"keypoints": models["vitpose"][0]})
    result = run(tools, Image.new("RGB", (64, 48)), **arguments)
    assert result.error == "bad_arguments" and words in result.text and "\n" not in result.text


class Failing:
    def run(self, crops, args):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


class Blind:
    def run(self, crops, args):
        return [Points(np.zeros((17, 2)), np.zeros(17), COCO_KEYPOINTS, ()) for _ in crops]


def test_a_model_that_raises_is_an_error_turn_and_nothing_found_is_an_answer(models, monkeypatch):
    folder = models["vitpose"][0]
    tools = resolve_tools(["keypoints"], {"keypoints": folder})
    key = ("keypoints", str(tool_model_folder("keypoints", folder)), None)
    monkeypatch.setitem(model_tools._LOADED, key, Failing())
    result = run(tools, Image.new("RGB", (64, 48)))
    assert result.error == "raised" and result.text.startswith("error: tool keypoints raised RuntimeError: CUDA out of")
    monkeypatch.setitem(model_tools._LOADED, key, Blind())
    result = run(tools, Image.new("RGB", (64, 48)), box=[8, 8, 40, 40])
    assert result.error is None and result.text == ("no keypoints found in box [8, 8, 40, 40] of image 0 (64x48) "
                                                    "(nothing scored above 0.3)")
    assert result.images[0].size == (448, 448)  # the box, as zoom shows it


def test_out_of_memory_in_the_forward_becomes_a_runtime_error(models, monkeypatch):
    runner = keypoint_model.KeypointModel(tool_model_folder("keypoints", models["vitpose"][0]), torch.device("cpu"))

    def oom(**inputs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(runner, "model", oom)
    with pytest.raises(RuntimeError, match="the keypoints model ran out of memory on cpu"):
        runner.run([Image.new("RGB", (32, 32))], [(None,)])


def test_folders_of_another_kind_or_missing_are_refused_in_one_line(models, tmp_path):
    def refused(path) -> str:
        with pytest.raises(VlmrlError) as error:
            resolve_tools(["keypoints"], {"keypoints": path})
        assert "\n" not in str(error.value)
        return str(error.value)

    other = tmp_path / "other"
    shutil.copytree(models["vitpose"][0], other)
    (other / "config.json").write_text(json.dumps({"model_type": "owlv2"}))
    assert "holds a 'owlv2' model; keypoints runs vitpose, superpoint checkpoints" in refused(str(other))
    assert "vlmrl tiny-model" in refused(str(tmp_path / "missing"))
    (other / "config.json").write_text(json.dumps({"model_type": "vitpose"}))
    (other / "preprocessor_config.json").unlink()
    assert "image processor (preprocessor_config.json)" in refused(str(other))


def test_the_preflight_counts_the_keypoints_models_weights(models):
    from vlmrl.models.tool_models import check_tool_models, tool_model_bytes

    for arch, (folder, _) in models.items():
        parameters = json.loads((tool_model_folder("keypoints", folder) / "vlmrl_tiny.json").read_text())["parameters"]
        assert tool_model_bytes(["zoom", "keypoints"], {"keypoints": folder}) == 4 * parameters
        check_tool_models(resolve_tools(["keypoints"], {"keypoints": folder}))  # whole safetensors: passes
