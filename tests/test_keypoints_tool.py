"""The `keypoints` model tool (tools/keypoints_tool.py, models/keypoint_model.py) on tiny ViTPose and SuperPoint
builds made offline.

The tiny ViTPose's first three keypoints (Nose, L_Eye, R_Eye) find the reddest, greenest and bluest patch of
what it sees, and the other 14 never score: coloured squares drawn at known places of an image are found
there, in the original image's pixels, through the box's widening to the input's aspect, its enlargement and
the warp, for wide and tall boxes (as exact as the model's patch). The warp and its inverse also equal the
processor's own functions. The tiny SuperPoint puts one point in each bright 8 x 8 cell of its input, at a
known place: its points in the original are known through the resize of non-square boxes. Also: batching
equal to one call at a time, the cache equal to no cache, bad arguments and a failing model as error turns,
a folder of another kind refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, ImageDraw

torch = pytest.importorskip("torch")

from vlmrl.models import keypoint_model  # noqa: E402
from vlmrl.models.keypoint_model import COCO_KEYPOINTS, SUPERPOINT_CELL, TINY_SUPERPOINT, decode_heatmaps  # noqa: E402

COLOURS = {"Nose": (255, 0, 0), "L_Eye": (0, 255, 0), "R_Eye": (0, 0, 255)}
"""The colour each of the tiny ViTPose's three live keypoints finds."""


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """The tiny ViTPose and SuperPoint, built once, and their runners on the CPU."""
    out = {}
    for arch in keypoint_model.ARCHES:
        folder = tmp_path_factory.mktemp("keypoints") / arch
        folder.mkdir()
        keypoint_model.build_tiny(folder, arch, 0)
        out[arch] = (str(folder), keypoint_model.RUNNER(folder, torch.device("cpu")))
    return out


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
