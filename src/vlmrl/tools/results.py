"""What a tool returns, normalised: text, images and videos a model can be shown, within the limits.

Every result is normalised (`_returned`): images decoded now, converted to RGB and padded (never
resampled) to a sane shape (`MIN_SIDE`, `MAX_ASPECT`: the processors refuse extreme aspects); each
video's frames likewise, at most MAX_VIDEO_FRAMES of them; text made valid UTF-8 (a lone surrogate
becomes "?") and cut to the limit. A value that breaks a limit or cannot be read is a failed result.
"""

from __future__ import annotations

import math
from typing import Any

from PIL import Image

from vlmrl.data.images import to_rgb
from vlmrl.data.video import Video
from vlmrl.tools.contract import ToolLimits, ToolResult, error_result, valid_text


TRUNCATED = "\n[truncated: {n} more characters]"
"""Appended to a tool's text cut to `ToolLimits.max_text_chars` ({n}: the characters dropped)."""
MIN_SIDE = 28
"""Shortest side of a returned image; a smaller image is padded (black, centred) to it."""
MAX_ASPECT = 20
"""Largest long side / short side of a returned image; a thinner one is padded (black, centred) to
it (Qwen2-VL's processor refuses 200 and more, and a 2 x 1000 strip is no picture for any model)."""
MAX_VIDEO_FRAMES = 64
"""Most frames of a video a tool returns; a longer one makes the call "too_large"."""


def sane_size(width: int, height: int) -> tuple[int, int]:
    """(width, height) with each side raised to at least MIN_SIDE and the long side / MAX_ASPECT."""
    floor = max(MIN_SIDE, math.ceil(max(width, height) / MAX_ASPECT))
    return max(width, floor), max(height, floor)


def sane_image(image: Image.Image) -> Image.Image:
    """`image` as RGB (`to_rgb`: transparency laid over white, 16-bit and float greys scaled), padded
    (black, centred; no pixel resampled) to `sane_size`."""
    rgb = to_rgb(image)
    size = sane_size(*rgb.size)
    if size == rgb.size:
        return rgb
    canvas = Image.new("RGB", size)
    canvas.paste(rgb, ((size[0] - rgb.width) // 2, (size[1] - rgb.height) // 2))
    return canvas


def _returned_image(name: str, image: Image.Image, limits: ToolLimits) -> Image.Image | ToolResult:
    """A returned image checked against the limit, decoded now (a lazily opened file that is truncated
    fails here, not in the processor), RGB and of a sane shape (`sane_image`); or the failed result."""
    width, height = image.size
    if width * height > limits.max_image_pixels:
        return error_result("too_large", f"tool {name} returned a {width}x{height} image ({width * height} "
                                    f"pixels); the limit is {limits.max_image_pixels} pixels")
    if width * height == 0:
        return error_result("raised", f"tool {name} returned an empty {width}x{height} image")
    width, height = sane_size(width, height)
    if width * height > limits.max_image_pixels:  # a strip too long to pad within the limit
        return error_result("too_large", f"tool {name} returned an image that is {width}x{height} pixels once "
                                    f"padded to a sane shape; the limit is {limits.max_image_pixels} pixels")
    try:
        image.load()
        return sane_image(image)
    except Exception as error:  # a truncated or corrupt file, a mode with no RGB form
        return error_result("raised", f"tool {name} returned an image that cannot be decoded: "
                                 f"{type(error).__name__}: {error}")


def _returned_video(name: str, video: Video, limits: ToolLimits) -> Video | ToolResult:
    """A returned video: at most MAX_VIDEO_FRAMES frames, each checked as a returned image; or the
    failed result."""
    if len(video.frames) > MAX_VIDEO_FRAMES:
        return error_result("too_large", f"tool {name} returned a video of {len(video.frames)} frames; the limit is "
                                    f"{MAX_VIDEO_FRAMES} frames")
    frames = [_returned_image(name, frame, limits) for frame in video.frames]
    failed = next((frame for frame in frames if isinstance(frame, ToolResult)), None)
    return failed if failed is not None else Video(frames, video.timestamps)


def _returned(name: str, value: Any, limits: ToolLimits) -> ToolResult:
    """A tool's return value as a normalised ToolResult: text valid and cut to the limit; images and
    each video's frames checked against the limits, decoded now, RGB and of a sane shape
    (`_returned_image`)."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    wrong = [item for item in items if not isinstance(item, (str, Image.Image, Video))]
    if wrong:
        return error_result("raised", f"tool {name} returned {type(wrong[0]).__name__}; a tool returns text, "
                                 "a PIL image, a vlmrl.tasks.Video, or a list of those")
    media = [_returned_image(name, item, limits) if isinstance(item, Image.Image) else _returned_video(name, item, limits)
             for item in items if not isinstance(item, str)]
    failed = next((item for item in media if isinstance(item, ToolResult)), None)
    if failed is not None:
        return failed
    text = valid_text("\n".join(item for item in items if isinstance(item, str)))
    if len(text) > limits.max_text_chars:
        text = text[:limits.max_text_chars] + TRUNCATED.format(n=len(text) - limits.max_text_chars)
    return ToolResult(text=text, images=[m for m in media if isinstance(m, Image.Image)],
                      videos=[m for m in media if isinstance(m, Video)])
