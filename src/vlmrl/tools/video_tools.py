"""The built-in video tool: `frames`.

`frames` returns up to FRAMES_PER_CALL frames of a time window of an example's video at its full
frame rate and resolution (`Example.video_originals`: the example may show fewer, smaller frames),
as a short video (a `vlmrl.tasks.Video`), for a model that wants to look again at a moment. The
rollout shows a returned video as a video where the model's family takes video, else as its frames,
each an image (frames as images).
"""

from __future__ import annotations

import math
from typing import Any

from PIL import Image

from vlmrl.data.video import Video
from vlmrl.tools.contract import ToolContext
from vlmrl.tools.image_tools import fit_side


FRAMES_PER_CALL = 4
"""Most frames one call of `frames` returns."""


def _seconds(name: str, value: Any) -> float:
    """`value` as a finite number of seconds; ValueError naming `name` for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number of seconds; got {value!r}")
    return float(value)


def frames(context: ToolContext, start: float, end: float, video: int = 0) -> list:
    """Look again at a time window: up to FRAMES_PER_CALL frames of video number `video` at its full
    frame rate and resolution (the original the example's video was sampled from), those whose times
    lie in [start, end] seconds, spread evenly from the first to the last of them, each resized
    (LANCZOS, aspect kept) so that its longest side is `context.max_side`, as a Video with their
    times; first a line naming the times. ValueError for a bad video number, a window that is not two numbers with start <= end,
    or one that holds no frame."""
    count = len(context.videos)
    if isinstance(video, bool) or not isinstance(video, int) or not 0 <= video < max(count, 1) or not count:
        raise ValueError(f"video must be a whole number from 0 to {count - 1} (the example has {count} "
                         f"video{'s' if count != 1 else ''}); got {video!r}" if count else
                         "the example has no video to look at")
    first, last = _seconds("start", start), _seconds("end", end)
    if first > last:
        raise ValueError(f"start must be <= end; got start={first:g}, end={last:g}")
    original = context.videos[video]
    inside = [k for k, t in enumerate(original.timestamps) if first - 1e-9 <= t <= last + 1e-9]
    if not inside:
        times = original.timestamps
        raise ValueError(f"no frame between {first:g} and {last:g} s; the video's frames run from {times[0]:g} "
                         f"to {times[-1]:g} s")
    if len(inside) > FRAMES_PER_CALL:
        inside = [inside[round(k * (len(inside) - 1) / (FRAMES_PER_CALL - 1))] for k in range(FRAMES_PER_CALL)]
    shown = [original.frames[k].convert("RGB") for k in inside]
    images = [frame.resize(fit_side(*frame.size, context.max_side), Image.Resampling.LANCZOS) for frame in shown]
    times = [original.timestamps[k] for k in inside]
    return [f"frames at {', '.join(f'{t:g}' for t in times)} s", Video(images, times)]
