"""`geometry`: visual math QA (geometry diagrams) from local files or a Hugging Face hub dataset.

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
the data file.

Splits are the dataset's: "train" is train_split; "test" is test_split, else the dataset's "test",
else its "validation", else (test_fraction > 0) a held-out share of train chosen by a stable hash of
problem + answer, so duplicates never straddle train and test. Other dataset splits keep their
names. Rows without a problem, answer or image are skipped. `example(idx)` wraps around the split
(idx modulo its size, one epoch after another).

Reward: "accuracy" (math_verify equivalence of the single <answer> with the gold, falling back to
normalized strings; choice letters "A", "(A)", "A." agree) + format_weight x "format" (strict
<think>/<answer> layout); total in [0, 1 + format_weight]. Loading is lazy and cached per source.
"""

from __future__ import annotations

import functools
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from vlmrl.errors import VlmrlError
from vlmrl.rewards import Rubric, extract_tag, math_equal, think_answer_format
from vlmrl.tasks.base import Example, Task, TaskParams, check, register_task, stable_unit

SCHEMAS = ("auto", "open_r1", "geometry3k", "geoqa")
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
    """A local .json/.jsonl/.parquet file, a folder of them named {split}.{ext} or {split}-*.{ext}
    (a single file is the train split), or a Hugging Face hub dataset id."""
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
    format_weight: float = 0.5
    """Weight of the format component in the total."""

    def validate(self) -> None:
        super().validate()
        check(bool(self.source.strip()), "geometry needs source=PATH_OR_HUB_ID (a .json/.jsonl/.parquet "
              "file, a folder of them, or a hub dataset id)")
        check(self.schema in SCHEMAS, f"schema must be one of {', '.join(SCHEMAS)}, got {self.schema!r}")
        check(0.0 <= self.test_fraction < 1.0, f"test_fraction must be in [0, 1), got {self.test_fraction}")
        check(self.max_image_side >= 0, f"max_image_side must be >= 0, got {self.max_image_side}")
        check(self.format_weight >= 0, f"format_weight must be >= 0, got {self.format_weight}")
        looks_local = self.source.startswith(("/", ".", "~")) or Path(self.source).suffix in DATA_SUFFIXES
        check(not looks_local or Path(self.source).expanduser().exists(),
              f"geometry source {self.source!r} does not exist")


def _local_files(path: Path) -> tuple[str, dict[str, list[str]]]:
    """(builder, {split: files}) for a data file or a folder of them."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in DATA_SUFFIXES)
    if not files:
        raise VlmrlError(f"no .json, .jsonl or .parquet files in {str(path)!r}")
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


@functools.lru_cache(maxsize=4)
def load_source(source: str) -> tuple[dict[str, Any], dict[str, tuple[Path, ...]]]:
    """({split: datasets.Dataset}, {split: folders where relative image paths are looked up: the
    data file's, then the source folder}), loaded once."""
    import datasets

    path = Path(source).expanduser()
    try:
        if path.exists():
            builder, data_files = _local_files(path)
            loaded = datasets.load_dataset(builder, data_files=data_files)
            root = path if path.is_dir() else path.parent
            folders = {split: (Path(files[0]).parent, root) for split, files in data_files.items()}
        else:
            loaded = datasets.load_dataset(source)
            folders = {}
    except VlmrlError:
        raise
    except Exception as error:  # noqa: BLE001 - any loader failure is a problem with the user's data
        raise VlmrlError(f"cannot load geometry source {source!r}: {type(error).__name__}: {error}") from error
    return dict(loaded), folders


def _to_image(value: Any, folders: tuple[Path, ...] = ()) -> Image.Image | None:
    """A PIL RGB image from the forms datasets hand back (see the module docstring), or None."""
    if isinstance(value, (list, tuple)):
        return _to_image(value[0], folders) if value else None
    if isinstance(value, dict):
        if value.get("bytes"):
            return Image.open(io.BytesIO(value["bytes"])).convert("RGB")
        return _to_image(value.get("path"), folders)
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, str) and value:
        path = Path(value)
        if not path.is_absolute():
            path = next((f / path for f in folders if (f / path).exists()), folders[0] / path if folders else path)
        if not path.exists():
            raise VlmrlError(f"image file {str(path)!r} does not exist")
        return Image.open(path).convert("RGB")
    return None


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
        splits, folders = load_source(p.source)
        for wanted in (p.train_split, p.test_split):
            if wanted and wanted not in splits:
                raise VlmrlError(f"geometry source has no split {wanted!r}; it has {', '.join(splits)}")
        columns = self._columns(list(splits[p.train_split].column_names))
        texts = {name: self._texts(ds, columns) for name, ds in splits.items()}
        usable = {name: [i for i, (problem, gold) in enumerate(rows) if problem and gold]
                  for name, rows in texts.items()}
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
        return _Loaded(splits, folders, columns, served, source_of)

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
        served = self._data.served
        return tuple(["train"] + (["test"] if "test" in served else []) +
                     sorted(s for s in served if s not in ("train", "test")))

    def _example(self, idx: int, split: str) -> Example:
        data = self._data
        columns, rows = data.columns, data.served[split]
        if not rows:
            raise VlmrlError(f"geometry split {split!r} has no usable rows")
        source_split = data.source_of[split]
        row_index = rows[idx % len(rows)]
        row = data.splits[source_split][row_index]
        image = _to_image(row.get(columns["image"]), data.folders.get(source_split, ()))
        if image is None:
            raise VlmrlError(f"row {row_index} of split {source_split!r} has no image in column {columns['image']!r}")
        side = self.params.max_image_side
        if side and max(image.size) > side:
            scale = side / max(image.size)
            image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))))
        problem = " ".join(str(row[columns["problem"]]).replace("<image>", " ").split())
        gold = _TAGS.sub(" ", self._gold(row, columns)).strip()
        reasoning = ""
        if columns["answer"] == "solution":
            reasoning = reasoning_from_solution(str(row.get(columns["answer"]) or ""))
        reasoning = reasoning or "I read the figure and the question, and work out the answer step by step."
        reference = f"<think> {reasoning} </think> <answer> {gold} </answer>"
        meta = {"idx": idx, "split": split, "row": row_index, "source_split": source_split,
                "schema": columns["schema"], "image_size": list(image.size)}
        return Example(image=image, prompt=f"{problem}\n{INSTRUCTION}", answer=gold, meta=meta,
                       reference_completion=reference)

    def score(self, example: Example, completion: str) -> dict[str, float]:
        """accuracy + format_weight * format; total in [0, 1 + format_weight]."""
        answer = extract_tag(completion, "answer")
        correct = float(answer is not None and math_equal(answer, example.answer))
        rubric = Rubric({"accuracy": 1.0, "format": self.params.format_weight})
        return rubric({"accuracy": correct, "format": think_answer_format(completion)})
