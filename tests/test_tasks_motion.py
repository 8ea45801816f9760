"""The motion task: a video whose answer is in the order of its frames, not in any one of them."""

from __future__ import annotations

import subprocess
import sys

import pytest
from PIL import Image, ImageSequence

from vlmrl.errors import VlmrlError
from vlmrl.tasks import get_task
from vlmrl.tasks.base import in_split
from vlmrl.tasks.inspect import show_task
from vlmrl.tasks.motion import DIRECTIONS, Path


def frames_bytes(example) -> list[bytes]:
    return [frame.tobytes() for frame in example.videos[0].frames]


def test_examples_are_deterministic_and_depend_on_seed_and_split():
    a, b, other = get_task("motion", seed=5), get_task("motion", seed=5), get_task("motion", seed=6)
    for split in ("train", "test"):
        for idx in (0, 7, 123456):
            x, y = a.example(idx, split), b.example(idx, split)
            assert frames_bytes(x) == frames_bytes(y) and x.meta == y.meta and x.prompt == y.prompt
    assert [frames_bytes(a.example(i)) for i in range(5)] != [frames_bytes(other.example(i)) for i in range(5)]


def test_train_and_test_are_disjoint_by_content():
    task = get_task("motion", seed=1, objects=2)
    for idx in range(40):
        for split in ("train", "test"):
            meta = task.example(idx, split).meta
            key = ";".join(f"{c},{d},{x},{y}" for c, d, x, y in meta["paths"])
            assert in_split(key, "test") == (split == "test")


def test_a_video_has_its_frames_at_their_times_and_every_square_inside():
    task = get_task("motion", frames=5, fps=4, image_size=96, objects=3)
    example = task.example(2)
    video = example.videos[0]
    assert video.timestamps == (0.0, 0.25, 0.5, 0.75, 1.0) and example.images == []
    assert all(frame.size == (96, 96) and frame.mode == "RGB" for frame in video.frames)
    side, travel = 24, 48  # 0.25 and 0.5 of 96
    for idx in range(100):
        for colour, direction, x, y in task.example(idx).meta["paths"]:
            for k in range(5):
                left, top = Path(colour, direction, (x, y)).corner(k, 5, side, travel)
                assert 0 < left and left + side < 96 and 0 < top and top + side < 96


def test_the_opposite_direction_is_the_same_frames_reversed():
    """Moving left visits moving right's positions in the opposite order: no frame alone (the middle
    one least of all: the centre either way, for an odd count) tells them apart; the order does."""
    task = get_task("motion", frames=5)
    right = task.frames([Path("red", "right", (56, 40))])
    left = task.frames([Path("red", "left", (56, 40))])
    assert [f.tobytes() for f in right] == [f.tobytes() for f in reversed(left)]
    assert right[2].tobytes() == left[2].tobytes()
    assert right[0].getpixel((56 - 14 - 14, 40)) == (220, 40, 40)  # starts 14 px left of its centre's square
    assert right[0].getpixel((56 + 14 + 13, 40)) == (255, 255, 255)


def test_answers_cover_the_directions_asked_for():
    seen = {get_task("motion", seed=3).example(i).answer for i in range(60)}
    assert seen == set(DIRECTIONS)
    assert {get_task("motion", directions="left,right").example(i).answer for i in range(40)} == {"left", "right"}
    prompt = get_task("motion", directions="up,down").example(0).prompt
    assert "move: up or down?" in prompt and prompt.startswith("<video>")


@pytest.mark.parametrize("completion, scores", [
    ("<think> It goes from left to right. </think> <answer> right </answer>", (1.0, 1.0)),
    ("<think> x </think> <answer>Right.</answer>", (1.0, 1.0)),
    ("<answer> right </answer>", (0.0, 1.0)),
    ("<think> x </think> <answer> left </answer>", (1.0, 0.0)),
    ("<think> x </think> <answer> left right </answer>", (1.0, 0.0)),
    ("<think> x </think> <answer> right or left </answer>", (1.0, 0.0)),
    ("<think> x </think> <answer> right </answer> <answer> right </answer>", (0.0, 0.0)),
    ("right", (0.0, 0.0)),
    ("", (0.0, 0.0)),
])
def test_the_reward_pays_one_right_word_and_the_format(completion, scores):
    task = get_task("motion", seed=0, directions="left,right")
    example = next(e for e in (task.example(i) for i in range(20)) if e.answer == "right")
    result = task.score(example, completion)
    assert (result["format"], result["accuracy"]) == scores and result["total"] == sum(scores)


def test_the_reference_scores_the_maximum():
    task = get_task("motion", objects=2)
    for idx in range(50):
        example = task.example(idx, "test")
        assert task.score(example, example.reference_completion)["total"] == 2.0


@pytest.mark.parametrize("params, message", [
    ({"frames": 1}, "frames must be in 2..64, got 1"),
    ({"fps": 0}, r"fps must be in \(0, 60\], got 0"),
    ({"travel": 0.9}, r"travel must be in \(0, 1 - square\], got 0.9"),
    ({"objects": 4}, "objects must be in 1..3, got 4"),
    ({"directions": "left"}, "directions must be two or more distinct names"),
    ({"directions": "left,sideways"}, "directions must be two or more distinct names"),
])
def test_bad_parameters_are_one_line(params, message):
    with pytest.raises(VlmrlError, match=message):
        get_task("motion", **params)


def test_show_writes_each_video_as_a_gif(tmp_path):
    text = show_task("motion", {"frames": "3", "fps": "4"}, n=1, out_dir=str(tmp_path))
    gif = tmp_path / "motion_train_0_video.gif"
    assert f"video: 3 frames 112x112 at 0, 0.25, 0.5 s -> {gif}" in text
    with Image.open(gif) as shown:
        frames = [frame.copy().convert("RGB") for frame in ImageSequence.Iterator(shown)]
        assert len(frames) == 3 and shown.info["duration"] == 250
    example = get_task("motion", frames=3, fps=4).example(0)
    assert [f.tobytes() for f in frames] == frames_bytes(example)


def test_the_task_imports_no_torch():
    code = ("import sys\nfrom vlmrl.tasks import get_task\nt = get_task('motion'); e = t.example(0)\n"
            "t.score(e, e.reference_completion)\nprint('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_a_bouncing_square_shown_in_two_frames_needs_the_frames_tool():
    """Bouncing, the square ends where it started: the two frames shown are the same picture; the
    reference calls `frames` on the first half of the full video, which shows the way it went."""
    import json

    from vlmrl.tools import ToolContext, frames

    task = get_task("motion", bounce=True, frames=9, view_frames=2, directions="left,right")
    example = task.example(4)
    shown, full = example.videos[0], example.video_originals[0]
    assert len(shown.frames) == 2 and shown.timestamps == (0.0, 4.0) and len(full.frames) == 9
    assert shown.frames[0].tobytes() == shown.frames[1].tobytes() == full.frames[0].tobytes()
    assert "move first:" in example.prompt and example.reference_completion.endswith(
        f"and back. </think> <answer> {example.answer} </answer>")
    call, answer = example.meta["reference_turns"]
    arguments = json.loads(call.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))["arguments"]
    assert arguments == {"start": 0, "end": 2.0} and answer == example.reference_completion
    _, looked = frames(ToolContext([], max_side=112, videos=example.video_originals), **arguments)
    row = example.meta["paths"][0][3]  # the path's centre row
    red = [[x for x in range(112) if image.getpixel((x, row)) != (255, 255, 255)] for image in looked.frames]
    moved = red[-1][0] - red[0][0]  # the square's left edge: the window's last frame (the far end) minus its first
    assert (moved > 0) == (example.answer == "right") and abs(moved) == 56  # the whole travel, 0.5 of 112
    assert "reference_turns" not in get_task("motion").example(4).meta


def test_view_frames_must_fit_the_video():
    with pytest.raises(VlmrlError, match=r"view_frames must be 0 \(all\) or in 2..frames \(4\), got 5"):
        get_task("motion", view_frames=5)
