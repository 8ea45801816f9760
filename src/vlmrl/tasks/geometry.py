"""`geometry`: visual math QA (geometry diagrams): generated here, or from local files or a
Hugging Face hub dataset.

`source=procedural` needs no data: each example is drawn by tasks/geometry_gen.py (angles in
triangles and on parallel lines, isosceles and right triangles, Pythagoras, areas and perimeters,
circle arcs; integer, fraction, surd, pi and multiple-choice answers), deterministic from (seed,
split, idx), train and test disjoint by the problem's content; `vlmrl data geometry OUT` writes the
same problems as Geometry3K-schema files.

Adapters read three public schemas (column names as published on the hub):
- `open_r1` (lmms-lab/multimodal-open-r1-8k-verified): image, problem, solution; the gold answer is
  the last <answer>...</answer> of the solution (a \\boxed{} inside it wins), else its last
  \\boxed{}, else the `original_answer` column. The solution's reasoning feeds the reference.
- `geometry3k` (hiyouga/geometry3k, as published for RL): images (a list; the first is used),
  problem (with an `<image>` marker, removed), answer.
- `geoqa` (leonardPKU/GEOQA_R1V_Train_8K, as used by R1-V): image, problem, solution holding
  `<answer> ... </answer>`.
`auto` picks geometry3k when there is an `answer` column, else open_r1/geoqa when there is a
`solution` column. `question` is accepted for `problem`; `image_column` overrides the image column.
An image may be a PIL image, a dict with bytes or path, a list (first item), or a path relative to
the data file. Every image becomes RGB: transparency is laid over white (diagrams are often black
lines on a transparent background), 16-bit and float greys are scaled to 8 bits, CMYK, palette
and the rest converted; one with more than max_pixels pixels is downscaled (aspect kept; a JPEG is
decoded at a reduced scale in the first place).

Splits are the dataset's: "train" is train_split; "test" is test_split, else the dataset's "test",
else its "validation", else (test_fraction > 0) a held-out share of train chosen by a stable hash of
problem + answer, so duplicates never straddle train and test. Other dataset splits keep their
names. `example(idx)` wraps around the split (idx modulo its size, one epoch after another).

Bad data is found when the dataset loads, before any training: every row of every split is
checked (a problem, an answer, an image value; with check_images, the image decoded once). A bad
row is an empty problem or answer, no image, a missing, unreadable, truncated or non-image file, a
value in the image column that is no image at all, a mode that cannot become RGB, or an image too
large to decode safely. By default the first one stops the run with a message naming the row, the
data file and the problem (and how many more there are); with on_bad_row=skip they are left out,
counted in a warning and listed in `task.bad_rows`. An empty data file, split or dataset is an
error either way.

Reward: "accuracy" (math_verify equivalence of the single <answer> with the gold, falling back to
normalized strings; choice letters "A", "(A)", "A." agree) + format_weight x "format" (strict
<think>/<answer> layout); total in [0, 1 + format_weight]. Loading is lazy and cached per source.
"""

from __future__ import annotations

import functools
import io
import math
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from vlmrl.errors import VlmrlError, one_line, warn
from vlmrl.tasks.base import Example, Task, TaskParams, check, in_split, register_task, stable_unit
from vlmrl.tasks.geometry_gen import KINDS, Problem, make_problem
from vlmrl.tasks.images import BadImage, to_rgb
from vlmrl.tasks.rewards import Rubric, extract_tag, math_equal, think_answer_format

PROCEDURAL = "procedural"
SCHEMAS = ("auto", "open_r1", "geometry3k", "geoqa")
ON_BAD_ROW = ("error", "skip")
MAX_IMAGE_SIZE = 4096
"""Largest side of a generated diagram: 16 megapixels, past what any model's processor keeps (a
side of 100000 drew for minutes before the first problem)."""
DATA_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
INSTRUCTION = "Think step by step inside <think> </think>, then give the final answer inside <answer> </answer>."
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TAGS = re.compile(r"</?(?:think|answer)>")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} in `text` (nested braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def answer_from_solution(solution: str) -> str:
    """The final answer written in a solution: last <answer> block (its \\boxed{} if any), else the
    last \\boxed{}, else "" (the caller may fall back to another column)."""
    blocks = _ANSWER_BLOCK.findall(solution)
    if blocks:
        return last_boxed(blocks[-1]) or blocks[-1].strip()
    return last_boxed(solution) or ""


def _prompt(problem: str) -> str:
    """The prompt of a problem text (Geometry3K's `<image>` marker dropped): the same for files and
    for generated problems, so exported data reads back as it was served."""
    return " ".join(problem.replace("<image>", " ").split()) + f"\n{INSTRUCTION}"


def _reference(reasoning: str, answer: str) -> str:
    """The reference completion (SFT target) of a worked solution and its answer."""
    return f"<think> {reasoning} </think> <answer> {answer} </answer>"


def reasoning_from_solution(solution: str) -> str:
    """The reasoning part of a solution: its <think> content, else the text around the answer
    blocks; tags removed so it can sit inside a reference <think> block."""
    think = re.search(r"<think>(.*?)</think>", solution, re.DOTALL)
    text = think.group(1) if think else _ANSWER_BLOCK.sub(" ", solution)
    return " ".join(_TAGS.sub(" ", text).split())


@dataclass
class GeometryParams(TaskParams):
    """Parameters of the geometry / visual math QA task."""

    source: str = ""
    """"procedural" (problems generated here: no data needed), a local .json/.jsonl/.parquet file,
    a folder of them named {split}.{ext} or {split}-*.{ext} (a single file is the train split), or a
    Hugging Face hub dataset id."""
    schema: str = "auto"
    """Column layout: auto, open_r1, geometry3k or geoqa (see `vlmrl tasks list`)."""
    train_split: str = "train"
    """Dataset split served as "train"."""
    test_split: str = ""
    """Dataset split served as "test"; empty: "test", else "validation", else held out from train."""
    test_fraction: float = 0.1
    """Share of train rows held out as "test" when the dataset has no test split (0: none)."""
    image_column: str = ""
    """Column holding the image(s); empty: "image" or "images"."""
    max_image_side: int = 0
    """Downscale images whose longer side exceeds this many pixels (0 keeps them as they are)."""
    max_pixels: int = 4_194_304
    """Downscale images with more pixels than this (2048 x 2048), aspect ratio kept, before the
    model's processor sees them (0 = no limit). Keeps a huge scan from filling memory."""
    on_bad_row: str = "error"
    """A bad row (no problem or answer, no image, a missing, unreadable, truncated or non-image
    file, an image too large to decode): "error" stops before training with a message naming the
    row, the file and the problem; "skip" leaves such rows out and counts them (a warning at load,
    task.bad_rows, the preflight report)."""
    check_images: bool = True
    """Decode every image once when the dataset loads, so a bad one is found before training
    (about a millisecond per small image). false: only the presence of an image value is checked
    then, and a bad image stops the run at the step that reaches it."""
    format_weight: float = 0.5
    """Weight of the format component in the total."""
    image_size: int = 224
    """source=procedural: side of the square diagram in pixels (64 to 4096)."""
    kinds: tuple[str, ...] = KINDS
    """source=procedural: the kinds of problem drawn from (triangle, isosceles, parallel,
    pythagoras, area, arc)."""
    choice_share: float = 0.25
    """source=procedural: share of problems given as four choices A-D (answered with the letter)."""

    def validate(self) -> None:
        super().validate()
        check(bool(self.source.strip()), "geometry needs source=procedural or a PATH_OR_HUB_ID (a "
              ".json/.jsonl/.parquet file, a folder of them, or a hub dataset id)")
        check(64 <= self.image_size <= MAX_IMAGE_SIZE,
              f"image_size must be in 64..{MAX_IMAGE_SIZE}, got {self.image_size}")
        check(bool(self.kinds) and set(self.kinds) <= set(KINDS),
              f"kinds must be some of {', '.join(KINDS)}, got {list(self.kinds)}")
        check(0.0 <= self.choice_share <= 1.0, f"choice_share must be in [0, 1], got {self.choice_share}")
        check(self.format_weight >= 0, f"format_weight must be >= 0, got {self.format_weight}")
        if self.source == PROCEDURAL:
            return
        check(self.schema in SCHEMAS, f"schema must be one of {', '.join(SCHEMAS)}, got {self.schema!r}")
        check(0.0 <= self.test_fraction < 1.0, f"test_fraction must be in [0, 1), got {self.test_fraction}")
        check(self.max_image_side >= 0, f"max_image_side must be >= 0, got {self.max_image_side}")
        check(self.max_pixels >= 0, f"max_pixels must be >= 0, got {self.max_pixels}")
        check(self.on_bad_row in ON_BAD_ROW, f"on_bad_row must be error or skip, got {self.on_bad_row!r}")
        looks_local = self.source.startswith(("/", ".", "~")) or Path(self.source).suffix in DATA_SUFFIXES
        check(not looks_local or Path(self.source).expanduser().exists(),
              f"geometry source {self.source!r} does not exist")


def _local_files(path: Path) -> tuple[str, dict[str, list[str]]]:
    """(builder, {split: files}) for a data file or a folder of them."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in DATA_SUFFIXES)
    if not files:
        raise VlmrlError(f"no .json, .jsonl or .parquet files in {str(path)!r}")
    empty = [p for p in files if _holds_no_rows(p)]
    if empty:
        raise VlmrlError(f"data file {str(empty[0])!r} is empty: it holds no rows")
    builders = {DATA_SUFFIXES.get(p.suffix) for p in files}
    if len(builders) != 1 or None in builders:
        raise VlmrlError(f"{str(path)!r}: use one format (.json/.jsonl or .parquet), "
                         f"found {sorted(map(str, builders))}")
    if path.is_file():
        return builders.pop(), {"train": [str(path)]}
    by_split: dict[str, list[str]] = {}
    for p in files:
        by_split.setdefault(re.split(r"[-.]", p.name, maxsplit=1)[0], []).append(str(p))
    return builders.pop(), by_split


def _holds_no_rows(path: Path) -> bool:
    """An empty file, whitespace or [] alone, or a parquet file of 0 rows (read from its footer)."""
    size = path.stat().st_size
    if path.suffix == ".parquet" and size:
        import pyarrow.parquet

        try:
            return pyarrow.parquet.read_metadata(path).num_rows == 0
        except Exception:  # noqa: BLE001 - an unreadable file: the loader says why
            return False
    return size == 0 or (size < 64 and path.read_text(errors="replace").strip() in ("", "[]"))


def hub_problem(error: Exception) -> str:
    """Why a name that is no local path did not load from the hub, in vlmrl's words (the datasets
    library's own speak of "Couldn't reach 'x' on the Hub (LocalEntryNotFoundError)")."""
    import datasets

    if any(os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")
           for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return "and the hub is off (HF_HUB_OFFLINE) and its cache does not hold such a dataset"
    if isinstance(error, datasets.exceptions.DatasetNotFoundError):
        return "nor a dataset on the hub"
    return f"and the hub cannot be reached to look for a dataset of that name ({type(error).__name__})"


@functools.lru_cache(maxsize=4)
def load_source(source: str) -> tuple[dict[str, Any], dict[str, tuple[Path, ...]], dict[str, list[str]]]:
    """({split: datasets.Dataset}, {split: folders where relative image paths are looked up: the
    data file's, then the source folder}, {split: its data files}), loaded once."""
    import datasets

    path = Path(source).expanduser()
    try:
        if path.exists():
            builder, data_files = _local_files(path)
            loaded = datasets.load_dataset(builder, data_files=data_files)
            root = path if path.is_dir() else path.parent
            folders = {split: (Path(files[0]).parent, root) for split, files in data_files.items()}
        else:
            try:
                loaded = datasets.load_dataset(source)
            except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as error:
                raise VlmrlError(f"geometry source {source!r} is not a local file or folder, {hub_problem(error)}: "
                                 "give a .json/.jsonl/.parquet file, a folder of them, or a hub dataset id") from error
            folders, data_files = {}, {}
    except VlmrlError:
        raise
    except Exception as error:  # noqa: BLE001 - any loader failure is a problem with the user's data
        raise VlmrlError(f"cannot load geometry source {source!r}: {type(error).__name__}: {one_line(error)}") from error
    return dict(loaded), folders, data_files


class NoImage(BadImage):
    """No image at all: null, empty, an empty list, a dict with neither bytes nor path."""


def _open_image(value: Any, folders: tuple[Path, ...] = ()) -> Image.Image:
    """A PIL image, not yet decoded, from the forms datasets hand back (see the module docstring)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise NoImage("no image (an empty list)")
        return _open_image(value[0], folders)
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        if value.get("bytes"):
            try:
                return Image.open(io.BytesIO(value["bytes"]))
            except Image.DecompressionBombError as error:
                raise BadImage(f"the image is too large to decode safely ({error})") from error
            except (UnidentifiedImageError, OSError, ValueError) as error:
                raise BadImage(f"the image bytes are not an image PIL can read ({error})") from error
        if value.get("path"):
            return _open_image(value["path"], folders)
        raise NoImage("no image (neither bytes nor a path)")
    if value is None or value == "":
        raise NoImage("no image")
    if isinstance(value, str):
        path = Path(value)
        if not path.is_absolute():
            path = next((f / path for f in folders if (f / path).exists()), folders[0] / path if folders else path)
        if not path.is_file():
            raise BadImage(f"image file {str(path)!r} does not exist")
        try:
            return Image.open(path)
        except Image.DecompressionBombError as error:
            raise BadImage(f"image file {str(path)!r} is too large to decode safely ({error})") from error
        except (UnidentifiedImageError, OSError, ValueError) as error:
            raise BadImage(f"{str(path)!r} is not an image file PIL can read ({type(error).__name__})") from error
    raise BadImage(f"the image column holds {type(value).__name__} {str(value)[:40]!r}, not an image, "
                   "image bytes or a path")


def fit_size(size: tuple[int, int], max_pixels: int = 0, max_side: int = 0) -> tuple[int, int]:
    """`size` scaled down (aspect kept) to at most max_pixels pixels and max_side per side (0: no limit)."""
    width, height = size
    scale = 1.0
    if max_side and max(width, height) > max_side:
        scale = max_side / max(width, height)
    if max_pixels and width * height * scale * scale > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
    if scale >= 1.0:
        return size
    return max(1, int(width * scale + 1e-6)), max(1, int(height * scale + 1e-6))


def load_image(value: Any, folders: tuple[Path, ...] = (), max_pixels: int = 0, max_side: int = 0) -> Image.Image:
    """The RGB image the model sees, from a row's image value: decoded, converted, downscaled to fit
    max_pixels and max_side. BadImage (NoImage when there is none) saying what is wrong."""
    with warnings.catch_warnings():  # big images are downscaled here; too big ones raise below
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        image = _open_image(value, folders)
        name = getattr(image, "filename", "") or ""
        what = f"image file {name!r}" if name else "the image"
        try:
            target = fit_size(image.size, max_pixels, max_side)
            if target != image.size and image.format == "JPEG":
                image.draft(None, target)  # decode at 1/2, 1/4 or 1/8 scale, no smaller than target
            image.load()
        except Image.DecompressionBombError as error:
            raise BadImage(f"{what} is too large to decode safely ({error})") from error
        except (OSError, SyntaxError, ValueError, EOFError) as error:
            raise BadImage(f"{what} cannot be decoded, truncated or corrupt "
                           f"({type(error).__name__}: {error})") from error
    image = to_rgb(image)
    target = fit_size(image.size, max_pixels, max_side)
    return image.resize(target) if target != image.size else image


def _to_image(value: Any, folders: tuple[Path, ...] = ()) -> Image.Image | None:
    """`load_image` without size limits; None when the value holds no image at all."""
    try:
        return load_image(value, folders)
    except NoImage:
        return None


def _raw_values(ds: Any, column: str, chunk: int = 256):
    """The values of one column, undecoded: images as {bytes, path} dicts, lists of them, or paths."""
    table = ds.select_columns([column]).with_format("arrow")
    for start in range(0, len(ds), chunk):
        yield from table[start:start + chunk].column(column).to_pylist()


@dataclass
class _Loaded:
    splits: dict[str, Any]
    """Dataset split name -> datasets.Dataset."""
    folders: dict[str, tuple[Path, ...]]
    """Dataset split name -> folders where relative image paths are looked up."""
    columns: dict[str, str]
    """schema, and the image, problem and answer/solution column names."""
    served: dict[str, list[int]]
    """Task split -> usable row indices."""
    source_of: dict[str, str]
    """Task split -> dataset split its rows come from."""
    rows: dict[str, Any]
    """Dataset split name -> the dataset without its image column (rows read without decoding)."""
    images: dict[str, Any]
    """Dataset split name -> its image column in arrow format (values undecoded)."""
    bad_rows: list[tuple[str, int, str]]
    """(dataset split, row, what is wrong) of the rows left out (on_bad_row=skip)."""


@register_task
class GeometryTask(Task):
    """Visual math QA from a dataset."""

    name = "geometry"
    description = ("visual math QA from local files or a hub id (schemas: open_r1, geometry3k, geoqa); "
                   "math-verify accuracy")
    Params = GeometryParams
    params: GeometryParams

    @functools.cached_property
    def _data(self) -> _Loaded:
        """The dataset, its columns and the rows each task split serves; built on first use."""
        p = self.params
        splits, folders, files = load_source(p.source)
        for wanted in (p.train_split, p.test_split):
            if wanted and wanted not in splits:
                raise VlmrlError(f"geometry source has no split {wanted!r}; it has {', '.join(splits)}")
        if not len(splits[p.train_split]):
            raise VlmrlError(f"geometry source {p.source!r} has no rows in split {p.train_split!r}")
        columns = self._columns(list(splits[p.train_split].column_names))
        texts = {name: self._texts(ds, columns) for name, ds in splits.items()}
        bad: list[tuple[str, int, str]] = []
        usable = {name: self._good_rows(name, ds, texts[name], columns, folders.get(name, ()), files.get(name, []), bad)
                  for name, ds in splits.items()}
        if bad:
            more = f" (and {len(bad) - 1} more bad rows)" if len(bad) > 1 else ""
            if p.on_bad_row == "error":
                raise VlmrlError(f"bad geometry data: {bad[0][2]}{more}; fix the data, or set "
                                 "task.params.on_bad_row=skip to leave bad rows out")
            total = sum(len(ds) for ds in splits.values())
            warn(f"geometry: skipped {len(bad)} bad rows of {total} (on_bad_row=skip); first: {bad[0][2]}")
        if not usable[p.train_split]:
            raise VlmrlError(f"geometry source {p.source!r} has no usable rows in split {p.train_split!r}")
        served = {name: rows for name, rows in usable.items() if name != p.train_split}
        source_of = {name: name for name in served}
        served["train"], source_of["train"] = usable[p.train_split], p.train_split
        test_name = p.test_split or next((s for s in ("test", "validation") if s in splits and s != p.train_split), "")
        if test_name:
            served["test"], source_of["test"] = usable[test_name], test_name
        elif p.test_fraction > 0:
            keys = [f"{problem}|{gold}" for problem, gold in texts[p.train_split]]
            served["test"] = [i for i in served["train"] if stable_unit(keys[i]) < p.test_fraction]
            served["train"] = [i for i in served["train"] if stable_unit(keys[i]) >= p.test_fraction]
            source_of["test"] = p.train_split
        rows = {name: ds.remove_columns([columns["image"]]) for name, ds in splits.items()}
        images = {name: ds.select_columns([columns["image"]]).with_format("arrow") for name, ds in splits.items()}
        return _Loaded(splits, folders, columns, served, source_of, rows, images, bad)

    def _good_rows(self, split: str, ds: Any, texts: list[tuple[str, str]], columns: dict[str, str],
                   folders: tuple[Path, ...], files: list[str], bad: list[tuple[str, int, str]]) -> list[int]:
        """Indices of the rows of `split` with a problem, an answer and an image (decoded once when
        check_images); the others go to `bad` as (split, row, message naming the row and file)."""
        p = self.params
        source = (f" ({files[0]})" if len(files) == 1 else f" ({len(files)} files in {Path(files[0]).parent})"
                  if files else f" of {p.source}")
        if columns["answer"] == "solution":
            no_answer = "its solution has no <answer> or \\boxed{} answer" + (
                " and original_answer is empty" if "original_answer" in ds.column_names else "")
        else:
            no_answer = f"column {columns['answer']!r} is empty"
        good = []
        for i, ((problem, gold), value) in enumerate(zip(texts, _raw_values(ds, columns["image"]))):
            try:
                if not problem:
                    raise VlmrlError(f"column {columns['problem']!r} is empty")
                if not gold:
                    raise VlmrlError(no_answer)
                if p.check_images:
                    load_image(value, folders, p.max_pixels, p.max_image_side)
                elif value is None or value in ("", []) or value == {"bytes": None, "path": None}:
                    raise NoImage("no image")
                good.append(i)
            except VlmrlError as error:
                bad.append((split, i, f"row {i} of split {split!r}{source}: {error}"))
        return good

    @property
    def bad_rows(self) -> list[tuple[str, int, str]]:
        """(dataset split, row, what is wrong) of every row left out with on_bad_row=skip."""
        return [] if self.params.source == PROCEDURAL else self._data.bad_rows

    def _columns(self, names: list[str]) -> dict[str, str]:
        """Which column holds the image, the problem, and the answer (or the solution)."""
        p = self.params
        schema = p.schema
        if schema == "auto":
            schema = "geometry3k" if "answer" in names else "open_r1" if "solution" in names else ""
            if not schema:
                raise VlmrlError(f"cannot tell the schema of columns {names}; need an 'answer' or 'solution' column")
        image = p.image_column or next((c for c in ("image", "images") if c in names), "")
        problem = next((c for c in ("problem", "question") if c in names), "")
        answer = "answer" if schema == "geometry3k" else "solution"
        missing = [what for what, col in (("image", image), ("problem", problem)) if not col or col not in names]
        if answer not in names:
            missing.append(answer)
        if missing:
            raise VlmrlError(f"schema {schema!r} needs columns {missing} but the data has {names}")
        return {"schema": schema, "image": image, "problem": problem, "answer": answer}

    def _gold(self, row: dict[str, Any], columns: dict[str, str]) -> str:
        value = str(row.get(columns["answer"]) or "")
        if columns["answer"] == "solution":
            return answer_from_solution(value) or str(row.get("original_answer") or "").strip()
        return value.strip()

    def _texts(self, ds: Any, columns: dict[str, str]) -> list[tuple[str, str]]:
        """(problem, gold answer) of every row, read without decoding images."""
        names = [c for c in (columns["problem"], columns["answer"], "original_answer") if c in ds.column_names]
        table = ds.select_columns(names).to_dict()
        return [(str(table[columns["problem"]][i] or "").strip(),
                 self._gold({c: table[c][i] for c in names}, columns)) for i in range(len(ds))]

    @property
    def splits(self) -> tuple[str, ...]:
        if self.params.source == PROCEDURAL:
            return ("train", "test")
        served = self._data.served
        return tuple(["train"] + (["test"] if "test" in served else []) +
                     sorted(s for s in served if s not in ("train", "test")))

    def generated_problem(self, idx: int, split: str) -> Problem:
        """Problem `idx` of `split` from the generator (source=procedural): drawn again until its
        content belongs to the split, so train and test never share a problem."""
        p, rng = self.params, self.rng(split, idx)
        for _ in range(1000):
            problem = make_problem(rng, p.image_size, p.kinds, p.choice_share)
            if in_split(problem.key, split):
                return problem
        raise RuntimeError("no generated problem landed in the split")  # pragma: no cover - p = 0.5 ** 1000

    def _generated(self, idx: int, split: str) -> Example:
        problem = self.generated_problem(idx, split)
        meta = {"idx": idx, "split": split, "kind": problem.kind, "schema": PROCEDURAL,
                "image_size": list(problem.image.size)}
        return Example(image=problem.image, prompt=_prompt(problem.problem), answer=problem.answer, meta=meta,
                       reference_completion=_reference(problem.solution, problem.answer))

    def _example(self, idx: int, split: str) -> Example:
        if self.params.source == PROCEDURAL:
            return self._generated(idx, split)
        data = self._data
        columns, rows = data.columns, data.served[split]
        if not rows:
            raise VlmrlError(f"geometry split {split!r} has no usable rows")
        source_split = data.source_of[split]
        row_index = rows[idx % len(rows)]
        row = data.rows[source_split][row_index]
        value = data.images[source_split][row_index:row_index + 1].column(columns["image"]).to_pylist()[0]
        try:
            image = load_image(value, data.folders.get(source_split, ()), self.params.max_pixels,
                               self.params.max_image_side)
        except BadImage as error:  # only with check_images=false: the rows were not decoded at load
            raise VlmrlError(f"row {row_index} of split {source_split!r}: {error}") from error
        gold = _TAGS.sub(" ", self._gold(row, columns)).strip()
        reasoning = ""
        if columns["answer"] == "solution":
            reasoning = reasoning_from_solution(str(row.get(columns["answer"]) or ""))
        reasoning = reasoning or "I read the figure and the question, and work out the answer step by step."
        meta = {"idx": idx, "split": split, "row": row_index, "source_split": source_split,
                "schema": columns["schema"], "image_size": list(image.size)}
        return Example(image=image, prompt=_prompt(str(row[columns["problem"]])), answer=gold, meta=meta,
                       reference_completion=_reference(reasoning, gold))

    def score(self, example: Example, completion: str) -> dict[str, float]:
        """accuracy + format_weight * format; total in [0, 1 + format_weight]."""
        answer = extract_tag(completion, "answer")
        correct = float(answer is not None and math_equal(answer, example.answer))
        rubric = Rubric({"accuracy": 1.0, "format": self.params.format_weight})
        return rubric({"accuracy": correct, "format": think_answer_format(completion)})
