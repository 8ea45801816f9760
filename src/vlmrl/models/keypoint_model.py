"""The model behind the `keypoints` tool (vlmrl/tools/keypoints_tool.py): a ViTPose body-pose model (COCO's 17
keypoints of the person in a given box) or a SuperPoint interest-point detector, loaded from a checked local
folder, run on the run's device, and built at tiny random size offline for the tests.

`KeypointModel.run(crops, args)` takes, for each call, an image and a box in it (`args[k] = (box,)`, [x1, y1, x2,
y2] in its pixels, x2 and y2 exclusive; None: the whole image) and gives back `Points`: each keypoint's x and y
in that image's pixels (fractional; a pixel's centre is at integer coordinates, as the processors compute
them), its score and its name (ViTPose: config.id2label, "Nose", "L_Eye", ...; SuperPoint names none), and the
skeleton's edges where the config lists them (ViTPose's `edges`). One forward for the batch: both models
take a fixed input size.

The pixels are prepared here with PIL and NumPy, keeping what each processor does (its PIL backend needs SciPy
for ViTPose, which this environment does not have, and no torchvision is needed either way):
- ViTPose (top-down): the box is widened or heightened to the input's aspect (width/height of `size`), enlarged
  by 1.25 about its centre (mmpose's padding: the model sees context around the person), and that region is
  warped to the input size by an affine map taking the region's first and last pixel centres to the input's
  first and last (the "unbiased" warp of the processor's `get_warp_matrix`; bilinear, black outside the image,
  as its SciPy warp); then rescaled and normalised. Its heatmaps (K, h, w) are decoded as the processor's
  `keypoints_from_heatmaps` does: the argmax of each map (its value is the score), refined by DARK (a Gaussian
  blur of sigma 0.8, the log, one Newton step on the finite-difference gradient and Hessian; here with the
  step bounded to one heatmap pixel, where the processor would follow a flat map's near-singular Hessian
  anywhere), then mapped back through the same warp (heatmap pixel 0 and w-1 at the region's first and last
  pixel centres). ViTPose+ (a mixture-of-experts backbone) is run with dataset index 0 (COCO).
- SuperPoint: the box is resized to the processor's size (its resample filter; the aspect is not kept), rescaled
  to [0, 1], made grey by the processor's NTSC weights where it says so (else the model reads the red channel,
  as it does with the processor's pixels); the model's own threshold, NMS and border removal pick the points,
  each at a pixel of the resized input, mapped back through the resize (pixel centres to pixel centres).

`build_tiny(out, arch, seed)` writes a tiny random model whose answers a test can predict:
- "vitpose": about 11k parameters, input 128 x 96 in patches of 8; the residual branches end at zero and a
  constant pair of channels in the position embeddings makes the last layer norm nearly linear, so that channels
  0-2 of each patch are its mean red, green and blue (normalised, black at 0); the head reads them after its
  ReLU, so keypoint 0 (Nose) peaks on the reddest patch, 1 (L_Eye) the greenest, 2 (R_Eye) the bluest, with a
  score of 0.87 for a patch of pure colour on black (0 on black), and the other 14 are -1 everywhere (never
  listed). Points are as exact as a
  patch (8 input pixels) of the warped box.
- "superpoint": about 4k parameters, input 48 x 64; its keypoint head puts one candidate in each 8 x 8 cell, at
  column 5, row 3 of the cell, scoring about 0.88 where the cell holds a bright pixel (grey 1 after rescaling)
  and below the model's threshold where it is black: the points lie on a known grid, in the bright cells only.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image

from vlmrl.errors import VlmrlError
from vlmrl.models.tool_models import freed_on_oom

ARCHES = ("vitpose", "superpoint")
"""The architectures `build_tiny` builds; the first is the default."""
MODEL_TYPES = ("vitpose", "superpoint")
"""The config.json model types the runner loads."""
PADDING = 1.25
"""ViTPose's box enlargement about its centre (the processor's `padding_factor`)."""
DARK_SIGMA = 0.8
"""Sigma of the Gaussian blur before DARK's Newton step (the processor's)."""
DARK_RADIUS = 5
"""Its radius in heatmap pixels (the processor's default kernel of 11)."""
TINY_VITPOSE = (128, 96)
"""(height, width) of the tiny ViTPose's input."""
TINY_SUPERPOINT = (48, 64)
"""(height, width) of the tiny SuperPoint's input."""
SUPERPOINT_CELL = (5, 3)
"""(column, row) in each 8 x 8 cell where the tiny SuperPoint puts its candidate."""
COCO_KEYPOINTS = ("Nose", "L_Eye", "R_Eye", "L_Ear", "R_Ear", "L_Shoulder", "R_Shoulder", "L_Elbow", "R_Elbow",
                  "L_Wrist", "R_Wrist", "L_Hip", "R_Hip", "L_Knee", "R_Knee", "L_Ankle", "R_Ankle")
"""The 17 COCO body keypoints, named as the usyd-community ViTPose checkpoints' id2label names them."""
COCO_EDGES = ((15, 13), (13, 11), (16, 14), (14, 12), (11, 12), (5, 11), (6, 12), (5, 6), (5, 7), (6, 8), (7, 9),
              (8, 10), (1, 2), (0, 1), (0, 2), (1, 3), (2, 4), (3, 5), (4, 6))
"""The COCO skeleton, as those checkpoints' config.json `edges` list it."""


class Points(NamedTuple):
    """One call's keypoints, in the pixels of the image it was given (pixel centres at integer coordinates)."""

    xy: np.ndarray
    """(N, 2) float64: x (column), y (row)."""
    scores: np.ndarray
    """(N,) float64: ViTPose: the heatmap's peak (about 0 to 1); SuperPoint: the point's probability."""
    names: tuple
    """(N,) each point's name (str), or None where the model names none (SuperPoint)."""
    edges: tuple
    """Pairs (i, j) of point indices the skeleton joins (ViTPose's config `edges`; empty when it has none)."""


def _box(image: Image.Image, box) -> tuple[float, float, float, float]:
    """`box` [x1, y1, x2, y2] (pixel edges) as floats; None: the whole image."""
    return (0.0, 0.0, float(image.width), float(image.height)) if box is None else tuple(float(v) for v in box)


def blur(maps: np.ndarray, sigma: float = DARK_SIGMA, radius: int = DARK_RADIUS) -> np.ndarray:
    """(..., h, w) each map blurred by a Gaussian of `sigma`, truncated at `radius`, edges mirrored (SciPy's
    `gaussian_filter(mode="reflect")`, which the processor uses)."""
    taps = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    taps /= taps.sum()
    for axis in (maps.ndim - 2, maps.ndim - 1):
        width = [(0, 0)] * maps.ndim
        width[axis] = (radius, radius)
        padded = np.pad(maps, width, mode="symmetric")
        maps = np.lib.stride_tricks.sliding_window_view(padded, len(taps), axis=axis) @ taps  # same shape
    return maps


def decode_heatmaps(heatmaps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(coords (B, K, 2) x, y in heatmap pixels, scores (B, K)) from `heatmaps` (B, K, h, w): each map's argmax
    (its value the score) moved by DARK's Newton step on the blurred log map, the step bounded to one pixel
    (none where the Hessian is not that of a maximum)."""
    b, k, h, w = heatmaps.shape
    flat = heatmaps.reshape(b, k, -1)  # (B, K, h*w)
    index = flat.argmax(axis=2)  # (B, K)
    scores = flat.max(axis=2).astype(np.float64)
    x, y = (index % w).astype(np.float64), (index // w).astype(np.float64)
    logs = np.pad(np.log(np.clip(blur(heatmaps.astype(np.float64)), 0.001, 50.0)), ((0, 0), (0, 0), (1, 1), (1, 1)),
                  mode="edge")  # (B, K, h+2, w+2)
    ib, ik = np.meshgrid(np.arange(b), np.arange(k), indexing="ij")
    at = lambda dx, dy: logs[ib, ik, index // w + 1 + dy, index % w + 1 + dx]  # noqa: E731 - (B, K)
    gx, gy = 0.5 * (at(1, 0) - at(-1, 0)), 0.5 * (at(0, 1) - at(0, -1))
    hxx, hyy = at(1, 0) - 2 * at(0, 0) + at(-1, 0), at(0, 1) - 2 * at(0, 0) + at(0, -1)
    hxy = 0.25 * (at(1, 1) - at(1, -1) - at(-1, 1) + at(-1, -1))
    det = hxx * hyy - hxy ** 2
    peak = (det > 1e-12) & (hxx < 0)
    safe = np.where(peak, det, 1.0)
    step_x = np.where(peak, -(hyy * gx - hxy * gy) / safe, 0.0)  # -H^-1 g
    step_y = np.where(peak, -(hxx * gy - hxy * gx) / safe, 0.0)
    coords = np.stack([x + np.clip(step_x, -1, 1), y + np.clip(step_y, -1, 1)], axis=-1)  # (B, K, 2)
    return coords, scores


class KeypointModel:
    """A ViTPose or SuperPoint checkpoint and its image processor's settings, on one device."""

    def __init__(self, folder: Path, device: torch.device):
        from transformers import AutoConfig, AutoImageProcessor

        config = AutoConfig.from_pretrained(folder)
        if config.model_type not in MODEL_TYPES:
            raise VlmrlError(f"the keypoints model in {str(folder)!r} is a {config.model_type!r} model; keypoints runs "
                             f"{' or '.join(MODEL_TYPES)} checkpoints")
        processor = AutoImageProcessor.from_pretrained(folder, backend="pil")  # no torchvision here
        height, width = getattr(processor.size, "height", None), getattr(processor.size, "width", None)
        if not height or not width:
            raise VlmrlError(f"the keypoints model in {str(folder)!r} resizes to {processor.size}; keypoints takes a "
                             "fixed height and width")
        self.pose = config.model_type == "vitpose"
        if self.pose:
            from transformers import AutoModelForPoseEstimation as model_class
        else:
            from transformers import AutoModelForKeypointDetection as model_class
        self.model = model_class.from_pretrained(folder, dtype=torch.float32).to(device).eval()
        self.device = device
        self.size = (int(width), int(height))
        self.rescale = float(processor.rescale_factor) if getattr(processor, "do_rescale", True) else 1.0
        normalise = bool(getattr(processor, "do_normalize", False))
        self.mean = np.array(processor.image_mean if normalise else (0.0,) * 3, np.float32)
        self.std = np.array(processor.image_std if normalise else (1.0,) * 3, np.float32)
        self.grey = bool(getattr(processor, "do_grayscale", False))
        self.resample = Image.Resampling(int(getattr(processor, "resample", None) or Image.Resampling.BILINEAR))
        self.experts = int(getattr(getattr(config, "backbone_config", None), "num_experts", 1) or 1)
        if self.pose:
            self.names = tuple(str(config.id2label.get(k, f"keypoint {k}")) for k in range(config.num_labels))
            edges = getattr(config, "edges", None) or ()
            self.edges = tuple((int(i), int(j)) for i, j in edges if max(i, j) < config.num_labels)
        else:
            self.names, self.edges = (), ()

    # ------------------------------------------------------------------ ViTPose

    def region(self, box: tuple[float, float, float, float]) -> tuple[np.ndarray, np.ndarray]:
        """(centre (2,) in pixel-centre coordinates, extent (2,) width and height) of what ViTPose sees for `box`
        [x1, y1, x2, y2] (pixel edges): the box at the input's aspect, enlarged by PADDING (the processor's
        `box_to_center_and_scale`, times its normalise factor)."""
        x1, y1, x2, y2 = box
        width, height = x2 - x1, y2 - y1
        aspect = self.size[0] / self.size[1]
        if width > aspect * height:
            height = width / aspect
        elif width < aspect * height:
            width = height * aspect
        centre = np.array([(x1 + x2) / 2 - 0.5, (y1 + y2) / 2 - 0.5])
        return centre, np.array([width, height]) * PADDING

    def warped(self, image: Image.Image, box: tuple[float, float, float, float]) -> np.ndarray:
        """(3, H, W) float32: the region of `box` as ViTPose sees it: warped to the input size (its first and last
        pixel centres onto the input's), bilinear, black outside `image`, then rescaled and normalised."""
        centre, extent = self.region(box)
        step = extent / (np.array(self.size) - 1.0)  # source pixels per input pixel
        origin = centre - extent / 2  # the source point input pixel (0, 0) samples, pixel-centre coordinates
        # PIL's affine map works on pixel edges (a pixel's centre at +0.5): input edge X -> source edge a*X + c
        data = (step[0], 0.0, origin[0] + 0.5 - 0.5 * step[0], 0.0, step[1], origin[1] + 0.5 - 0.5 * step[1])
        warped = image.convert("RGB").transform(self.size, Image.Transform.AFFINE, data, Image.Resampling.BILINEAR,
                                                fillcolor=(0, 0, 0))
        pixels = np.asarray(warped, np.float32) * self.rescale  # (H, W, 3)
        return ((pixels - self.mean) / self.std).transpose(2, 0, 1)

    def _pose(self, crops: list[Image.Image], boxes: list) -> list[Points]:
        pixels = torch.from_numpy(np.stack([self.warped(c, b) for c, b in zip(crops, boxes)])).to(self.device)
        extra = {}
        if self.experts > 1:  # ViTPose+: the COCO expert
            extra["dataset_index"] = torch.zeros(len(crops), dtype=torch.long, device=self.device)
        heatmaps = self.forward(pixel_values=pixels, **extra).heatmaps.float().cpu().numpy()  # (B, K, h, w)
        coords, scores = decode_heatmaps(heatmaps)  # (B, K, 2), (B, K)
        size = np.array(heatmaps.shape[:1:-1], np.float64)  # (w, h)
        out = []
        for b, box in enumerate(boxes):
            centre, extent = self.region(box)
            xy = centre - extent / 2 + coords[b] * extent / (size - 1.0)  # (K, 2): heatmap -> source pixels
            out.append(Points(xy, scores[b], self.names[:len(xy)], self.edges))
        return out

    # ------------------------------------------------------------------ SuperPoint

    def resized(self, image: Image.Image, box: tuple[float, float, float, float]) -> np.ndarray:
        """(3, H, W) float32: `box` of `image` as SuperPoint sees it: resized to the input size, rescaled, grey by
        the NTSC weights where the processor says so."""
        region = image.convert("RGB").crop(tuple(round(v) for v in box)).resize(self.size, self.resample)
        pixels = np.asarray(region, np.float32) * self.rescale  # (H, W, 3)
        if self.grey:
            pixels = np.repeat((pixels @ np.array([0.2989, 0.5870, 0.1140], np.float32))[..., None], 3, axis=2)
        return ((pixels - self.mean) / self.std).transpose(2, 0, 1)

    def _interest(self, crops: list[Image.Image], boxes: list) -> list[Points]:
        pixels = torch.from_numpy(np.stack([self.resized(c, b) for c, b in zip(crops, boxes)])).to(self.device)
        output = self.forward(pixel_values=pixels)
        points = (output.keypoints.float().cpu().numpy() * np.array(self.size, np.float32)).round()  # (B, N, 2) input px
        scores, mask = output.scores.float().cpu().numpy(), output.mask.bool().cpu().numpy()  # (B, N)
        out = []
        for b, box in enumerate(boxes):
            x1, y1, x2, y2 = (round(v) for v in box)
            scale = np.array([(x2 - x1) / self.size[0], (y2 - y1) / self.size[1]])
            xy = np.array([x1, y1]) + (points[b][mask[b]] + 0.5) * scale - 0.5  # (N, 2) pixel centres to centres
            out.append(Points(xy.astype(np.float64), scores[b][mask[b]].astype(np.float64), (None,) * len(xy), ()))
        return out

    # ------------------------------------------------------------------ both

    def forward(self, **inputs):
        """The model's outputs; running out of device memory frees the cache and raises a RuntimeError."""
        with freed_on_oom("the keypoints model", self.device):
            return self.model(**inputs)

    @torch.inference_mode()
    def run(self, crops: list[Image.Image], args: list[tuple]) -> list[Points]:
        """Each call's `Points` in its crop's pixels; `args[k]` is (box,): [x1, y1, x2, y2] in crop k's pixels
        (pixel edges, x2 and y2 exclusive), None for the whole crop. One forward for the batch."""
        boxes = [_box(crop, arg[0] if arg else None) for crop, arg in zip(crops, args)]
        return self._pose(crops, boxes) if self.pose else self._interest(crops, boxes)


RUNNER = KeypointModel


def _tiny_vitpose():
    """A ViTPose of about 11k parameters reading TINY_VITPOSE, whose first three keypoints find the reddest,
    greenest and bluest patch (module docstring), and its PIL image processor."""
    from transformers import VitPoseBackboneConfig, VitPoseConfig, VitPoseForPoseEstimation
    from transformers.models.vitpose.image_processing_pil_vitpose import VitPoseImageProcessorPil

    hidden, constant = 16, 100.0
    backbone = VitPoseBackboneConfig(image_size=list(TINY_VITPOSE), patch_size=[8, 8], hidden_size=hidden,
                                     num_hidden_layers=1, num_attention_heads=2, mlp_ratio=2, out_indices=[1])
    config = VitPoseConfig(backbone_config=backbone, num_labels=len(COCO_KEYPOINTS),
                           id2label=dict(enumerate(COCO_KEYPOINTS)),
                           label2id={name: k for k, name in enumerate(COCO_KEYPOINTS)})
    config.edges = [list(edge) for edge in COCO_EDGES]
    model = VitPoseForPoseEstimation(config)
    processor = VitPoseImageProcessorPil(size={"height": TINY_VITPOSE[0], "width": TINY_VITPOSE[1]})
    embed = model.backbone.embeddings
    with torch.no_grad():
        projection = embed.patch_embeddings.projection  # channels 0-2: the patch's mean colour, black at 0; 3-5: minus
        projection.weight.zero_()
        projection.bias.zero_()
        black = torch.tensor(processor.image_mean) / torch.tensor(processor.image_std)  # minus black, normalised
        for c in range(3):
            projection.weight[c, c] = 1.0 / 64
            projection.weight[3 + c, c] = -1.0 / 64
            projection.bias[c], projection.bias[3 + c] = black[c], -black[c]
        # the projection's zero padding (2 pixels, top and left) is not black: take its share of black back per patch
        rows, columns = TINY_VITPOSE[0] // 8, TINY_VITPOSE[1] // 8
        edge = torch.tensor([2 / 8] + [0.0] * (rows - 1))[:, None], torch.tensor([2 / 8] + [0.0] * (columns - 1))[None]
        padded = (1 - (1 - edge[0]) * (1 - edge[1])).reshape(-1, 1)  # (P, 1) share of each patch in the padding
        embed.position_embeddings.zero_()
        embed.position_embeddings[0, 1:, :3] = -padded * black
        embed.position_embeddings[0, 1:, 3:6] = padded * black
        embed.position_embeddings[0, 0, -2:] = torch.tensor([constant, -constant])  # every token: +C, -C (slot 0)
        for layer in model.backbone.encoder.layer:  # the residual branches end at zero: the tokens pass unchanged
            for last in (layer.attention.output.dense, layer.mlp.fc2):
                last.weight.zero_()
                last.bias.zero_()
        norm = model.backbone.layernorm  # mean 0, std ~ C / sqrt(8) over the channels: scaled back, ~linear
        norm.weight.fill_(constant / math.sqrt(hidden / 2))
        norm.bias.zero_()
        head = model.head.conv  # keypoint c < 3 reads colour c (after the head's ReLU); the others are -1
        head.weight.zero_()
        head.bias.fill_(-1.0)
        for c in range(3):
            head.weight[c, c, 1, 1] = 0.2
            head.bias[c] = 0.0
    return model, processor


def _tiny_superpoint():
    """A SuperPoint of about 4k parameters reading TINY_SUPERPOINT, with one candidate per cell at SUPERPOINT_CELL,
    kept where the cell holds a bright pixel (module docstring), and its PIL image processor."""
    from transformers import SuperPointConfig, SuperPointForKeypointDetection
    from transformers.models.superpoint.image_processing_pil_superpoint import SuperPointImageProcessorPil

    config = SuperPointConfig(encoder_hidden_sizes=[4, 4, 8, 8], decoder_hidden_size=8, descriptor_decoder_dim=8)
    model = SuperPointForKeypointDetection(config)
    with torch.no_grad():
        for block in model.encoder.conv_blocks:  # channel 0 carries the brightest pixel through the max pools
            for conv in (block.conv_a, block.conv_b):
                conv.weight[0].zero_()
                conv.weight[0, 0, 1, 1] = 1.0
                conv.bias[0] = 0.0
        decoder = model.keypoint_decoder
        decoder.conv_score_a.weight[0].zero_()
        decoder.conv_score_a.weight[0, 0, 1, 1] = 1.0
        decoder.conv_score_a.bias[0] = 0.0
        scores = decoder.conv_score_b  # logits: the cell's candidate 8 x brightest - 6; the rest -10; dustbin 0
        scores.weight.zero_()
        scores.bias.fill_(-10.0)
        scores.bias[-1] = 0.0
        candidate = SUPERPOINT_CELL[1] * 8 + SUPERPOINT_CELL[0]
        scores.weight[candidate, 0, 0, 0] = 8.0
        scores.bias[candidate] = -6.0
    processor = SuperPointImageProcessorPil(size={"height": TINY_SUPERPOINT[0], "width": TINY_SUPERPOINT[1]},
                                            do_grayscale=True)
    return model, processor


def build_tiny(out: Path, arch: str, seed: int) -> dict:
    """A tiny random `arch` (ARCHES) saved in `out` so that it loads like a hub checkpoint (weights, config,
    image processor); returns {"arch", "parameters"} for vlmrl_tiny.json."""
    if arch not in ARCHES:
        raise VlmrlError(f"unknown keypoints model {arch!r}; choose one of {', '.join(ARCHES)}")
    torch.manual_seed(seed)
    model, processor = _tiny_vitpose() if arch == "vitpose" else _tiny_superpoint()
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return {"arch": arch, "parameters": sum(p.numel() for p in model.parameters())}

