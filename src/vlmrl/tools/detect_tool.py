"""The model tool `detect(query, box=None, image=0)`: open-vocabulary detection (OWLv2, OWL-ViT, Grounding DINO).

    {"name": "detect", "arguments": {"query": "red circle", "box": [0, 0, 224, 224]}}

`detect` returns, as text, the objects found for each phrase of `query` (a string, or a list of up to
MAX_QUERIES strings) inside `box` (original pixels; default the whole image) of image number `image`:
an id, the phrase, the box [x1, y1, x2, y2] in the ORIGINAL image's pixels (as `zoom` takes it) and a
score in [0, 1], best first, at most MAX_DETECTIONS after non-maximum suppression; AND the overlay image
with the numbered boxes (cv_tools' set-of-marks). Nothing above the score threshold is an answer ("no
'red circle' found ..."), not an error. A bad argument (a query that is not text, a box of NaN) raises
ValueError: a "bad_arguments" error turn. The model runner (vlmrl/models/detect_model.py) gives each crop's
boxes in the crop's own pixels; `select` keeps, suppresses and places them in the original.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from vlmrl.tools.cv_tools import marks
from vlmrl.tools.model_tools import ModelTool, Prepared

MAX_QUERIES = 8
"""Most phrases one detect call takes."""
MAX_QUERY_CHARS = 100
"""Longest phrase."""
MAX_DETECTIONS = 20
"""Most objects one call lists and draws (best scores first)."""
SCORE_THRESHOLD = 0.1
"""Lowest score an object is listed with (OWL-ViT's and OWLv2's own default)."""
NMS_IOU = 0.3
"""A box overlapping a better box of the same phrase by more than this (intersection over union) is dropped."""


def _iou(box: np.ndarray, others: np.ndarray) -> np.ndarray:
    """(M,) intersection over union of `box` (4,) with each of `others` (M, 4)."""
    x1, y1 = np.maximum(box[0], others[:, 0]), np.maximum(box[1], others[:, 1])
    x2, y2 = np.minimum(box[2], others[:, 2]), np.minimum(box[3], others[:, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area = lambda b: np.clip(b[..., 2] - b[..., 0], 0, None) * np.clip(b[..., 3] - b[..., 1], 0, None)  # noqa: E731
    return inter / np.maximum(area(box) + area(others) - inter, 1e-9)


@dataclass
class Detection:
    """One object found: the phrase's index in the call's queries, its box (original pixels), its score."""

    query: int
    box: tuple[int, int, int, int]
    """[x1, y1, x2, y2] rounded to the nearest pixel edges of the original (x2, y2 exclusive, as zoom takes it)."""
    score: float


def select(boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray, origin: tuple[int, int]) -> list[Detection]:
    """The detections to list from a model's `boxes` (N, 4) in the searched region's pixels, `scores` (N,)
    and `labels` (N,) (query index): above SCORE_THRESHOLD and at least a pixel wide and high inside the
    region (a box wholly in OWLv2's padding is clipped to nothing), non-maximum suppressed per query
    (NMS_IOU), best first, at most MAX_DETECTIONS, placed at `origin` (x, y) of the original and rounded."""
    sized = (boxes[:, 2] - boxes[:, 0] >= 1) & (boxes[:, 3] - boxes[:, 1] >= 1)
    keep = np.flatnonzero((scores > SCORE_THRESHOLD) & sized)
    keep = keep[np.argsort(-scores[keep], kind="stable")]
    chosen: list[int] = []
    for index in keep:
        same = [k for k in chosen if labels[k] == labels[index]]
        if same and _iou(boxes[index], boxes[same]).max() > NMS_IOU:
            continue
        chosen.append(int(index))
        if len(chosen) == MAX_DETECTIONS:
            break
    found = []
    for index in chosen:
        x1, y1, x2, y2 = boxes[index]
        x1, y1, x2, y2 = (math.floor(v + 0.5) for v in (x1, y1, x2, y2))  # to the nearest pixel edge; still >= 1 px
        box = (origin[0] + x1, origin[1] + y1, origin[0] + x2, origin[1] + y2)
        found.append(Detection(int(labels[index]), box, round(float(scores[index]), 3)))
    return found


def queries_of(query: Any) -> tuple[str, ...]:
    """The phrases of `query`: one string, or a list of 1 to MAX_QUERIES strings; ValueError otherwise."""
    phrases = [query] if isinstance(query, str) else query
    if not isinstance(phrases, (list, tuple)) or not phrases or len(phrases) > MAX_QUERIES:
        raise ValueError(f"query must be a phrase (\"red circle\") or a list of 1 to {MAX_QUERIES} phrases; got {query!r}")
    out = []
    for phrase in phrases:
        if not isinstance(phrase, str) or not phrase.strip() or len(phrase) > MAX_QUERY_CHARS:
            raise ValueError(f"each query must be a non-empty phrase of at most {MAX_QUERY_CHARS} characters, in words "
                             f"(\"red circle\"); got {phrase!r}")
        out.append(" ".join(phrase.split()))
    return tuple(out)


def describe(found: list[Detection], phrases: tuple[str, ...], where: tuple, image: int, size: tuple[int, int]) -> str:
    """detect's text: a head line (how many, where, in which coordinates) and one line per object."""
    what = " or ".join(repr(p) for p in phrases)
    head = f"in box {list(where)} of image {image} ({size[0]}x{size[1]})"
    if not found:
        return f"no {what} found {head} (nothing scored above {SCORE_THRESHOLD:g})"
    lines = [f"{len(found)} found for {what} {head}; boxes [x1, y1, x2, y2] in the original image's pixels, "
             f"scores from 0 to 1, best first"]
    lines += [f"{n} {phrases[d.query]} box {list(d.box)} score {d.score:.2f}" for n, d in enumerate(found, 1)]
    return "\n".join(lines)


class DetectTool(ModelTool):
    """`detect(query, box=None, image=0)` (module docstring); the runner's args are the call's phrases."""

    name = "detect"
    model_types = ("owlv2", "owlvit", "grounding-dino")
    needs_tokenizer = True

    def prepare(self, context: Any, query: Any, box: Any = None, image: Any = 0) -> Prepared:
        """The phrases checked, the searched box and the image (ValueError for a bad one)."""
        return self.prepared(context, queries_of(query), box, image)

    def answer(self, call: Prepared, output: tuple) -> tuple[str, Image.Image]:
        """The objects of the runner's (boxes, scores, labels) for the call's crop, listed and drawn."""
        boxes, scores, labels = output
        found = select(boxes, scores, labels, call.where[:2])
        return (describe(found, call.args, call.where, call.image, call.original.size),
                marks(call.original, found, call.where, call.side))
