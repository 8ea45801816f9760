"""Whether a token looks where it should: the share of its image attention on a known region.

A task that knows where in its image each part of the answer is drawn (the cryptogram: the table
cell of each decoded letter, `cryptogram.decoded_letter_cells`) gives, per example, spans of its
reference completion and the pixel box each span should read. The reference completion is
teacher-forced after the prompt (so an untrained model is measured on the same tokens as a trained
one); for each span, the query is the position that produced the span's first token, and its
attention to the image tokens (heads averaged) is split into the part on tokens whose 28-px cell
(the processor's token grid) has its centre inside the box, and the rest. The result is that part's
share of the image attention, averaged over spans and examples, per layer, next to the share a
uniform attention over the image tokens would give (tokens in the box / image tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmrl.evaluation.attention import attention_forward, token_grid
from vlmrl.rollout.prompts import encode_prompts, image_token_id
from vlmrl.tasks import Example

Box = tuple[int, int, int, int]
Span = tuple[int, int, Box]
"""(start, end) characters of the reference completion and the (x0, y0, x1, y1) pixel box it reads."""


@dataclass
class RegionAttention:
    """The share of image attention on the right region, averaged over spans and examples."""

    per_layer: list[float]
    """Per layer of the language model, the mean share of a span's image attention on its box."""
    uniform: float
    """The mean share a uniform attention over the image tokens would put on the box."""
    spans: int
    """How many spans were measured."""

    @property
    def share(self) -> float:
        """The share averaged over layers."""
        return sum(self.per_layer) / len(self.per_layer)

    @property
    def best_layer(self) -> int:
        """The layer with the largest share."""
        return max(range(len(self.per_layer)), key=self.per_layer.__getitem__)

    def summary(self) -> dict:
        """The numbers as a JSON-able dict (ratios to the uniform share included)."""
        best = self.best_layer
        return {"share": self.share, "uniform": self.uniform, "ratio": self.share / self.uniform,
                "per_layer": self.per_layer, "best_layer": best, "best_share": self.per_layer[best],
                "best_ratio": self.per_layer[best] / self.uniform, "spans": self.spans}


def box_token_mask(box: Box, image_size: tuple[int, int], grid: tuple[int, int]) -> torch.Tensor:
    """(rows, cols) bool: the image tokens whose cell centre lies inside `box` (pixels of the image
    as the task drew it, `image_size` = (width, height); the processor may have resized it)."""
    rows, cols = grid
    width, height = image_size
    x0, y0, x1, y1 = box
    centre_x = (torch.arange(cols) + 0.5) * width / cols  # (cols,) in image pixels
    centre_y = (torch.arange(rows) + 0.5) * height / rows  # (rows,)
    inside_x = (centre_x >= x0) & (centre_x < x1)
    inside_y = (centre_y >= y0) & (centre_y < y1)
    return inside_y[:, None] & inside_x[None, :]  # (rows, cols)


def span_token_indices(offsets: list[tuple[int, int]], spans: list[Span]) -> list[int]:
    """For each span, the index of the first token whose characters overlap it (offsets: each
    token's (start, end) in the text)."""
    picked = []
    for start, end, _ in spans:
        picked.append(next(i for i, (a, b) in enumerate(offsets) if a < end and b > start))
    return picked


@torch.no_grad()
def region_attention(model, processor, examples: list[Example], spans: list[list[Span]],
                     batch_size: int = 8) -> RegionAttention:
    """The share of image attention each span's producing position puts on its box (module
    docstring), over `examples` with their reference completions; one image per example."""
    tokenizer = processor.tokenizer
    eos = model.generation_config.eos_token_id
    stop = eos[0] if isinstance(eos, list) else eos
    image_id = image_token_id(processor, model.config)
    totals: list[float] | None = None
    uniform_total, count = 0.0, 0
    device = next(model.parameters()).device
    for first in range(0, len(examples), batch_size):
        rows, row_spans = examples[first:first + batch_size], spans[first:first + batch_size]
        encoded = [tokenizer(ex.reference_completion, add_special_tokens=False, return_offsets_mapping=True)
                   for ex in rows]
        length = max(len(e.input_ids) for e in encoded) + 1
        ids = torch.full((len(rows), length), tokenizer.pad_token_id)  # (B, T)
        mask = torch.zeros(len(rows), length, dtype=torch.long)  # (B, T)
        for i, e in enumerate(encoded):
            ids[i, :len(e.input_ids) + 1] = torch.tensor([*e.input_ids, stop])
            mask[i, :len(e.input_ids) + 1] = 1
        attentions, inputs, _ = attention_forward(model, processor, rows, ids.to(device), mask.to(device))
        prompt_len = inputs["input_ids"].shape[1] - length  # P
        for i, (example, e, example_spans) in enumerate(zip(rows, encoded, row_spans)):
            positions = (inputs["input_ids"][i] == image_id).nonzero().squeeze(-1)  # (N,)
            grid = token_grid({"image_grid_thw": inputs["image_grid_thw"][i:i + 1]}, processor, model,
                              positions.numel())  # (rows, cols) of this row's image tokens
            tokens = span_token_indices(e.offset_mapping, example_spans)
            queries = torch.tensor([prompt_len - 1 + t for t in tokens], device=device)  # (n,)
            boxes = torch.stack([box_token_mask(box, example.image.size, grid).flatten()
                                 for _, _, box in example_spans]).to(device)  # (n, N)
            uniform_total += float(boxes.float().mean(1).sum())
            count += len(example_spans)
            shares = []
            for weights in attentions:  # (B, H, S, S) per layer
                on_image = weights[i].float().mean(0)[queries][:, positions]  # (n, N) heads averaged
                on_box = (on_image * boxes).sum(1) / on_image.sum(1).clamp_min(1e-12)  # (n,)
                shares.append(float(on_box.sum()))
            totals = shares if totals is None else [a + b for a, b in zip(totals, shares)]
    if not count or totals is None:
        return RegionAttention(per_layer=[0.0], uniform=1.0, spans=0)
    return RegionAttention(per_layer=[t / count for t in totals], uniform=uniform_total / count, spans=count)
