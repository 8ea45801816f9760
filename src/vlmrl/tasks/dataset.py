"""`dataset`: any dataset a researcher brings, as a task: rows of files, a `save_to_disk` folder, an
imagefolder, a hub id in the local cache or a `datasets` object (data/sources.py), their columns
mapped to prompt, answer, images, reference completion and system prompt (data/columns.py: layouts detected, an
explicit `columns` mapping wins), served in a seeded order (data/order.py).

    task.name: dataset
    task.params: {path: data/bars.jsonl, columns: {prompt: question, answer: label, images: chart}}

A `videos` (or `video`) column holds video file paths (one or a list per row), found when the data
loads (a missing file is a bad row then) and decoded with PyAV when an example is made
(tasks/video_file.py: `video_fps` frames a second, at most `max_frames`; a file that will not
decode is a bad row then, under `on_bad_row`; a `<video>` marker count that differs from the
video count is a bad row at load). Every image of a row is kept, in order: where the prompt has
`<image>` markers they are placed there (a marker count that differs from the image count is a bad
row), else they come before the text. Relative image and video paths are read from the data file's
folder, then the source folder, and every file read must lie inside the data folder or `media_root`
(data/paths.py). The
columns of a row other than the prompt and the images (the answer's own column too, by its name, as
TRL passes `solution`) reach the rewards as `example.meta["columns"]`.

Splits: "train" is train_split; "test" is test_split, else the dataset's "test", else its
"validation", else (test_fraction > 0) round(test_fraction x rows) of train held out by row, chosen by
split_seed (not by content: rows sharing a question or an answer are split like any others). Train
rows are served in a new shuffled order each epoch, a pure function of (seed, epoch, row), so a
resumed run draws what an uninterrupted one does; held-out splits in one fixed shuffled order, so
the first n are a sample without replacement. Every row of every split is checked when the data
loads (a prompt, an answer, its images decoded once with check_images, its markers): the first bad
row stops with a message naming it, or (on_bad_row=skip) bad rows are left out and counted.

The final answer is written as `answer_format` says, the name the built-in rewards' `extract` gives
it: answer_tag (`<think> ... </think> <answer> X </answer>`, the house format and what the default
template asks for), boxed (the last `\\boxed{X}`) or whole (the completion is the answer); auto is boxed
for a template that asks for `\\boxed` and not for `<answer>`, else answer_tag. A row without a worked
solution gets an SFT target made from its answer in that format and nothing else (reference_of):
`<think> </think> <answer> X </answer>`, `\\boxed{X}` or `X`. The fixed 34-token sentence it once
put before the answer left 120 SFT steps at 31.5% held out, against 100% for this target and 99% for
a short worked solution (docs/results.md): the steps went to tokens that carry nothing.

Reward: accuracy (the verifier on the final answer: math, number, choice or exact) + format_weight x
format (answer_tag: the strict <think>/<answer> layout; boxed: a `\\boxed{}` present; whole: a
non-blank completion); total in [0, 1 + format_weight].
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmrl.data.columns import MARKER, VIDEO_MARKER, Columns, RowText, detect, read_text, value_at
from vlmrl.data.images import NoImage, image_file, image_values, load_image
from vlmrl.data.fingerprint import fingerprint
from vlmrl.data.order import draw_row, held_out
from vlmrl.data.paths import Media, media, media_file, preview
from vlmrl.data.sources import Source, open_source
from vlmrl.errors import VlmrlError, warn
from vlmrl.tasks.base import Example, Task, TaskParams, check, register_task
from vlmrl.tasks.video_file import check_sampling, read_video
from vlmrl.rewards.builtin import final_answer, last_boxed
from vlmrl.rewards.verify import (
    Rubric,
    collapse_whitespace,
    last_number,
    math_equal,
    think_answer_format,
)

INSTRUCTION = "Think step by step inside <think> </think>, then give the final answer inside <answer> </answer>."
VERIFIERS = ("auto", "math", "number", "choice", "exact")
ON_BAD_ROW = ("error", "skip")
ANSWER_FORMATS = ("auto", "answer_tag", "boxed", "whole")
MARKERS = ("place", "drop")
_CHOICE = re.compile(r"\(?([A-Za-z])(?:[).:]|\s|$)")
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TAGS = re.compile(r"</?(?:think|answer)>")


@dataclass
class FileParams(TaskParams):
    """How rows are read from a dataset, split and served: the parameters the `dataset` task and
    geometry's file sources share (one definition; geometry keeps its own `shuffle` default)."""

    train_split: str = "train"
    """Dataset split served as "train"."""
    test_split: str = ""
    """Dataset split served as "test"; empty: "test", else "validation", else held out from train."""
    test_fraction: float = 0.1
    """Share of train rows held out as "test" when the dataset has no test split (0: none)."""
    split_seed: int = 0
    """Seed of the held-out choice; fixed apart from `seed`, so runs of several seeds share one test set."""
    shuffle: bool = True
    """Serve train rows in a new seeded order each epoch (false: file order, every epoch)."""
    max_image_side: int = 0
    """Downscale images whose longer side exceeds this many pixels (0 keeps them as they are)."""
    max_pixels: int = 4_194_304
    """Downscale images with more pixels than this (2048 x 2048), aspect ratio kept, before the
    model's processor sees them (0 = no limit). Keeps a huge scan from filling memory."""
    on_bad_row: str = "error"
    """A bad row (no prompt or answer, a missing, unreadable, truncated or non-image file, an image too
    large to decode, markers that do not match the images): "error" stops before training with a
    message naming the row, the file and the problem; "skip" leaves such rows out and counts them (a
    warning at load, task.bad_rows, the preflight report)."""
    check_images: bool = True
    """Decode every image once when the dataset loads, so a bad one is found before training (about
    a millisecond per small image). false: only the presence of an image value is checked then, and a
    bad image stops the run at the step that reaches it."""
    format_weight: float = 0.5
    """Weight of the format component in the total."""
    media_root: str = ""
    """The folder image and video files may be read from. Empty: the data folder (the folder given as
    the path, or the data file's folder), so a data file cannot make a run read files elsewhere and
    copy them into rollout logs and the report; a path naming a file outside it is a bad row. Set it
    (e.g. /data/images, or / for anywhere) when the rows name files elsewhere; paths in a data file
    are still relative to the data file's folder."""

    def validate_files(self) -> None:
        """VlmrlError in one line for a file parameter out of range."""
        check(0.0 <= self.test_fraction < 1.0, f"test_fraction must be in [0, 1), got {self.test_fraction}")
        check(not self.media_root or Path(self.media_root).expanduser().is_dir(),
              f"media_root {self.media_root!r} is not a folder")
        check(self.max_image_side >= 0, f"max_image_side must be >= 0, got {self.max_image_side}")
        check(self.max_pixels >= 0, f"max_pixels must be >= 0, got {self.max_pixels}")
        check(self.on_bad_row in ON_BAD_ROW, f"on_bad_row must be error or skip, got {self.on_bad_row!r}")

    def file_params(self) -> dict[str, Any]:
        """The values of every file parameter (seed aside): what a task reading files passes on."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(FileParams) if f.name != "seed"}


@dataclass
class DatasetParams(FileParams):
    """Parameters of the dataset task."""

    path: str = ""
    """The data: a .jsonl/.json/.csv/.parquet/.arrow file, a folder of them named {split}.{ext} or
    {split}-*.{ext}, an imagefolder (images + metadata.jsonl/.csv naming them in `file_name`), a
    `save_to_disk` folder, or a hub id in the local Hugging Face cache."""
    columns: dict[str, str] = field(default_factory=dict)
    """Which column holds each part: {prompt, answer, images, reference, system}; a key given wins
    over the detected layout, the others are detected. A dotted name reads inside a dict column."""
    template: str = "{prompt}\n" + INSTRUCTION
    """The prompt the model sees: `{prompt}` is replaced by the row's prompt (no other braces are read)."""
    system: str = ""
    """A system prompt for every example (empty: the row's own system turn, if any)."""
    answer_format: str = "auto"
    """How a completion writes its final answer, named as the built-in rewards' `extract`: answer_tag
    (`<think> ... </think> <answer> X </answer>`), boxed (the last `\\boxed{X}`) or whole (the
    completion is the answer); auto: boxed when the template asks for `\\boxed` and not for
    `<answer>`, else answer_tag. The SFT target made from a row's answer and the task's own score
    follow it; give the same `extract` to built-in rewards."""
    verifier: str = "auto"
    """How the answer is checked: math (math-verify, choices, normalized strings; what auto means),
    number (the last number, to 1e-6 relative), choice (the option letter) or exact (the text,
    whitespace and case aside)."""
    markers: str = "place"
    """`<image>` markers in the prompt: place (each image at its marker) or drop (removed; images first)."""
    video_fps: float = 2.0
    """Frames per second kept from each video file (the first frame at or after each step); > 0."""
    max_frames: int = 16
    """Most frames kept from each video file, spread evenly over those `video_fps` keeps."""

    def validate(self) -> None:
        super().validate()
        self.validate_files()
        check(self.answer_format in ANSWER_FORMATS,
              f"answer_format must be one of {', '.join(ANSWER_FORMATS)}, got {self.answer_format!r}")
        check(self.verifier in VERIFIERS, f"verifier must be one of {', '.join(VERIFIERS)}, got {self.verifier!r}")
        check(self.markers in MARKERS, f"markers must be place or drop, got {self.markers!r}")
        check(self.format_weight >= 0, f"format_weight must be >= 0, got {self.format_weight}")
        check(isinstance(self.split_seed, int), f"split_seed must be an integer, got {self.split_seed!r}")
        check("{prompt}" in self.template, f"template must hold {{prompt}} (where the row's question goes), got "
              f"{self.template[:60]!r}: without it every example would ask the same thing")
        check_sampling(self.video_fps, self.max_frames, ("video_fps", "max_frames"), none=False)


def choice_letter(text: str) -> str | None:
    """The option letter a text starts with: "B", "(B)", "B.", "B) 45", "B. 45°" -> "B"; else None."""
    match = _CHOICE.match(text.strip().strip("$").strip())
    return match.group(1).upper() if match else None


def verify(verifier: str, answer: str, gold: str) -> bool:
    """Whether `answer` matches `gold` under `verifier` (see DatasetParams.verifier); never raises."""
    if verifier == "number":
        got, want = last_number(answer), last_number(gold)
        return got is not None and want is not None and abs(got - want) <= 1e-6 * max(1.0, abs(want))
    if verifier == "choice":
        letter = choice_letter(gold)
        return letter is not None and choice_letter(answer) == letter
    if verifier == "exact":
        return collapse_whitespace(answer).casefold() == collapse_whitespace(gold).casefold()
    return math_equal(answer, gold)


def reasoning_from_solution(solution: str) -> str:
    """The reasoning part of a solution: its <think> content, else the text around the answer
    blocks; tags removed so it can sit inside a reference <think> block."""
    think = re.search(r"<think>(.*?)</think>", solution, re.DOTALL)
    text = think.group(1) if think else _ANSWER_BLOCK.sub(" ", solution)
    return " ".join(_TAGS.sub(" ", text).split())


def answer_format_of(answer_format: str, template: str) -> str:
    """The answer format `answer_format` names; auto: boxed for a template that asks for `\\boxed` and
    not for `<answer>`, else answer_tag (see DatasetParams.answer_format)."""
    if answer_format != "auto":
        return answer_format
    return "boxed" if "\\boxed" in template and "<answer>" not in template else "answer_tag"


def reference_of(reasoning: str, answer: str, answer_format: str = "answer_tag") -> str:
    """The reference completion (SFT target) of a worked solution's reasoning and its answer, written
    in `answer_format`. Without reasoning nothing is made up around the answer: `<think> </think>
    <answer> X </answer>`, `\\boxed{X}` or `X` (whole: the completion is the answer, so reasoning is
    left out)."""
    if answer_format == "whole":
        return answer
    if answer_format == "boxed":
        return f"{reasoning} \\boxed{{{answer}}}" if reasoning else f"\\boxed{{{answer}}}"
    return f"<think> {reasoning} </think> <answer> {answer} </answer>" if reasoning else \
        f"<think> </think> <answer> {answer} </answer>"


@dataclass
class Loaded:
    """A loaded dataset: its columns, the rows each task split serves, and the rows left out."""

    source: Source
    columns: Columns
    served: dict[str, list[int]]
    """Task split -> usable row indices of its dataset split."""
    source_of: dict[str, str]
    """Task split -> the dataset split its rows come from."""
    texts: dict[str, list[RowText | None]]
    """Dataset split -> each row's text parts (None for a bad row)."""
    images: dict[str, Any]
    """Dataset split -> its image column in arrow format (values undecoded), or None."""
    extras: dict[str, Any]
    """Dataset split -> the dataset's other columns (no images), for example.meta["columns"]."""
    videos: dict[str, list[list[Path]]] = field(default_factory=dict)
    """Dataset split -> each row's video files (found when the data loads; decoded per example)."""
    media: dict[str, Media] = field(default_factory=dict)
    """Dataset split -> where its rows' relative paths are looked up and reads are kept (data/paths.py)."""
    files: set[Path] = field(default_factory=set)
    """The image and video files the rows name (resolved), for the data fingerprint."""
    bad_rows: list[tuple[str, int, str]] = field(default_factory=list)
    """(dataset split, row, what is wrong) of the rows left out (on_bad_row=skip)."""


def video_files(value: Any, where: Media) -> list[Path]:
    """A row's video files: one path or a list of them, read as image paths are (data/paths.py:
    relative to the data file's folder, then the source folder, inside the data folder or
    media_root); VlmrlError naming a path that is not a file there."""
    paths = [value] if isinstance(value, (str, Path)) else list(value) if isinstance(value, (list, tuple)) else \
        [] if value is None else [value]
    found = []
    for path in paths:
        if not isinstance(path, (str, Path)) or not str(path):
            raise VlmrlError(f"a video is a file path; got {preview(path)}")
        found.append(media_file(str(path), where, "video"))
    return found


def named_images(values: list[Any], at: Media) -> list[Path]:
    """The files among a row's image values that name one that is there (with check_images=false a
    path not checked at load is not counted: its row says what is wrong when it is drawn)."""
    found = []
    for value in values:
        try:
            path = image_file(value, at)
        except VlmrlError:
            continue
        if path is not None:
            found.append(path)
    return found


def datasets_json() -> type:
    """The `datasets` feature of a column whose cells have mixed types (each stored as JSON text)."""
    from datasets.features import Json

    return Json


def image_columns(ds: Any) -> list[str]:
    """The columns of `ds` typed as images (datasets.Image, or a list of them)."""
    import datasets

    def is_image(feature: Any) -> bool:
        inner = getattr(feature, "feature", None)
        return isinstance(feature, datasets.Image) or (inner is not None and is_image(inner))

    return [name for name, feature in ds.features.items() if is_image(feature)]


@register_task
class DatasetTask(Task):
    """Any dataset: rows mapped to prompts, answers and images (see the module docstring)."""

    name = "dataset"
    description = ("your own data: jsonl/json/csv/parquet/arrow files, imagefolders, save_to_disk folders or a "
                   "cached hub id; "
                   "TRL, EasyR1, verl, messages layouts detected or columns mapped; math/number/choice/exact")
    Params = DatasetParams
    params: DatasetParams

    def __init__(self, params: DatasetParams | None = None, data: Any = None) -> None:
        super().__init__(params)
        self.data = data
        """A `datasets.Dataset` or `DatasetDict` given from Python (then `path` is not read)."""
        check(data is not None or bool(self.params.path.strip()),
              f"task {self.name!r} needs path=FILE_FOLDER_OR_HUB_ID (a .jsonl/.json/.csv/.parquet/.arrow file, a "
              "folder of them, a save_to_disk folder, or a hub id in the local cache)")
        if data is None and self.params.path.startswith(("/", ".", "~")):
            check(Path(self.params.path).expanduser().exists(), f"data path {self.params.path!r} does not exist")

    def choose_columns(self, names: list[str]) -> Columns:
        """The column mapping of a dataset with these columns (a preset may fix its own)."""
        return detect(names, self.params.columns)

    @functools.cached_property
    def _data(self) -> Loaded:
        """The dataset, its columns and the rows each task split serves; built on first use."""
        p = self.params
        source = open_source(self.data if self.data is not None else p.path)
        splits = source.splits
        for wanted in (p.train_split, p.test_split):
            if wanted and wanted not in splits:
                raise VlmrlError(f"{self.name} source has no split {wanted!r}; it has {', '.join(splits)}")
        if not len(splits[p.train_split]):
            raise VlmrlError(f"{self.name} source {source.name!r} has no rows in split {p.train_split!r}")
        columns = self.choose_columns(list(splits[p.train_split].column_names))
        data = Loaded(source, columns, {}, {}, {}, {}, {})
        for name, ds in splits.items():
            self._load_split(data, name, ds)
        self._report_bad_rows(data)
        self._assign_splits(data)
        return data

    def _load_split(self, data: Loaded, name: str, ds: Any) -> None:
        """Read split `name`'s text parts and image values, checking every row (bad ones to data.bad_rows)."""
        columns = data.columns
        pictures = [c for c in image_columns(ds) if c != columns.images]
        kept = [c for c in ds.column_names if c != columns.images and c not in pictures]
        text_table = ds.select_columns(kept).with_format(None)
        images = ds.select_columns([columns.images]).with_format("arrow") if columns.images else None
        data.images[name] = images
        others = [c for c in kept if c != columns.prompt]  # the answer's own column too: TRL's `solution`
        data.extras[name] = ds.select_columns(others) if others else None
        files = data.source.files.get(name, [])
        where = (f" ({files[0]})" if len(files) == 1 else f" ({len(files)} files in {Path(files[0]).parent})"
                 if files else f" of {data.source.name}")
        texts: list[RowText | None] = []
        videos: list[list[Path]] = []
        at = data.media[name] = media(data.source.folders.get(name, ()), data.source.root, self.params.media_root)
        for i, row in enumerate(text_table):
            files: list[Path] = []  # one entry per row, a bad row's too: rows are read by index
            try:
                values = self._image_values(data, name, i)
                files = video_files(value_at(row, columns.videos), at) if columns.videos else []
                texts.append(self._checked(row, columns, values, at, len(files)))
                data.files.update(files, named_images(values, at))
            except VlmrlError as error:
                texts.append(None)
                data.bad_rows.append((name, i, f"row {i} of split {name!r}{where}: {error}"))
            videos.append(files)
        data.texts[name] = texts
        data.videos[name] = videos

    def _image_values(self, data: Loaded, split: str, row: int) -> list[Any]:
        table = data.images[split]
        if table is None:
            return []
        value = table[row:row + 1].column(data.columns.images).to_pylist()[0]
        if isinstance(table.features.get(data.columns.images), datasets_json()) and isinstance(value, str):
            value = json.loads(value)  # a column of mixed types: the `datasets` library stores each cell as JSON
        return image_values(value)

    def _checked(self, row: dict[str, Any], columns: Columns, values: list[Any], where: Media, videos: int) -> RowText:
        """The text parts of a row whose answer, images and markers are good; VlmrlError saying why not."""
        p = self.params
        text = read_text(row, columns)
        if columns.images and not values:
            raise NoImage("no image")
        if p.check_images:
            for value in values:
                load_image(value, where, p.max_pixels, p.max_image_side)
        prompt = self.prompt_text(text)
        for marker, count, what in ((MARKER, len(values), "images"), (VIDEO_MARKER, videos, "videos")):
            markers = prompt.count(marker)
            if markers and markers != count:
                raise VlmrlError(f"the prompt has {markers} {marker} markers but the row has {count} {what}")
        return text

    def _report_bad_rows(self, data: Loaded) -> None:
        bad = data.bad_rows
        if not bad:
            return
        more = f" (and {len(bad) - 1} more bad rows)" if len(bad) > 1 else ""
        if self.params.on_bad_row == "error":
            raise VlmrlError(f"bad {self.name} data: {bad[0][2]}{more}; fix the data, or set "
                             "task.params.on_bad_row=skip to leave bad rows out")
        total = sum(len(texts) for texts in data.texts.values())
        warn(f"{self.name}: skipped {len(bad)} bad rows of {total} (on_bad_row=skip); first: {bad[0][2]}")

    def _assign_splits(self, data: Loaded) -> None:
        """Which rows each task split serves: the dataset's own splits, else a share of train held out."""
        p = self.params
        usable = {name: [i for i, text in enumerate(texts) if text is not None] for name, texts in data.texts.items()}
        if not usable[p.train_split]:
            raise VlmrlError(f"{self.name} source {data.source.name!r} has no usable rows in split {p.train_split!r}")
        data.served = {name: rows for name, rows in usable.items() if name != p.train_split}
        data.source_of = {name: name for name in data.served}
        data.served["train"], data.source_of["train"] = usable[p.train_split], p.train_split
        test_name = p.test_split or next((s for s in ("test", "validation") if s in usable and s != p.train_split), "")
        if test_name:
            data.served["test"], data.source_of["test"] = usable[test_name], test_name
        elif p.test_fraction > 0:
            held = held_out(len(data.texts[p.train_split]), p.test_fraction, str(p.split_seed))
            data.served["test"] = [i for i in usable[p.train_split] if i in held]
            data.served["train"] = [i for i in usable[p.train_split] if i not in held]
            data.source_of["test"] = p.train_split

    @property
    def bad_rows(self) -> list[tuple[str, int, str]]:
        """(dataset split, row, what is wrong) of every row left out with on_bad_row=skip."""
        return self._data.bad_rows

    @property
    def video_rows(self) -> int:
        """How many of the rows served (every split) hold a video file: the model must take video
        (the preflight refuses one that does not before step 1, whichever rows its first batch drew)."""
        data = self._data
        return sum(bool(data.videos[data.source_of[split]][row]) for split, rows in data.served.items() for row in rows)

    @property
    def splits(self) -> tuple[str, ...]:
        served = self._data.served
        return tuple(["train"] + (["test"] if "test" in served else []) +
                     sorted(s for s in served if s not in ("train", "test")))

    def size(self, split: str = "train") -> int:
        """How many rows `split` serves (one epoch)."""
        self.check_split(split)
        return len(self._data.served[split])

    def data_line(self) -> str:
        """One line for the preflight: the mapping used, the rows of each split and the order."""
        data, p = self._data, self.params
        sizes = ", ".join(f"{len(data.served[name])} {name}" for name in self.splits)  # train first
        held = (f" ({p.test_fraction:g} of train held out by row, split_seed {p.split_seed})"
                if data.source_of.get("test") == data.source_of["train"] else "")
        order = f"shuffled by seed {p.seed}, a new order each epoch" if p.shuffle else "in file order"
        return f"{data.columns.line()}; rows: {sizes}{held}; train {order}"

    def data_fingerprint(self) -> dict[str, str]:
        """Each data file's size and hash (each split's `datasets` fingerprint for a hub id or a
        Python object), and each image and video file the rows name: compared on resume
        (safety/resume.py)."""
        return fingerprint(self._data.source, self._data.files)

    def row_of(self, idx: int, split: str) -> tuple[str, int]:
        """(dataset split, row) served as example `idx` of `split` (see the module docstring)."""
        data = self._data
        rows = data.served[split]
        if not rows:
            raise VlmrlError(f"{self.name} split {split!r} has no usable rows")
        position = draw_row(idx, len(rows), f"{self.params.seed}:{split}", per_epoch=split == "train") \
            if self.params.shuffle else idx % len(rows)
        return data.source_of[split], rows[position]

    def prompt_text(self, text: RowText) -> str:
        """The prompt the model sees, from a row's prompt: the template filled (markers dropped if asked)."""
        prompt = text.prompt.replace(MARKER, " ") if self.params.markers == "drop" else text.prompt
        return self.params.template.replace("{prompt}", prompt)

    @property
    def answer_format(self) -> str:
        """How a completion writes its final answer: answer_tag, boxed or whole (auto resolved)."""
        return answer_format_of(self.params.answer_format, self.params.template)

    def answer_and_reference(self, text: RowText) -> tuple[str, str]:
        """The gold answer and the reference completion of a row: its own, else one made from its
        solution's reasoning (if any) and its answer, in the task's answer format."""
        return text.answer, text.reference or reference_of(reasoning_from_solution(text.solution), text.answer,
                                                           self.answer_format)

    def _example(self, idx: int, split: str) -> Example:
        data, p = self._data, self.params
        source_split, row = self.row_of(idx, split)
        text = data.texts[source_split][row]
        try:
            images = [load_image(value, data.media[source_split], p.max_pixels, p.max_image_side)
                      for value in self._image_values(data, source_split, row)]
        except VlmrlError as error:  # only with check_images=false: the rows were not decoded at load
            raise VlmrlError(f"row {row} of split {source_split!r}: {error}") from error
        try:  # decoded here, not at load: a file that will not decode is a bad row (on_bad_row) when drawn
            videos = [read_video(path, p.video_fps, p.max_frames) for path in data.videos[source_split][row]]
        except VlmrlError as error:
            raise VlmrlError(f"row {row} of split {source_split!r}: {error}") from error
        answer, reference = self.answer_and_reference(text)
        meta = {"idx": idx, "split": split, "row": row, "source_split": source_split,
                "layout": data.columns.layout, "columns": self._other_columns(source_split, row),
                "made_reference": not text.reference}
        return Example(images=images, prompt=self.prompt_text(text), answer=answer, meta=meta,
                       reference_completion=reference, system=p.system or text.system, videos=videos)

    def _other_columns(self, split: str, row: int) -> dict[str, Any]:
        """The columns of a row that the mapping does not read (images excepted), for the rewards."""
        extras = self._data.extras[split]
        return dict(extras[row]) if extras is not None else {}

    def score(self, example: Example, completion: str) -> dict[str, float]:
        """accuracy (the verifier on the final answer, read as answer_format says) + format_weight *
        format; total in [0, 1 + format_weight]."""
        answer_format = self.answer_format
        answer = final_answer(completion, answer_format)
        correct = float(answer is not None and verify(self.params.verifier, answer, example.answer))
        layout = (think_answer_format(completion) if answer_format == "answer_tag" else
                  float(bool(last_boxed(completion))) if answer_format == "boxed" else float(bool(completion.strip())))
        rubric = Rubric({"accuracy": 1.0, "format": self.params.format_weight})
        return rubric({"accuracy": correct, "format": layout})
