"""Where rows come from: a path, a hub id or a `datasets` object opened as {split: datasets.Dataset},
with the folders where each split's relative image paths are looked up.

A source is one of:
- a data file (.jsonl/.json/.csv/.parquet/.arrow): its rows are the train split;
- a folder of them named {split}.{ext} or {split}-*.{ext} (searched recursively: Hugging Face's
  `data/train-00000-of-00001.parquet` too); when no file is named train/test/validation, every file
  is the train split;
- an imagefolder (Hugging Face's layout): a folder of images with a metadata.jsonl/.csv/.parquet whose
  `file_name` (or `file_names`, `*_file_name`) column names each row's images, optionally in
  train/test/validation subfolders (read with the `imagefolder` builder: images become an `image` or
  `images` column);
- a folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk` (read with `load_from_disk`);
- a Hugging Face hub id, read from the local cache (no download when HF_HUB_OFFLINE=1: then one line
  says it is not cached);
- a `datasets.Dataset` (the train split) or `datasets.DatasetDict` from Python.
Empty files and splits are errors. A CSV file is text: every column is read as the text its cells
hold (`007` stays `007`, `12` stays `12` beside a blank or `1e3`, a blank cell is "" and `NA` stays
`NA`; an imagefolder's metadata.csv the same, but for its blank and NA cells, which the `datasets`
library reads as empty), never retyped by the type inference that made the gold answer `7` or `12.0`.
A load that fails is one line with the cause the `datasets` library wraps ("An error occurred while
generating the dataset" hid a JSON parse error or an imagefolder file_name that escapes). No torch here.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmrl.errors import VlmrlError, one_line

DATA_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
SPLIT_NAMES = ("train", "test", "validation")
METADATA_FILES = ("metadata.jsonl", "metadata.csv", "metadata.parquet")
"""The files that make a folder of images an imagefolder (the `datasets` library's names)."""


@dataclass
class Source:
    """A dataset's splits, and where relative image paths of each are looked up."""

    splits: dict[str, Any]
    """Split name -> datasets.Dataset."""
    folders: dict[str, tuple[Path, ...]] = field(default_factory=dict)
    """Split name -> folders for relative image paths: the data file's, then the source folder."""
    files: dict[str, list[str]] = field(default_factory=dict)
    """Split name -> its data files (empty for save_to_disk folders, hub ids and Python objects)."""
    name: str = ""
    """How the source was given (a path, a hub id, or "a datasets object")."""
    root: Path | None = None
    """The data folder: the folder given, or the data file's folder (None for a hub id or a Python
    object). The files its rows name are read inside it (data/paths.py)."""


def open_source(source: Any) -> Source:
    """The splits of `source` (see the module docstring); VlmrlError in one line when it cannot be read."""
    import datasets

    if isinstance(source, (datasets.Dataset, datasets.DatasetDict)):
        splits = dict(source) if isinstance(source, datasets.DatasetDict) else {"train": source}
        return Source(splits, name="a datasets object")
    return _open_path_or_id(str(source))


@functools.lru_cache(maxsize=4)
def _open_path_or_id(source: str) -> Source:
    """A path or hub id opened once per process (several tasks over one source share it)."""
    import datasets

    path = Path(source).expanduser()
    try:
        if path.is_dir() and _saved_to_disk(path):
            loaded = datasets.load_from_disk(str(path))
            splits = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
            return Source(splits, {name: (path,) for name in splits}, name=source, root=path)
        if path.is_dir() and _imagefolder(path):
            loaded = datasets.load_dataset("imagefolder", data_dir=str(path), features=_metadata_csv_features(path))
            return Source(dict(loaded), {name: (path,) for name in loaded}, name=source, root=path)
        if path.exists():
            builder, data_files = local_files(path)
            loaded = _read_csv(data_files) if builder == "csv" else datasets.load_dataset(builder, data_files=data_files)
            root = path if path.is_dir() else path.parent
            folders = {split: (Path(files[0]).parent, root) for split, files in data_files.items()}
            return Source(dict(loaded), folders, data_files, name=source, root=root)
        return Source(dict(datasets.load_dataset(source)), name=source)
    except VlmrlError:
        raise
    except Exception as error:  # noqa: BLE001 - any loader failure is a problem with the user's data
        if not path.exists():
            raise VlmrlError(f"data source {source!r} is not a local file or folder, {hub_problem(error)}: give a "
                             ".json/.jsonl/.csv/.parquet file, a folder of them, or a hub dataset id") from error
        cause = root_cause(error)
        raise VlmrlError(f"cannot load data source {source!r}: {type(cause).__name__}: {short(one_line(cause))}") \
            from error


MAX_CAUSE = 300
"""Characters of a loader's message kept in the one line (a JSON parse error may quote a whole row)."""


def short(text: str, limit: int = MAX_CAUSE) -> str:
    """`text` cut to `limit` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def root_cause(error: BaseException) -> BaseException:
    """The error a `datasets` wrapper hides: "An error occurred while generating the dataset"
    (DatasetGenerationError) says nothing of its cause, which it holds as `__cause__` (else
    `__context__`); the first error of the chain that is no such wrapper."""
    import datasets

    seen: set[int] = set()
    while isinstance(error, datasets.exceptions.DatasetGenerationError) and id(error) not in seen:
        seen.add(id(error))
        inner = error.__cause__ or error.__context__
        if inner is None:
            break
        error = inner
    return error


def _csv_header(path: str | Path) -> list[str]:
    """The column names of a CSV file as pandas (the `datasets` csv loader) reads them."""
    import pandas

    return [str(name) for name in pandas.read_csv(path, nrows=0).columns]


def _read_csv(data_files: dict[str, list[str]]) -> dict[str, Any]:
    """{split: Dataset} of CSV files, every column a string (the text the file holds, a blank cell ""),
    each split read with its own header (a test file may lack a column the train file has)."""
    import datasets

    splits = {}
    for split, files in data_files.items():
        headers = {tuple(_csv_header(f)) for f in files}
        if len(headers) != 1:
            raise VlmrlError(f"the csv files of split {split!r} have different columns: "
                             f"{' vs '.join(str(list(h)) for h in sorted(headers))[:300]}")
        features = datasets.Features({name: datasets.Value("string") for name in headers.pop()})
        splits[split] = datasets.load_dataset("csv", data_files={split: files}, features=features,
                                              keep_default_na=False)[split]
    return splits


def _metadata_csv_features(path: Path):
    """An imagefolder's features when its metadata files are CSV: each `file_name` column its image
    column (`x_file_name` -> `x`), every other column a string; None otherwise (typed metadata)."""
    import datasets

    files = [p for p in path.rglob("metadata.*") if p.name in METADATA_FILES]
    headers = {tuple(_csv_header(p)) for p in files if p.suffix == ".csv"}
    if len(headers) != 1 or any(p.suffix != ".csv" for p in files):
        return None
    features = {}
    for name in headers.pop():
        if name == "file_name" or name.endswith("_file_name"):
            features[name[: -len("_file_name")] or "image"] = datasets.Image()
        else:
            features[name] = datasets.Value("string")
    return datasets.Features(features)


def hub_problem(error: Exception) -> str:
    """Why a name that is no local path did not load from the hub, in vlmrl's words (the datasets
    library's own read "Couldn't reach 'x' on the Hub (LocalEntryNotFoundError)")."""
    import datasets

    if any(os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")
           for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")) or "offline" in str(error).lower():
        return "and the hub is off (HF_HUB_OFFLINE) and its cache does not hold such a dataset"
    if isinstance(error, datasets.exceptions.DatasetNotFoundError) or "Couldn't find" in str(error):
        return "nor a dataset on the hub"
    return f"and the hub cannot be reached to look for a dataset of that name ({type(error).__name__})"


def _saved_to_disk(path: Path) -> bool:
    """A `save_to_disk` folder: a DatasetDict's dataset_dict.json, or a Dataset's state.json."""
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _imagefolder(path: Path) -> bool:
    """A folder of images described by metadata files (Hugging Face's imagefolder)."""
    return any(p.name in METADATA_FILES for p in path.rglob("metadata.*"))


def local_files(path: Path) -> tuple[str, dict[str, list[str]]]:
    """(builder, {split: files}) for a data file or a folder of them."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in DATA_SUFFIXES)
    if not files:
        raise VlmrlError(f"no {', '.join(DATA_SUFFIXES)} files in {str(path)!r}")
    empty = [p for p in files if holds_no_rows(p)]
    if empty:
        raise VlmrlError(f"data file {str(empty[0])!r} is empty: it holds no rows")
    builders = {DATA_SUFFIXES.get(p.suffix) for p in files}
    if len(builders) != 1 or None in builders:
        raise VlmrlError(f"{str(path)!r}: use one format ({', '.join(DATA_SUFFIXES)}), "
                         f"found {sorted(map(str, builders))}")
    if path.is_file():
        return builders.pop(), {"train": [str(path)]}
    by_split: dict[str, list[str]] = {}
    for p in files:
        by_split.setdefault(re.split(r"[-.]", p.name, maxsplit=1)[0], []).append(str(p))
    if not set(by_split) & set(SPLIT_NAMES):  # bars.jsonl, more_bars.jsonl: all of them are train
        by_split = {"train": [str(p) for p in files]}
    return builders.pop(), by_split


def holds_no_rows(path: Path) -> bool:
    """An empty file, whitespace or [] alone, a csv of a header alone, or a parquet file of 0 rows."""
    size = path.stat().st_size
    if path.suffix == ".parquet" and size:
        import pyarrow.parquet

        try:
            return pyarrow.parquet.read_metadata(path).num_rows == 0
        except Exception:  # noqa: BLE001 - an unreadable file: the loader says why
            return False
    if path.suffix == ".csv" and 0 < size < 4096:
        return len([line for line in path.read_text(errors="replace").splitlines() if line.strip()]) < 2
    return size == 0 or (size < 64 and path.suffix != ".arrow"
                         and path.read_text(errors="replace").strip() in ("", "[]"))
