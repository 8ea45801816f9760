"""The `frames` tool: a time window of an example's video at its full rate and resolution, a few
frames at a time; every bad call is the model's error turn, never the run's."""

from __future__ import annotations

import re

import pytest
from PIL import Image

from vlmrl.tasks import Example, Video
from vlmrl.tools import ToolCall, ToolContext, ToolLimits, frames, resolve_tools, run_tool
from vlmrl.tools.video_tools import FRAMES_PER_CALL


def clip(n: int = 10, side: int = 64) -> Video:
    """n frames, 0.1 s apart, frame k a flat grey 20 * k."""
    return Video([Image.new("RGB", (side, side), (20 * k,) * 3) for k in range(n)], [k / 10 for k in range(n)])


def greys(images) -> list[int]:
    return [image.getpixel((0, 0))[0] // 20 for image in images]


def test_a_window_gives_up_to_four_frames_spread_from_its_first_to_its_last():
    context = ToolContext([], max_side=128, videos=[clip()])
    text, video = frames(context, 0.2, 0.9)  # frames 2..9: 8 frames, 4 of them at ranks 0, 2, 5, 7
    assert greys(video.frames) == [2, 4, 7, 9] and text == "frames at 0.2, 0.4, 0.7, 0.9 s"
    assert video.timestamps == (0.2, 0.4, 0.7, 0.9)
    assert all(image.size == (128, 128) for image in video.frames) and len(video.frames) == FRAMES_PER_CALL
    text, video = frames(context, 0.25, 0.45)
    assert greys(video.frames) == [3, 4] and text == "frames at 0.3, 0.4 s"
    text, video = frames(context, 0.5, 0.5)
    assert text == "frames at 0.5 s" and video.timestamps == (0.5,)


@pytest.mark.parametrize("arguments, message", [
    ({"start": 0.5, "end": 0.2}, "start must be <= end; got start=0.5, end=0.2"),
    ({"start": 2.0, "end": 3.0}, "no frame between 2 and 3 s; the video's frames run from 0 to 0.9 s"),
    ({"start": "a", "end": 1}, "start must be a number of seconds; got 'a'"),
    ({"start": 0, "end": float("nan")}, "end must be a number of seconds"),
    ({"start": 0, "end": 1, "video": 1}, r"video must be a whole number from 0 to 0 \(the example has 1 video\)"),
    ({"start": 0, "end": 1, "video": True}, "video must be a whole number"),
])
def test_a_bad_call_is_an_error_turn_for_the_model(arguments, message):
    context = ToolContext([], videos=[clip()])
    result = run_tool(ToolCall("frames", arguments), resolve_tools(["frames"]), context, ToolLimits())
    assert result.error == "bad_arguments" and result.images == []
    assert re.search(message, result.text), result.text


def test_an_example_without_a_video_says_so():
    result = run_tool(ToolCall("frames", {"start": 0, "end": 1}), resolve_tools(["frames"]), ToolContext([]),
                      ToolLimits())
    assert result.error == "bad_arguments" and "the example has no video to look at" in result.text


def test_the_tool_reads_the_originals_and_leaves_them_as_they_are():
    shown, original = clip(2, side=16), clip(10, side=64)
    example = Example(prompt="?", videos=[shown], video_originals=[original])
    assert Example(prompt="?", videos=[shown]).video_originals == [shown]  # default: what the model sees
    context = ToolContext([], max_side=32, videos=example.video_originals)
    before = [frame.tobytes() for frame in original.frames]
    _, video = frames(context, 0.0, 0.3)
    assert greys(video.frames) == [0, 1, 2, 3] and video.frames[0].size == (32, 32)
    assert [frame.tobytes() for frame in original.frames] == before


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "smolvlm", "idefics3"])
def test_a_frames_call_in_a_rollout_shows_the_window_and_trains_packed_as_plain(arch, tiny_model_factory):
    """A scripted model calls `frames` on a video prompt: the tool turn holds the window's frames at
    tool_image_side, as a video where the family takes video (Qwen2.5-VL, SmolVLM: its video's frames
    and the prompt's in one stream), else as images (Idefics3, whose prompt is then an image); the
    trajectory's packed log-probs and gradients equal the plain path's."""
    import torch

    from vlmrl.config import load_config
    from vlmrl.models import load_policy
    from vlmrl.rollout.generation import stop_token_ids
    from vlmrl.rollout.tool_rollout import ToolBox, generate_trajectories
    from vlmrl.training.logprobs import LogprobScorer

    model, processor = load_policy(tiny_model_factory(arch), device="cpu")
    call = '<tool_call>\n{"name": "frames", "arguments": {"start": 0.3, "end": 0.6}}\n</tool_call>'
    turns = [[call, "<answer>right</answer>"], ["<answer>left</answer>"]]
    stop, pad, calls = stop_token_ids(processor, model)[0], processor.tokenizer.pad_token_id, [0]

    def generate(**kwargs):  # writes turns[row][k] as row k's turn, after a real prefill
        k, calls[0] = calls[0], calls[0] + 1
        texts = [processor.tokenizer(t[k], add_special_tokens=False).input_ids
                 + ([] if t[k].endswith("</tool_call>") else [stop]) for t in turns if len(t) > k]
        width = max(len(t) for t in texts)
        return torch.cat([kwargs["input_ids"], torch.tensor([t + [pad] * (width - len(t)) for t in texts])], dim=1)

    video = arch != "idefics3"
    shown = {"videos": [clip(2, side=28)]} if video else {"images": [clip(1, side=28).frames[0]]}
    example = Example(prompt="Which way?", answer="right", video_originals=[clip(10)], **shown)
    plain_generate, model.generate = model.generate, generate
    config = load_config(None, ["rollout.group_size=2", "rollout.max_new_tokens=40", "rollout.tools=[frames]",
                                "rollout.tool_image_side=56"]).rollout
    rollout = generate_trajectories(model, processor, [example], ToolBox.from_config(config))
    model.generate = plain_generate
    tool = rollout.trajectories[0].turns[1]
    assert tool.role == "tool" and tool.error is None and "frames at 0.3, 0.4, 0.5, 0.6 s" in tool.text
    assert greys(tool.images) == [3, 4, 5, 6] and all(image.size == (56, 56) for image in tool.images)
    segment = rollout.segments[0][1]
    if video:
        assert len(segment.videos) == 1 and segment.images == []
    if arch == "qwen2_5_vl":  # one video of 4 frames: 2 temporal slots of 2 x 2 merged patches
        assert segment.ids.count(processor.video_token_id) == 2 * 2 * 2
    if not video:
        assert segment.videos == [] and greys(segment.images) == [3, 4, 5, 6]
    results = {}
    for pack in (False, True):
        model.zero_grad()
        logp, _ = LogprobScorer(processor, 1.0, pack, 5)(model, rollout)  # (N, T)
        logp.sum().backward()
        results[pack] = (logp.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert (results[False][0] - results[True][0]).abs().max() < 1e-5
    assert torch.nn.functional.cosine_similarity(results[False][1], results[True][1], dim=0) >= 0.9999
