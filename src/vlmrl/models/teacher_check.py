"""Whether a teacher model (algorithm.teacher) can score the student's sampled tokens: checked from
its files, before any model loads.

The teacher is called on the token ids and pixel inputs the student's processor wrote
(training/teacher.py), so it must read them as the student does. Two sizes of one family share all
of this; two families do not. Refused in one line, naming what differs:
- a teacher that does not exist (a folder, a LoRA adapter folder whose base does not, a hub id
  neither cached nor reachable: model_source.py), or that is the policy's own folder (a student
  distilled from itself gets no signal: name another model);
- another model type (the pixel inputs and image-token layout its forward expects differ);
- another image token id (config.json), another tokenizer (a token with another id, or tokens
  the other has not), or other image-processor settings (patch and merge sizes, resolution,
  normalisation: the teacher would see other image tokens or other pixels than its own processor
  writes);
- weight files that are not whole (a truncated model.safetensors, a shard the index places tensors
  in that lacks them, a damaged adapter_model.safetensors): the policy's own check (folder_check.py),
  before any model loads and before the preflight reads their headers for the teacher's size.
A LoRA adapter folder (adapter_config.json) is its base model plus the adapter: the base's
config.json, and the adapter folder's tokenizer and processor files where it has them (vlmrl saves
them beside a trained adapter), else the base's.
`teacher_weight_bytes` is the teacher's size from its safetensors headers, for the preflight.
"""

from __future__ import annotations

import json
from pathlib import Path

from vlmrl.config import Config
from vlmrl.errors import VlmrlError
from vlmrl.models.folder_check import check_weight_file, check_weight_files, image_token_id
from vlmrl.models.model_source import find_model_config, first_line

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
NAMING_KEYS = ("processor_class", "image_processor_type", "_processor_class")
"""Image-processor settings that name a class rather than change what the model sees."""


def adapter_base(name_or_path: str) -> str | None:
    """The base model of a LoRA adapter folder (its adapter_config.json), or None for a model."""
    path = Path(name_or_path).expanduser() / ADAPTER_CONFIG
    if not path.is_file():
        return None
    try:
        base = json.loads(path.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as error:
        raise VlmrlError(f"algorithm.teacher: cannot read {path}: {first_line(error)}") from None
    if not isinstance(base, str) or not base:
        raise VlmrlError(f"algorithm.teacher: {path} names no base_model_name_or_path; a LoRA adapter needs its base")
    return base


def weights_source(name_or_path: str) -> str:
    """Where the teacher's weights (its base's, for an adapter) and config.json come from."""
    return adapter_base(name_or_path) or name_or_path


def files_source(name_or_path: str) -> str:
    """Where the teacher's tokenizer and processor files come from: an adapter folder's own, else its base's."""
    base = adapter_base(name_or_path)
    if base is None or (Path(name_or_path).expanduser() / "tokenizer_config.json").is_file():
        return name_or_path
    return base


def same_folder(a: str, b: str) -> bool:
    """Whether two model names are one local folder."""
    first, second = Path(a).expanduser(), Path(b).expanduser()
    return first.is_dir() and second.is_dir() and first.resolve() == second.resolve()


def image_processor_settings(name_or_path: str) -> dict:
    """The image processor's settings from a local folder's processor files ({} where there are none)."""
    for file in PROCESSOR_FILES:
        path = Path(name_or_path).expanduser() / file
        if path.is_file():
            settings = json.loads(path.read_text())
            settings = settings.get("image_processor", settings) if file == PROCESSOR_FILES[0] else settings
            return {k: v for k, v in settings.items() if k not in NAMING_KEYS}
    return {}


def vocabulary(name_or_path: str) -> dict[str, int]:
    """Token -> id of a model's tokenizer (loaded alone: no weights)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path).get_vocab()
    except (OSError, ValueError, ImportError) as error:
        raise VlmrlError(f"algorithm.teacher: cannot load the tokenizer of {name_or_path!r}: {first_line(error)}")


def vocabulary_difference(student: dict[str, int], teacher: dict[str, int]) -> str | None:
    """What differs between two tokenizers' token -> id maps, in a few words, or None."""
    for token, index in student.items():
        if token not in teacher:
            return f"the student's token {token!r} (id {index}) is not in the teacher's tokenizer"
        if teacher[token] != index:
            return f"token {token!r} is id {index} for the student and {teacher[token]} for the teacher"
    extra = sorted(set(teacher) - set(student))
    return f"the teacher's tokenizer has {len(extra)} tokens more (first {extra[0]!r})" if extra else None


def check_teacher(config: Config) -> None:
    """VlmrlError (one line) when algorithm.teacher cannot score the policy's tokens (module doc);
    nothing when there is no teacher."""
    teacher, policy = config.algorithm.teacher, config.model.name_or_path
    if not teacher:
        return
    if same_folder(teacher, policy) or teacher == policy:
        raise VlmrlError(f"algorithm.teacher={teacher} is the policy's own model (model.name_or_path): a student "
                         "distilled from itself gets no signal; name another model, e.g. a larger one of its family")
    try:
        teacher_config = find_model_config(teacher) or {}  # an adapter: its base's (model_source.py)
    except VlmrlError as error:
        raise VlmrlError(f"algorithm.teacher: {error}") from None
    try:
        check_weight_files(weights_source(teacher))  # a hub id: nothing to check here
        if adapter_base(teacher) is not None:
            check_weight_file(Path(teacher).expanduser() / ADAPTER_FILE, "LoRA adapter file")
    except VlmrlError as error:
        raise VlmrlError(f"algorithm.teacher: {error}") from None
    student_config = find_model_config(policy) or {}
    fix = "the teacher must share the student's tokenizer and image-token layout (two sizes of one family do)"
    kinds = teacher_config.get("model_type"), student_config.get("model_type")
    if all(kinds) and kinds[0] != kinds[1]:
        raise VlmrlError(f"algorithm.teacher={teacher} is a {kinds[0]} model and the policy a {kinds[1]} one: {fix}")
    images = image_token_id(teacher_config), image_token_id(student_config)
    if images[0] != images[1]:
        raise VlmrlError(f"algorithm.teacher={teacher} has image token id {images[0]}, the policy {images[1]}: {fix}")
    files = files_source(teacher)
    difference = vocabulary_difference(vocabulary(policy), vocabulary(files))
    if difference:
        raise VlmrlError(f"algorithm.teacher={teacher} has another tokenizer: {difference}; {fix}")
    theirs, ours = image_processor_settings(files), image_processor_settings(policy)
    differing = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k)) if theirs and ours else []
    if differing:
        key = differing[0]
        raise VlmrlError(f"algorithm.teacher={teacher} processes images otherwise: {key} is {theirs.get(key)!r} for the "
                         f"teacher and {ours.get(key)!r} for the policy; {fix}")


def teacher_weight_bytes(config: Config, element_size: int) -> int:
    """Bytes of the teacher's weights (its base's and its adapter's) at `element_size` bytes per
    value, from the headers of its local safetensors files; 0 without a teacher or for a hub id."""
    teacher = config.algorithm.teacher
    if not teacher:
        return 0
    from vlmrl.models.folder_check import tensor_shapes

    total = 0
    for folder in {Path(weights_source(teacher)).expanduser(), Path(teacher).expanduser()}:
        for file in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
            for shape in tensor_shapes(file).values():
                count = 1
                for size in shape:
                    count *= size
                total += count * element_size
    return total
