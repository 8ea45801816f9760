"""The segmenter behind the model tool `segment` (vlmrl/tools/segment_tool.py): SAM and SAM-HQ checkpoints,
loaded from a checked local folder (tool_models.load_tool_model), and built at tiny size offline.

`Segmenter.run` takes a turn's calls (each an image and its prompts: a box, a point or both, in the image's
own pixels) and computes the image embedding once per distinct image, all in one forward of the vision
encoder; then the prompt encoder and the mask decoder run once per kind of prompt (box, point, both: SAM
takes one prompt shape per batch) over the calls of that kind, each with its image's embedding. The pixels
are the processor's own (its PIL backend: no torchvision here): the longest side resized to its
`size.longest_edge`, padded at the bottom and right to `pad_size`, normalised. The prompts are scaled to
the resized image as SamProcessor scales them, and the mask comes back through the processor's own
`post_process_masks` (the low-resolution mask upsampled to the padded square, the pad cut off, upsampled
to the image's size, thresholded at 0): the mask in the image's own pixels. A box prompt asks for one mask
(SAM's advice: a box is not ambiguous), a point alone for three, of which the best predicted IoU is kept.
SAM 2 is not run: its image processor needs torchvision.

`build_tiny(out, "sam", seed)` (`vlmrl tiny-model OUT --tool segment`) writes a SAM of about 20k parameters
(64-pixel input, 8 x 8 patches of 8, masks of 32 x 32) in a second, built so that its answer is known:
its layers add nothing (their output projections are zero), its patch embedding is the mean brightness
of the patch (normalised, less a small margin), its layer norms keep the sign of that mean, and its mask
decoder turns the sign into a mask logit of +8 or -8: the mask is exactly the patches brighter than the
processor's mean colour (about grey 115), whatever the prompt; the padding counts as dark. Its predicted
IoU is 0.9 for a box prompt and 0.8 for a point alone. A test can then predict a mask in the original's
pixels: a white rectangle on black, on the patch grid, is its own mask.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vlmrl.errors import VlmrlError
from vlmrl.models.tool_models import freed_on_oom
from vlmrl.tools.cache import image_key

TINY_IMAGE = 64
"""Side of the tiny SAM's square input (8 x 8 patches of 8; its masks are 32 x 32)."""
TINY_LOGIT = 8.0
"""The tiny SAM's mask logit: + for a bright patch, - for a dark one or the padding."""
TINY_SCORES = (0.9, 0.8, 0.8, 0.8)
"""The tiny SAM's predicted IoU of its single mask (a box prompt) and of its three masks (a point alone)."""


class Segmenter:
    """A SAM or SAM-HQ checkpoint and its PIL image processor on one device."""

    def __init__(self, folder: Path, device: torch.device):
        from transformers import AutoConfig, AutoImageProcessor, SamHQModel, SamModel

        config = AutoConfig.from_pretrained(folder)
        self.processor = AutoImageProcessor.from_pretrained(folder, backend="pil")  # no torchvision here
        size, pad = self.processor.size, self.processor.pad_size
        if not getattr(size, "longest_edge", None) or not getattr(pad, "height", None) or not getattr(pad, "width", None):
            raise VlmrlError(f"the segmenter in {str(folder)!r} resizes to {size} and pads to {pad}; segment maps masks "
                             "back from a longest edge and a pad only")
        self.hq = config.model_type == "sam_hq"
        model_class = SamHQModel if self.hq else SamModel
        self.model = model_class.from_pretrained(folder, dtype=torch.float32).to(device).eval()
        self.device = device

    def _prompts(self, args: list[tuple], sizes: list[tuple[int, int]], resized: list[tuple[int, int]]) -> tuple:
        """The calls' box and point prompts (args (box, point), in pixels of images of (width, height) `sizes`)
        scaled to their resized images (`resized` (height, width)) as SamProcessor scales them, as tensors:
        (input_boxes (M, 1, 4), input_points (M, 1, 1, 2), input_labels (M, 1, 1): a foreground point), or None."""
        scales = [(w / size[0], h / size[1]) for size, (h, w) in zip(sizes, resized)]
        boxes = points = labels = None
        if args[0][0] is not None:
            boxes = torch.tensor([[[b[0] * sx, b[1] * sy, b[2] * sx, b[3] * sy]] for (b, _), (sx, sy) in zip(args, scales)],
                                 dtype=torch.float32, device=self.device)  # (M, 1, 4)
        if args[0][1] is not None:
            points = torch.tensor([[[[p[0] * sx, p[1] * sy]]] for (_, p), (sx, sy) in zip(args, scales)],
                                  dtype=torch.float32, device=self.device)  # (M, 1, 1, 2)
            labels = torch.ones(len(args), 1, 1, dtype=torch.long, device=self.device)  # (M, 1, 1)
        return boxes, points, labels

    def _decode(self, embeddings: torch.Tensor, layers: list | None, prompts: tuple, multimask: bool):
        """The mask decoder's output for `embeddings` (M, C, h, w) (SAM-HQ: and its vision `layers`, each (M, ...))
        and the (boxes, points, labels) `prompts` of M calls."""
        boxes, points, labels = prompts
        with freed_on_oom("the segmenter", self.device):
            if self.hq:
                return self.model(image_embeddings=embeddings, intermediate_embeddings=layers, input_boxes=boxes,
                                  input_points=points, input_labels=labels, multimask_output=multimask)
            return self.model(image_embeddings=embeddings, input_boxes=boxes, input_points=points, input_labels=labels,
                              multimask_output=multimask)

    @torch.inference_mode()
    def run(self, images: list[Image.Image], args: list[tuple]) -> list[tuple[np.ndarray, float]]:
        """For each image and its (box, point) prompts (pixels of that image, either None): (mask (H, W) bool in
        the image's own pixels, the model's predicted IoU). One vision forward for the distinct images; one
        mask-decoder forward per kind of prompt."""
        keys = [image_key(image) for image in images]
        distinct = list(dict.fromkeys(keys))
        first = {key: keys.index(key) for key in distinct}
        inputs = self.processor(images=[images[first[key]] for key in distinct], return_tensors="pt")
        resized = [tuple(hw) for hw in inputs["reshaped_input_sizes"].tolist()]  # (height, width) each
        with freed_on_oom("the segmenter", self.device):
            embedded = self.model.get_image_embeddings(inputs["pixel_values"].to(self.device))
        embeddings, layers = embedded if self.hq else (embedded, None)  # (N, C, h, w); SAM-HQ: its layers' too
        out: list[tuple[np.ndarray, float] | None] = [None] * len(images)
        kinds: dict[tuple[bool, bool], list[int]] = {}
        for k, (box, point) in enumerate(args):
            kinds.setdefault((box is not None, point is not None), []).append(k)
        for (has_box, _), rows in kinds.items():
            image_of = [distinct.index(keys[k]) for k in rows]  # each call's image among the distinct ones
            which = torch.tensor(image_of, device=self.device)  # (M,)
            prompts = self._prompts([args[k] for k in rows], [images[k].size for k in rows], [resized[i] for i in image_of])
            result = self._decode(embeddings[which], layers and [layer[which] for layer in layers], prompts, not has_box)
            scores = result.iou_scores[:, 0].float()  # (M, K)
            best = scores.argmax(dim=1)  # (M,)
            masks = result.pred_masks[:, 0][torch.arange(len(rows), device=best.device), best].float().cpu()  # (M, h, w)
            for m, k in enumerate(rows):
                size = images[k].size[::-1]  # (H, W)
                [full] = self.processor.post_process_masks([masks[m][None, None]], [size], [resized[image_of[m]]])
                out[k] = (full[0, 0].numpy(), float(scores[m, best[m]]))
        return out


RUNNER = Segmenter
ARCHES = ("sam", "sam_hq")
"""The segmenters `build_tiny` builds (the first, SAM, by default)."""


def _tiny_config(arch: str):
    """The tiny SAM's (or SAM-HQ's) config: width 16, one vision layer, TINY_IMAGE pixels in patches of 8."""
    from transformers import SamConfig, SamHQConfig

    width = 16
    vision = dict(hidden_size=width, output_channels=width, num_hidden_layers=1, num_attention_heads=1,
                  image_size=TINY_IMAGE, patch_size=8, window_size=0, global_attn_indexes=[0],
                  num_pos_feats=width // 2, mlp_dim=2 * width)
    prompt = dict(hidden_size=width, image_size=TINY_IMAGE, patch_size=8, mask_input_channels=4)
    decoder = dict(hidden_size=width, mlp_dim=2 * width, num_hidden_layers=2, num_attention_heads=2,
                   iou_head_hidden_dim=width)
    if arch == "sam_hq":
        decoder["vit_dim"] = width
        return SamHQConfig(vision_config=vision, prompt_encoder_config=prompt, mask_decoder_config=decoder)
    return SamConfig(vision_config=vision, prompt_encoder_config=prompt, mask_decoder_config=decoder)


def _known_answer(model) -> None:
    """Set the tiny SAM's weights so that its mask is the patches brighter than the processor's mean colour and its
    predicted IoU is TINY_SCORES (module docstring). Shapes: width 16, 4 channels after the first upscaling, 2
    after the second."""
    vision, decoder = model.vision_encoder, model.mask_decoder
    for module in model.modules():  # every layer norm plain: weight 1, bias 0
        if "LayerNorm" in type(module).__name__:
            module.weight.fill_(1.0)
            module.bias.zero_()
    width = vision.config.hidden_size
    sign = torch.tensor([(-1.0) ** c for c in range(width)])  # (16,) a zero-mean pattern: LayerNorm keeps it
    patch = vision.patch_embed.projection  # Conv2d(3, 16, 8, 8)
    patch.weight.copy_(sign[:, None, None, None].expand_as(patch.weight) / patch.weight[0].numel())
    patch.bias.copy_(-0.05 * sign)  # the padding (0 after normalising) reads as dark
    vision.pos_embed.zero_()
    for layer in vision.layers:  # each layer adds nothing
        for linear in (layer.attn.proj, layer.mlp.lin2):
            linear.weight.zero_()
            linear.bias.zero_()
    vision.neck.conv1.weight.copy_(torch.eye(width)[:, :, None, None])
    vision.neck.conv2.weight.zero_()
    vision.neck.conv2.weight[:, :, 1, 1] = torch.eye(width)
    model.prompt_encoder.no_mask_embed.weight.zero_()
    for layer in decoder.transformer.layers:  # the image's tokens pass the decoder unchanged (layer-normed)
        layer.cross_attn_image_to_token.out_proj.weight.zero_()
        layer.cross_attn_image_to_token.out_proj.bias.zero_()
    up1, up2 = decoder.upscale_conv1, decoder.upscale_conv2  # ConvTranspose2d(16, 4, 2, 2), (4, 2, 2, 2)
    up1.weight.zero_()
    up1.bias.zero_()
    up1.weight[:, 0] = sign[:, None, None] / width  # channel 0: +-1 by the patch's sign; channel 1 its opposite
    up1.weight[:, 1] = -sign[:, None, None] / width
    up2.weight.zero_()
    up2.bias.zero_()
    up2.weight[0, 0], up2.weight[1, 0] = TINY_LOGIT, -TINY_LOGIT  # (bright, dark) after the GELUs: (8, 0) or (0, 8)
    up2.weight[1, 1], up2.weight[0, 1] = TINY_LOGIT, -TINY_LOGIT
    for mlp in decoder.output_hypernetworks_mlps:  # every mask = bright channel - dark channel: +-8 x 1.41
        mlp.proj_out.weight.zero_()
        mlp.proj_out.bias.copy_(torch.tensor([1.0, -1.0]) / 1.4142135)
    decoder.iou_prediction_head.proj_out.weight.zero_()
    decoder.iou_prediction_head.proj_out.bias.copy_(torch.tensor(TINY_SCORES))


def build_tiny(out: Path, arch: str, seed: int) -> dict:
    """A tiny SAM (`arch` "sam": the known answer of the module docstring) or a tiny random SAM-HQ ("sam_hq"),
    with its PIL image processor (TINY_IMAGE pixels, masks of a quarter of it), saved into `out` so that it
    loads like a hub checkpoint; its parameter count."""
    from transformers import SamHQModel, SamModel
    from transformers.models.sam.image_processing_pil_sam import SamImageProcessorPil

    torch.manual_seed(seed)
    model = SamHQModel(_tiny_config(arch)) if arch == "sam_hq" else SamModel(_tiny_config(arch))
    if arch == "sam":
        with torch.no_grad():
            _known_answer(model)
    side, mask = {"height": TINY_IMAGE, "width": TINY_IMAGE}, {"height": TINY_IMAGE // 4, "width": TINY_IMAGE // 4}
    processor = SamImageProcessorPil(size={"longest_edge": TINY_IMAGE}, pad_size=side,
                                     mask_size={"longest_edge": TINY_IMAGE // 4}, mask_pad_size=mask)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return {"parameters": sum(p.numel() for p in model.parameters())}
