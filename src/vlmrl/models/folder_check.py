"""Whether a model's weight files are whole and load every weight, checked where vlmrl loads them.

Left to themselves, a damaged weights file is a `SafetensorError` traceback, and a weight missing
from the files trains from random values (transformers prints a table and goes on).
`loading.load_policy` calls, in order:

- `check_weight_files` (before the weights load; a local folder): each file the loader reads
  (model.safetensors, or every shard model.safetensors.index.json names) is a whole safetensors file,
  and each shard holds the tensors the index places in it;
- `check_loaded_weights` (the weights loaded): transformers' own account of the load names no weight
  missing from the files, none the model has no place for, none of another shape. What transformers
  fills in on purpose is not in that account: a weight tied to another (the tiny builds' lm_head, tied
  to the embedding and left out of the file) and what the model class lists as new on purpose
  (`_keys_to_ignore_on_load_missing`).

Weights vlmrl saves itself are checked the same way before they load: `check_weight_file` for the
file, `check_fit` for names and shapes (the LoRA adapter of a checkpoint, the reference copy).
Each refusal is one line naming the file or the tensors.
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
from pathlib import Path

from vlmrl.errors import VlmrlError
from vlmrl.models.model_source import first_line

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHOWN = 3
"""How many tensor names a message lists before "and N more"."""
FIX = "restore it from where the model came from, or save the model again"
FIX_FILES = "restore the weight files from where the model came from, or save the model again"


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be whole (unreadable header, shorter than the header says,
    not what safetensors itself accepts), or None. Reads the header only, never the tensors."""
    from safetensors import SafetensorError, safe_open

    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is truncated ({size} bytes)" if size else "is empty"
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            return f"is truncated or not a safetensors file: its header alone should be {length} bytes, the file has {size}"
        try:
            header = json.loads(f.read(length))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return "has an unreadable header (not a safetensors file)"
    if 8 + length + end > size:
        return f"is truncated: {size} of {8 + length + end} bytes"
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except SafetensorError as error:  # offsets that overlap, leave gaps or do not fit the dtype, trailing bytes
        return f"is not a valid safetensors file ({first_line(error)})"
    return None


def check_weight_file(path: Path, what: str = "weights file") -> None:
    """VlmrlError naming `path` when it is missing or not a whole safetensors file."""
    if not path.is_file():
        raise VlmrlError(f"{what} {path} is missing; {FIX}")
    problem = safetensors_problem(path)
    if problem:
        raise VlmrlError(f"{what} {path} {problem}; {FIX}")


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a (whole) safetensors file, from its header."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def check_weight_files(name_or_path: str) -> None:
    """For a local folder: the files the loader will read are whole, and each shard of a sharded
    folder holds the tensors model.safetensors.index.json places in it. A hub id: nothing here."""
    folder = Path(name_or_path).expanduser()
    if not folder.is_dir():
        return
    if (folder / SINGLE_FILE).is_file():  # what transformers reads first
        check_weight_file(folder / SINGLE_FILE, "the model's weights file")
        return
    index = folder / INDEX_FILE
    if not index.is_file():
        return  # no safetensors weights: the loader says so
    try:
        placed = json.loads(index.read_text())["weight_map"]
        shards = {str(file) for file in placed.values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise VlmrlError(f"{index} is unreadable ({first_line(error)}); {FIX}") from None
    for shard in sorted(shards):
        check_weight_file(folder / shard, f"weight shard (listed in {INDEX_FILE})")
        held = tensor_shapes(folder / shard)
        absent = sorted(name for name, file in placed.items() if file == shard and name not in held)
        if absent:
            raise VlmrlError(f"weight shard {folder / shard} lacks {len(absent)} tensors that {INDEX_FILE} places in "
                             f"it: {names(absent)}; {FIX}")


def check_loaded_weights(name_or_path: str, info: dict) -> None:
    """VlmrlError naming the tensors when transformers' loading info (`output_loading_info=True`, with
    `ignore_mismatched_sizes=True` so that shapes are reported, not raised) says weights are missing
    from the files, left unused, or of another shape than config.json gives them."""
    check_fit(f"model {name_or_path!r}", weights_label(name_or_path), sorted(info.get("missing_keys") or ()),
              sorted(info.get("unexpected_keys") or ()),
              sorted((name, tuple(found), tuple(wanted)) for name, found, wanted in info.get("mismatched_keys") or ()),
              "config.json")


def check_fit(what: str, files: str, missing: list[str], unexpected: list[str],
              mismatched: list[tuple[str, tuple, tuple]], model_from: str = "the model") -> None:
    """One line for weights that do not fit `what`: `mismatched` as (name, shape in `files`, shape the
    model has by `model_from`), then names missing from `files`, then names it has no place for."""
    if mismatched:
        name, found, wanted = mismatched[0]
        more = f" (and {len(mismatched) - 1} more tensors of other shapes)" if len(mismatched) > 1 else ""
        raise VlmrlError(f"{what}: tensor {name} is {list(found)} in {files} but {list(wanted)} by {model_from}{more}; "
                         f"the weights and {model_from} are of different models")
    if missing:
        raise VlmrlError(f"{what}: {several(len(missing), 'weight')} not in {files} and would start from random "
                         f"values: {names(missing)}; {FIX_FILES}")
    if unexpected:
        raise VlmrlError(f"{what}: {files} holds tensors the model has no place for ({len(unexpected)}): "
                         f"{names(unexpected)}; the weights and {model_from} are of different models")


def shape_fit(expected: dict[str, tuple], found: dict[str, tuple]) -> tuple[list, list, list]:
    """(missing, unexpected, mismatched) of the tensors `found` in a file against those `expected`
    (name -> shape each), as `check_fit` takes them."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    mismatched = sorted((name, found[name], tuple(expected[name])) for name in set(expected) & set(found)
                        if tuple(found[name]) != tuple(expected[name]))
    return missing, unexpected, mismatched


def weights_label(name_or_path: str) -> str:
    """How a message names a model's weight files: model.safetensors, or the shards of its index."""
    folder = Path(name_or_path).expanduser()
    if folder.is_dir() and not (folder / SINGLE_FILE).is_file() and (folder / INDEX_FILE).is_file():
        return f"the shards {INDEX_FILE} lists"
    return SINGLE_FILE


def several(count: int, noun: str) -> str:
    """"1 weight is", "3 weights are": a count, its noun and verb."""
    return f"{count} {noun} is" if count == 1 else f"{count} {noun}s are"


def names(items: list[str]) -> str:
    """The first few names, and how many more."""
    shown = ", ".join(items[:SHOWN])
    return shown + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


@contextlib.contextmanager
def withheld_load_report():
    """Within: transformers' LOAD REPORT table (missing, unexpected and mismatched weights) is held
    back, as `check_loaded_weights` says the same in one line; where loading fails within, it is
    logged after all (transformers' error then points at it)."""
    logger = logging.getLogger("transformers.modeling_utils")
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in str(record.msg):
            held.append(record)
            return False
        return True

    logger.addFilter(hold)
    try:
        yield
    except BaseException:
        logger.removeFilter(hold)
        for record in held:
            logger.handle(record)
        raise
    finally:
        logger.removeFilter(hold)
