"""What every task shares: the Example record, the Task base class, parameter dataclasses that check
and coerce their values, stable per-example randomness, split membership, and the registry.

Parameters are read by the rule of `vlmrl.fields`, the same as the run config: from YAML, from
`key=value` on the command line or from Python, "3" is 3 and 3.0 is not an int.

A task is deterministic from (seed, split, idx): `Task.rng(split, idx)` seeds `random.Random` with
the string "name:seed:split:idx" (Python hashes str seeds with SHA-512, never with `hash()`), so any
worker can make example 12345 without making the first 12344. Procedural tasks keep train and test
disjoint by construction: a candidate example belongs to "test" exactly when a stable hash
(BLAKE2b) of its content falls below 0.5 (`in_split`); a generator redraws until its candidate
belongs to the requested split. No torch here.
"""

from __future__ import annotations

import operator
import random
import typing
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

from PIL import Image

from vlmrl.data.order import stable_unit
from vlmrl.errors import VlmrlError
from vlmrl.fields import Naming, build, closest, field_docs, type_name
from vlmrl.imports import is_import_spec, load_object
from vlmrl.data.video import Video

if TYPE_CHECKING:
    from vlmrl.tools.trajectory import Trajectory

TEST_FRACTION = 0.5
"""Share of the content space (by stable hash) that belongs to the test split."""


@dataclass(init=False)
class Example:
    """One prompt: the images the model sees, the question, the gold answer and a model solution.

    Most tasks show one image: `Example(image, prompt, answer)`. A task that shows several passes
    `images=[...]` (the prompt shows them in order, before the question, or each at its `<image>`
    marker when the prompt has one per image: rollout/prompts.py); `image` is always the
    first of them. `originals` are the full-resolution images that tools read (a task may show a
    downscaled first view); they default to the images themselves. `videos` are shown like images:
    each at its `<video>` marker when the prompt has one per video, else before the images.
    """

    images: list[Image.Image]
    """The images the model sees (RGB), in order. Pixel coordinates in prompts and answers refer to
    them, unless the prompt says it means the originals."""
    prompt: str
    """The question, stating the output format."""
    answer: str
    """The gold final answer, as it should appear inside <answer> </answer>."""
    meta: dict[str, Any]
    """Task-specific facts used by `score` (counts, cipher, box) plus idx and split."""
    reference_completion: str
    """A well-formed reasoning trace ending in the right answer; it scores the maximum (SFT data)."""
    originals: list[Image.Image]
    """Full-resolution versions of `images` that tools (zoom, crop) read; default: the images."""
    system: str
    """A system prompt shown before the user turn ("" for none: the procedural tasks)."""
    videos: list[Video]
    """The videos the model sees, in order (none for most tasks)."""
    video_originals: list[Video]
    """Full-rate, full-resolution versions of `videos` that tools read (`frames`); default: the videos."""

    def __init__(self, image: Image.Image | None = None, prompt: str = "", answer: str = "",
                 meta: dict[str, Any] | None = None, reference_completion: str = "", *,
                 images: list[Image.Image] | None = None, originals: list[Image.Image] | None = None,
                 system: str = "", videos: list[Video] | None = None,
                 video_originals: list[Video] | None = None):
        if images is None:
            images = [image] if image is not None else []
        elif image is not None and images and image is not images[0]:
            images = [image, *images[1:]]  # dataclasses.replace(example, image=x): x becomes the first
        self.images = list(images)
        self.prompt, self.answer = prompt, answer
        self.meta = meta if meta is not None else {}
        self.reference_completion = reference_completion
        self.originals = list(originals) if originals is not None else list(self.images)
        self.system = system
        self.videos = list(videos) if videos is not None else []
        self.video_originals = list(video_originals) if video_originals is not None else list(self.videos)

    @property
    def image(self) -> Image.Image | None:
        """The first image (None when the example has none)."""
        return self.images[0] if self.images else None


@dataclass
class TaskParams:
    """Parameters shared by every task; each task extends this dataclass."""

    seed: int = 0
    """Seed of the generator; with (split, idx) it fixes every example."""

    def validate(self) -> None:
        """Raise VlmrlError with a one-line message when a value is out of range."""
        check(isinstance(self.seed, int) and not isinstance(self.seed, bool),
              f"seed must be an integer, got {self.seed!r}")


def check(condition: bool, message: str) -> None:
    """Raise VlmrlError(message) unless `condition` holds."""
    if not condition:
        raise VlmrlError(message)


def build_params(cls: type[TaskParams], values: dict[str, Any], task: str = "") -> TaskParams:
    """`cls(**values)` with unknown names reported (closest valid names first), values coerced to
    the field types (`vlmrl.fields`: "3" -> 3, "yes" -> True, "red,blue" -> a tuple) and the result
    validated; errors name `parameter NAME of task 'task'`."""
    owner = f" of task {task!r}" if task else ""
    return build(cls, values, Naming(noun="parameter", label="parameter {key}" + owner, owner=owner))


def param_table(cls: type[TaskParams]) -> list[tuple[str, str, Any, str]]:
    """(name, type, default, doc) for each parameter of `cls`, in declaration order."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows = []
    for f in fields(cls):
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else None)
        rows.append((f.name, type_name(hints[f.name]), default, docs.get(f.name, "")))
    return rows


def in_split(key: str, split: str) -> bool:
    """Whether content `key` belongs to `split`: "test" holds the keys hashing below TEST_FRACTION,
    "train" the others; other splits (OOD) are disjoint by their parameters and accept any key."""
    if split == "test":
        return stable_unit(key) < TEST_FRACTION
    if split == "train":
        return stable_unit(key) >= TEST_FRACTION
    return True


class Task:
    """Base class of a task: subclasses set `name`, `description`, `Params` and implement
    `_example` and `score`."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Params: ClassVar[type[TaskParams]] = TaskParams

    def __init__(self, params: TaskParams | None = None) -> None:
        self.params = params if params is not None else self.Params()
        self.params.validate()

    @property
    def splits(self) -> tuple[str, ...]:
        """The split names `example` accepts."""
        return ("train", "test")

    def rng(self, split: str, idx: int) -> random.Random:
        """The random generator of example (split, idx): seeded by the string "name:seed:split:idx"."""
        return random.Random(f"{self.name}:{self.params.seed}:{split}:{idx}")

    def check_split(self, split: str) -> None:
        """Raise VlmrlError naming the valid splits when `split` is not one of them."""
        if split not in self.splits:
            raise VlmrlError(f"task {self.name!r} has no split {split!r}; valid: {', '.join(self.splits)}")

    def example(self, idx: int, split: str = "train") -> Example:
        """Example number `idx` (>= 0) of `split`; the same for the same (seed, split, idx)."""
        self.check_split(split)
        try:
            index = operator.index(idx)  # numpy integers too
        except TypeError:
            index = -1
        if isinstance(idx, bool) or index < 0:
            raise VlmrlError(f"example index must be an integer >= 0, got {idx!r}")
        return self._example(index, split)

    def _example(self, idx: int, split: str) -> Example:
        raise NotImplementedError

    def score(self, example: Example, completion: str) -> dict[str, float]:
        """Reward components of `completion`, always with "total" and "accuracy" (0.0 or 1.0)."""
        raise NotImplementedError

    def data_fingerprint(self) -> dict[str, str]:
        """What a resumed run compares to know it reads the same data (`vlmrl.data.fingerprint`):
        {file or split: its size and hash}; {} for a task that generates its examples."""
        return {}

    def answer_regions(self, example: Example) -> list[tuple[int, int, tuple[int, int, int, int]]] | None:
        """Where in the image each part of the reference completion is read from: (start, end)
        characters of `example.reference_completion` and the (x0, y0, x1, y1) pixel box of the first
        image that part reads (the attention measure, `vlmrl.evaluation.cell_attention`); None when
        the task does not know."""
        return None

    def image_only_spans(self, example: Example) -> list[tuple[int, int]]:
        """The (start, end) characters of `example.reference_completion` that only the image tells
        (a decoder's entries): SFT leaves them out of the loss where it shows the example without its
        image (`sft.text_examples`), so the text teaches the rest (format, copies) and no letter
        nobody could predict from the text is a target. [] by default: every character follows from
        the text."""
        return []

    def score_trajectory(self, example: Example, trajectory: Trajectory) -> dict[str, float]:
        """Reward components of a tool-using rollout (`vlmrl.tools.Trajectory`). By default `score`
        of its final text (the model's last turn), so every task takes trajectories; a task that
        rewards the tool use itself (zoom) overrides it."""
        return self.score(example, trajectory.final_text)


_REGISTRY: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator: make the task available to `get_task(cls.name)`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty `name`")
    _REGISTRY[cls.name] = cls
    return cls


def list_tasks() -> list[str]:
    """Names of the registered tasks, sorted."""
    return sorted(_REGISTRY)


def task_class(name: str) -> type[Task]:
    """The class of task `name`: a registered name, or an import path `package.module:ClassName` or
    `path/to/file.py:ClassName` naming a `Task` subclass of your own (only the module you name is imported).

    VlmrlError with the closest names when unknown, or when the import path does not lead to a Task.
    """
    if is_import_spec(name):
        return _import_task(name)
    if name not in _REGISTRY:
        close = closest(name, _REGISTRY)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise VlmrlError(f"unknown task {name!r}; {hint}registered: {', '.join(list_tasks())}")
    return _REGISTRY[name]


def _import_task(path: str) -> type[Task]:
    """The Task subclass at `package.module:ClassName` or `path/to/file.py:ClassName`."""
    cls = load_object(path, "task")
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise VlmrlError(f"task {path!r} must name a subclass of vlmrl.tasks.Task; got {cls!r}")
    return cls


def get_task(name: str, **params: Any) -> Task:
    """Task `name` built from keyword parameters (strings are coerced to the field types)."""
    cls = task_class(name)
    return cls(build_params(cls.Params, params, task=name))


def run_task(name: str, run_seed: int, params: dict[str, Any]) -> Task:
    """A run's task: `params` (task.params) with the run's seed as the task's seed, unless they give
    one (task.params.seed: the examples, split and order stay fixed while the run's `seed` changes)."""
    return get_task(name, **{"seed": run_seed, **params})
