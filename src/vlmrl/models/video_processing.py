"""Video processors without torchvision: the Qwen family's and LLaVA-OneVision's video math on PIL and NumPy.

In transformers 5.x every video processor resizes through torchvision (`BaseVideoProcessor`'s
backend), which has no working CPU build here: Qwen3-VL's video module imports, but its first call
fails in `convert_to_rgb`/`resize`, and Qwen2-VL's does not import at all. vlmrl's processors are
built without their video slot (processing.py); `attach_video` puts this module's twin in it for a
family listed in `TWINS`, so `processor(text=..., videos=...)` runs the family's own processor code
(its `replace_video_token`: Qwen3-VL's per-frame `<t seconds>` blocks, Qwen2.5-VL's
`second_per_grid_ts`) on pixels computed here.

The twin computes what the family's video processor computes, step by step:
- one size for every frame of a video, by the family's own `smart_resize`: Qwen2-VL's (and
  Qwen2.5-VL's) is the image rule per frame (`image_processing_pil_qwen2_vl.smart_resize`),
  Qwen3-VL's bounds frames x height x width (`video_processing_qwen3_vl.smart_resize`);
- each frame resized, rescaled and normalized by the family's PIL image processor (the image path's
  own functions: a video of two equal frames gives the image's pixel values exactly,
  tests/test_video.py);
- frames padded to a multiple of `temporal_patch_size` by repeating the last, and cut into patches
  in the family's layout (`patchify`: grid_t x merged rows x merged cols, each patch
  channel x time x row x col), checked against Qwen3-VL's own torch `patchify`.
LLaVA-OneVision's video processor resizes every frame to its fixed `size`, rescales and normalizes
(CLIP mean and std): the twin (`FixedSizeVideoPil`) does it with the family's PIL image processor's
own functions (a frame gives the image path's base-resolution tile exactly), and returns
(videos, frames, C, H, W); the model pools each frame's features 2 x 2 and adds one newline per
video, which the family's processor counts. Its videos of one batch must have as many frames.
Frames come sampled already (an `Example`'s `Video`: frames and their times in seconds): nothing is
sampled here. The times reach the family's code as `VideoMetadata` (`metadata`; LLaVA-OneVision
reads none).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlmrl.tasks import Video

VIDEO_CONFIG = "video_preprocessor_config.json"
"""A model folder's video processor settings (read for size, mean and std where present)."""


@dataclass(frozen=True)
class Twin:
    """Which size rule a family's video processor uses, and its defaults."""

    rule: str
    """"qwen2": the image rule per frame; "qwen3": frames x height x width bounded together;
    "fixed": every frame resized to the image processor's `size` (LLaVA-OneVision)."""


TWINS = {"Qwen2VLProcessor": Twin("qwen2"), "Qwen2_5_VLProcessor": Twin("qwen2"), "Qwen3VLProcessor": Twin("qwen3"),
         "LlavaOnevisionProcessor": Twin("fixed")}
"""Processor class name -> its video twin. A processor not listed here takes no video."""


def metadata(video: Video):
    """The `VideoMetadata` the family's processor reads: its `fps` the video's mean frame rate and
    its frame indices the times in frames, so that Qwen3-VL's `index / fps` is each frame's time and
    Qwen2.5-VL's `sampled_fps` the rate (`second_per_grid_ts` = temporal patch / rate)."""
    from transformers.video_utils import VideoMetadata

    rate = video.fps
    return VideoMetadata(total_num_frames=len(video.frames), fps=rate, width=video.frames[0].width,
                         height=video.frames[0].height, duration=video.timestamps[-1],
                         frames_indices=[t * rate for t in video.timestamps])


class QwenVideoPil:
    """The Qwen family's video processor on PIL and NumPy (see the module docstring)."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, rule: str, images, min_pixels: int, max_pixels: int):
        from transformers import Qwen2VLImageProcessorPil

        self.rule = rule
        self.patch_size, self.merge_size = images.patch_size, images.merge_size
        self.temporal_patch_size = images.temporal_patch_size
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.images = Qwen2VLImageProcessorPil(
            min_pixels=min_pixels, max_pixels=max_pixels, patch_size=self.patch_size, merge_size=self.merge_size,
            temporal_patch_size=self.temporal_patch_size, image_mean=list(images.image_mean),
            image_std=list(images.image_std), resample=images.resample,
            rescale_factor=images.rescale_factor)

    def frame_size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """(height, width) every frame of a video is resized to, by the family's rule."""
        factor = self.patch_size * self.merge_size
        if self.rule == "qwen3":
            from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

            return smart_resize(max(frames, self.temporal_patch_size), height, width,
                                temporal_factor=self.temporal_patch_size, factor=factor,
                                min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        return smart_resize(height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)

    def frame_pixels(self, frame, size: tuple[int, int]) -> np.ndarray:
        """One frame resized to `size`, rescaled and normalized by the image path's own functions: (C, H, W)."""
        from transformers.image_processing_backends import PilBackend
        from transformers.image_utils import SizeDict

        images = self.images
        array = np.asarray(frame.convert("RGB")).transpose(2, 0, 1)  # (C, H, W) uint8, as the image path reads it
        array = PilBackend.resize(images, array, SizeDict(height=size[0], width=size[1]), resample=images.resample)
        array = PilBackend.rescale(images, array, images.rescale_factor)
        return PilBackend.normalize(images, array, images.image_mean, images.image_std)

    def patchify(self, video: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Frames (T, C, H, W) -> patches (grid_t * grid_h * grid_w, C * temporal * patch * patch) and the
        grid, in the family's layout; T padded to a multiple of the temporal patch with the last frame."""
        temporal, patch, merge = self.temporal_patch_size, self.patch_size, self.merge_size
        if pad := -len(video) % temporal:
            video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])  # (T', C, H, W)
        frames, channels, height, width = video.shape
        grid = (frames // temporal, height // patch, width // patch)
        patches = video.reshape(grid[0], temporal, channels, grid[1] // merge, merge, patch,
                                grid[2] // merge, merge, patch)
        patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (t, rows, cols, mh, mw, C, temporal, ph, pw)
        return patches.reshape(grid[0] * grid[1] * grid[2], channels * temporal * patch * patch), grid

    def __call__(self, videos, video_metadata=None, return_tensors=None, **unused):
        """Pixel values and grids of a batch of videos (each a list of PIL frames, as
        `rollout.prompts.processor_inputs` passes them), with their metadata."""
        from transformers import BatchFeature

        if video_metadata is None or len(video_metadata) != len(videos):
            raise ValueError(f"{len(videos)} videos need as many video_metadata (their frame times)")
        pixels, grids = [], []
        for frames in videos:
            size = self.frame_size(len(frames), frames[0].height, frames[0].width)
            patches, grid = self.patchify(np.stack([self.frame_pixels(f, size) for f in frames]))
            pixels.append(patches.astype(np.float32))
            grids.append(list(grid))
        data = {"pixel_values_videos": np.concatenate(pixels), "video_grid_thw": np.array(grids, dtype=np.int64)}
        feature = BatchFeature(data=data, tensor_type=return_tensors)
        feature["video_metadata"] = list(video_metadata)
        return feature


class FixedSizeVideoPil:
    """LLaVA-OneVision's video processor on PIL and NumPy: every frame resized to (height, width),
    rescaled and normalized by the family's PIL image processor's functions; (V, T, C, H, W)."""

    model_input_names = ["pixel_values_videos"]

    def __init__(self, images, height: int, width: int):
        self.images, self.height, self.width = images, height, width

    def frame_pixels(self, frame) -> np.ndarray:
        """One frame at (height, width), rescaled and normalized: (C, H, W)."""
        from transformers.image_processing_backends import PilBackend
        from transformers.image_utils import SizeDict

        images = self.images
        array = np.asarray(frame.convert("RGB")).transpose(2, 0, 1)  # (C, H, W) uint8
        array = PilBackend.resize(images, array, SizeDict(height=self.height, width=self.width),
                                  resample=images.resample)
        array = PilBackend.rescale(images, array, images.rescale_factor)
        return PilBackend.normalize(images, array, images.image_mean, images.image_std)

    def __call__(self, videos, video_metadata=None, return_tensors=None, **unused):
        """Pixel values (V, T, C, H, W) of a batch of videos of T frames each, with their metadata."""
        from transformers import BatchFeature

        if len({len(frames) for frames in videos}) > 1:
            raise ValueError(f"the videos of one batch must have as many frames each for this family; got "
                             f"{sorted({len(frames) for frames in videos})}")
        pixels = np.stack([np.stack([self.frame_pixels(f) for f in frames]) for frames in videos]).astype(np.float32)
        feature = BatchFeature(data={"pixel_values_videos": pixels}, tensor_type=return_tensors)
        feature["video_metadata"] = list(video_metadata or [])
        return feature


def saved_settings(folder: str | None) -> dict:
    """The folder's `video_preprocessor_config.json` as a dict ({} where it has none)."""
    saved = Path(folder) / VIDEO_CONFIG if folder else None
    return json.loads(saved.read_text()) if saved is not None and saved.is_file() else {}


def attach_video(processor, folder: str | None = None) -> None:
    """Give `processor` (built without its video slot) the twin of its family's video processor, when
    `TWINS` lists the family: sizes from the folder's `video_preprocessor_config.json` where it has
    one (`size`: shortest/longest edge or height/width; `min_pixels`/`max_pixels`), else the image
    processor's."""
    twin = TWINS.get(type(processor).__name__)
    if twin is None or getattr(processor, "video_processor", None) is not None:
        return
    images, settings = processor.image_processor, saved_settings(folder)
    size = {key: images.size[key] for key in ("height", "width", "shortest_edge", "longest_edge")
            if images.size.get(key) is not None} | (settings.get("size") or {})
    if twin.rule == "fixed":
        processor.video_processor = FixedSizeVideoPil(images, size["height"], size["width"])
        return
    low = settings.get("min_pixels", size["shortest_edge"])
    high = settings.get("max_pixels", size["longest_edge"])
    processor.video_processor = QwenVideoPil(twin.rule, images, low, high)


def takes_video(processor) -> bool:
    """Whether the processor has a video processor (its family's own, or a twin from here)."""
    return getattr(processor, "video_processor", None) is not None
