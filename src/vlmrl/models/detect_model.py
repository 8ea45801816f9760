"""The detector behind the model tool `detect` (vlmrl/tools/detect_tool.py): OWLv2, OWL-ViT, Grounding DINO,
loaded from a checked local folder (tool_models.load_tool_model), and built at tiny random size offline.

`Detector.run` runs an open-vocabulary detector (OWLv2, OWL-ViT: a batch of images, each with its own
phrases, in one forward; Grounding DINO: one image a forward) and gives its boxes back in each image's own
pixels (`original_boxes`, through the processor's pad and resize). Its image processor is read with the PIL
backend (no torchvision here), and the pixels are prepared here with PIL and NumPy: the PIL OWLv2
processor resizes with SciPy, which this environment does not have. What the processor does is kept:
OWLv2 pads at the bottom and right to a square (black, 0 before normalising), then resizes to its size
(PIL's filter, antialiased on downscaling, where the reference uses a Gaussian then a linear SciPy zoom:
the same geometry, pixel values within a few levels); OWL-ViT resizes to its square; Grounding DINO
resizes to its shortest edge, aspect kept; all then normalise with the processor's mean and std. A
model that runs out of memory frees the cache and raises, which the tool call turns into an error turn.

`build_tiny(out, "owlv2", seed)` (`vlmrl tiny-model OUT --tool detect`) writes a random OWLv2 of about 85k
parameters with a tokenizer trained offline, in about a second; its box head's last layer is zero, so
patch k's box is OWLv2's grid box of patch k (centred on the patch's bottom-right corner, a patch wide and
high, in the padded square): boxes the tests can predict; and its logits are 3 times the cosine of a
patch's and a phrase's embeddings (a fixed logit scale and no shift), so that its scores spread over
(0.05, 0.95) instead of saturating at 0 or 1. `"owlvit"` builds a tiny OWL-ViT the same way,
`"grounding-dino"` a tiny random Grounding DINO (for the tests).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vlmrl.errors import VlmrlError
from vlmrl.models.tiny_model import train_bpe
from vlmrl.models.tool_models import freed_on_oom
from vlmrl.tools.model_tools import original_boxes

TINY_IMAGE = 96
"""Side of the tiny detector's square input (6 x 6 patches of 16)."""


def _input_size(folder: Path, processor, grounding: bool) -> tuple[int, int]:
    """OWL: (width, height) the processor resizes to. Grounding DINO: (shortest edge, longest edge) it resizes to,
    aspect kept. VlmrlError for a size or a centre crop whose boxes this module cannot map back."""
    size, crop = processor.size, getattr(processor, "crop_size", None)
    if grounding:
        edges = getattr(size, "shortest_edge", None), getattr(size, "longest_edge", None)
        if not all(edges):
            raise VlmrlError(f"the detector in {str(folder)!r} resizes to {size}; detect takes a Grounding DINO that "
                             "resizes to a shortest and a longest edge")
        return edges
    height, width = getattr(size, "height", None), getattr(size, "width", None)
    if not height or not width:
        raise VlmrlError(f"the detector in {str(folder)!r} resizes to {size}; detect maps boxes back from a fixed "
                         "height and width only")
    if getattr(processor, "do_center_crop", False) and crop is not None and (crop.height, crop.width) != (height, width):
        raise VlmrlError(f"the detector in {str(folder)!r} crops its {width}x{height} input to {crop.width}x"
                         f"{crop.height}; detect maps boxes back through a resize and a pad only")
    return width, height


def phrase_tokens(offsets: list[tuple[int, int]], phrases: tuple[str, ...]) -> np.ndarray:
    """(P, T) bool: which of the T tokens of `". ".join(phrases) + "."` (their character `offsets`) belong to each
    phrase (a token overlapping its characters); special tokens (empty offsets) belong to none."""
    member = np.zeros((len(phrases), len(offsets)), bool)
    start = 0
    for k, phrase in enumerate(phrases):
        end = start + len(phrase)
        member[k] = [b > a and a < end and b > start for a, b in offsets]
        start = end + 2  # ". "
    return member


class Detector:
    """An OWLv2, OWL-ViT or Grounding DINO checkpoint, its tokenizer and its image processor's settings, on one
    device. OWL scores each patch against each phrase; Grounding DINO scores each query against each token
    of one text, the phrases joined by ". ", and a phrase's score is its best token's."""

    def __init__(self, folder: Path, device: torch.device):
        from transformers import AutoConfig, AutoImageProcessor, AutoModelForZeroShotObjectDetection, AutoTokenizer

        config = AutoConfig.from_pretrained(folder)
        processor = AutoImageProcessor.from_pretrained(folder, backend="pil")  # no torchvision here
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForZeroShotObjectDetection.from_pretrained(folder, dtype=torch.float32).to(device).eval()
        self.device = device
        self.grounding = config.model_type == "grounding-dino"
        self.padded_square = config.model_type == "owlv2" and bool(getattr(processor, "do_pad", True))
        self.size = _input_size(folder, processor, self.grounding)
        self.resample = Image.Resampling(int(getattr(processor, "resample", None) or Image.Resampling.BILINEAR))
        self.mean = np.array(processor.image_mean, np.float32)
        self.std = np.array(processor.image_std, np.float32)
        self.text_length = config.max_text_len if self.grounding else config.text_config.max_position_embeddings

    def pixels(self, image: Image.Image) -> np.ndarray:
        """(3, H, W) float32: `image` as the model sees it: OWLv2 padded to a square then resized, OWL-ViT resized
        to its square, Grounding DINO resized to its shortest edge (its longest within bounds), all normalised."""
        image = image.convert("RGB")
        if self.padded_square:
            side = max(image.size)
            square = Image.new("RGB", (side, side), (0, 0, 0))  # OWLv2 pads with 0 at the bottom and right
            square.paste(image, (0, 0))
            image = square
        size = self.size
        if self.grounding:
            scale = min(self.size[0] / min(image.size), self.size[1] / max(image.size))
            size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        resized = np.asarray(image.resize(size, self.resample), np.float32) / 255.0  # (H, W, 3)
        return ((resized - self.mean) / self.std).transpose(2, 0, 1)

    def forward(self, **inputs):
        """The model's outputs; running out of device memory frees the cache and raises a RuntimeError."""
        with freed_on_oom("the detector", self.device):
            return self.model(**inputs)

    @torch.inference_mode()
    def run(self, images: list[Image.Image], queries: list[tuple[str, ...]]) -> list[tuple]:
        """For each image and its phrases: (boxes (N, 4) [x1, y1, x2, y2] in the image's own pixels, scores (N,),
        labels (N,): the index of the phrase), one per patch (OWL) or query (Grounding DINO). OWL: one forward
        for the batch. Grounding DINO: one forward per image (its backbone would see a batch's padding)."""
        if self.grounding:
            return [self._grounded(image, phrases) for image, phrases in zip(images, queries)]
        width = max(len(q) for q in queries)
        texts = [q[k] if k < len(q) else q[0] for q in queries for k in range(width)]  # each image padded to `width`
        tokens = self.tokenizer(texts, padding="max_length", max_length=self.text_length, truncation=True,
                                return_tensors="pt").to(self.device)
        pixels = torch.from_numpy(np.stack([self.pixels(image) for image in images])).to(self.device)  # (B, 3, H, W)
        out = self.forward(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, pixel_values=pixels)
        logits = out.logits.float().cpu().numpy()  # (B, P, width)
        centres = out.pred_boxes.float().cpu().numpy()  # (B, P, 4): cx, cy, w, h in [0, 1]
        return [self._boxes(image, logits[b, :, :len(phrases)], centres[b])  # the padding phrases are not its own
                for b, (image, phrases) in enumerate(zip(images, queries))]

    def _grounded(self, image: Image.Image, phrases: tuple[str, ...]) -> tuple:
        """One image's detections by Grounding DINO: the phrases joined by ". " as its one text."""
        tokens = self.tokenizer([". ".join(phrases) + "."], truncation=True, max_length=self.text_length,
                                return_offsets_mapping=True, return_tensors="pt")
        member = phrase_tokens([tuple(pair) for pair in tokens.pop("offset_mapping")[0].tolist()], phrases)  # (P, T)
        pixels = torch.from_numpy(self.pixels(image))[None].to(self.device)  # (1, 3, H, W)
        out = self.forward(**tokens.to(self.device), pixel_values=pixels,
                           pixel_mask=torch.ones(pixels.shape[0], *pixels.shape[2:], dtype=torch.long, device=self.device))
        logits = out.logits[0, :, :member.shape[1]].float().cpu().numpy()  # (Q, T)
        per_phrase = np.stack([logits[:, row].max(axis=1) if row.any() else np.full(len(logits), -np.inf)
                               for row in member], axis=1)  # (Q, P)
        return self._boxes(image, per_phrase, out.pred_boxes[0].float().cpu().numpy())

    def _boxes(self, image: Image.Image, logits: np.ndarray, centres: np.ndarray) -> tuple:
        """(boxes in `image`'s pixels, scores, labels) from `logits` (N, P) and `centres` (N, 4) cx, cy, w, h in [0, 1]."""
        labels = logits.argmax(axis=1)
        scores = 1.0 / (1.0 + np.exp(-logits.max(axis=1)))
        cx, cy, w, h = centres.T
        corners = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)  # (N, 4)
        return original_boxes(corners, *image.size, self.padded_square), scores, labels


RUNNER = Detector
ARCHES = ("owlv2", "owlvit", "grounding-dino")
"""The detectors `build_tiny` builds (the first, OWLv2, by default)."""


def _tiny_grounding_dino(tokenizer):
    """A random Grounding DINO of about 0.5M parameters (a 4-stage Swin of width 16, a 1-layer BERT of width 32,
    d_model 32: a multiple of 32 for its GroupNorm; 2 decoder layers: the weight tying wants 2) reading
    TINY_IMAGE to 2 x TINY_IMAGE pixels, and its PIL image processor."""
    from transformers import BertConfig, GroundingDinoConfig, GroundingDinoForObjectDetection, SwinConfig
    from transformers.models.grounding_dino.image_processing_pil_grounding_dino import GroundingDinoImageProcessorPil

    config = GroundingDinoConfig(
        backbone_config=SwinConfig(embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], window_size=4,
                                   image_size=TINY_IMAGE, out_features=["stage2", "stage3", "stage4"]),
        text_config=BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64, pad_token_id=tokenizer.pad_token_id),
        d_model=32, encoder_layers=1, decoder_layers=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        encoder_attention_heads=2, decoder_attention_heads=2, num_queries=16, max_text_len=32)
    processor = GroundingDinoImageProcessorPil(size={"shortest_edge": TINY_IMAGE, "longest_edge": 2 * TINY_IMAGE})
    return GroundingDinoForObjectDetection(config), processor


def _tiny_detector(arch: str, tokenizer):
    """A random OWLv2 or OWL-ViT of TINY_IMAGE pixels with known boxes and spread scores (module docstring),
    and its PIL image processor."""
    from transformers import Owlv2Config, Owlv2ForObjectDetection, OwlViTConfig, OwlViTForObjectDetection
    from transformers.models.owlv2.image_processing_pil_owlv2 import Owlv2ImageProcessorPil
    from transformers.models.owlvit.image_processing_pil_owlvit import OwlViTImageProcessorPil

    config_class, model_class, processor_class = ((Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessorPil)
                                                  if arch == "owlv2" else
                                                  (OwlViTConfig, OwlViTForObjectDetection, OwlViTImageProcessorPil))
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    config = config_class(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=16, **ids),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=TINY_IMAGE, patch_size=16), projection_dim=32)
    model = model_class(config)
    with torch.no_grad():  # the box head's last layer at zero: each patch's box is its grid box (known answers)
        model.box_head.dense2.weight.zero_()
        model.box_head.dense2.bias.zero_()
        for layer, bias in ((model.class_head.logit_shift, 0.0), (model.class_head.logit_scale, 2.0)):
            layer.weight.zero_()  # logits = 3 x cosine(patch, phrase): scores spread over (0.05, 0.95)
            layer.bias.fill_(bias)
    side = {"height": TINY_IMAGE, "width": TINY_IMAGE}
    return model, processor_class(size=side, crop_size=side)


def build_tiny(out: Path, arch: str, seed: int) -> dict:
    """A random-weight detector of `arch` (one of ARCHES) with a tokenizer trained offline and an image processor
    of TINY_IMAGE pixels, saved into `out` so that it loads like a hub checkpoint; its parameter count."""
    from transformers import PreTrainedTokenizerFast

    bos, eos = "<|startoftext|>", "<|endoftext|>"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_bpe(512, (bos, eos)), bos_token=bos, eos_token=eos,
                                        pad_token=eos, unk_token=None)
    torch.manual_seed(seed)
    model, processor = _tiny_grounding_dino(tokenizer) if arch == "grounding-dino" else _tiny_detector(arch, tokenizer)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    processor.save_pretrained(out)
    return {"parameters": sum(p.numel() for p in model.parameters())}
