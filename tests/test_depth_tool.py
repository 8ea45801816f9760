"""The `depth` model tool (tools/depth_tool.py, models/depth_model.py) on tiny builds whose depth is a known
function of the pixels: depth = 1 + 2 x brightness wherever the image is uniform over a couple of patches
(`tiny_depth`), smoothed at the patch scale at an edge. So a uniform image's map is a predicted constant
in the crop's own pixels for every processor's resize and pad (Depth Anything: aspect kept, multiples of
14; DPT: stretched to a square; DPT on DINOv2: padded), an edge stays where it is in the original, and
the pad is cut off exactly (by hand). Also: the maps equal transformers' own post-processing, one
batched forward equals one crop at a time, a model out of memory raises."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from vlmrl.errors import VlmrlError

torch = pytest.importorskip("torch")

from vlmrl.models import depth_model  # noqa: E402
from vlmrl.models.depth_model import DepthRunner, input_geometry, original_depth, tiny_depth  # noqa: E402


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict:
    """Each tiny depth architecture, built once, and its runner on the CPU."""
    runners = {}
    for arch in depth_model.ARCHES:
        out = tmp_path_factory.mktemp("depth") / arch
        out.mkdir()
        info = depth_model.build_tiny(out, arch, seed=0)
        assert info["arch"] == arch and 20_000 < info["parameters"] < 100_000
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
    import json
    import shutil

    folder = shutil.copytree(builds["dpt"].model.name_or_path, tmp_path / "dpt")
    settings = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps({**settings, "keep_aspect_ratio": True}))
    with pytest.raises(VlmrlError, match="reads a square grid of patches") as error:
        DepthRunner(folder, torch.device("cpu"))
    assert "\n" not in str(error.value)
