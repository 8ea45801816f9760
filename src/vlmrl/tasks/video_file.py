"""Video files as `Video`s: decoded by PyAV (its own FFmpeg), sampled to `fps` and `max_frames`.

`read_video(path, fps, max_frames)` keeps each frame's own time (the stream's timestamps, from the
first frame: a variable frame rate stays as it was recorded), takes at most `fps` frames per second
(the first frame at or after each 1 / fps step), then at most `max_frames` of those, spread evenly
from the first to the last (a 10000-frame file is decoded once for its times and once for the frames
kept, never held whole). What a file can get wrong is one line (`VlmrlError`), never a traceback:
a missing file, one that is not a video or is cut short before its first frame, a file with no
frames, a still image (a PNG or JPEG opens in FFmpeg as a video of one frame), a frame of another
size than the first (a resolution change), and an `fps` or `max_frames` that is not positive. A file cut short or damaged after its first frames (FFmpeg decodes what it
can and stops without an error) is one line too, found against what the file declares: frames that
end more than `CUT_SLACK_S` (and two frame intervals) before its video's declared end (the stream's
duration, else the container's when the video is its only stream; not the frame count, which an
mp4's edit list may put above the frames shown); it used to become a shorter video, silently. A file with one frame is a
one-frame video. No torch.
"""

from __future__ import annotations

import math
from pathlib import Path

from vlmrl.errors import VlmrlError, one_line
from vlmrl.tasks.base import Video

CUT_SLACK_S = 0.5
"""Seconds the decoded frames may end before the video's declared end (or two mean frame intervals,
whichever is more) before the file counts as cut short: the declared end is the last frame's time
plus its own duration, which a variable frame rate (a still held at the end) can make long. A file
cut within its last half second decodes to the frames it still has."""


def check_sampling(fps: float | None, max_frames: int | None, names: tuple[str, str] = ("fps", "max_frames"),
                   none: bool = True) -> None:
    """VlmrlError unless fps (frames per second to keep) is positive and finite and max_frames a
    positive integer (or, with `none`, None); the message names them as `names` (a dataset's
    `video_fps`, whose None is no value)."""
    if fps is not None or not none:
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
            raise VlmrlError(f"{names[0]} must be > 0{' (or none: every frame)' if none else ''}, got {fps!r}")
        if fps == math.inf:
            raise VlmrlError(f"{names[0]} must be a finite number of frames a second, got {fps!r}")
    if (max_frames is not None or not none) and (isinstance(max_frames, bool) or not isinstance(max_frames, int)
                                                 or max_frames < 1):
        raise VlmrlError(f"{names[1]} must be an integer >= 1{' (or none: no limit)' if none else ''}, "
                         f"got {max_frames!r}")


def sampled(times: list[float], fps: float | None, max_frames: int | None) -> list[int]:
    """Indices of the frames kept from frames at `times` (seconds, rising): at most `fps` a second
    (the first at or after each step of 1 / fps from the first frame), then at most `max_frames`,
    evenly spread over those, the first and the last included."""
    kept = list(range(len(times)))
    if fps is not None and times:
        kept, due = [], 0  # the next step of 1 / fps not yet given a frame
        for i, t in enumerate(times):
            step = math.floor((t - times[0]) * fps + 1e-9)  # the last step at or before t
            if step >= due:
                kept.append(i)
                due = step + 1
    if max_frames is not None and len(kept) > max_frames:
        if max_frames == 1:
            return kept[:1]
        kept = [kept[round(k * (len(kept) - 1) / (max_frames - 1))] for k in range(max_frames)]
    return kept


def read_video(path: str | Path, fps: float | None = None, max_frames: int | None = None) -> Video:
    """The video at `path`, sampled (see the module docstring); its times start at 0."""
    import av  # here: importing the tasks does not load FFmpeg

    check_sampling(fps, max_frames)
    path = Path(path)
    if not path.is_file():
        raise VlmrlError(f"video file {str(path)!r} does not exist")
    try:
        times = [frame.time for frame in _frames(av, path)]
        if not times:
            raise VlmrlError(f"video file {str(path)!r} has no frames")
        if cut := cut_short(times, declared_end(av, path)):
            raise VlmrlError(f"video file {str(path)!r} is cut short or damaged: {cut}")
        keep = set(sampled([t - times[0] for t in times], fps, max_frames))
        frames = [frame.to_image().convert("RGB") for i, frame in enumerate(_frames(av, path)) if i in keep]
    except (av.FFmpegError, OSError, ValueError) as error:
        raise VlmrlError(f"cannot read video file {str(path)!r}: {one_line(error)}") from error
    chosen = sorted(keep)
    try:
        return Video(frames, [times[i] - times[0] for i in chosen])
    except VlmrlError as error:  # a frame of another size (a resolution change): say which file
        raise VlmrlError(f"video file {str(path)!r}: {error}") from error


def declared_end(av, path: Path) -> float | None:
    """When the file says its first video stream ends, in seconds: the stream's duration, else the
    container's when the video is its only stream; None when it says neither."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        if stream.duration is not None and stream.time_base is not None:
            return float(((stream.start_time or 0) + stream.duration) * stream.time_base)
        if container.duration is not None and len(container.streams) == 1:
            return ((container.start_time or 0) + container.duration) / av.time_base
        return None


def cut_short(times: list[float], end: float | None) -> str | None:
    """Why decoded frames at `times` (seconds, rising) fall short of the `end` a file declares, or None."""
    interval = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    if end is not None and end - times[-1] > max(CUT_SLACK_S, 2 * interval):
        return f"its frames end at {times[-1]:.2f} s of the {end:.2f} s it declares"
    return None


def _frames(av, path: Path):
    """The decoded frames of the file's first video stream, in order, each with a time."""
    with av.open(str(path)) as container:
        if not container.streams.video:
            raise VlmrlError(f"file {str(path)!r} holds no video stream")
        demuxer = container.format.name  # a still image opens as one frame: png_pipe, jpeg_pipe, image2 ...
        if demuxer.endswith("_pipe") or demuxer == "image2":
            raise VlmrlError(f"file {str(path)!r} is a still image ({demuxer.removesuffix('_pipe')}), not a video "
                             "file: give images in the image column")
        for number, frame in enumerate(container.decode(video=0)):
            if frame.time is None:
                frame.pts = number  # a stream without timestamps: one frame per second
                frame.time_base = 1
            yield frame
