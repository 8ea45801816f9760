"""The Video record: a video as the model sees it, its frames sampled already, each with its time.

Tasks put videos in an `Example`; tools (`frames`, your own) return them: it lives here, below both
(tasks/ and tools/ import it; `vlmrl.tasks.Video` is its public name). No torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from PIL import Image

from vlmrl.errors import VlmrlError, require


@dataclass(frozen=True, init=False)
class Video:
    """A video as the model sees it: frames sampled already, each with its time in seconds.

    Every frame is an RGB image of the same size; times start at 0 or later and rise strictly. A
    one-frame video is allowed (its frame rate is taken as 1 per second). Checked when made: a
    `VlmrlError` in one line otherwise.
    """

    frames: tuple[Image.Image, ...]
    timestamps: tuple[float, ...]

    def __init__(self, frames, timestamps=None):
        frames = tuple(frames)
        times = tuple(float(t) for t in (timestamps if timestamps is not None else range(len(frames))))
        require((len(frames) >= 1, "a video needs at least one frame"),
                (len(times) == len(frames), f"a video of {len(frames)} frames needs as many timestamps, got {len(times)}"),
                (all(math.isfinite(t) and t >= 0 for t in times), f"video timestamps must be finite and >= 0: {times}"),
                (all(b > a for a, b in zip(times, times[1:])), f"video timestamps must rise strictly: {times}"))
        first = frames[0].size
        for k, frame in enumerate(frames):
            if frame.size != first:
                raise VlmrlError(f"video frame {k} is {frame.width}x{frame.height}; frame 0 is {first[0]}x{first[1]}: "
                                 "every frame of a video has the same size")
        object.__setattr__(self, "frames", tuple(f if f.mode == "RGB" else f.convert("RGB") for f in frames))
        object.__setattr__(self, "timestamps", times)

    @property
    def fps(self) -> float:
        """The mean frame rate: (frames - 1) / (last time - first time); 1.0 for one frame."""
        if len(self.frames) == 1:
            return 1.0
        return (len(self.frames) - 1) / (self.timestamps[-1] - self.timestamps[0])
