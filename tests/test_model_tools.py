"""Model tools (tools/model_tools.py, detect_tool.py; models/tool_models.py, detect_model.py): `detect` on a tiny
random OWLv2 built offline.

Random weights give random scores, but the tiny build's box head ends at zero, so its boxes are OWLv2's
grid boxes (patch k's box centred on the patch's bottom-right corner, one patch wide, in the padded
square): the boxes in original pixels are known, for square and non-square images and sub-boxes. Also:
the box mapping by hand, the pad as the model sees it, bad inputs and a failing model as error turns,
an empty answer, folders refused before step 1 in one line, the model loaded once, the cache equal to
no cache, and one batched forward equal to one image at a time."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from PIL import Image

from vlmrl.errors import VlmrlError
from vlmrl.tools import ToolCall, ToolContext, ToolLimits, resolve_tools, run_tool
from vlmrl.tools import detect_tool, model_tools
from vlmrl.tools.cache import AnswerCache, counts_of
from vlmrl.tools.image_tools import fit_side
from vlmrl.tools.detect_tool import DetectTool, select
from vlmrl.tools.model_tools import original_boxes, tool_model_folder

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def detector_dir(tmp_path_factory) -> str:
    """The tiny OWLv2, built once through the command line."""
    from vlmrl.cli import main

    out = tmp_path_factory.mktemp("tool") / "owlv2"
    assert main(["tiny-model", str(out), "--tool", "detect"]) in (0, None)
    return str(out)


@pytest.fixture
def detect(detector_dir):
    """A fresh registry with detect bound to the tiny OWLv2 (its model stays loaded for the process)."""
    return resolve_tools(["detect", "zoom"], {"detect": detector_dir})


def run(tools, picture: Image.Image, **arguments):
    return run_tool(ToolCall("detect", arguments), tools, ToolContext([picture]), ToolLimits())


def grid_boxes(width: int, height: int, patches: int = 6) -> np.ndarray:
    """OWLv2's grid boxes in pixels of a width x height image (padded to a square), clipped to it."""
    centres = (np.arange(patches) + 1) / patches
    cx, cy = np.meshgrid(centres, centres, indexing="xy")
    half = 0.5 / patches
    corners = np.stack([cx - half, cy - half, cx + half, cy + half], axis=-1).reshape(-1, 4)
    return original_boxes(corners, width, height, padded_square=True)


def listed(text: str) -> list[tuple[str, list[int], float]]:
    """(phrase, box, score) of each object line of detect's text, every line checked for its format."""
    rows = []
    for line in text.splitlines()[1:]:
        match = re.fullmatch(r"(\d+) (.+) box \[(\d+), (\d+), (\d+), (\d+)\] score (\d\.\d\d)", line)
        assert match, line
        rows.append((match[2], [int(match[k]) for k in range(3, 7)], float(match[7])))
    return rows


# --------------------------------------------------------------------------- the box mapping


def test_owlv2_boxes_span_the_padded_square_by_hand():
    """300x100: OWLv2 pads to 300x300 at the bottom, so y in [0, 1] spans 300 px, and a box reaching into the
    padding is clipped at y = 100; OWL-ViT stretches the image itself, so y spans 100 px."""
    corners = np.array([[0.1, 0.2, 0.5, 0.3], [0.0, 0.2, 1.0, 0.5]])
    np.testing.assert_allclose(original_boxes(corners, 300, 100, padded_square=True),
                               [[30, 60, 150, 90], [0, 60, 300, 100]])
    np.testing.assert_allclose(original_boxes(corners, 300, 100, padded_square=False),
                               [[30, 20, 150, 30], [0, 20, 300, 50]])
    # a tall image pads on the right: x spans the height
    np.testing.assert_allclose(original_boxes(np.array([[0.5, 0.5, 0.75, 1.0]]), 100, 400, padded_square=True),
                               [[100, 200, 100, 400]])


def test_select_keeps_scores_above_the_threshold_suppresses_overlaps_and_places_at_the_origin():
    boxes = np.array([[10, 10, 20, 20], [11, 10, 21, 20], [11, 10, 21, 20], [50, 50, 50, 60], [0, 0, 5.5, 5.2]])
    scores = np.array([0.9, 0.8, 0.7, 0.95, 0.05])
    labels = np.array([0, 0, 1, 0, 0])
    found = select(boxes, scores, labels, origin=(100, 200))
    # [1] overlaps [0] (same phrase) and goes; [2] is another phrase and stays; [3] is empty; [4] scores 0.05
    assert [(d.query, d.box, d.score) for d in found] == [(0, (110, 210, 120, 220), 0.9), (1, (111, 210, 121, 220), 0.7)]


def test_the_pixels_are_padded_at_the_bottom_as_the_boxes_assume(detector_dir):
    from vlmrl.models.detect_model import Detector

    detector = Detector(tool_model_folder("detect", detector_dir), torch.device("cpu"))
    assert detector.padded_square and detector.size == (96, 96)
    pixels = detector.pixels(Image.new("RGB", (192, 96), (255, 255, 255)))  # (3, 96, 96)
    white, black = (1 - detector.mean) / detector.std, -detector.mean / detector.std
    np.testing.assert_allclose(pixels[:, :47, :].mean(axis=(1, 2)), white, atol=1e-3)  # the image: top half
    np.testing.assert_allclose(pixels[:, 49:, :].mean(axis=(1, 2)), black, atol=1e-3)  # the padding: bottom half


# --------------------------------------------------------------------------- the call


@pytest.mark.parametrize("size", [(240, 240), (300, 150), (120, 360)])
def test_detect_lists_boxes_in_the_original_images_pixels(detect, size):
    image = Image.new("RGB", size, (200, 40, 40))
    result = run(detect, image, query="red circle")
    assert result.error is None, result.text
    head, rows = result.text.splitlines()[0], listed(result.text)
    assert head.startswith(f"{len(rows)} found for 'red circle' in box [0, 0, {size[0]}, {size[1]}] of image 0")
    assert 1 <= len(rows) <= detect_tool.MAX_DETECTIONS
    expected = grid_boxes(*size)
    for phrase, box, score in rows:
        assert phrase == "red circle" and 0.1 < score <= 1
        assert 0 <= box[0] < box[2] <= size[0] and 0 <= box[1] < box[3] <= size[1]
        assert np.abs(expected - np.array(box)).max(axis=1).min() <= 1, box  # a grid box of the padded square
    assert [image.size for image in result.images] == [fit_side(*size, 448)]


def test_detect_in_a_box_maps_back_through_the_box(detect):
    image = Image.new("RGB", (400, 300), (40, 70, 220))
    result = run(detect, image, query=["blue square", "disc"], box=[40, 20, 240, 120])
    rows = listed(result.text)
    assert rows and "in box [40, 20, 240, 120] of image 0 (400x300)" in result.text.splitlines()[0]
    expected = grid_boxes(200, 100) + np.array([40, 20, 40, 20])  # the 200x100 box, padded to 200x200
    for phrase, box, _ in rows:
        assert phrase in ("blue square", "disc")
        assert 40 <= box[0] < box[2] <= 240 and 20 <= box[1] < box[3] <= 120
        assert np.abs(expected - np.array(box)).max(axis=1).min() <= 1, box
    assert result.images[0].size == (448, 224)


@pytest.mark.parametrize("arguments, words", [
    ({"query": 3}, "query must be a phrase"),
    ({"query": []}, "query must be a phrase"),
    ({"query": ["cat", 7]}, "each query must be"),
    ({"query": "cat", "box": [float("nan"), 0, 10, 10]}, "box must be 4 numbers"),
    ({"query": "cat", "box": [500, 500, 600, 600]}, "is empty inside"),
    ({"query": "cat", "image": 2}, "image must be a whole number"),
    ({"box": [0, 0, 5, 5]}, "missing a required argument: 'query'"),
])
def test_bad_inputs_are_error_turns(detect, arguments, words):
    result = run(detect, Image.new("RGB", (64, 48)), **arguments)
    assert result.error == "bad_arguments" and words in result.text and "\n" not in result.text


class Failing:
    def run(self, images, queries):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


class Blind:
    def run(self, images, queries):
        return [(np.zeros((4, 4)), np.zeros(4), np.zeros(4, int)) for _ in images]


class Empty:
    """A detector that returns no box at all (a post-processing that kept none)."""

    def run(self, images, queries):
        return [(np.zeros((0, 4)), np.zeros(0), np.zeros(0, int)) for _ in images]


def test_a_model_that_raises_is_an_error_turn_and_nothing_found_is_an_answer(detect, detector_dir, monkeypatch):
    key = ("detect", str(tool_model_folder("detect", detector_dir)), None)
    monkeypatch.setitem(model_tools._LOADED, key, Failing())
    result = run(detect, Image.new("RGB", (64, 48)), query="cat")
    assert result.error == "raised" and result.text.startswith("error: tool detect raised RuntimeError: CUDA out of")
    monkeypatch.setitem(model_tools._LOADED, key, Blind())
    result = run(detect, Image.new("RGB", (64, 48)), query="cat")
    assert result.error is None and result.text.startswith("no 'cat' found in box [0, 0, 64, 48] of image 0")
    assert result.images[0].size == (448, 336)
    monkeypatch.setitem(model_tools._LOADED, key, Empty())
    result = run(detect, Image.new("RGB", (64, 48)), query="dog", box=[8, 8, 40, 40])
    assert result.error is None and result.text.startswith("no 'dog' found in box [8, 8, 40, 40] of image 0 (64x48)")
    assert result.images[0].size == (448, 448)


def test_out_of_memory_in_the_forward_becomes_a_runtime_error(detector_dir, monkeypatch):
    from vlmrl.models.detect_model import Detector

    detector = Detector(tool_model_folder("detect", detector_dir), torch.device("cpu"))

    def oom(**inputs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(detector, "model", oom)
    with pytest.raises(RuntimeError, match="the detector ran out of memory on cpu"):
        detector.run([Image.new("RGB", (32, 32))], [("cat",)])


# --------------------------------------------------------------------------- loading, cache, batching


def test_the_model_loads_once_per_process(detector_dir, monkeypatch):
    from vlmrl.models import tool_models

    loads = []
    real = tool_models.load_tool_model
    monkeypatch.setattr(tool_models, "load_tool_model",
                        lambda name, folder, device: loads.append(name) or real(name, folder, device))
    monkeypatch.setattr(model_tools, "_LOADED", {})
    for _ in range(2):
        tools = resolve_tools(["detect"], {"detect": detector_dir})
        for query in ("cat", "dog"):
            assert run(tools, Image.new("RGB", (50, 40)), query=query).error is None
    assert loads == ["detect"]


def test_the_cache_equals_no_cache_and_computes_a_repeated_call_once(detector_dir, monkeypatch):
    folder = tool_model_folder("detect", detector_dir)
    cached, uncached = DetectTool(folder), DetectTool(folder, cache_size=0)
    forwards = []
    model = model_tools.loaded_model("detect", folder)
    monkeypatch.setattr(model, "run", lambda images, queries, real=model.run: forwards.append(1) or real(images, queries))
    images = [Image.new("RGB", (90, 60), colour) for colour in ("red", "blue")]
    calls = [(0, "cat", None), (0, "cat", None), (1, "cat", None), (0, "cat", [0, 0, 45, 60]), (0, "cat", None)]
    for k, query, box in calls:
        context = ToolContext([images[k].copy()])  # the same content in another object: still a hit
        a, b = cached(context, query, box), uncached(context, query, box)
        assert a[0] == b[0] and a[1].tobytes() == b[1].tobytes()
    assert (cached.calls, cached.cache_hits) == (5, 2) and (uncached.calls, uncached.cache_hits) == (5, 0)
    assert len(forwards) == 3 + 5
    # the one answer cache of every tool (tools/cache.py): the rollout reads its counters, a caller draws on its copy
    assert isinstance(cached.answer_cache, AnswerCache) and len(cached.answer_cache.entries) == 3
    assert counts_of(cached) == (5, 3) and counts_of(uncached) == (5, 5)
    context = ToolContext([images[0]])
    first = cached(context, "cat", None)
    first[1].paste((255, 255, 255), (0, 0, *first[1].size))
    assert cached(context, "cat", None)[1].tobytes() == uncached(context, "cat", None)[1].tobytes()


def test_one_batched_forward_equals_one_image_at_a_time(detector_dir):
    detector = model_tools.loaded_model("detect", tool_model_folder("detect", detector_dir))
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in ((80, 40), (50, 120))]
    queries = [("red circle",), ("blue square", "a disc", "the green one")]
    together = detector.run(images, queries)
    for image, phrases, (boxes, scores, labels) in zip(images, queries, together):
        [(alone_boxes, alone_scores, alone_labels)] = detector.run([image], [phrases])
        np.testing.assert_allclose(boxes, alone_boxes, atol=1e-4)
        np.testing.assert_allclose(scores, alone_scores, atol=1e-5)
        assert (labels == alone_labels).all() and labels.max() < len(phrases)


# --------------------------------------------------------------------------- folders refused before step 1


def test_folders_are_refused_in_one_line(detector_dir, tiny_model_dir, tmp_path):
    def refused(models, names=("detect",)) -> str:
        with pytest.raises(VlmrlError) as error:
            resolve_tools(list(names), models)
        assert "\n" not in str(error.value)
        return str(error.value)

    assert "needs a model: set rollout.tool_models.detect" in refused(None)
    assert "vlmrl tiny-model" in refused({"detect": str(tmp_path / "missing")})
    assert "vlmrl tiny-model" in refused({"detect": str(tmp_path / "missing")}, ())  # configured: checked unnamed too
    assert "neither a folder nor in the local hub cache" in refused({"detect": "nobody/no-such-owlv2"})
    assert "holds a 'qwen2_5_vl' model; detect runs owlv2, owlvit" in refused({"detect": tiny_model_dir})
    assert "names colour; the model tools are detect, segment" in refused({"colour": detector_dir}, ())
    damaged = tmp_path / "damaged"
    shutil.copytree(detector_dir, damaged)
    (damaged / "config.json").write_text("{not json")
    assert "has no readable config.json" in refused({"detect": str(damaged)})
    (damaged / "config.json").write_text(json.dumps({"model_type": "owlv2"}))
    (damaged / "model.safetensors").write_bytes(b"")
    assert "model.safetensors is damaged" in refused({"detect": str(damaged)})
    (damaged / "model.safetensors").unlink()
    assert "has no weights file" in refused({"detect": str(damaged)})


def test_a_missing_tool_model_stops_the_run_before_step_1(tiny_model_dir, tmp_path):
    from vlmrl.config import load_config
    from vlmrl.safety.early_checks import check_before_loading

    config = load_config(None, ["task.name=shapes", "rollout.tools=[detect]", f"model.name_or_path={tiny_model_dir}",
                                f"rollout.tool_models.detect={tmp_path / 'gone'}", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(VlmrlError, match=r"rollout.tool_models.detect .*gone.* is neither a folder"):
        check_before_loading(config, "train")


def test_a_truncated_tool_model_stops_the_run_before_step_1(detector_dir, tiny_model_dir, tmp_path):
    from vlmrl.config import load_config
    from vlmrl.safety.early_checks import check_before_loading

    damaged = tmp_path / "truncated"
    shutil.copytree(detector_dir, damaged)
    weights = (damaged / "model.safetensors").read_bytes()
    (damaged / "model.safetensors").write_bytes(weights[:len(weights) // 2])  # the header whole, the tensors cut
    config = load_config(None, ["task.name=shapes", "rollout.tools=[detect]", f"model.name_or_path={tiny_model_dir}",
                                f"rollout.tool_models.detect={damaged}", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(VlmrlError) as error:
        check_before_loading(config, "train")
    assert str(error.value).startswith("the detect model (rollout.tool_models.detect): the model's weights file")
    assert "is truncated" in str(error.value) and "\n" not in str(error.value)
    tools = resolve_tools(["detect"], {"detect": str(damaged)})  # evaluate resolves without the early checks:
    result = run(tools, Image.new("RGB", (40, 40)), query="cat")  # the first call says it, as an error turn
    assert result.error == "raised" and "is truncated" in result.text


def test_detect_in_a_rollout_shows_its_overlay_and_its_errors_as_turns(detector_dir, tiny_model_dir):
    from test_tool_rollout import ANSWER, scripted, settings

    from vlmrl.models import load_policy
    from vlmrl.rollout.tool_rollout import ToolBox, generate_trajectories
    from vlmrl.tasks import Example

    original = Image.new("RGB", (224, 112), (255, 255, 255))
    example = Example(original.resize((56, 28)), "How many red circles?", "3", originals=[original])
    good = '<tool_call>\n{"name": "detect", "arguments": {"query": "red circle"}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "detect", "arguments": {"query": 7}}\n</tool_call>'
    model, processor = load_policy(tiny_model_dir, device="cpu")
    scripted(model, processor, [[good, ANSWER], [bad, ANSWER]])
    toolbox = ToolBox.from_config(settings("rollout.tools=[detect]", f"rollout.tool_models.detect={detector_dir}"))
    rollout = generate_trajectories(model, processor, [example], toolbox)
    found, failed = rollout.trajectories
    assert [t.role for t in found.turns] == ["assistant", "tool", "assistant"] and found.errors == []
    assert "found for 'red circle' in box [0, 0, 224, 112] of image 0 (224x112)" in found.turns[1].text
    assert [image.size for image in found.turns[1].images] == [(448, 224)]
    assert failed.errors == ["bad_arguments"] and "query must be a phrase" in failed.turns[1].text


def test_an_evaluation_of_a_run_takes_its_tool_models(tmp_path):
    from vlmrl.evaluation.eval_settings import EvalSettings, resolve_run_eval

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "config.yaml").write_text("task:\n  name: shapes\nrollout:\n  tools: [zoom, detect]\n"
                                     "  tool_models: {detect: models/owlv2}\n")
    resolved = resolve_run_eval(run, None, {}, {})
    assert resolved.values["tool_models"] == {"detect": "models/owlv2"}
    assert "tools zoom, detect; tool models detect models/owlv2" in resolved.line()
    assert EvalSettings(**resolved.values).tool_models == {"detect": "models/owlv2"}


def test_a_turns_detect_calls_run_in_one_forward_equal_to_one_at_a_time(detector_dir, tiny_model_dir):
    from test_tool_rollout import ANSWER, scripted, settings

    from vlmrl.models import load_policy
    from vlmrl.rollout.tool_rollout import ToolBox, generate_trajectories
    from vlmrl.tasks import Example

    rng = np.random.default_rng(1)
    original = Image.fromarray(rng.integers(0, 255, (120, 200, 3), dtype=np.uint8))
    example = Example(original.resize((50, 30)), "How many red circles?", "3", originals=[original])
    arguments = [{"query": "red circle"}, {"query": ["dog", "cat"], "box": [10, 5, 150, 100]},
                 {"query": "red circle"}, {"query": "tree", "box": [100, 0, 200, 120]}]
    calls = ['<tool_call>\n' + json.dumps({"name": "detect", "arguments": a}) + '\n</tool_call>' for a in arguments]
    model, processor = load_policy(tiny_model_dir, device="cpu")
    scripted(model, processor, [[call, ANSWER] for call in calls])
    toolbox = ToolBox.from_config(settings("rollout.group_size=4", "rollout.tools=[detect]",
                                           f"rollout.tool_models.detect={detector_dir}"))
    detect = toolbox.tools["detect"]
    rollout = generate_trajectories(model, processor, [example], toolbox)
    assert (detect.forwards, detect.computed, detect.calls, detect.cache_hits) == (1, 3, 4, 1)  # one forward, 3 distinct
    assert detect.device == "cpu" and ("detect", str(detect.folder), "cpu") in model_tools._LOADED  # the policy's
    alone = DetectTool(detect.folder, cache_size=0)
    for trajectory, given in zip(rollout.trajectories, arguments):
        text, overlay = alone(ToolContext([original]), **given)
        assert text in trajectory.turns[1].text and trajectory.errors == []
        assert trajectory.turns[1].images[0].tobytes() == overlay.tobytes()
    assert alone.forwards == 4


def test_vlmrl_check_counts_the_tool_models_memory(detector_dir, tiny_model_dir, letter_task):
    from vlmrl.config import load_config
    from vlmrl.disk import gib
    from vlmrl.safety.preflight import check

    base = [f"model.name_or_path={tiny_model_dir}", "model.device=cpu", "task.name=letter_task:LetterTask",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
            "rollout.generation_batch_size=2", "train.micro_batch_size=4"]
    without = check(load_config(None, base)).memory
    report = check(load_config(None, base + ["rollout.tools=[zoom, detect]",
                                             f"rollout.tool_models.detect={detector_dir}"]))
    detector = model_tools.loaded_model("detect", tool_model_folder("detect", detector_dir)).model
    weights = sum(p.numel() * 4 for p in detector.parameters())
    assert without.tool_models == 0 and report.memory.tool_models == weights
    assert report.memory.peak - report.memory.tool_models == without.peak
    assert f"tool models {gib(weights)}" in "\n".join(report.lines())


def test_owl_vit_stretches_the_image_so_its_boxes_span_width_and_height(tmp_path):
    from vlmrl.cli import main

    folder = tmp_path / "owlvit"
    assert main(["tiny-model", str(folder), "--tool", "detect", "--arch", "owlvit"]) in (0, None)
    assert json.loads((folder / "vlmrl_tiny.json").read_text())["arch"] == "owlvit"
    tools = resolve_tools(["detect"], {"detect": str(folder)})
    result = run(tools, Image.new("RGB", (300, 120), (200, 40, 40)), query="red circle")
    rows = listed(result.text)
    assert result.error is None and rows
    centres = (np.arange(6) + 1) / 6
    cx, cy = np.meshgrid(centres, centres, indexing="xy")
    corners = np.stack([cx - 1 / 12, cy - 1 / 12, cx + 1 / 12, cy + 1 / 12], axis=-1).reshape(-1, 4)
    expected = original_boxes(corners, 300, 120, padded_square=False)  # no padding: the whole height is used
    for _, box, _ in rows:
        assert np.abs(expected - np.array(box)).max(axis=1).min() <= 1, box
    # a patch's box is 300 / 6 wide and 120 / 6 high here (OWLv2's would be 300 / 6 both ways, in a padded square)
    assert all(box[2] - box[0] <= 51 and box[3] - box[1] <= 21 for _, box, _ in rows)


def test_a_phrases_tokens_are_found_by_their_characters():
    from vlmrl.models.detect_model import phrase_tokens

    # "red circle. cat." tokens: [CLS] "red" " circle" "." " cat" "." [SEP]
    offsets = [(0, 0), (0, 3), (3, 10), (10, 11), (11, 15), (15, 16), (0, 0)]
    assert phrase_tokens(offsets, ("red circle", "cat")).tolist() == [
        [False, True, True, False, False, False, False], [False, False, False, False, True, False, False]]


@pytest.mark.parametrize("arch, size", [("owlv2", (200, 100)), ("owlv2", (90, 150)), ("owlvit", (200, 100)),
                                        ("grounding-dino", (200, 100)), ("grounding-dino", (70, 140))])
def test_boxes_equal_the_processors_own_post_processing(arch, size, tmp_path):
    """detect's boxes (before they are clipped, selected and rounded) are what transformers' own post-processing
    makes of the same outputs for the image's original size, clipped to the image."""
    from transformers import AutoImageProcessor

    from vlmrl.models.detect_model import Detector
    from vlmrl.models.tool_models import build_tiny_tool_model

    folder = build_tiny_tool_model(tmp_path / arch, "detect", arch=arch)
    detector = Detector(folder, torch.device("cpu"))
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
    [(boxes, scores, labels)] = detector.run([image], [("red circle", "cat")])
    outputs = []
    real = detector.model.forward
    detector.model.forward = lambda **inputs: outputs.append(real(**inputs)) or outputs[-1]
    detector.run([image], [("red circle", "cat")])
    processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
    expected = processor.post_process_object_detection(outputs[0], threshold=0.0, target_sizes=[size[::-1]])[0]
    limit = np.array([*size, *size], np.float64)
    np.testing.assert_allclose(boxes, np.clip(expected["boxes"].numpy(), 0, limit), atol=1e-3)
    assert len(boxes) == len(scores) == len(labels) and set(labels.tolist()) <= {0, 1}


def test_detect_runs_a_grounding_dino(tmp_path):
    from vlmrl.models.tool_models import build_tiny_tool_model

    folder = build_tiny_tool_model(tmp_path / "gdino", "detect", arch="grounding-dino")
    tools = resolve_tools(["detect"], {"detect": str(folder)})
    result = run(tools, Image.new("RGB", (300, 120), (200, 40, 40)), query=["red circle", "cat"], box=[20, 10, 220, 110])
    rows = listed(result.text)
    assert result.error is None and rows and "in box [20, 10, 220, 110] of image 0 (300x120)" in result.text
    assert all(p in ("red circle", "cat") and 20 <= b[0] < b[2] <= 220 and 10 <= b[1] < b[3] <= 110 for p, b, _ in rows)
    assert run(tools, Image.new("RGB", (300, 120)), query=5).error == "bad_arguments"


def test_a_hub_id_is_read_from_the_local_hub_cache_never_downloaded(detector_dir, tmp_path, monkeypatch):
    from huggingface_hub import constants

    snapshot = tmp_path / "models--someone--tiny-owlv2" / "snapshots" / ("0" * 40)
    shutil.copytree(detector_dir, snapshot)
    (tmp_path / "models--someone--tiny-owlv2" / "refs").mkdir()
    (tmp_path / "models--someone--tiny-owlv2" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert tool_model_folder("detect", "someone/tiny-owlv2") == snapshot
    with pytest.raises(VlmrlError, match="neither a folder nor in the local hub cache"):
        tool_model_folder("detect", "someone/not-cached")


def test_each_model_tool_has_its_model_code_and_a_tiny_build(tmp_path):
    """MODEL_TOOLS (the tool side) and RUNNERS (the model side) name the same tools; each runner module has
    RUNNER, ARCHES and build_tiny; an architecture the tool does not build is refused in one line."""
    import importlib

    from vlmrl.models.tool_models import RUNNERS, build_tiny_tool_model
    from vlmrl.tools.model_table import MODEL_KINDS, MODEL_TOOLS

    assert MODEL_KINDS["detect"] == ("owlv2", "owlvit", "grounding-dino") and set(MODEL_TOOLS) <= set(RUNNERS)
    for name, tool in MODEL_TOOLS.items():
        module = importlib.import_module(RUNNERS[name])
        assert tool.name == name and callable(module.RUNNER) and module.ARCHES and callable(module.build_tiny)
    with pytest.raises(VlmrlError, match=r"^unknown detect model architecture 'qwen2_5_vl'; choose one of owlv2, "):
        build_tiny_tool_model(tmp_path / "x", "detect", arch="qwen2_5_vl")
    with pytest.raises(VlmrlError, match=r"^unknown model tool 'colour'; model tools: detect"):
        build_tiny_tool_model(tmp_path / "x", "colour")
    assert not (tmp_path / "x").exists()
