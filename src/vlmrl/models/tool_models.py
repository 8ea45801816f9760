"""The models behind the model tools (vlmrl/tools/model_tools.py): loaded from a checked local folder,
run on the run's device, and built at tiny random size offline for the tests.

`Detector` runs an open-vocabulary detector (OWLv2, OWL-ViT) on a batch of images, each with its own
phrases, in one forward, and gives its boxes back in each image's own pixels (`original_boxes`, through
the processor's pad and resize). Its image processor is read with the PIL backend (no torchvision here),
and the pixels are prepared here with PIL and NumPy: the PIL OWLv2 processor resizes with SciPy, which
this environment does not have. What the processor does is kept: OWLv2 pads at the bottom and right to
a square (black, 0 before normalising), then resizes to its size (PIL bilinear, antialiased on
downscaling, where the reference uses a Gaussian then a linear SciPy zoom: the same geometry, pixel
values within a few levels); OWL-ViT resizes to its square; both then normalise with the processor's
mean and std. A model that runs out of memory frees the cache and raises, which the tool call turns
into an error turn.

`build_tiny_tool_model(out, "detect")` writes a random OWLv2 of about 85k parameters with a tokenizer
trained offline (`vlmrl tiny-model OUT --tool detect`), in about a second; its box head's last layer is
zero, so patch k's box is OWLv2's grid box of patch k (centred on the patch's bottom-right corner, a
patch wide and high, in the padded square): boxes the tests can predict; and its logits are 3 times the
cosine of a patch's and a phrase's embeddings (a fixed logit scale and no shift), so that its scores
spread over (0.05, 0.95) instead of saturating at 0 or 1.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vlmrl.disk import output_folder, write_text, writing
from vlmrl.errors import VlmrlError
from vlmrl.models.folder_check import tensor_shapes
from vlmrl.models.tiny_model import train_bpe
from vlmrl.tools.model_tools import MODEL_KINDS, original_boxes, tool_model_folder

TOOLS = tuple(MODEL_KINDS)
"""The model tools `vlmrl tiny-model --tool` builds."""
TINY_IMAGE = 96
"""Side of the tiny detector's square input (6 x 6 patches of 16)."""


def run_device() -> torch.device:
    """The run's device: the current CUDA device (each process's own under accelerate) where there is one."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _square_size(folder: Path, processor) -> tuple[int, int]:
    """(width, height) the processor resizes to; VlmrlError for a size or a centre crop whose boxes this module
    cannot map back (a shortest edge, a crop smaller than the resized image)."""
    size, crop = processor.size, getattr(processor, "crop_size", None)
    height, width = getattr(size, "height", None), getattr(size, "width", None)
    if not height or not width:
        raise VlmrlError(f"the detector in {str(folder)!r} resizes to {size}; detect maps boxes back from a fixed "
                         "height and width only")
    if getattr(processor, "do_center_crop", False) and crop is not None and (crop.height, crop.width) != (height, width):
        raise VlmrlError(f"the detector in {str(folder)!r} crops its {width}x{height} input to {crop.width}x"
                         f"{crop.height}; detect maps boxes back through a resize and a pad only")
    return width, height


class Detector:
    """An OWLv2 or OWL-ViT checkpoint, its tokenizer and its image processor's settings, on one device."""

    def __init__(self, folder: Path, device: torch.device):
        from transformers import AutoConfig, AutoImageProcessor, AutoModelForZeroShotObjectDetection, AutoTokenizer

        config = AutoConfig.from_pretrained(folder)
        processor = AutoImageProcessor.from_pretrained(folder, backend="pil")  # no torchvision here
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForZeroShotObjectDetection.from_pretrained(folder, dtype=torch.float32).to(device).eval()
        self.device = device
        self.padded_square = config.model_type == "owlv2" and bool(getattr(processor, "do_pad", True))
        self.size = _square_size(folder, processor)
        self.resample = Image.Resampling(int(getattr(processor, "resample", None) or Image.Resampling.BILINEAR))
        self.mean = np.array(processor.image_mean, np.float32)
        self.std = np.array(processor.image_std, np.float32)
        self.text_length = config.text_config.max_position_embeddings

    def pixels(self, image: Image.Image) -> np.ndarray:
        """(3, H, W) float32: `image` as the model sees it (padded to a square for OWLv2, resized, normalised)."""
        image = image.convert("RGB")
        if self.padded_square:
            side = max(image.size)
            square = Image.new("RGB", (side, side), (0, 0, 0))  # OWLv2 pads with 0 at the bottom and right
            square.paste(image, (0, 0))
            image = square
        resized = np.asarray(image.resize(self.size, self.resample), np.float32) / 255.0  # (H, W, 3)
        return ((resized - self.mean) / self.std).transpose(2, 0, 1)

    @torch.inference_mode()
    def detect(self, images: list[Image.Image], queries: list[tuple[str, ...]]) -> list[tuple]:
        """For each image and its phrases: (boxes (N, 4) [x1, y1, x2, y2] in the image's own pixels, scores (N,),
        labels (N,): the index of the phrase), one per patch, in one forward for the batch."""
        width = max(len(q) for q in queries)
        texts = [q[k] if k < len(q) else q[0] for q in queries for k in range(width)]  # each image padded to `width`
        tokens = self.tokenizer(texts, padding="max_length", max_length=self.text_length, truncation=True,
                                return_tensors="pt").to(self.device)
        pixels = torch.from_numpy(np.stack([self.pixels(image) for image in images])).to(self.device)  # (B, 3, H, W)
        try:
            out = self.model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, pixel_values=pixels)
        except torch.cuda.OutOfMemoryError as error:
            torch.cuda.empty_cache()
            raise RuntimeError(f"the detector ran out of memory on {self.device}: {error}") from None
        logits = out.logits.float().cpu().numpy()  # (B, P, width)
        centres = out.pred_boxes.float().cpu().numpy()  # (B, P, 4): cx, cy, w, h in [0, 1]
        results = []
        for b, (image, phrases) in enumerate(zip(images, queries)):
            own = logits[b, :, :len(phrases)]  # (P, q): the padding phrases are not this image's
            labels = own.argmax(axis=1)
            scores = 1.0 / (1.0 + np.exp(-own.max(axis=1)))
            cx, cy, w, h = centres[b].T
            corners = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)  # (P, 4)
            results.append((original_boxes(corners, *image.size, self.padded_square), scores, labels))
        return results


def tool_model_bytes(tools: list, models: dict) -> int:
    """Bytes of the float32 weights of the model tools `tools` names (rollout.tools) with a folder in `models`
    (rollout.tool_models), read from their safetensors headers; 0 for one whose folder cannot be read (the
    early checks refuse it)."""
    total = 0
    for name in [name for name in dict.fromkeys(tools) if name in MODEL_KINDS and name in (models or {})]:
        try:
            folder = tool_model_folder(name, models[name])
        except VlmrlError:
            continue
        for file in sorted(folder.glob("*.safetensors")):
            total += sum(4 * math.prod(shape) for shape in tensor_shapes(file).values())
    return total


def load_tool_model(name: str, folder: Path) -> Detector:
    """Tool `name`'s model from its folder, checked again (`tool_model_folder`), on the run's device."""
    if name not in MODEL_KINDS:
        raise VlmrlError(f"unknown model tool {name!r}; model tools: {', '.join(MODEL_KINDS)}")
    return Detector(tool_model_folder(name, str(folder)), run_device())


DETECTOR_ARCHES = ("owlv2", "owlvit")
"""The detectors `build_tiny_tool_model` builds (the command line builds OWLv2)."""


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


def build_tiny_tool_model(out_dir: str | Path, tool: str = "detect", seed: int = 0, arch: str = "owlv2") -> Path:
    """A random-weight detector (`tool` "detect"; `arch` one of DETECTOR_ARCHES) with a tokenizer trained
    offline and an image processor of TINY_IMAGE pixels, saved so that it loads like a hub checkpoint.
    Returns the folder."""
    from transformers import PreTrainedTokenizerFast

    if tool not in TOOLS:
        raise VlmrlError(f"unknown tool model {tool!r}; choose one of {', '.join(TOOLS)}")
    if arch not in DETECTOR_ARCHES:
        raise VlmrlError(f"unknown detector {arch!r}; choose one of {', '.join(DETECTOR_ARCHES)}")
    out = output_folder(out_dir, "the tool model")
    bos, eos = "<|startoftext|>", "<|endoftext|>"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_bpe(512, (bos, eos)), bos_token=bos, eos_token=eos,
                                        pad_token=eos, unk_token=None)
    torch.manual_seed(seed)
    model, processor = _tiny_detector(arch, tokenizer)
    with writing("the tool model", out):
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        processor.save_pretrained(out)
    write_text(out / "vlmrl_tiny.json", "the tool model", json.dumps(
        {"tool": tool, "arch": arch, "seed": seed, "parameters": sum(p.numel() for p in model.parameters())},
        indent=2))
    return out
