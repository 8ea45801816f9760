"""Video processors without torchvision: the Qwen family's, LLaVA-OneVision's and SmolVLM's video math on PIL and NumPy.

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
SmolVLM's model reads each frame as one more image (`image_seq_len` image tokens after a
`Frame from MM:SS:` line, an intro with the frame count and the duration first): the twin
(`FramesVideoPil`) resizes each frame by the family's own rule (longest edge to `size`, then the
square tile its image processor gives an unsplit image; a frame is the image path's unsplit image
exactly), and `OneImageStream` makes the family's processor write each video by its own frames
alone and put each row's image tiles and frames in one stream in text order (the family's own
`__call__` returns the videos' pixels in place of the images').
Frames come sampled already (an `Example`'s `Video`: frames and their times in seconds): nothing is
sampled here. The times reach the family's code as `VideoMetadata` (`metadata`; LLaVA-OneVision
reads none).
"""

from __future__ import annotations

import functools
import json
import math
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
    "fixed": every frame resized to the image processor's `size` (LLaVA-OneVision); "frames": every frame
    an image of the family's image stream (SmolVLM: `FramesVideoPil` and `OneImageStream`)."""


TWINS = {"Qwen2VLProcessor": Twin("qwen2"), "Qwen2_5_VLProcessor": Twin("qwen2"), "Qwen3VLProcessor": Twin("qwen3"),
         "LlavaOnevisionProcessor": Twin("fixed"), "SmolVLMProcessor": Twin("frames")}
"""Processor class name -> its video twin. A processor not listed here takes no video."""


def metadata(video: Video):
    """The `VideoMetadata` the family's processor reads: its `fps` the video's mean frame rate and
    its frame indices the times in frames, so that Qwen3-VL's `index / fps` is each frame's time and
    Qwen2.5-VL's `sampled_fps` the rate (`second_per_grid_ts` = temporal patch / rate)."""
    from transformers.video_utils import VideoMetadata

    rate = video.fps
    return VideoMetadata(total_num_frames=len(video.frames), fps=rate, width=video.frames[0].width,
                         height=video.frames[0].height, duration=video.timestamps[-1],
                         frames_indices=[frame_index(t, rate) for t in video.timestamps])


def frame_index(time: float, rate: float) -> float:
    """`time` x `rate`, moved up an ulp at a time until dividing it back by the rate gives `time` or
    just above: 3 x (2/11) / (2/11) is 2.9999999999999996 in floats, and SmolVLM floors each frame's
    time to the second (`Frame from 00:02` for a frame at 3 s)."""
    index = time * rate
    while index / rate < time:
        index = math.nextafter(index, math.inf)
    return index


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


class FramesVideoPil:
    """SmolVLM's video processor on PIL and NumPy: each frame resized so that its longest edge is
    `longest_edge` (the family's own `get_resize_output_image_size`: the other edge by the aspect
    ratio, rounded up to even), then to the square `tile` x `tile` its image processor gives every
    image it does not split, rescaled and normalized by that image processor's functions; videos of
    one batch padded with zero frames to the longest: (videos, frames, C, tile, tile) and the pixel
    mask (videos, frames, tile, tile), all 1 as the family's own gives it (every frame fills its tile;
    the model drops all-zero frames)."""

    model_input_names = ["pixel_values", "pixel_attention_mask"]

    def __init__(self, images, longest_edge: int, tile: int, sampling: dict):
        self.images, self.longest_edge, self.tile = images, longest_edge, tile
        self.num_frames, self.fps = sampling.get("max_frames"), sampling.get("fps")  # read by its chat template call

    def frame_pixels(self, frame) -> np.ndarray:
        """One frame, resized twice as the family's `resize` does, rescaled and normalized: (C, tile, tile)."""
        import torch
        from transformers.image_processing_backends import PilBackend
        from transformers.image_utils import SizeDict
        from transformers.models.smolvlm.video_processing_smolvlm import get_resize_output_image_size

        images = self.images
        array = np.asarray(frame.convert("RGB")).transpose(2, 0, 1)  # (C, H, W) uint8
        height, width = get_resize_output_image_size(torch.empty(0, *array.shape[1:]), self.longest_edge)
        for size in (SizeDict(height=height, width=width), SizeDict(height=self.tile, width=self.tile)):
            array = PilBackend.resize(images, array, size, resample=images.resample)
        array = PilBackend.rescale(images, array, images.rescale_factor)
        return PilBackend.normalize(images, array, images.image_mean, images.image_std)

    def __call__(self, videos, video_metadata=None, return_tensors=None, **unused):
        """Pixel values (V, T, C, tile, tile), zero frames after a shorter video's last, the pixel mask
        (V, T, tile, tile) and the metadata (each video's frame times)."""
        from transformers import BatchFeature

        longest = max(len(frames) for frames in videos)  # T
        pixels = np.zeros((len(videos), longest, 3, self.tile, self.tile), dtype=np.float32)  # (V, T, C, S, S)
        mask = np.ones((len(videos), longest, self.tile, self.tile), dtype=np.int64)  # (V, T, S, S)
        for v, frames in enumerate(videos):
            pixels[v, :len(frames)] = np.stack([self.frame_pixels(frame) for frame in frames])
        feature = BatchFeature(data={"pixel_values": pixels, "pixel_attention_mask": mask}, tensor_type=return_tensors)
        feature["video_metadata"] = list(video_metadata or [])
        return feature


FRAMES = "video_"
"""The prefix `OneImageStream` gives the video processor's outputs until they join the images'."""


class OneImageStream:
    """What a processor whose model reads video frames as images (SmolVLM) gains beside its video
    twin, so that the family's own processor code gives each video its tokens and the model its pixels.

    - Each video is written by the family's own `replace_video_token` (the intro with its frame
      count and duration, then per frame its `Frame from MM:SS:` and the frame's image tokens), given
      that video's frames alone: the family's reads the batch's padded frame count, which would
      make a video's prompt depend on the videos beside it.
    - The family's `__call__` returns the video processor's `pixel_values` in place of the image
      processor's; here each row's image tiles and video frames are put back in one stream, in the
      order its text places them (the processor's `text_replacement_offsets`: each image's tiles
      and each frame are `image_seq_len` image tokens), zero-padded to the longest row:
      (B, N, C, S, S) and the pixel mask (B, N, S, S), the image processor's layout, which the
      model reads in token order, dropping the all-zero padding.
    """

    def replace_video_token(self, video_inputs: dict, video_idx: int, **kwargs) -> str:
        """The family's text for video `video_idx`, from that video's own frames."""
        own = video_inputs["video_metadata"][video_idx].total_num_frames
        alone = {"pixel_values": video_inputs["pixel_values"][video_idx:video_idx + 1, :own],
                 "video_metadata": video_inputs["video_metadata"]}
        return super().replace_video_token(alone, video_idx, **kwargs)

    def _process_videos(self, videos, **kwargs):
        """The family's, its pixel outputs renamed (`FRAMES`) so that the images' are not overwritten."""
        processed, replacements = super()._process_videos(videos, **kwargs)
        return {(FRAMES + key if key in FramesVideoPil.model_input_names else key): value
                for key, value in processed.items()}, replacements

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        """The family's call; with videos, the images' tiles and the videos' frames in one stream."""
        if videos is None:
            return super().__call__(images=images, text=text, videos=videos, **kwargs)
        asked = kwargs.pop("return_text_replacement_offsets", False)
        out = super().__call__(images=images, text=text, videos=videos, return_text_replacement_offsets=True, **kwargs)
        offsets = out["text_replacement_offsets"] if asked else out.pop("text_replacement_offsets")
        frames = (out.pop(FRAMES + "pixel_values"), out.pop(FRAMES + "pixel_attention_mask"))
        tiles = (out.pop("pixel_values"), out.pop("pixel_attention_mask")) if images is not None else None
        out.update(one_stream(offsets, tiles, frames, self.image_token, self.image_seq_len))
        return out


def one_stream(offsets: list[list[dict]], tiles, frames, image_token: str, per_image: int) -> dict:
    """Each row's images (their tiles, `tiles`: (B, N_i, C, S, S) and masks) and videos (their frames,
    `frames`: (V, T, C, S, S) and masks) in the order its text places them (`offsets`, the
    processor's replacements in order; a replacement of k x `per_image` image tokens shows k
    images), zero-padded: pixel_values (B, N, C, S, S), pixel_attention_mask (B, N, S, S)."""
    import torch

    frames = tuple(torch.as_tensor(x) for x in frames)
    tiles = tuple(torch.as_tensor(x) for x in tiles) if tiles is not None else None
    video, rows = 0, []
    for b, replaced in enumerate(offsets):
        tile, row = 0, []
        for part in replaced:
            count = part["replacement"].count(image_token) // per_image
            if part["type"] == "video":
                row.append((frames[0][video, :count], frames[1][video, :count]))
                video += 1
            else:
                row.append((tiles[0][b, tile:tile + count], tiles[1][b, tile:tile + count]))
                tile += count
        rows.append((torch.cat([p for p, _ in row]), torch.cat([m for _, m in row])) if row else None)
    sample = frames[0][0, :0], frames[1][0, :0]  # (0, C, S, S), (0, S, S): an empty row
    rows = [row or sample for row in rows]
    longest = max(len(p) for p, _ in rows)  # N
    pixels = sample[0].new_zeros((len(rows), longest, *sample[0].shape[1:]))  # (B, N, C, S, S)
    masks = sample[1].new_zeros((len(rows), longest, *sample[1].shape[1:]))  # (B, N, S, S)
    for b, (p, m) in enumerate(rows):
        pixels[b, :len(p)], masks[b, :len(m)] = p, m
    return {"pixel_values": pixels, "pixel_attention_mask": masks}


@functools.cache
def with_mixin(cls: type, mixin: type) -> type:
    """`cls` with `mixin`'s methods first, under `cls`'s name (a saved processor still names the
    family's)."""
    derived = type(cls.__name__, (mixin, cls), {"__module__": cls.__module__, "__doc__": cls.__doc__})
    derived.__qualname__ = f"{mixin.__name__}[{cls.__qualname__}]"
    return derived


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
    if twin.rule == "frames":
        sampling = settings.get("video_sampling") or {}
        longest = (settings.get("size") or sampling.get("video_size") or images.size)["longest_edge"]
        tile = (settings.get("max_image_size") or images.max_image_size)["longest_edge"]
        processor.__class__ = with_mixin(type(processor), OneImageStream)
        processor.video_processor = FramesVideoPil(images, longest, tile, sampling)
        return
    low = settings.get("min_pixels", size["shortest_edge"])
    high = settings.get("max_pixels", size["longest_edge"])
    processor.video_processor = QwenVideoPil(twin.rule, images, low, high)


def takes_video(processor) -> bool:
    """Whether the processor has a video processor (its family's own, or a twin from here)."""
    return getattr(processor, "video_processor", None) is not None
