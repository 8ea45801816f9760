"""The model behind the `depth` tool: a monocular depth estimator (Depth Anything, DPT) run on image crops,
its depth map given back in each crop's own pixels.

`DepthRunner` loads a checked folder (config.json of model type depth_anything or dpt) with its image
processor read with the PIL backend (no torchvision here): `DPTImageProcessorPil`, which resizes with PIL,
so the processor itself prepares the pixels. What it does to an image is computed here too, to undo it on
the prediction (`input_geometry`): a resize to its size, either stretched (DPT-Large: 384 x 384) or
aspect kept, scaled as little as possible and rounded to a multiple of `ensure_multiple_of` (Depth
Anything: the short side to 518, both sides multiples of 14); then, with `do_pad`, a centred pad to a
multiple of `size_divisor` (DPT with a DINOv2 backbone: no resize, padded to a multiple of 14). The
model reads the input's whole patches (floor(side / patch) x patch pixels), and its prediction spans
them, at whatever resolution it comes out; `original_depth` cuts the pad off (after scaling the
prediction to those pixels) and resizes what is left to the crop's size, bicubic, as transformers'
own `post_process_depth_estimation` does (exactly that where nothing is padded).

What a map means: Depth Anything's relative checkpoints and every DPT give relative inverse depth
(disparity: larger is nearer, unknown scale and shift); Depth Anything's metric checkpoints
(`depth_estimation_type: metric`) give metres (larger is farther). `run` hands each map back with which
of the two it is. Crops whose inputs come out the same size run in one forward (DPT-Large: all;
Depth Anything: those of the same shape); a model that runs out of memory frees the cache and raises,
which the tool call turns into an error turn.

`build_tiny(out, arch, seed)` (`vlmrl tiny-model OUT --tool depth [--arch ...]`) writes a tiny Depth
Anything (DINOv2 backbone; 34k parameters), DPT (ViT backbone, a square input) or DPT with a DINOv2
backbone (padded input), in well under a second, whose depth is a known function of the pixels: its
transformer layers are identities (DINOv2's layer scale at 0; ViT's output projections at 0), each patch's
token holds the mean of its normalised pixels in channel 0, the neck and the head carry that channel
through (the 3x3 convolutions' centre taps, the transposed convolutions as nearest upsampling, the
residual units off, the fusion stages summing 4 copies), and the head adds an offset and scales:
depth = 1 + 2 x brightness (the mean of R, G and B over 255) wherever the image is uniform over a couple
of patches, smoothed at the patch scale elsewhere. So a uniform image's map is a constant the tests
predict, a brighter region is nearer, and an edge stays where it is in the original's pixels.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vlmrl.errors import VlmrlError
from vlmrl.models.tool_models import freed_on_oom

ARCHES = ("depth-anything", "dpt", "dpt-dinov2")
"""The depth models `build_tiny` builds (the first the default): Depth Anything (DINOv2 backbone, aspect kept,
multiples of 14), DPT (ViT backbone, stretched to a square), DPT with a DINOv2 backbone (padded to 14)."""
TINY_SIDE = 56
"""The side the tiny Depth Anything resizes its short side to (4 patches of 14)."""
TINY_DPT_SIDE = 64
"""The square the tiny DPT stretches images to (8 x 8 patches of 8: even, as DPT's halving stage wants)."""
TINY_OFFSET = 8.0
"""The tiny head's offset before its ReLU (4 copies of the mean normalised pixel, each in [-1, 1], stay above 0)."""
TINY_SCALE = 0.25
"""The tiny head's last weight: depth = TINY_SCALE x (4 x v + TINY_OFFSET) = 2 + v, v = 2 x brightness - 1."""


def tiny_depth(brightness: float) -> float:
    """The tiny builds' depth of a uniform region of `brightness` (the mean of R, G and B over 255)."""
    return TINY_SCALE * (4 * (2 * brightness - 1) + TINY_OFFSET)


def input_geometry(width: int, height: int, processor) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """What a DPT image processor (`DPTImageProcessorPil`) makes of a width x height image: ((w, h) it is
    resized to, (w, h) after the pad, (left, top) where the resized image sits in the padded one)."""
    from transformers.models.dpt.image_processing_pil_dpt import get_resize_output_image_size

    size = (width, height)
    if processor.do_resize:
        target = get_resize_output_image_size(np.broadcast_to(np.float32(0), (height, width)),
                                              (processor.size.height, processor.size.width),
                                              bool(processor.keep_aspect_ratio), int(processor.ensure_multiple_of or 1))
        size = (int(target.width), int(target.height))
    padded, offset = size, (0, 0)
    divisor = getattr(processor, "size_divisor", None)  # the processor pads only with one
    if processor.do_pad and divisor:
        padded = tuple(math.ceil(side / divisor) * divisor for side in size)
        offset = tuple((outer - inner) // 2 for outer, inner in zip(padded, size))
    return size, padded, offset


def original_depth(predicted: torch.Tensor, geometry: tuple, patch: int, width: int, height: int) -> torch.Tensor:
    """(height, width): the prediction (h, w) for one input of `geometry` (`input_geometry`) in the pixels of
    the width x height image it was made from. The prediction spans the input's whole patches of `patch`
    pixels; where the image fills them exactly it is resized straight to the image (bicubic, as
    `post_process_depth_estimation`), else first to those pixels, then the image's part is cut out."""
    (resized_w, resized_h), (padded_w, padded_h), (left, top) = geometry
    seen_w, seen_h = padded_w // patch * patch, padded_h // patch * patch  # the pixels the patches cover
    depth = predicted[None, None].float()  # (1, 1, h, w)
    if (left, top, resized_w, resized_h) != (0, 0, seen_w, seen_h):
        if depth.shape[-2:] != (seen_h, seen_w):
            depth = torch.nn.functional.interpolate(depth, size=(seen_h, seen_w), mode="bilinear", align_corners=False)
        depth = depth[..., top:min(top + resized_h, seen_h), left:min(left + resized_w, seen_w)]  # the pad cut off
    return torch.nn.functional.interpolate(depth, size=(height, width), mode="bicubic", align_corners=False)[0, 0]


class DepthRunner:
    """A Depth Anything or DPT checkpoint and its PIL image processor, on one device (module docstring)."""

    def __init__(self, folder: Path, device: torch.device):
        from transformers import AutoConfig, AutoImageProcessor, AutoModelForDepthEstimation
        from transformers.models.dpt.image_processing_pil_dpt import DPTImageProcessorPil

        config = AutoConfig.from_pretrained(folder)
        self.processor = AutoImageProcessor.from_pretrained(folder, backend="pil")  # no torchvision here
        if not isinstance(self.processor, DPTImageProcessorPil):
            raise VlmrlError(f"the depth model in {str(folder)!r} has a {type(self.processor).__name__}; depth maps "
                             "its output back through a DPT image processor's resize and pad only")
        hybrid = bool(getattr(config, "is_hybrid", False))  # DPT-Hybrid: a BiT stem of stride patch_size, then a ViT
        backbone = None if hybrid else getattr(config, "backbone_config", None)  # DINOv2, BEiT, ...: any shape
        self.patch = int(backbone.patch_size if backbone is not None else config.patch_size)
        self.metric = getattr(config, "depth_estimation_type", "relative") == "metric"
        if config.model_type == "dpt" and backbone is None and not self._square_inputs():
            raise VlmrlError(f"the DPT in {str(folder)!r} reads a square grid of patches, but its image processor "
                             "keeps the aspect ratio or pads; set keep_aspect_ratio and do_pad to false in its "
                             "preprocessor_config.json")
        self.model = AutoModelForDepthEstimation.from_pretrained(folder, dtype=torch.float32).to(device).eval()
        self.device = device

    def _square_inputs(self) -> bool:
        """Whether the processor makes every image a square (a stretching resize to a square, no pad)."""
        processor = self.processor
        return (bool(processor.do_resize) and not processor.keep_aspect_ratio and processor.size.height ==
                processor.size.width and not (processor.do_pad and getattr(processor, "size_divisor", None)))

    def pixels(self, crop: Image.Image) -> np.ndarray:
        """(3, H, W) float32: `crop` as the model sees it (the processor's resize, normalisation and pad)."""
        pixels = self.processor(images=[crop.convert("RGB")], return_tensors="np")["pixel_values"][0]
        _, padded, _ = input_geometry(*crop.size, self.processor)
        if pixels.shape[1:] != padded[::-1]:
            raise RuntimeError(f"the depth processor made a {pixels.shape[2]}x{pixels.shape[1]} input of a "
                               f"{crop.width}x{crop.height} image, not the {padded[0]}x{padded[1]} its settings say")
        return pixels.astype(np.float32)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, h, w) predicted depth of `pixels` (B, 3, H, W); running out of device memory frees the cache and
        raises a RuntimeError."""
        with freed_on_oom("the depth model", self.device):
            return self.model(pixel_values=pixels).predicted_depth

    @torch.inference_mode()
    def run(self, crops: list[Image.Image], args: list[tuple]) -> list[tuple[np.ndarray, bool]]:
        """For each crop: (its depth map (height, width) float32 in the crop's own pixels, whether it is metric:
        metres, larger farther; else relative inverse depth, larger nearer). Crops whose inputs have the same
        shape run in one forward. `args` (depth takes no model arguments) are not read."""
        inputs = [self.pixels(crop) for crop in crops]
        groups: dict[tuple, list[int]] = {}
        for index, pixels in enumerate(inputs):
            groups.setdefault(pixels.shape, []).append(index)
        maps: list[np.ndarray | None] = [None] * len(crops)
        for indices in groups.values():
            batch = torch.from_numpy(np.stack([inputs[k] for k in indices])).to(self.device)  # (B, 3, H, W)
            predicted = self.forward(batch)  # (B, h, w)
            for row, k in enumerate(indices):
                geometry = input_geometry(*crops[k].size, self.processor)
                depth = original_depth(predicted[row], geometry, self.patch, *crops[k].size)  # (height, width)
                maps[k] = depth.cpu().numpy().astype(np.float32)
        return [(depth, self.metric) for depth in maps]


RUNNER = DepthRunner


# --------------------------------------------------------------------------- tiny builds


def _carry_channel(conv: torch.nn.Module, weight: float = 1.0, bias: float = 0.0) -> None:
    """`conv` (a Conv2d or ConvTranspose2d) made to carry its input's channel 0 to its output's channel 0, times
    `weight`, plus `bias`, and nothing else: a Conv2d's centre tap (no border effect, a strided one subsamples),
    a ConvTranspose2d's every tap (kernel = stride: nearest upsampling)."""
    conv.weight.zero_()
    if isinstance(conv, torch.nn.ConvTranspose2d):
        conv.weight[0, 0] = weight
    else:
        conv.weight[0, 0, conv.kernel_size[0] // 2, conv.kernel_size[1] // 2] = weight
    if conv.bias is not None:
        conv.bias.zero_()
        conv.bias[0] = bias


def _known_depth(model: torch.nn.Module, embeddings: torch.nn.Module, head: list[torch.nn.Conv2d]) -> None:
    """Make a tiny random depth model's output the known function of the module docstring: the patch embedding
    (`embeddings`: its patch convolution, position embeddings and CLS token) writes each patch's mean
    normalised pixel into channel 0; every convolution of the neck carries channel 0, except the fusion's
    residual units, which are turned off (zero: their residual alone passes); the `head`'s three convolutions
    carry it, adding TINY_OFFSET before the ReLU and scaling by TINY_SCALE last. The transformer layers must
    already be identities."""
    patch = embeddings.patch_embeddings.projection  # Conv2d(3, hidden, patch, stride=patch)
    with torch.no_grad():
        patch.weight.zero_()
        patch.weight[0] = 1.0 / (3 * patch.kernel_size[0] * patch.kernel_size[1])
        patch.bias.zero_()
        embeddings.position_embeddings.zero_()
        embeddings.cls_token.zero_()
        for name, module in model.neck.named_modules():
            if isinstance(module, (torch.nn.Conv2d, torch.nn.ConvTranspose2d)):
                if ".residual_layer" in f".{name}":
                    module.weight.zero_()
                    if module.bias is not None:
                        module.bias.zero_()
                else:
                    _carry_channel(module)
        _carry_channel(head[0])
        _carry_channel(head[1], bias=TINY_OFFSET)
        _carry_channel(head[2], weight=TINY_SCALE)


def _tiny_dinov2(patch_size: int):
    """A DINOv2 backbone config of width 16, 4 layers that are identities (layer scale 0), no final layer norm."""
    from transformers import Dinov2Config

    return Dinov2Config(hidden_size=16, num_hidden_layers=4, num_attention_heads=2, mlp_ratio=2, patch_size=patch_size,
                        image_size=TINY_SIDE, out_indices=[1, 2, 3, 4], layerscale_value=0.0, apply_layernorm=False,
                        reshape_hidden_states=False)


def _tiny_model(arch: str):
    """(model, image processor) of `arch` (ARCHES), random, then made to give the known depth."""
    from transformers import DepthAnythingConfig, DepthAnythingForDepthEstimation, DPTConfig, DPTForDepthEstimation
    from transformers.models.dpt.image_processing_pil_dpt import DPTImageProcessorPil

    neck = {"neck_hidden_sizes": [8, 8, 8, 8], "fusion_hidden_size": 8}
    half = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3, "resample": Image.Resampling.BICUBIC}
    side = {"height": TINY_SIDE, "width": TINY_SIDE}
    if arch == "depth-anything":  # as Depth-Anything-V2: aspect kept, multiples of 14, no pad
        model = DepthAnythingForDepthEstimation(DepthAnythingConfig(
            backbone_config=_tiny_dinov2(14), reassemble_hidden_size=16, head_hidden_size=8, patch_size=14, **neck))
        processor = DPTImageProcessorPil(size=side, keep_aspect_ratio=True, ensure_multiple_of=14, **half)
        _known_depth(model, model.backbone.embeddings, [model.head.conv1, model.head.conv2, model.head.conv3])
    elif arch == "dpt-dinov2":  # as facebook/dpt-dinov2-*: no resize, padded to a multiple of 14
        model = DPTForDepthEstimation(DPTConfig(backbone_config=_tiny_dinov2(14), readout_type="ignore",
                                                use_auxiliary_head=False, **neck))
        processor = DPTImageProcessorPil(do_resize=False, do_pad=True, size_divisor=14, **half)
        _known_depth(model, model.backbone.embeddings, [model.head.head[0], model.head.head[2], model.head.head[4]])
    else:  # as Intel/dpt-large: a ViT stretched to its square
        model = DPTForDepthEstimation(DPTConfig(
            hidden_size=16, num_hidden_layers=4, num_attention_heads=2, intermediate_size=32, patch_size=8,
            image_size=TINY_DPT_SIDE, backbone_out_indices=[0, 1, 2, 3], readout_type="ignore", use_auxiliary_head=False,
            **neck))
        processor = DPTImageProcessorPil(size={"height": TINY_DPT_SIDE, "width": TINY_DPT_SIDE}, keep_aspect_ratio=False,
                                         **half)
        with torch.no_grad():
            for layer in model.dpt.encoder.layer:  # each ViT layer an identity: its two residual branches at 0
                for linear in (layer.attention.output.dense, layer.output.dense):
                    linear.weight.zero_()
                    linear.bias.zero_()
        _known_depth(model, model.dpt.embeddings, [model.head.head[0], model.head.head[2], model.head.head[4]])
    return model, processor


def build_tiny(out: Path, arch: str, seed: int) -> dict:
    """A tiny depth model of `arch` (ARCHES) with its PIL image processor, saved in `out` so that it loads like a
    hub checkpoint; its depth is a known function of the pixels (module docstring, `tiny_depth`). Returns
    what vlmrl_tiny.json records of it (its parameter count)."""
    torch.manual_seed(seed)
    model, processor = _tiny_model(arch)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return {"parameters": sum(p.numel() for p in model.parameters())}
