"""Pre-trained models as tools: the generic part every model tool shares (`ModelTool`), and the checks of its
model's folder. The tools themselves are one module each (detect_tool.py: `detect`, ...), listed in
model_table.py (`MODEL_TOOLS`), the one table a new model tool is added to.

A tool model is a Hugging Face checkpoint named in `rollout.tool_models` ({detect: PATH}): a local folder,
or a hub id already in the local hub cache (never downloaded: tools run offline). The folder is checked
when the tools are resolved, before step 1 (`tool_model_folder`: missing, damaged or of another kind is
a one-line VlmrlError), and loaded once per process at the first call (`loaded_model`), on the run's device
(the policy's: the tool rollout sets `ModelTool.device`).

Where it runs: in the trainer's process, like the built-in tools (running.py), not in the tool worker:
the model then loads once per process, on the GPU the policy uses, and stays loaded (a worker is killed
and replaced at a timeout, which would reload it; and a second process would need a CUDA context of its
own). The models' own code (torch, transformers) lives in vlmrl/models/tool_models.py (the dispatch) and
one module per model kind there, imported at the first call by name (`importlib`): vlmrl.tools imports
no torch.

A model tool is a `ModelTool` subclass that holds only what is its own: its name, the `model_types` it
runs, `prepare(context, ...)` (its signature after the context IS the tool's signature: it checks the
arguments, ValueError for a bad one, and returns a `Prepared` call, made by `ModelTool.prepared`) and
`answer(call, output)` (the text and the overlay image from the model runner's output for that call).
The base holds the rest:

Repeated calls: the G completions of a group often ask the same thing of the same image, so each
ModelTool keeps the last CACHE_SIZE answers in an `AnswerCache` (cache.py, the one find_objects and measure
use) keyed by (the image's content, the arguments): a repeated call within a step is computed once
(`cache_hits` counts them; the rollout logs each tool's hit rate). And the calls of one turn (one per
trajectory still going) are computed together: the rollout hands them to `ModelTool.prefetch`, which
runs the ones not cached in one forward (up to MAX_BATCH calls: the runner's `run(crops, args)`) and stores
them, before each call is run as usual, from the cache. A bad argument raises ValueError, which `run_tool`
makes a "bad_arguments" error turn; a model that raises or runs out of memory is a "raised" error turn
(call_tool), never a crash.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import importlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from PIL import Image

from vlmrl.errors import VlmrlError
from vlmrl.tools.cache import AnswerCache, image_key
from vlmrl.tools.image_tools import context_image, pixel_box

MODEL_CODE = "vlmrl.models.tool_models"
"""The module that loads and runs the models (torch), imported by name at the first call."""
TOOL_TABLE = "vlmrl.tools.model_table"
"""The table of the model tools (`MODEL_TOOLS`), imported by name: it imports the tools, which import this module."""
CACHE_SIZE = 64
"""Answers each model tool keeps for repeated calls (the distinct calls of a step, about: G completions of a
group often make the same call). Each keeps its overlay image: about 0.6 MB at 448 px, 40 MB in all."""
MAX_BATCH = 16
"""Most calls `ModelTool.prefetch` puts in one forward."""
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer_config.json")


# --------------------------------------------------------------------------- the folder


def tool_class(name: str) -> type[ModelTool]:
    """The ModelTool subclass of model tool `name` (model_table.MODEL_TOOLS); VlmrlError for another name."""
    table = importlib.import_module(TOOL_TABLE).MODEL_TOOLS
    if name not in table:
        raise VlmrlError(f"unknown model tool {name!r}; model tools: {', '.join(table)}")
    return table[name]


def _folder(name: str, path: Any, kinds: tuple[str, ...]) -> Path:
    """The local folder of `path`: a folder, or a hub id found in the local hub cache (never downloaded)."""
    if not isinstance(path, str) or not path:
        raise VlmrlError(f"tool {name!r} needs a model: set rollout.tool_models.{name} to a local folder or a hub id "
                         f"in the local hub cache (a {' or '.join(kinds)} checkpoint); got {path!r}")
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
    """The checked folder of tool `name`'s model: config.json of a `model_type` the tool's class lists, a weights
    file, preprocessor_config.json and, for a tool that `needs_tokenizer`, a tokenizer. VlmrlError in one line
    for anything missing or damaged (run before step 1, when the tools are resolved)."""
    kind = tool_class(name)
    folder = _folder(name, path, kind.model_types)
    where = f"the {name} model folder {str(folder)!r} (rollout.tool_models.{name})"
    try:
        config = json.loads((folder / "config.json").read_text())
        model_type = config.get("model_type") if isinstance(config, dict) else None
    except (OSError, ValueError) as error:
        raise VlmrlError(f"{where} has no readable config.json: {type(error).__name__}: {error}") from None
    if model_type not in kind.model_types:
        raise VlmrlError(f"{where} holds a {model_type!r} model; {name} runs {', '.join(kind.model_types)} checkpoints")
    weights = [f for f in WEIGHT_FILES if (folder / f).is_file()]
    if not weights:
        raise VlmrlError(f"{where} has no weights file ({', '.join(WEIGHT_FILES)})")
    if weights[0] == "model.safetensors" and (folder / weights[0]).stat().st_size < 16:
        raise VlmrlError(f"{where}: model.safetensors is damaged ({(folder / weights[0]).stat().st_size} bytes)")
    parts = [("image processor", ("preprocessor_config.json",))]
    parts += [("tokenizer", TOKENIZER_FILES)] if kind.needs_tokenizer else []
    for part, files in parts:
        if not any((folder / f).is_file() for f in files):
            raise VlmrlError(f"{where} has no {part} ({' or '.join(files)})")
    return folder


# --------------------------------------------------------------------------- coordinates, images


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


_LOADED: dict[tuple[str, str, str | None], Any] = {}
"""The models this process has loaded, by (tool name, folder, device): each loads once per process."""


def loaded_model(name: str, folder: Path, device: str | None = None) -> Any:
    """Tool `name`'s model runner for `folder`, loaded at the first call of this process (MODEL_CODE's
    `load_tool_model`, on `device`: the policy's, as the rollout sets it; None: the current CUDA device, else
    the CPU) and kept."""
    key = (name, str(folder), device)
    if key not in _LOADED:
        _LOADED[key] = importlib.import_module(MODEL_CODE).load_tool_model(name, folder, device)
    return _LOADED[key]


# --------------------------------------------------------------------------- the tool


@dataclass
class Prepared:
    """One call's checked arguments (`ModelTool.prepared` makes it): what it is cached under, the image, the
    region the model reads, and the tool's own arguments, handed to the model runner."""

    key: tuple
    """What the answer is cached under: image_key(original), args, where, image, side."""
    original: Image.Image
    """The original image the call reads."""
    where: tuple[int, int, int, int]
    """The region the model reads (its crop), [x1, y1, x2, y2] in the original's pixels (default the whole image)."""
    image: int
    """The image's number (it is in the text)."""
    args: tuple
    """The tool's own checked arguments (hashable), handed to the model runner (`run(crops, args)`)."""
    side: int
    """The overlay's longest side (the context's `max_side`, as zoom's)."""


class ModelTool(ABC):
    """A model tool bound to its checked folder: callable as a tool, `tool(context, ...)` with the arguments of
    its `prepare`; loads its model at the first call (`loaded_model`) and answers repeated calls from its
    cache. `prefetch` computes several calls in one forward (a turn's calls, before they are run one by one).
    Subclasses set `name`, `model_types` (and `needs_tokenizer`) and define `prepare` and `answer`."""

    name: ClassVar[str]
    """The tool's name, as the model writes it ("detect")."""
    model_types: ClassVar[tuple[str, ...]]
    """The config.json `model_type`s of the checkpoints it runs."""
    needs_tokenizer: ClassVar[bool] = False
    """Whether its folder must hold a tokenizer (detect's phrases)."""

    def __init__(self, folder: Path, cache_size: int = CACHE_SIZE):
        self.folder, self.cache_size = folder, cache_size
        self.device: str | None = None
        """Where the model runs: the policy's device, set by the tool rollout before the first call (None: the
        current CUDA device, else the CPU)."""
        self.answer_cache = AnswerCache(cache_size)
        """The last `cache_size` answers, [text, overlay], by `Prepared.key`; it counts the calls and the answers
        computed."""
        self.forwards = 0
        self.__signature__ = inspect.signature(self.prepare)  # the tool's signature, as run_tool checks it

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.folder)!r})"

    @property
    def calls(self) -> int:
        """Calls made (`__call__`), answered from the cache or computed."""
        return self.answer_cache.calls

    @property
    def computed(self) -> int:
        """Answers computed (by a call, or by `prefetch` for the calls that follow)."""
        return self.answer_cache.computed

    @property
    def cache_hits(self) -> int:
        """Calls answered without computing anything of their own (repeats of a call already computed)."""
        return self.answer_cache.cache_hits

    @abstractmethod
    def prepare(self, context: Any) -> Prepared:
        """The call's arguments checked (ValueError for a bad one), as a Prepared call (`prepared`). Its signature
        after `context` is the tool's."""

    @abstractmethod
    def answer(self, call: Prepared, output: Any) -> tuple[str, Image.Image]:
        """(text, overlay image of longest side `call.side`) of `call` from the runner's `output` for its crop."""

    @staticmethod
    def prepared(context: Any, args: tuple, box: Any = None, image: Any = 0) -> Prepared:
        """A call on image number `image` of the context, reading region `box` (original pixels; None: the whole
        image) with the tool's checked `args`; ValueError for a bad image number or box."""
        original = context_image(context, image)
        where = pixel_box([0, 0, *original.size] if box is None else box, *original.size)
        key = (image_key(original), args, where, image, context.max_side)
        return Prepared(key, original, where, image, args, context.max_side)

    def _compute(self, calls: list[Prepared]) -> list[list]:
        """The [text, overlay] of each of `calls`, computed in one forward of the model (neither kept nor counted:
        the callers do)."""
        crops = [call.original.crop(call.where).convert("RGB") for call in calls]
        outputs = loaded_model(self.name, self.folder, self.device).run(crops, [call.args for call in calls])
        self.forwards += 1
        return [list(self.answer(call, output)) for call, output in zip(calls, outputs)]

    def __call__(self, context: Any, /, *args: Any, **arguments: Any) -> list:
        """[text, overlay image] of the call `prepare(context, ...)` makes, from the cache or computed (the overlay
        the caller's own copy); ValueError or TypeError for a bad argument."""
        prepared = self.prepare(context, *args, **arguments)
        return self.answer_cache.answer(prepared.key, lambda: self._compute([prepared])[0])

    def prefetch(self, calls: list[tuple[Any, dict]]) -> None:
        """Compute the (context, arguments) `calls` not yet cached in one forward per MAX_BATCH, so that the calls
        themselves, run one by one next, are answered from the cache (at most `cache_size` of them: the rest run
        alone); a call whose arguments are bad is left to fail as itself, and a model that fails here fails
        again, as an error turn, when its call runs."""
        pending: dict[tuple, Prepared] = {}
        for context, arguments in calls:
            try:
                call = self.prepare(context, **arguments)
            except (TypeError, ValueError):
                continue
            if call.key not in self.answer_cache:
                pending.setdefault(call.key, call)
        waiting = list(pending.values())[:self.cache_size]  # more would push the first out before their calls
        for start in range(0, len(waiting) if self.cache_size > 0 else 0, MAX_BATCH):
            batch = waiting[start:start + MAX_BATCH]
            try:
                answers = self._compute(batch)
            except Exception:  # noqa: BLE001 - the call itself turns it into an error turn
                return
            for call, answer in zip(batch, answers):
                self.answer_cache.store(call.key, answer)
