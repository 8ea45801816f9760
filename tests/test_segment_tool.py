"""The model tool `segment` (tools/segment_tool.py, models/segment_model.py) on the tiny SAM built offline.

The tiny SAM is built so that its answer is known (segment_model.py's docstring): its mask is the patches
brighter than the processor's mean colour, whatever the prompt, the padding counting as dark, and its
predicted IoU is 0.9 for a box prompt, 0.8 for a point alone. So a white rectangle on black, on the patch
grid of the resized image, is its own mask: the mask mapped back through the processor's resize and pad is
predicted in the original's pixels for wide and tall images (a mapping that kept the pad would squash it).
Also: one batch equal to one call at a time with each image encoded once, the cache equal to no cache, bad
arguments and a failing model as error turns, other folders refused in one line."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from PIL import Image

from vlmrl.errors import VlmrlError
from vlmrl.tools import ToolCall, ToolContext, ToolLimits, resolve_tools, run_tool
from vlmrl.tools import model_tools
from vlmrl.tools.image_tools import fit_side
from vlmrl.tools.model_tools import tool_model_folder
from vlmrl.tools.segment_tool import TINT, SegmentTool

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def sam_dir(tmp_path_factory) -> str:
    """The tiny SAM, built once through the command line."""
    from vlmrl.cli import main

    out = tmp_path_factory.mktemp("tool") / "sam"
    assert main(["tiny-model", str(out), "--tool", "segment"]) in (0, None)
    return str(out)


@pytest.fixture
def segment(sam_dir):
    return resolve_tools(["segment", "zoom"], {"segment": sam_dir})


def run(tools, picture: Image.Image, **arguments):
    return run_tool(ToolCall("segment", arguments), tools, ToolContext([picture]), ToolLimits())


def rectangle(size: tuple[int, int], box: tuple[int, int, int, int]) -> Image.Image:
    """A white `box` on a black image of `size`."""
    image = Image.new("RGB", size, (0, 0, 0))
    image.paste((255, 255, 255), box)
    return image


# --------------------------------------------------------------------------- the mask in the original's pixels


@pytest.mark.parametrize("size, box", [((200, 100), (50, 25, 100, 50)),  # padded below: 64 x 32 in a 64 square
                                       ((100, 200), (25, 50, 50, 100)),  # padded on the right
                                       ((150, 90), (0, 0, 150, 90))])  # all white: the whole image
def test_the_mask_is_the_white_rectangle_in_the_originals_pixels(segment, sam_dir, size, box):
    image = rectangle(size, box)
    width, height = box[2] - box[0], box[3] - box[1]
    result = run(segment, image, box=[0, 0, 40, 40])
    assert result.error is None, result.text
    text = result.text
    assert text.startswith(f"mask for box [0, 0, 40, 40] of image 0 ({size[0]}x{size[1]}): area ")
    assert f"box {list(box)}, score 0.90 (the model's predicted IoU)" in text and "\n" not in text
    area = int(text.split("area ")[1].split(" ")[0])
    # bilinear upsampling rounds the rectangle's corners by a few pixels each; its edges are exact
    assert 0.97 * width * height <= area <= width * height
    [(mask, score)] = model_tools.loaded_model("segment", tool_model_folder("segment", sam_dir)).run([image], [(None, (1.0, 1.0))])
    assert mask.shape == (size[1], size[0]) and math.isclose(score, 0.8, abs_tol=1e-6)
    assert not mask[:box[1]].any() and not mask[box[3]:].any() and not mask[:, :box[0]].any() and not mask[:, box[2]:].any()
    inner = mask[box[1] + 3:box[3] - 3, box[0] + 3:box[2] - 3]
    assert inner.all() and mask.sum() == area
    overlay = result.images[0]
    assert overlay.size == fit_side(*size, 448)
    centre = overlay.getpixel((overlay.width * (box[0] + box[2]) // (2 * size[0]),
                               overlay.height * (box[1] + box[3]) // (2 * size[1])))
    assert all(abs(v - (0.5 * 255 + 0.5 * c)) <= 1 for v, c in zip(centre, TINT))  # white, tinted half-way
    corner = overlay.getpixel((overlay.width - 1, overlay.height - 1))  # black, outside the mask: untouched
    assert corner == (0, 0, 0) or box == (0, 0, *size)


def test_a_point_and_a_box_together_and_a_point_alone(segment):
    image = rectangle((200, 100), (50, 25, 100, 50))
    both = run(segment, image, box=[40.4, 20, 110, 60], point=[75, 37.5], image=0)
    assert both.error is None and both.text.startswith("mask for box [40, 20, 110, 60] and point [75.0, 37.5] of image 0")
    alone = run(segment, image, point=[75, 37])
    assert "box [50, 25, 100, 50], score 0.80" in alone.text  # three masks: the best predicted IoU kept


# --------------------------------------------------------------------------- batching, cache


def test_one_batch_equals_one_call_at_a_time_and_encodes_each_image_once(sam_dir, monkeypatch):
    segmenter = model_tools.loaded_model("segment", tool_model_folder("segment", sam_dir))
    rng = np.random.default_rng(0)
    a, b = (Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in ((120, 70), (60, 110)))
    crops = [a, a.copy(), b, a]
    args = [((10, 5, 80, 60), None), (None, (30.0, 40.0)), ((0, 0, 60, 50), (20.0, 20.0)), ((60, 0, 120, 70), None)]
    encoded = []
    real = segmenter.model.get_image_embeddings
    monkeypatch.setattr(segmenter.model, "get_image_embeddings",
                        lambda pixels: encoded.append(pixels.shape[0]) or real(pixels))
    together = segmenter.run(crops, args)
    assert encoded == [2]  # a and its copy share one pass of the vision encoder
    for crop, arg, (mask, score) in zip(crops, args, together):
        [(alone, alone_score)] = segmenter.run([crop], [arg])
        assert mask.shape == crop.size[::-1] and (mask == alone).all() and math.isclose(score, alone_score, abs_tol=1e-5)
    assert encoded == [2, 1, 1, 1, 1]


def test_the_cache_equals_no_cache_and_a_turn_is_one_forward(sam_dir):
    folder = tool_model_folder("segment", sam_dir)
    cached, uncached = SegmentTool(folder), SegmentTool(folder, cache_size=0)
    images = [rectangle((90, 60), (30, 15, 60, 45)), rectangle((60, 90), (0, 0, 30, 30))]
    calls = [(0, {"box": [0, 0, 45, 30]}), (0, {"point": [40, 30]}), (1, {"box": [0, 0, 45, 30]}),
             (0, {"box": [0, 0, 45, 30]}), (0, {"point": [40, 30], "box": [10, 10, 80, 50]})]
    cached.prefetch([(ToolContext([images[k].copy()]), arguments) for k, arguments in calls])
    assert (cached.forwards, cached.computed) == (1, 4)  # one forward for the turn's 4 distinct calls
    for k, arguments in calls:
        context = ToolContext([images[k].copy()])
        a, b = cached(context, **arguments), uncached(context, **arguments)
        assert a[0] == b[0] and a[1].tobytes() == b[1].tobytes()
    assert (cached.calls, cached.cache_hits, cached.forwards) == (5, 1, 1)
    assert (uncached.calls, uncached.cache_hits, uncached.forwards) == (5, 0, 5)


# --------------------------------------------------------------------------- bad inputs, a failing model


@pytest.mark.parametrize("arguments, words", [
    ({}, "segment needs a box [x1, y1, x2, y2] or a point [x, y]"),
    ({"box": [float("nan"), 0, 10, 10]}, "box must be 4 numbers"),
    ({"box": "[0, 0, 10, 10]"}, "box must be 4 numbers"),
    ({"box": [500, 500, 600, 600]}, "is empty inside"),
    ({"point": [70, 10]}, "point [70, 10] is outside the 64x48 image"),
    ({"point": [-1, 10]}, "is outside the 64x48 image"),
    ({"point": [float("inf"), 3]}, "point must be 2 numbers [x, y]"),
    ({"point": "centre"}, "point must be 2 numbers [x, y]"),
    ({"point": [True, 3]}, "point must be 2 numbers [x, y]"),
    ({"point": [1, 2, 3]}, "point must be 2 numbers [x, y]"),
    ({"box": [0, 0, 5, 5], "image": 2}, "image must be a whole number"),
    ({"query": "cat"}, "got an unexpected keyword argument 'query'"),
])
def test_bad_inputs_are_error_turns(segment, arguments, words):
    result = run(segment, Image.new("RGB", (64, 48)), **arguments)
    assert result.error == "bad_arguments" and words in result.text and "\n" not in result.text


class Failing:
    def run(self, images, args):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


class Empty:
    def run(self, images, args):
        return [(np.zeros(image.size[::-1], bool), 0.12) for image in images]


def test_a_model_that_raises_is_an_error_turn_and_an_empty_mask_is_an_answer(segment, sam_dir, monkeypatch):
    key = ("segment", str(tool_model_folder("segment", sam_dir)), None)
    monkeypatch.setitem(model_tools._LOADED, key, Failing())
    result = run(segment, Image.new("RGB", (64, 48)), point=[3, 4])
    assert result.error == "raised" and result.text.startswith("error: tool segment raised RuntimeError: CUDA out of")
    monkeypatch.setitem(model_tools._LOADED, key, Empty())
    result = run(segment, Image.new("RGB", (64, 48)), point=[3, 4])
    assert result.error is None and result.text == ("no mask for point [3.0, 4.0] of image 0 (64x48): the model's "
                                                     "mask is empty (score 0.12)")
    assert result.images[0].size == (448, 336)


def test_out_of_memory_in_the_vision_encoder_becomes_a_runtime_error(sam_dir, monkeypatch):
    from vlmrl.models.segment_model import Segmenter

    segmenter = Segmenter(tool_model_folder("segment", sam_dir), torch.device("cpu"))

    def oom(pixels):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(segmenter.model, "get_image_embeddings", oom)
    with pytest.raises(RuntimeError, match="the segmenter ran out of memory on cpu"):
        segmenter.run([Image.new("RGB", (32, 32))], [((0, 0, 8, 8), None)])


def test_folders_are_refused_in_one_line(sam_dir, tiny_model_dir, tmp_path):
    import shutil

    def refused(path) -> str:
        with pytest.raises(VlmrlError) as error:
            resolve_tools(["segment"], {"segment": path})
        assert "\n" not in str(error.value)
        return str(error.value)

    assert "holds a 'qwen2_5_vl' model; segment runs sam, sam_hq checkpoints" in refused(tiny_model_dir)
    assert "vlmrl tiny-model" in refused(str(tmp_path / "missing"))
    damaged = tmp_path / "damaged"
    shutil.copytree(sam_dir, damaged)
    (damaged / "preprocessor_config.json").unlink()
    assert "has no image processor (preprocessor_config.json)" in refused(str(damaged))
    assert json.loads((damaged / "vlmrl_tiny.json").read_text())["parameters"] < 100_000


def test_a_tiny_sam_hq_runs_through_the_tool(tmp_path):
    from vlmrl.models.tool_models import build_tiny_tool_model

    folder = build_tiny_tool_model(tmp_path / "hq", "segment", arch="sam_hq")
    tools = resolve_tools(["segment"], {"segment": str(folder)})
    result = run(tools, Image.new("RGB", (170, 90), (200, 40, 40)), box=[10, 10, 60, 50])
    assert result.error is None and result.text.startswith("mask for box [10, 10, 60, 50] of image 0 (170x90)")
    [(mask, _)] = model_tools.loaded_model("segment", folder).run([Image.new("RGB", (170, 90))], [(None, (5.0, 5.0))])
    assert mask.shape == (90, 170) and mask.dtype == bool


def test_the_preflight_counts_the_segmenters_weights(sam_dir):
    """The preflight and `vlmrl check` count a listed model tool's float32 weights in each process's peak, read
    from its safetensors headers (tool_model_bytes): the SAM's parameters, 4 bytes each; nothing when
    rollout.tools does not list it."""
    from vlmrl.models.tool_models import check_tool_models, tool_model_bytes

    folder = tool_model_folder("segment", sam_dir)
    weights = 4 * sum(p.numel() for p in model_tools.loaded_model("segment", folder).model.parameters())
    assert weights == 4 * json.loads((folder / "vlmrl_tiny.json").read_text())["parameters"]
    assert tool_model_bytes(["zoom", "segment"], {"segment": sam_dir}) == weights
    assert tool_model_bytes(["zoom"], {"segment": sam_dir}) == 0
    check_tool_models(resolve_tools(["segment"], {"segment": sam_dir}))  # whole safetensors: passes
