"""The `depth` model tool (tools/depth_tool.py, models/depth_model.py) on tiny builds whose depth is a known
function of the pixels: depth = 1 + 2 x brightness wherever the image is uniform over a couple of patches
(`tiny_depth`), smoothed at the patch scale at an edge; relative inverse depth, so brighter is nearer.
So a uniform image's map is a predicted constant in the crop's own pixels for every processor's resize
and pad (Depth Anything: aspect kept, multiples of 14; DPT: stretched to a square; DPT on DINOv2:
padded), an edge stays where it is in the original, and the pad is cut off exactly (by hand). Also: the
maps equal transformers' own post-processing, one batched forward equals one crop at a time, a model out
of memory raises. The tool: its grid, points, regions and coloured map in the original's pixels for
non-square images and boxes, bad arguments and a failing model as error turns, a flat and a metric map,
the cache equal to no cache, a turn's calls in one forward, folders of another kind refused in one line."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from PIL import Image

from vlmrl.errors import VlmrlError
from vlmrl.tools import ToolCall, ToolContext, ToolLimits, model_tools, resolve_tools, run_tool
from vlmrl.tools.depth_tool import DepthTool
from vlmrl.tools.image_tools import fit_side

torch = pytest.importorskip("torch")

from vlmrl.models import depth_model  # noqa: E402
from vlmrl.models.depth_model import DepthRunner, input_geometry, original_depth, tiny_depth  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """Each tiny depth architecture, built once (the default one through the command line), by arch."""
    from vlmrl.cli import main
    from vlmrl.models.tool_models import build_tiny_tool_model

    out = {}
    for arch in depth_model.ARCHES:
        if arch == depth_model.ARCHES[0]:
            out[arch] = tmp_path_factory.mktemp("depth") / arch
            assert main(["tiny-model", str(out[arch]), "--tool", "depth"]) in (0, None)
        else:
            out[arch] = build_tiny_tool_model(tmp_path_factory.mktemp("depth") / arch, "depth", arch=arch)
    return out


@pytest.fixture(scope="module")
def builds(folders) -> dict:
    """Each tiny depth architecture's runner on the CPU."""
    runners = {}
    for arch, out in folders.items():
        info = json.loads((out / "vlmrl_tiny.json").read_text())
        assert info["tool"] == "depth" and info["arch"] == arch and 20_000 < info["parameters"] < 100_000
        runners[arch] = DepthRunner(out, torch.device("cpu"))
    return runners


def two_tone(width: int, height: int, split: int, vertical: bool = True) -> Image.Image:
    """Black before `split` (a column, or a row when not `vertical`), white from it on."""
    pixels = np.zeros((height, width, 3), np.uint8)
    if vertical:
        pixels[:, split:] = 255
    else:
        pixels[split:] = 255
    return Image.fromarray(pixels)


# --------------------------------------------------------------------------- the mapping by hand


def test_the_pad_is_cut_off_and_the_rest_resized_to_the_crop():
    """A 100x60 crop padded to 112x70 (6 left, 5 on top): a prediction of 1 over the image and 0 over the pad
    comes back as 1 everywhere, at the input's resolution and at twice it (the DPT head's)."""
    geometry = ((100, 60), (112, 70), (6, 5))
    for scale in (1, 2):
        predicted = torch.zeros(70 * scale, 112 * scale)
        predicted[5 * scale:65 * scale, 6 * scale:106 * scale] = 1.0
        depth = original_depth(predicted, geometry, 14, 100, 60)
        assert depth.shape == (60, 100)
        np.testing.assert_allclose(depth.numpy(), 1.0, atol=1e-6)
    # nothing padded: straight to the crop's size, as transformers' post-processing does
    predicted = torch.arange(12.0).reshape(3, 4)
    expected = torch.nn.functional.interpolate(predicted[None, None], size=(30, 50), mode="bicubic")[0, 0]
    np.testing.assert_allclose(original_depth(predicted, ((56, 42), (56, 42), (0, 0)), 14, 50, 30), expected)


def test_input_geometry_is_the_processors(builds):
    """The geometry the maps are undone through is what each processor makes of an image."""
    cases = {"depth-anything": ((90, 150), ((56, 98), (56, 98), (0, 0))),  # fit the width: 56 x 93.3 -> 98 (x14)
             "dpt": ((90, 150), ((64, 64), (64, 64), (0, 0))),
             "dpt-dinov2": ((100, 60), ((100, 60), (112, 70), (6, 5)))}
    for arch, (size, geometry) in cases.items():
        runner = builds[arch]
        assert input_geometry(*size, runner.processor) == geometry
        assert runner.pixels(Image.new("RGB", size)).shape == (3, geometry[1][1], geometry[1][0])
    # Depth-Anything-V2-Small-hf's settings: 640x480 -> the short side to 518, the long one to a multiple of 14
    from transformers.models.dpt.image_processing_pil_dpt import DPTImageProcessorPil

    v2 = DPTImageProcessorPil(size={"height": 518, "width": 518}, keep_aspect_ratio=True, ensure_multiple_of=14)
    assert input_geometry(640, 480, v2) == ((686, 518), (686, 518), (0, 0))
    assert v2(images=[Image.new("RGB", (640, 480))], return_tensors="np")["pixel_values"].shape == (1, 3, 518, 686)


# --------------------------------------------------------------------------- the known depth


@pytest.mark.parametrize("arch", depth_model.ARCHES)
def test_a_uniform_crop_gets_the_known_depth_in_its_own_pixels(builds, arch):
    runner = builds[arch]
    sizes = [(280, 112), (84, 140)] + ([(98, 56)] if arch == "dpt-dinov2" else [(90, 150), (100, 60)])
    for size in sizes:  # dpt-dinov2: multiples of 14 (no pad, which would bleed grey into the border patches)
        for level in (0, 128, 255):
            [(depth, metric)] = runner.run([Image.new("RGB", size, (level, level, level))], [()])
            assert depth.shape == size[::-1] and depth.dtype == np.float32 and metric is False
            np.testing.assert_allclose(depth, tiny_depth(level / 255), atol=1e-4)
    assert tiny_depth(0.0) == 1.0 and tiny_depth(1.0) == 3.0


@pytest.mark.parametrize("arch", depth_model.ARCHES)
def test_an_edge_stays_where_it_is_in_the_original(builds, arch):
    """Black | white at column 140 of a 280x112 crop (and at row 90 of a 100x150 one, padded for dpt-dinov2): the
    map crosses the middle (depth 2) at the edge, within 10 pixels (under half a patch of these inputs, 14 to 35
    pixels of the original: the model smooths at the patch scale), and is 1 and 3 two patches away."""
    runner = builds[arch]
    [(depth, _)] = runner.run([two_tone(280, 112, 140)], [()])
    row = depth[56]
    assert abs(int(np.argmax(row > 2.0)) - 140) <= 10
    np.testing.assert_allclose(row[:70], 1.0, atol=0.01)
    np.testing.assert_allclose(row[230:], 3.0, atol=0.01)
    [(depth, _)] = runner.run([two_tone(100, 150, 90, vertical=False)], [()])
    column = depth[:, 50]
    assert depth.shape == (150, 100) and abs(int(np.argmax(column > 2.0)) - 90) <= 10


def test_the_maps_equal_transformers_own_post_processing(builds):
    """Where nothing is padded, the map is what `post_process_depth_estimation` makes of the same prediction."""
    runner = builds["depth-anything"]
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (70, 130, 3), dtype=np.uint8))
    [(depth, _)] = runner.run([image], [()])
    inputs = runner.processor(images=[image], return_tensors="pt")
    with torch.no_grad():
        outputs = runner.model(**inputs)
    [expected] = runner.processor.post_process_depth_estimation(outputs, target_sizes=[(70, 130)])
    np.testing.assert_allclose(depth, expected["predicted_depth"].numpy(), atol=1e-5)


def test_one_batched_forward_equals_one_crop_at_a_time(builds, monkeypatch):
    runner = builds["depth-anything"]
    rng = np.random.default_rng(1)
    crops = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
             for w, h in ((80, 40), (78, 40), (50, 120), (80, 40))]  # three of one input shape (56x28), one of another
    forwards = []
    real = runner.forward
    monkeypatch.setattr(runner, "forward", lambda pixels: forwards.append(len(pixels)) or real(pixels))
    together = runner.run(crops, [()] * len(crops))
    assert sorted(forwards) == [1, 3]  # one forward per input shape
    for crop, (depth, _) in zip(crops, together):
        [(alone, _)] = runner.run([crop], [()])
        assert depth.shape == crop.size[::-1]
        np.testing.assert_allclose(depth, alone, atol=1e-5)


def test_out_of_memory_in_the_forward_becomes_a_runtime_error(builds, monkeypatch):
    runner = builds["dpt"]

    def oom(**inputs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(runner, "model", oom)
    with pytest.raises(RuntimeError, match="the depth model ran out of memory on cpu"):
        runner.run([Image.new("RGB", (32, 32))], [()])


def test_a_square_dpt_with_an_aspect_keeping_processor_is_refused(builds, tmp_path):
    folder = shutil.copytree(builds["dpt"].model.name_or_path, tmp_path / "dpt")
    settings = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps({**settings, "keep_aspect_ratio": True}))
    with pytest.raises(VlmrlError, match="reads a square grid of patches") as error:
        DepthRunner(folder, torch.device("cpu"))
    assert "\n" not in str(error.value)


# --------------------------------------------------------------------------- the tool


def call(tools, picture: Image.Image, **arguments):
    return run_tool(ToolCall("depth", arguments), tools, ToolContext([picture]), ToolLimits())


def grid_of(text: str) -> np.ndarray:
    """The rows of digits of depth's text."""
    return np.array([[int(v) for v in line.split()] for line in text.splitlines() if re.fullmatch(r"[0-9 ]+", line)])


@pytest.mark.parametrize("arch", depth_model.ARCHES)
def test_depth_reads_the_box_in_the_original_images_pixels(folders, arch):
    """A 300x150 image, black left of x = 150 and white from it (white is nearer): the grid's left columns are far
    (9) and its right ones near (0), the nearest point right of the edge and the farthest left of it, the region
    on the right nearer; the map image is the box resized as zoom resizes it, dark left and bright right of the
    edge's place in it. In a sub-box and in a tall image (white at the top), the same in their own pixels."""
    tools = resolve_tools(["depth"], {"depth": str(folders[arch])})
    result = call(tools, two_tone(300, 150, 150), regions=[[0, 0, 100, 150], [200, 0, 300, 150]])
    assert result.error is None, result.text
    head = result.text.splitlines()[0]
    assert head.startswith("depth in box [0, 0, 300, 150] of image 0 (300x150), relative to the box: 0 nearest")
    near, far = (int(re.search(rf"{word} \[(\d+), (\d+)\]", head)[1]) for word in ("nearest point", "farthest"))
    assert near >= 150 > far
    assert grid_of(result.text).tolist() == [[9, 9, 0, 0]] * 4
    assert result.text.splitlines()[-1] == ("regions, nearest first (median relative depth): "
                                            "2 box [200, 0, 300, 150] 0.00; 1 box [0, 0, 100, 150] 1.00")
    [shown] = result.images
    assert shown.size == fit_side(300, 150, 448) == (448, 224)
    brightness = np.asarray(shown.convert("L"), np.float32)[112]  # the middle row; the edge at x = 224 here
    assert brightness[20:190].max() < 40 and brightness[260:296].min() > 200 and brightness[302:].min() > 200  # 299: a mark

    result = call(tools, two_tone(300, 150, 150), box=[100, 20, 260, 120])
    assert "depth in box [100, 20, 260, 120] of image 0 (300x150)" in result.text
    cells = grid_of(result.text)  # 40 px columns: 100-140 black, 140-180 across the edge, 180-260 white
    assert cells.shape == (4, 4) and (cells[:, 0] >= 7).all() and (cells[:, 2:] == 0).all()
    brightness = np.asarray(result.images[0].convert("L"), np.float32)[140]
    assert result.images[0].size == (448, 280) and brightness[:100].max() < 60 and brightness[200:].min() > 200

    result = call(tools, two_tone(120, 300, 150, vertical=False).transpose(Image.Transpose.FLIP_TOP_BOTTOM))
    cells = grid_of(result.text)  # white (near) on top; 75 px rows, the third one starting at the edge
    assert (cells[:2] == 0).all() and (cells[2] >= 7).all() and (cells[3] == 9).all()
    assert result.images[0].size == (179, 448)


@pytest.mark.parametrize("arguments, words", [
    ({"box": [float("nan"), 0, 10, 10]}, "box must be 4 numbers"),
    ({"box": [500, 500, 600, 600]}, "is empty inside"),
    ({"box": "left half"}, "box must be 4 numbers"),
    ({"regions": 3}, "regions must be a list of 1 to 8 boxes"),
    ({"regions": []}, "regions must be a list of 1 to 8 boxes"),
    ({"regions": [[0, 0, 5, 5]] * 9}, "regions must be a list of 1 to 8 boxes"),
    ({"regions": [[0, 0, 5, float("inf")]]}, "region 1: box must be 4 numbers"),
    ({"regions": [[0, 0, 5, 5], [1, 2, 3]]}, "region 2: box must be 4 numbers"),
    ({"regions": [[0, 0, 10, 10]], "box": [20, 0, 64, 48]}, "region 1 [0, 0, 10, 10] lies outside box [20, 0, 64, 48]"),
    ({"image": 2}, "image must be a whole number"),
    ({"query": "car"}, "unexpected keyword argument 'query'"),
])
def test_bad_arguments_are_error_turns(folders, arguments, words):
    tools = resolve_tools(["depth"], {"depth": str(folders["depth-anything"])})
    result = call(tools, Image.new("RGB", (64, 48)), **arguments)
    assert result.error == "bad_arguments" and words in result.text and "\n" not in result.text, result.text


class Failing:
    def run(self, crops, args):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


class Fixed:
    """A runner whose maps are `values` (a function of the crop's (height, width) grid), metric or not."""

    def __init__(self, values, metric: bool):
        self.values, self.metric = values, metric

    def run(self, crops, args):
        return [(self.values(*np.mgrid[0:crop.height, 0:crop.width]).astype(np.float32), self.metric) for crop in crops]


def test_a_failing_model_is_an_error_turn_and_flat_and_metric_maps_are_answers(folders, monkeypatch):
    folder = str(folders["depth-anything"])
    key = ("depth", folder, None)
    picture = Image.new("RGB", (80, 40))
    monkeypatch.setitem(model_tools._LOADED, key, Failing())
    result = call(resolve_tools(["depth"], {"depth": folder}), picture)
    assert result.error == "raised" and result.text.startswith("error: tool depth raised RuntimeError: CUDA out of")
    monkeypatch.setitem(model_tools._LOADED, key, Fixed(lambda y, x: 2.0 + 0 * x, metric=False))
    result = call(resolve_tools(["depth"], {"depth": folder}), picture, regions=[[0, 0, 10, 10]])
    assert result.error is None and result.text == ("depth in box [0, 0, 80, 40] of image 0 (80x40): flat, the model "
                                                    "sees no depth differences in this box\nregions: all at the same depth")
    assert result.images[0].size == (448, 224)
    # metres grow to the right: the nearest point is on the left, the far region first in nothing but its place
    monkeypatch.setitem(model_tools._LOADED, key, Fixed(lambda y, x: 1.0 + x / 10, metric=True))
    result = call(resolve_tools(["depth"], {"depth": folder}), picture, regions=[[60, 0, 80, 40], [0, 0, 20, 40]])
    assert "(metres from 1.00 to 8.90); nearest point [0, 0], farthest [79, 0]" in result.text
    assert grid_of(result.text).tolist() == [[1, 3, 6, 8]] * 4
    assert result.text.splitlines()[-1].endswith("2 box [0, 0, 20, 40] 0.12 (1.95 m); 1 box [60, 0, 80, 40] 0.88 (7.95 m)")


def test_the_cache_equals_no_cache_and_a_turns_calls_run_in_one_forward(folders, monkeypatch):
    folder = model_tools.tool_model_folder("depth", str(folders["depth-anything"]))
    cached, uncached = DepthTool(folder), DepthTool(folder, cache_size=0)
    runner = model_tools.loaded_model("depth", folder)
    batches = []
    monkeypatch.setattr(runner, "run", lambda crops, args, real=runner.run: batches.append(len(crops)) or real(crops, args))
    rng = np.random.default_rng(2)
    images = [Image.fromarray(rng.integers(0, 255, (60, 90, 3), dtype=np.uint8)) for _ in range(2)]
    calls = [(0, {}), (0, {}), (1, {}), (0, {"box": [0, 0, 45, 60]}), (0, {"regions": [[0, 0, 30, 30]]}), (0, {})]
    for k, arguments in calls:
        context = ToolContext([images[k].copy()])  # the same content in another object: still a hit
        a, b = cached(context, **arguments), uncached(context, **arguments)
        assert a[0] == b[0] and a[1].tobytes() == b[1].tobytes()
    assert (cached.calls, cached.cache_hits) == (6, 2) and (uncached.calls, uncached.cache_hits) == (6, 0)
    assert batches == [1] * (4 + 6)
    batches.clear()
    together = DepthTool(folder)
    turn = [(ToolContext([images[k]]), arguments) for k, arguments in calls]
    together.prefetch(turn)
    assert batches == [4] and together.forwards == 1  # the 4 distinct calls, one run
    for context, arguments in turn:
        assert together(context, **arguments)[0] == uncached(context, **arguments)[0]
    assert (together.calls, together.computed, together.forwards) == (6, 4, 1)  # all 6 read from what the one run made
    assert batches == [4] + [1] * 6  # the rest: the uncached tool's own calls


def test_folders_of_another_kind_are_refused_in_one_line(folders, tmp_path):
    def refused(models) -> str:
        with pytest.raises(VlmrlError) as error:
            resolve_tools(list(models), models)
        assert "\n" not in str(error.value)
        return str(error.value)

    other = shutil.copytree(folders["depth-anything"], tmp_path / "other")
    (other / "config.json").write_text(json.dumps({"model_type": "owlv2"}))
    assert "holds a 'owlv2' model; depth runs depth_anything, dpt checkpoints" in refused({"depth": str(other)})
    assert "holds a 'depth_anything' model; detect runs owlv2" in refused({"detect": str(folders["depth-anything"])})
    assert "vlmrl tiny-model" in refused({"depth": str(tmp_path / "missing")})
    (other / "config.json").write_text(json.dumps({"model_type": "dpt"}))
    (other / "preprocessor_config.json").unlink()
    assert "has no image processor (preprocessor_config.json)" in refused({"depth": str(other)})
    assert isinstance(resolve_tools(["depth"], {"depth": str(folders["dpt"])})["depth"], DepthTool)  # no tokenizer


def test_the_preflight_counts_the_depth_models_weights(folders, builds):
    """The preflight and `vlmrl check` count a listed model tool's float32 weights in each process's peak, read
    from its safetensors headers (tool_model_bytes): each depth architecture's parameters, 4 bytes each."""
    from vlmrl.models.tool_models import check_tool_models, tool_model_bytes

    for arch, folder in folders.items():
        weights = 4 * sum(p.numel() for p in builds[arch].model.parameters())
        assert tool_model_bytes(["depth", "zoom"], {"depth": str(folder)}) == weights, arch
        check_tool_models(resolve_tools(["depth"], {"depth": str(folder)}))  # whole safetensors: passes
