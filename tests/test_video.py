"""Videos in prompts: each family's video math without torchvision, and the fast paths on video.

The twin (models/video_processing.py) is checked against the family's own processing: a video of two
equal frames is the image path's pixel values exactly (the Qwen image processor repeats an image over
the temporal patch), each frame fills its own temporal slot, the patch layout is Qwen3-VL's own torch
`patchify`, and the frame sizes follow each family's `smart_resize`. Frame times reach the prompt as
Qwen3-VL's `<t seconds>` blocks and as Qwen2.5-VL's seconds per temporal grid in the M-RoPE temporal
positions. SmolVLM's frames are its image path's unsplit images exactly, laid out and padded as its
own video processor does (run where it runs without torchvision), written with their times by its
own processor code, and put with the images in one stream in text order. On every family whose row of `support.FAMILIES` has video on, the shared prompt cache,
the packed passes and static decoding give the plain path's numbers on video prompts, and each
video reaches the vision tower once per group.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vlmrl.config import GenerationSettings
from vlmrl.errors import VlmrlError
from vlmrl.models import support
from vlmrl.models.loading import counting_vision_rows, load_policy
from vlmrl.models.tiny_model import ARCHES as BUILDABLE
from vlmrl.models.token_inputs import prompt_positions
from vlmrl.models.video_processing import QwenVideoPil
from vlmrl.rollout.completions import Completions
from vlmrl.rollout.generation import generate_groups
from vlmrl.rollout.prompts import chat_messages, encode_prompts
from vlmrl.safety.preflight import check_prompts
from vlmrl.tasks import Example, Video
from vlmrl.training.logprobs import LogprobScorer

VIDEO_ON = [a for a in BUILDABLE if support.FAMILIES[a].video is None]
G = 3

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest (conftest.py)


def noise(seed: int, size=(84, 56)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def images_processor(patch: int = 14):
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448, patch_size=patch, merge_size=2,
                                    temporal_patch_size=2)


def twin(rule: str = "qwen2", patch: int = 14, high: int = 448 * 448) -> QwenVideoPil:
    return QwenVideoPil(rule, images_processor(patch), 56 * 56, high)


def run_twin(processor: QwenVideoPil, frames: list[Image.Image]):
    from vlmrl.models.video_processing import metadata

    video = Video(frames, [float(k) for k in range(len(frames))])
    return processor([list(video.frames)], video_metadata=[metadata(video)])


def test_a_video_of_two_equal_frames_is_the_image_path_exactly():
    frame = noise(0)
    image = images_processor()(images=[frame])
    video = run_twin(twin(), [frame, frame])
    assert video["video_grid_thw"].tolist() == image["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert np.array_equal(video["pixel_values_videos"], image["pixel_values"])


def test_each_frame_fills_its_own_temporal_slot():
    """Patch vectors are (channel, time, row, col): slot 0 holds frame 0, slot 1 frame 1; an odd
    frame count repeats the last frame into the missing slot."""
    frames = [noise(1), noise(2), noise(3)]
    video = run_twin(twin(), frames)
    assert video["video_grid_thw"].tolist() == [[2, 4, 6]]  # 3 frames padded to 4: two temporal grids
    slots = video["pixel_values_videos"].reshape(2, 24, 3, 2, 14, 14)  # (t, patches, C, time, ph, pw)
    for k, frame in enumerate(frames + [frames[-1]]):
        alone = images_processor()(images=[frame])["pixel_values"].reshape(24, 3, 2, 14, 14)
        assert np.array_equal(slots[k // 2, :, :, k % 2], alone[:, :, 0])


def test_the_patch_layout_is_qwen3s_own_patchify():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    frames = np.random.default_rng(4).standard_normal((3, 3, 64, 96)).astype(np.float32)  # (T, C, H, W)
    mine, grid = twin("qwen3", patch=16).patchify(frames)
    theirs, *their_grid = Qwen3VLVideoProcessor().patchify(torch.from_numpy(frames)[None], patch_size=16,
                                                           merge_size=2, temporal_patch_size=2)
    assert grid == tuple(their_grid) == (2, 4, 6)
    assert np.array_equal(mine, theirs[0].numpy())


def test_frame_sizes_follow_each_familys_rule():
    """Qwen3-VL bounds frames x height x width by max_pixels (8 frames of 224: sqrt(2) smaller each
    side, 224/1.414/32 floored = 4 -> 128); Qwen2-VL bounds each frame alone (224 stays)."""
    qwen3, qwen2 = twin("qwen3", patch=16, high=448 * 448), twin("qwen2", patch=14, high=448 * 448)
    assert qwen3.frame_size(8, 224, 224) == (128, 128)
    assert qwen3.frame_size(2, 224, 224) == (224, 224)
    assert qwen2.frame_size(8, 224, 224) == qwen2.frame_size(2, 224, 224) == (224, 224)


def test_llava_onevision_frames_are_the_image_paths_base_tile():
    """Each frame resized to the fixed size, rescaled and normalized: the image processor's first tile
    (the whole image at base resolution) of the same picture, exactly; (videos, frames, C, H, W)."""
    from transformers import LlavaOnevisionImageProcessorPil

    from vlmrl.models.video_processing import FixedSizeVideoPil, metadata

    images = LlavaOnevisionImageProcessorPil(size={"height": 56, "width": 56},
                                             image_grid_pinpoints=[[56, 56], [56, 112], [112, 56], [112, 112]])
    frames = [noise(5), noise(6)]
    video = Video(frames, [0, 1])
    out = FixedSizeVideoPil(images, 56, 56)([list(video.frames)], video_metadata=[metadata(video)])
    assert out["pixel_values_videos"].shape == (1, 2, 3, 56, 56)
    for k, frame in enumerate(frames):
        assert np.array_equal(out["pixel_values_videos"][0, k], images(images=[frame])["pixel_values"][0][0])
    with pytest.raises(ValueError, match=r"as many frames each for this family; got \[1, 2\]"):
        FixedSizeVideoPil(images, 56, 56)([[frames[0]], frames], video_metadata=[None, None])


def test_llava_onevision_counts_pooled_frames_and_a_newline(tiny_model_factory, four_frame_examples):
    _, processor = load_policy(tiny_model_factory("llava_onevision"), device="cpu")
    ids = encode_prompts(processor, four_frame_examples[:1], torch.device("cpu"))["input_ids"][0]
    assert int((ids == processor.video_token_id).sum()) == 4 * 2 * 2 + 1  # 4x4 patches pooled to 2x2, per frame


def smolvlm_images(longest: int = 224, tile: int = 112):
    from transformers import SmolVLMImageProcessorPil

    return SmolVLMImageProcessorPil(size={"longest_edge": longest}, max_image_size={"longest_edge": tile},
                                    do_image_splitting=False)


def test_smolvlm_frames_are_the_image_paths_unsplit_image():
    """Each frame resized by the family's rule (longest edge, then the square tile), rescaled and
    normalized: the image processor's unsplit image of the same picture, exactly."""
    from vlmrl.models.video_processing import FramesVideoPil, metadata

    frames = [noise(7, (84, 56)), noise(8, (84, 56))]  # 84 wide: 224 x 150 (even: 150), then 112 x 112
    video = Video(frames, [0, 1])
    out = FramesVideoPil(smolvlm_images(), 224, 112, {})([list(video.frames)], video_metadata=[metadata(video)])
    assert out["pixel_values"].shape == (1, 2, 3, 112, 112)
    for k, frame in enumerate(frames):
        assert np.array_equal(out["pixel_values"][0, k], smolvlm_images()(images=[[frame]])["pixel_values"][0, 0])


def test_smolvlm_layout_and_padding_are_the_familys_own():
    """Against transformers' SmolVLMVideoProcessor, run where it runs without torchvision (no resize,
    no normalization: both go through torchvision there): videos of 3 and 1 frames at the tile size
    give the same (videos, frames, C, H, W) values, zero frames after the shorter, and the same mask."""
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

    from vlmrl.models.video_processing import FramesVideoPil, metadata

    videos = [Video([noise(10 + k, (112, 112)) for k in range(n)]) for n in (3, 1)]
    mine = FramesVideoPil(smolvlm_images(112), 112, 112, {})([list(v.frames) for v in videos],
                                                             video_metadata=[metadata(v) for v in videos])
    theirs = SmolVLMVideoProcessor(do_resize=False, do_convert_rgb=False, do_normalize=False)(
        videos=[np.stack([np.asarray(f) for f in v.frames]) for v in videos], return_tensors="np")
    assert mine["pixel_values"].shape == theirs["pixel_values"].shape == (2, 3, 3, 112, 112)
    unnormalized = mine["pixel_values"] * 0.5 + 0.5  # IMAGENET_STANDARD mean and std, the family's
    unnormalized[1, 1:] = 0  # the padding frames stay zero
    assert np.abs(unnormalized - theirs["pixel_values"]).max() < 1e-6
    assert np.array_equal(mine["pixel_values"][1, 1:], np.zeros((2, 3, 112, 112)))
    assert np.array_equal(mine["pixel_attention_mask"], theirs["pixel_attention_mask"])


def test_smolvlm_writes_each_frame_with_its_time_and_its_own_count(tiny_model_factory):
    """The family's prompt for a video: the intro (frame count, duration), then per frame its
    `Frame from MM:SS:` and 16 image tokens; a 3-frame video says three frames beside a 4-frame one."""
    _, processor = load_policy(tiny_model_factory("smolvlm"), device="cpu")
    long, short = (Example(prompt="Where?", videos=[moving(times)]) for times in ([0, 20, 40, 75], [0, 1, 2.5]))
    batch = encode_prompts(processor, [long, short], torch.device("cpu"))["input_ids"]
    alone = encode_prompts(processor, [short], torch.device("cpu"))["input_ids"][0]
    assert torch.equal(batch[1][-len(alone):], alone)
    text = processor.tokenizer.decode(alone).replace("<image>" * 16, "<16 image tokens>")
    frame = "<fake_token_around_image><global-img><16 image tokens><fake_token_around_image>"
    assert text == ("<|im_start|>User: You are provided the following series of three frames from a 0:00:02 "
                    f"[H:MM:SS] video.\n\nFrame from 00:00:{frame}\nFrame from 00:01:{frame}\nFrame from 00:02:"
                    f"{frame}\n\nWhere?<end_of_utterance>\nAssistant:")
    assert "four frames from a 0:01:15" in processor.tokenizer.decode(batch[0]) and "Frame from 01:15:" in \
        processor.tokenizer.decode(batch[0])


@pytest.mark.parametrize("saved, expected", [
    ({}, (224, 112, None, None)),  # no video settings: the image processor's size and tile
    ({"video_sampling": {"video_size": {"longest_edge": 448}, "max_frames": 8, "fps": 1}}, (448, 112, 8, 1)),
    ({"size": {"longest_edge": 336}, "max_image_size": {"longest_edge": 56},
      "video_sampling": {"video_size": {"longest_edge": 448}, "max_frames": 8, "fps": 1}}, (336, 56, 8, 1))])
def test_smolvlm_reads_its_video_settings_as_its_video_processor_does(saved, expected, tiny_model_factory, tmp_path):
    """`size` before `video_sampling.video_size` (the family's own __init__ puts `size` there), the
    tile from `max_image_size`, the frame count and rate its chat template call reads."""
    import json
    import shutil

    from vlmrl.models.loading import load_processor

    folder = shutil.copytree(tiny_model_factory("smolvlm"), tmp_path / "model")
    if saved:
        (folder / "video_preprocessor_config.json").write_text(json.dumps(saved))
    video = load_processor(str(folder)).video_processor
    assert (video.longest_edge, video.tile, video.num_frames, video.fps) == expected


def test_each_frames_time_reaches_the_family_whole():
    """The family reads a frame's time as index / fps; 3 x (2/11) / (2/11) is 2.9999999999999996 in
    floats, which SmolVLM's `Frame from MM:SS` would floor to 00:02: each index is moved up an ulp
    until it divides back to the frame's time or just above (no float index gives 3 exactly here)."""
    from vlmrl.models.video_processing import metadata

    times = metadata(moving([0, 3, 11])).timestamps  # a mean rate of 2/11 frames a second
    assert [int(t) for t in times] == [0, 3, 11] and max(abs(t - k) for t, k in zip(times, [0, 3, 11])) < 1e-12


def test_smolvlm_puts_images_and_frames_in_one_stream_in_text_order(tiny_model_factory):
    """A row with a video before an image and a row with an image only: pixel_values (rows, stream,
    C, H, W) hold each row's frames and tiles in the order of its text, zeros after."""
    from vlmrl.models.video_processing import FramesVideoPil, metadata

    _, processor = load_policy(tiny_model_factory("smolvlm"), device="cpu")
    clip, blue = moving([0, 1, 2]), Image.new("RGB", (56, 84), (0, 0, 200))
    rows = [Example(prompt="Is <video> like <image>?", images=[blue], videos=[clip]),
            Example(prompt="Blue?", images=[blue])]
    inputs = encode_prompts(processor, rows, torch.device("cpu"))
    twin = FramesVideoPil(processor.image_processor, 224, 112, {})
    frames = twin([list(clip.frames)], video_metadata=[metadata(clip)])
    image = processor.image_processor(images=[[blue]], return_tensors="pt")["pixel_values"][0, 0]
    assert inputs["pixel_values"].shape == (2, 4, 3, 112, 112)
    assert torch.equal(inputs["pixel_values"][0, :3], torch.from_numpy(frames["pixel_values"][0]))
    assert torch.equal(inputs["pixel_values"][0, 3], image) and torch.equal(inputs["pixel_values"][1, 0], image)
    assert not inputs["pixel_values"][1, 1:].any()
    assert inputs["pixel_attention_mask"][:, :, 0, 0].tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]


def test_a_video_is_checked_when_made():
    red = Image.new("RGB", (32, 32), "red")
    assert Video([red, red, red], [0, 0.5, 1.0]).fps == 2.0 and Video([red]).fps == 1.0
    with pytest.raises(VlmrlError, match="video frame 1 is 16x32; frame 0 is 32x32"):
        Video([red, Image.new("RGB", (16, 32))], [0, 1])
    with pytest.raises(VlmrlError, match="timestamps must rise strictly"):
        Video([red, red], [1, 1])
    with pytest.raises(VlmrlError, match="at least one frame"):
        Video([], [])
    with pytest.raises(VlmrlError, match="needs as many timestamps, got 1"):
        Video([red, red], [0])


def test_videos_are_placed_at_their_markers_else_first():
    clip = Video([Image.new("RGB", (32, 32))], [0])
    image = Image.new("RGB", (32, 32))
    at = chat_messages(Example(prompt="See <video> then <image>.", images=[image], videos=[clip]))[0]["content"]
    assert [p["type"] for p in at] == ["text", "video", "text", "image", "text"]
    first = chat_messages(Example(prompt="Which?", images=[image], videos=[clip, clip]))[0]["content"]
    assert [p["type"] for p in first] == ["video", "video", "image", "text"]


def moving(times: list[float], side: int = 56) -> Video:
    """A red square crossing a white frame left to right, one frame per time."""
    frames = []
    for k in range(len(times)):
        frame = Image.new("RGB", (side, side), "white")
        x = 4 + k * (side - 20) // max(len(times) - 1, 1)
        frame.paste((220, 30, 30), (x, 20, x + 14, 34))
        frames.append(frame)
    return Video(frames, times)


def test_qwen3_writes_each_temporal_grids_time(tiny_model_factory):
    _, processor = load_policy(tiny_model_factory("qwen3_vl"), device="cpu")
    example = Example(prompt="Where does it go?", videos=[moving([0, 2, 4, 6])])  # 0.5 frames per second
    text = processor.tokenizer.decode(encode_prompts(processor, [example], torch.device("cpu"))["input_ids"][0])
    assert "<1.0 seconds><|vision_start|>" in text and "<5.0 seconds><|vision_start|>" in text  # mean of each pair
    assert text.count(" seconds>") == 2


def test_qwen2_5_puts_the_seconds_in_the_temporal_positions(tiny_model_factory):
    """second_per_grid_ts = temporal patch / frame rate; a video token's temporal position is its
    grid index x seconds per grid x tokens_per_second."""
    model, processor = load_policy(tiny_model_factory("qwen2_5_vl"), device="cpu")
    per_second = model.config.vision_config.tokens_per_second
    steps = {}
    for times, seconds in (([0, 0.5, 1.0, 1.5], 1.0), ([0, 2, 4, 6], 4.0)):
        inputs = encode_prompts(processor, [Example(prompt="Where?", videos=[moving(times)])], torch.device("cpu"))
        assert inputs["second_per_grid_ts"].tolist() == [seconds]
        temporal = prompt_positions(model, inputs)[1, 0]  # (P,) the temporal axis
        video = temporal[inputs["input_ids"][0] == processor.video_token_id]  # 2 grids x 4 tokens
        steps[seconds] = int(video[4] - video[0])
    assert steps == {1.0: round(1.0 * per_second), 4.0: round(4.0 * per_second)}


@pytest.fixture(scope="module")
def video_examples() -> list[Example]:
    """Prompts with a video alone, a video and an image, and a one-frame video: left padding differs."""
    return [Example(prompt="Where does the square go?", answer="right", videos=[moving([0, 0.5, 1.0, 1.5])]),
            Example(prompt="Is <video> like <image>?", answer="no", images=[Image.new("RGB", (56, 84), (0, 0, 200))],
                    videos=[moving([0, 1, 2], side=84)]),
            Example(prompt="Colour?", answer="red", videos=[moving([0.25])])]


@pytest.fixture(scope="module")
def four_frame_examples() -> list[Example]:
    """Videos of 4 frames each (LLaVA-OneVision stacks a batch's videos: one frame count), of
    different sizes, one beside an image."""
    return [Example(prompt="Where does the square go?", answer="right", videos=[moving([0, 0.5, 1.0, 1.5])]),
            Example(prompt="Is <video> like <image>?", answer="no", images=[Image.new("RGB", (56, 84), (0, 0, 200))],
                    videos=[moving([0, 1, 2, 3], side=84)]),
            Example(prompt="Colour?", answer="red", videos=[moving([0, 2, 4, 6], side=70)])]


def sampled(model, processor, examples, shared: bool, temperature: float, decode: str = "dynamic"):
    settings = GenerationSettings(group_size=G, max_new_tokens=8, temperature=temperature,
                                  share_prompt_cache=shared, decode=decode)
    with counting_vision_rows(model) as rows:
        rollout = generate_groups(model, processor, examples, settings, seed=3)
    return rollout, sum(rows)


@pytest.mark.parametrize("arch", VIDEO_ON)
def test_the_fast_paths_equal_the_plain_path_on_video_prompts(arch, tiny_model_factory, video_examples,
                                                               four_frame_examples):
    model, processor = load_policy(tiny_model_factory(arch), device="cpu")
    video_examples = four_frame_examples if arch == "llava_onevision" else video_examples
    shared, shared_rows = sampled(model, processor, video_examples, True, 0)
    plain, plain_rows = sampled(model, processor, video_examples, False, 0)
    assert torch.equal(shared.completion_ids, plain.completion_ids)
    once = support.FAMILIES[arch].shared_prefill is None  # else declared off: the plain path, said once
    assert shared_rows * (G if once else 1) == plain_rows > 0  # each video (and image) through the tower once per group
    static, _ = sampled(model, processor, video_examples, True, 1.0, decode="static")
    dynamic, _ = sampled(model, processor, video_examples, True, 1.0)
    assert torch.equal(static.completion_ids, dynamic.completion_ids) and len(set(dynamic.texts)) > 1

    rollout = dynamic
    results = {}
    for pack, chunk in [(False, 0), (True, 3)]:
        model.zero_grad()
        logp, _ = LogprobScorer(processor, 1.0, pack, chunk)(model, Completions(rollout.rows, rollout.completion_ids,
                                                                                 rollout.completion_mask))
        logp.sum().backward()
        results[pack] = (logp.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert (results[False][0] - results[True][0]).abs().max() < 1e-5
    assert (results[False][0] * rollout.completion_mask - rollout.sampler_logp).abs().max() < 1e-5  # the sampler's
    assert torch.nn.functional.cosine_similarity(results[False][1], results[True][1], dim=0) >= 0.9999


@pytest.mark.parametrize("arch, video_tokens", [("qwen2_5_vl", 8), ("smolvlm", 64)])
def test_the_preflight_counts_video_tokens_and_refuses_a_video_past_the_limit(arch, video_tokens, tiny_model_factory,
                                                                              video_examples):
    """4 frames of 56x56: Qwen2.5-VL 2x2 merged tokens x 2 temporal grids; SmolVLM 4 frames x 16
    image tokens (a 112-pixel tile, 14-pixel patches, 2x2 pixel shuffle)."""
    _, processor = load_policy(tiny_model_factory(arch), device="cpu")
    check = check_prompts(processor, video_examples[:1], [0], "train", 4096)
    assert (check.image_tokens, check.video_tokens) == (video_tokens, video_tokens)
    assert check.vision() == f"0 image and {video_tokens} video tokens"
    with pytest.raises(VlmrlError, match=rf"prompt of train example 0 is \d+ tokens \(0 of them image tokens, "
                                         rf"{video_tokens} video tokens\) > rollout.max_prompt_length=20; image and "
                                         r"video tokens are never truncated"):
        check_prompts(processor, video_examples[:1], [0], "train", 20)


@pytest.mark.parametrize("arch, tokens", [("qwen2_5_vl", (6 + 18, 18)), ("smolvlm", (16 + 48, 48))])
def test_the_preflight_tells_a_videos_tokens_from_an_images(arch, tokens, tiny_model_factory, video_examples):
    """A 56x84 image and a 3-frame video of 84x84: Qwen2.5-VL 2x3 merged image tokens and 3x3 merged
    tokens x 2 temporal grids (3 frames padded to 4); SmolVLM 16 image tokens the image (one 112-pixel
    tile) and 3 x 16 the frames, image tokens all."""
    _, processor = load_policy(tiny_model_factory(arch), device="cpu")
    check = check_prompts(processor, video_examples[1:2], [1], "train", 4096)
    assert (check.image_tokens, check.video_tokens) == tokens


def test_a_video_on_a_family_without_video_is_one_line(tiny_model_factory, video_examples):
    _, processor = load_policy(tiny_model_factory("idefics3"), device="cpu")
    with pytest.raises(VlmrlError, match=r"an example has a video, and the model's processor \(Idefics3Processor\) "
                                         r"takes none"):
        encode_prompts(processor, video_examples[:1], torch.device("cpu"))


@pytest.mark.parametrize("arch", [a for a in VIDEO_ON if support.FAMILIES[a].tool_rollouts is None])
def test_a_trajectory_from_a_video_prompt_is_one_processor_call(arch, tiny_model_factory):
    """A tool turn after a video prompt: the trajectory's inputs equal the processor's encoding of the
    whole conversation (the video, then the tool's image) in one call, with the same logits."""
    from vlmrl.rollout.prompts import processor_inputs
    from vlmrl.rollout.trajectories import Segment, encode_trajectories, prompt_text, tool_turn

    model, processor = load_policy(tiny_model_factory(arch), device="cpu")
    example = Example(prompt="Where does it go?", answer="right", videos=[moving([0, 0.5, 1.0, 1.5])])
    crop = Image.new("RGB", (56, 56), (20, 160, 10))
    first = 'Let me look.<tool_call>\n{"name": "zoom", "arguments": {"box": [0, 0, 28, 28]}}\n</tool_call>'
    ids = processor.tokenizer(first, add_special_tokens=False).input_ids
    turns = [Segment(ids, model=True), tool_turn(processor, example, "zoomed", [crop])]
    inputs = encode_trajectories(processor, [example], [turns], torch.device("cpu"))
    text = prompt_text(processor, example) + first + turns[1].text
    expected = processor(text=[text], return_tensors="pt", **processor_inputs(processor, [example], [[crop]]))
    assert torch.equal(inputs["input_ids"][0], expected["input_ids"][0])
    vision = torch.tensor([processor.image_token_id, getattr(processor, "video_token_id", processor.image_token_id)])
    tool_tokens = int(torch.isin(torch.tensor(turns[1].ids), vision).sum())
    assert int(torch.isin(inputs["input_ids"], vision).sum()) > tool_tokens > 0  # the video's tokens, the crop's
    assert set(expected) - {"input_ids", "attention_mask"} <= set(inputs)
    for key in set(expected) - {"input_ids", "attention_mask"}:
        assert torch.equal(inputs[key], expected[key]), key
    with torch.no_grad():
        assert (model(**inputs).logits - model(**expected).logits).abs().max() < 1e-5


def test_attention_maps_of_a_video_example_are_refused_in_one_line(capsys):
    from vlmrl.cli import main

    assert main(["attention", "no-model-needed", "--task", "motion"]) == 2
    assert capsys.readouterr().err == ("error: vlmrl attention draws attention over images; example 0 of task "
                                       "'motion' shows a video, which it does not draw yet\n")
