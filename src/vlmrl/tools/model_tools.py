"""Pre-trained models as tools: `detect(query, box=None, image=0)`, open-vocabulary detection (OWLv2, OWL-ViT,
Grounding DINO).

A tool model is a Hugging Face checkpoint named in `rollout.tool_models` ({detect: PATH}): a local folder,
or a hub id already in the local hub cache (never downloaded: tools run offline). The folder is checked
when the tools are resolved, before step 1 (`tool_model_folder`: missing, damaged or of another kind is
a one-line VlmrlError), and loaded once per process at the first call (`ModelTool`), on the run's device
(the policy's: the tool rollout sets `ModelTool.device`).

Where it runs: in the trainer's process, like the built-in tools (running.py), not in the tool worker:
the model then loads once per process, on the GPU the policy uses, and stays loaded (a worker is killed
and replaced at a timeout, which would reload it; and a second process would need a CUDA context of its
own). The model's own code (torch, transformers) lives in vlmrl/models/tool_models.py, imported at the
first call by name (`importlib`): vlmrl.tools imports no torch.

    {"name": "detect", "arguments": {"query": "red circle", "box": [0, 0, 224, 224]}}

`detect` returns, as text, the objects found for each phrase of `query` (a string, or a list of up to
MAX_QUERIES strings) inside `box` (original pixels; default the whole image) of image number `image`:
an id, the phrase, the box [x1, y1, x2, y2] in the ORIGINAL image's pixels (as `zoom` takes it) and a
score in [0, 1], best first, at most MAX_DETECTIONS after non-maximum suppression; AND the overlay image
with the numbered boxes (cv_tools' set-of-marks). Nothing above the score threshold is an answer ("no
'red circle' found ..."), not an error. A bad argument (a query that is not text, a box of NaN) raises
ValueError, which `run_tool` makes a "bad_arguments" error turn; a model that raises or runs out of
memory is a "raised" error turn (call_tool), never a crash.

Repeated calls: the G completions of a group often ask the same thing of the same image, so each
ModelTool keeps the last CACHE_SIZE answers keyed by (the image's content, the arguments): a repeated
call within a step is computed once (`cache_hits` counts them). And the calls of one turn (one per
trajectory still going) are computed together: the rollout hands them to `ModelTool.prefetch`, which
runs the ones not cached in one forward (up to MAX_BATCH images) and caches them, before each call is
run as usual, from the cache.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vlmrl.errors import VlmrlError
from vlmrl.tools.cv_tools import _marks
from vlmrl.tools.image_tools import context_image, pixel_box

MODEL_KINDS: dict[str, tuple[str, ...]] = {"detect": ("owlv2", "owlvit", "grounding-dino")}
"""Each model tool's name, and the `model_type`s (config.json) of the checkpoints it runs."""
MODEL_CODE = "vlmrl.models.tool_models"
"""The module that loads and runs the models (torch), imported by name at the first call."""
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
CACHE_SIZE = 64
"""Answers each model tool keeps for repeated calls (the distinct calls of a step, about: G completions of a
group often make the same call). Each keeps its overlay image: about 0.6 MB at 448 px, 40 MB in all."""
MAX_BATCH = 16
"""Most calls `ModelTool.prefetch` puts in one forward."""
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


# --------------------------------------------------------------------------- the folder


def _folder(name: str, path: Any) -> Path:
    """The local folder of `path`: a folder, or a hub id found in the local hub cache (never downloaded)."""
    if not isinstance(path, str) or not path:
        raise VlmrlError(f"tool {name!r} needs a model: set rollout.tool_models.{name} to a local folder or a hub id "
                         f"in the local hub cache (a {' or '.join(MODEL_KINDS[name])} checkpoint); got {path!r}")
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    if folder.exists():
        raise VlmrlError(f"rollout.tool_models.{name} {path!r} is a file, not a model folder")
    if path.count("/") == 1 and not path.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(path, local_files_only=True))
        except Exception:  # not in the cache (LocalEntryNotFoundError), or a malformed id
            pass
    raise VlmrlError(f"rollout.tool_models.{name} {path!r} is neither a folder nor in the local hub cache (tool models "
                     f"are never downloaded during a run): download it beforehand, or build a tiny one with "
                     f"vlmrl tiny-model {path} --tool {name}")


def tool_model_folder(name: str, path: Any) -> Path:
    """The checked folder of tool `name`'s model: config.json of a kind MODEL_KINDS[name] lists, a weights
    file, preprocessor_config.json and a tokenizer. VlmrlError in one line for anything missing or damaged
    (run before step 1, when the tools are resolved)."""
    folder = _folder(name, path)
    where = f"the {name} model folder {str(folder)!r} (rollout.tool_models.{name})"
    try:
        config = json.loads((folder / "config.json").read_text())
        model_type = config.get("model_type") if isinstance(config, dict) else None
    except (OSError, ValueError) as error:
        raise VlmrlError(f"{where} has no readable config.json: {type(error).__name__}: {error}") from None
    if model_type not in MODEL_KINDS[name]:
        raise VlmrlError(f"{where} holds a {model_type!r} model; {name} runs {', '.join(MODEL_KINDS[name])} checkpoints")
    weights = [f for f in WEIGHT_FILES if (folder / f).is_file()]
    if not weights:
        raise VlmrlError(f"{where} has no weights file ({', '.join(WEIGHT_FILES)})")
    if weights[0] == "model.safetensors" and (folder / weights[0]).stat().st_size < 16:
        raise VlmrlError(f"{where}: model.safetensors is damaged ({(folder / weights[0]).stat().st_size} bytes)")
    for part, files in (("an image processor", ("preprocessor_config.json",)),
                        ("a tokenizer", ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer_config.json"))):
        if not any((folder / f).is_file() for f in files):
            raise VlmrlError(f"{where} has no {part} ({' or '.join(files)})")
    return folder


# --------------------------------------------------------------------------- boxes


def original_boxes(corners: np.ndarray, width: int, height: int, padded_square: bool) -> np.ndarray:
    """(N, 4) boxes [x1, y1, x2, y2] in pixels of a width x height image, from the model's `corners` (N, 4)
    in [0, 1] of what it saw: OWLv2 pads the image at the bottom and right to a square of side
    max(width, height) before resizing, so its [0, 1] spans that square (`padded_square`); OWL-ViT
    resizes the image itself to its square, and Grounding DINO's boxes are relative to the image it was
    given (its batch padding is masked), so [0, 1] spans the width and the height. Clipped to the image
    (a box may reach into the padding)."""
    scale = (np.array([max(width, height)] * 4, np.float64) if padded_square
             else np.array([width, height, width, height], np.float64))
    boxes = np.asarray(corners, np.float64).reshape(-1, 4) * scale  # (N, 4)
    return np.clip(boxes, 0.0, np.array([width, height, width, height], np.float64))


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


# --------------------------------------------------------------------------- arguments


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


def image_key(image: Image.Image) -> tuple:
    """What identifies an image's content: its mode, size and a digest of its pixels (a millisecond at 448 px)."""
    return image.mode, image.size, hashlib.blake2b(image.tobytes(), digest_size=16).hexdigest()


# --------------------------------------------------------------------------- the tool


_LOADED: dict[tuple[str, str, str | None], Any] = {}
"""The models this process has loaded, by (tool name, folder, device): each loads once per process."""


def loaded_model(name: str, folder: Path, device: str | None = None) -> Any:
    """Tool `name`'s model in `folder`, loaded at the first call of this process (MODEL_CODE's `load_tool_model`,
    on `device`: the policy's, as the rollout sets it; None: the current CUDA device, else the CPU) and kept."""
    key = (name, str(folder), device)
    if key not in _LOADED:
        _LOADED[key] = importlib.import_module(MODEL_CODE).load_tool_model(name, folder, device)
    return _LOADED[key]


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


@dataclass
class Prepared:
    """One call's checked arguments: what it is cached under, the image and the searched box."""

    key: tuple
    original: Image.Image
    phrases: tuple[str, ...]
    where: tuple[int, int, int, int]
    image: int


class ModelTool:
    """A model tool (`detect`) bound to its checked folder: callable as a tool, `tool(context, query, box=None,
    image=0)`; loads its model at the first call (`loaded_model`) and answers repeated calls from its cache.
    `prefetch` computes several calls in one forward (a turn's calls, before they are run one by one)."""

    def __init__(self, name: str, folder: Path, cache_size: int = CACHE_SIZE):
        self.name, self.folder, self.cache_size = name, folder, cache_size
        self.device: str | None = None
        """Where the model runs: the policy's device, set by the tool rollout before the first call (None: the
        current CUDA device, else the CPU)."""
        self.cache: OrderedDict[tuple, tuple[str, Image.Image]] = OrderedDict()
        self.calls = self.computed = self.forwards = 0

    def __repr__(self) -> str:
        return f"ModelTool({self.name!r}, {str(self.folder)!r})"

    @property
    def cache_hits(self) -> int:
        """Calls answered without computing anything of their own (repeats of a call already computed)."""
        return self.calls - self.computed

    def _prepare(self, context: Any, query: Any, box: Any, image: Any) -> Prepared:
        """The call's arguments checked (ValueError for a bad one) and its cache key: the image's content,
        the phrases, the box, the image's number (it is in the text) and the overlay's side."""
        original = context_image(context, image)
        phrases = queries_of(query)
        where = pixel_box([0, 0, *original.size] if box is None else box, *original.size)
        return Prepared((image_key(original), phrases, where, image, context.max_side), original, phrases, where, image)

    def _compute(self, calls: list[Prepared]) -> list[tuple[str, Image.Image]]:
        """The (text, overlay) of each of `calls`, computed in one forward of the model, and kept in the cache."""
        regions = [call.original.crop(call.where).convert("RGB") for call in calls]
        outputs = loaded_model(self.name, self.folder, self.device).detect(regions, [call.phrases for call in calls])
        self.forwards += 1
        answers = []
        for call, (boxes, scores, labels) in zip(calls, outputs):
            found = select(boxes, scores, labels, call.where[:2])
            text = describe(found, call.phrases, call.where, call.image, call.original.size)
            answers.append((text, _marks(call.original, found, call.where, call.key[-1])))
            self.computed += 1
            if self.cache_size > 0:
                self.cache[call.key] = answers[-1]
                if len(self.cache) > self.cache_size:
                    self.cache.popitem(last=False)
        return answers

    def __call__(self, context: Any, query: Any, box: Any = None, image: Any = 0) -> list:
        """[text, overlay image] (module docstring); ValueError for a bad argument."""
        call = self._prepare(context, query, box, image)
        self.calls += 1
        if call.key in self.cache:
            self.cache.move_to_end(call.key)
            text, overlay = self.cache[call.key]
        else:
            [(text, overlay)] = self._compute([call])
        return [text, overlay.copy()]

    def prefetch(self, calls: list[tuple[Any, dict]]) -> None:
        """Compute the (context, arguments) `calls` not yet cached in one forward per MAX_BATCH, so that the calls
        themselves, run one by one next, are answered from the cache (at most `cache_size` of them: the rest run
        alone); a call whose arguments are bad is left to fail as itself, and a model that fails here fails
        again, as an error turn, when its call runs."""
        pending: dict[tuple, Prepared] = {}
        for context, arguments in calls:
            try:
                bound = inspect.signature(self.__call__).bind(context, **arguments)
                bound.apply_defaults()
                call = self._prepare(*bound.args)
            except (TypeError, ValueError):
                continue
            if call.key not in self.cache:
                pending.setdefault(call.key, call)
        waiting = list(pending.values())[:self.cache_size]  # more would push the first out before their calls
        for start in range(0, len(waiting) if self.cache_size > 0 else 0, MAX_BATCH):
            try:
                self._compute(waiting[start:start + MAX_BATCH])
            except Exception:  # noqa: BLE001 - the call itself turns it into an error turn
                return
