"""Whether a model's files are whole and belong to one model, checked where vlmrl loads them.

Left to themselves, a damaged weights file is a `SafetensorError` traceback, a weight missing from
the files trains from random values (transformers prints a table and goes on), and files of two
models in one folder fail deep in a forward. `loading.load_policy` calls, in order:

- `check_processor_family` (before the processor loads): the processor class that
  processor_config.json (or preprocessor_config.json) names belongs to config.json's model type, or
  to the type of one of its parts (Pixtral's processor for a LLaVA config with a Pixtral tower);
- `check_image_token` (the processor loaded): config.json's image token id is the tokenizer's id of
  the token the processor writes for an image;
- `check_weight_files` (before the weights load; a local folder): each file the loader reads
  (model.safetensors, or every shard model.safetensors.index.json names) is a whole safetensors file,
  and each shard holds the tensors the index places in it; a folder with pickled weights alone
  (pytorch_model.bin) is refused with the line that converts them, never unpickled;
- `check_loaded_weights` (the weights loaded): transformers' own account of the load names no weight
  missing from the files, none the model has no place for, none of another shape. What transformers
  fills in on purpose is not in that account: a weight tied to another (the tiny builds' lm_head, tied
  to the embedding and left out of the file) and what the model class lists as new on purpose
  (`_keys_to_ignore_on_load_missing`);
- `check_vocabulary` (the loaded model): every token of the tokenizer has a row in the input
  embedding (its rows, not config.json's vocab_size: Mllama's embedding has 8 rows more).

Weights vlmrl saves itself are checked the same way before they load: `check_weight_file` for the
file, `check_fit` for names and shapes (the LoRA adapter of a checkpoint, the reference copy).
Each refusal is one line naming the file or the tensors, and which part disagrees with which.
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
from pathlib import Path

from vlmrl.errors import VlmrlError
from vlmrl.models.model_source import first_line, saved_processor_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLED_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
"""Weights saved by torch.save (a pickle), one file or the index of its shards: refused, not loaded."""
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
            return (f"is truncated or not a safetensors file: its header alone should be {length} bytes, "
                    f"the file has {size}")
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
        check_pickled_weights(folder)
        return  # no weights at all: the loader says so
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


def check_pickled_weights(folder: Path) -> None:
    """VlmrlError for a folder whose weights are pickled (pytorch_model.bin, or the shards of its index)
    and not in safetensors: vlmrl loads safetensors alone, since unpickling a file can run code in
    it; the message names the file and the line that converts it, for the user to run on a file
    they trust (transformers reads it with torch's weights-only unpickler)."""
    found = next((name for name in PICKLED_FILES if (folder / name).is_file()), None)
    if found is None:
        return
    where = str(folder)
    convert = (f"python -c \"from transformers import AutoModelForImageTextToText as M; "
               f"M.from_pretrained({where!r}, use_safetensors=False).save_pretrained({where!r})\"")
    raise VlmrlError(f"{where!r} holds its weights as {found} (PyTorch pickle) and no {SINGLE_FILE}: vlmrl loads "
                     "safetensors weights only, since unpickling a file can run code in it; if you trust the file, "
                     f"convert it once (it writes {SINGLE_FILE} beside it): {convert}")


def check_processor_family(name_or_path: str, config: dict | None) -> None:
    """VlmrlError when the processor a local folder's processor files name is another family's than
    config.json's model type (and than the types of its parts): the files come from two models."""
    saved = saved_processor_file(name_or_path)
    kind = (config or {}).get("model_type")
    if saved is None or not kind:
        return
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    file, class_name = saved
    own = PROCESSOR_MAPPING_NAMES.get(kind)
    families = sorted(k for k, name in PROCESSOR_MAPPING_NAMES.items() if name == class_name)
    if not own or not families or set(families) & model_types(config):
        return  # a family transformers does not map, a processor of its own code, or this model's
    raise VlmrlError(
        f"{name_or_path!r} holds parts of two models: config.json's model type is {kind} (processor {own}) but "
        f"{file} names {class_name}, the processor of {', '.join(families)}; put config.json, the processor files "
        "and the tokenizer files of one model together")


def model_types(config: dict) -> set[str]:
    """The model types in a config: its own and those of its parts (text_config, vision_config, ...)."""
    types = {config.get("model_type")}
    types |= {part.get("model_type") for part in config.values() if isinstance(part, dict)}
    return {kind for kind in types if isinstance(kind, str)}


def image_token_id(config: dict) -> int | None:
    """The id config.json gives the image token (image_token_id or image_token_index), or None."""
    for part in (config, config.get("text_config") or {}):
        for key in ("image_token_id", "image_token_index"):
            if isinstance(part.get(key), int):
                return part[key]
    return None


def check_image_token(name_or_path: str, config: dict | None, processor) -> None:
    """VlmrlError when config.json's image token id is not the tokenizer's id of the token the
    processor writes for an image (the tokenizer or the config is another model's): the model would
    find no image where the processor put one."""
    expected = image_token_id(config or {})
    tokenizer = getattr(processor, "tokenizer", None)
    if expected is None or tokenizer is None:
        return
    written = [t for t in (getattr(processor, "image_token", None), getattr(tokenizer, "image_token", None))
               if isinstance(t, str)]
    ids = {tokenizer.convert_tokens_to_ids(token) for token in written}
    ids |= {v for v in (getattr(processor, "image_token_id", None), getattr(tokenizer, "image_token_id", None))
            if isinstance(v, int)}
    if expected in ids or not (written or ids):
        return  # this model's image token, or a processor without one of its own: nothing to compare
    in_tokenizer = tokenizer.convert_ids_to_tokens(expected) if 0 <= expected < len(tokenizer) else None
    said = (f"{in_tokenizer!r} in the tokenizer" if in_tokenizer is not None
            else f"beyond the tokenizer's {len(tokenizer)} tokens")
    given = ", ".join(f"{token!r} ({token_id(tokenizer, token)})" for token in dict.fromkeys(written))
    given = given or f"image token id {', '.join(str(i) for i in sorted(ids))}"
    raise VlmrlError(
        f"{name_or_path!r}: config.json and the tokenizer disagree on the image token: config.json's image token id "
        f"is {expected} ({said}), the processor writes {given}; the tokenizer files or config.json are another "
        "model's: put those of one model together")


def token_id(tokenizer, token: str) -> str:
    """"id N" of `token` in the tokenizer, or that it has none."""
    found = tokenizer.convert_tokens_to_ids(token)
    return f"id {found}" if isinstance(found, int) and found != tokenizer.unk_token_id else "not in the tokenizer"


def check_vocabulary(name_or_path: str, model, tokenizer) -> None:
    """VlmrlError when the tokenizer has tokens beyond the model's input embedding (tokenizer.json
    of a larger vocabulary than config.json's): their ids would index past the embedding."""
    try:
        rows = int(model.get_input_embeddings().weight.shape[0])
    except (AttributeError, NotImplementedError, TypeError):  # remote code without the accessor
        return
    if len(tokenizer) > rows:
        vocab = getattr(model.config.get_text_config(), "vocab_size", None)
        raise VlmrlError(
            f"{name_or_path!r}: the tokenizer has {len(tokenizer)} tokens but the model's embedding has {rows} rows "
            f"(config.json's vocab_size {vocab}): the tokenizer files are another model's; put this model's "
            "tokenizer.json and tokenizer_config.json in the folder")


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
    model has by `model_from`), then names missing from `files` and names it has no place for (both:
    the files are another model's)."""
    if mismatched:
        name, found, wanted = mismatched[0]
        more = f" (and {len(mismatched) - 1} more tensors of other shapes)" if len(mismatched) > 1 else ""
        raise VlmrlError(f"{what}: tensor {name} is {list(found)} in {files} but {list(wanted)} by {model_from}{more}; "
                         f"the weights and {model_from} are of different models")
    if missing and unexpected:  # one model's weights under another's config
        raise VlmrlError(f"{what}: {files} and {model_from} are of different models: {several(len(missing), 'weight')} "
                         f"not in {files} ({names(missing)}) and it holds {len(unexpected)} tensors the model has no "
                         f"place for ({names(unexpected)})")
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
