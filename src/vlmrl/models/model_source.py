"""Where a model comes from, checked before anything heavy is imported or loaded.

`check_model_source` fails at once, in one line, for a model that cannot load from here: a path
that looks local and does not exist (with the command that builds the offline model there), a
folder without config.json, a hub id while HF_HUB_OFFLINE is set and the id is not in the local
cache, or a hub that cannot be reached (one quick request instead of minutes of retries) or does
not know the id. `vlmrl train`, `sft` and `check` call it before loading anything.

It then refuses, from the config alone (config.json, or what the hub says of it), a model vlmrl
cannot train (`check_model_kind`): an encoder-decoder, a folder whose code is not in transformers
while `model.trust_remote_code` is off, a model type outside transformers' image-text-to-text
models, and a family whose processor's module does not import here for want of a package (a
torchvision image-processor module it imports is first replaced by its PIL twin, processing.py, as
for Pixtral). Nothing is loaded but the config and, for the last check, the processor's module;
transformers (and torch with it) is imported only once a config has been found.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

from vlmrl.errors import VlmrlError, one_line
from vlmrl.models.adapter_folder import BASE_KEY, adapter_base, describe_folder, is_adapter_folder
from vlmrl.models.processing import import_processor_module
from vlmrl.models.tiny_model import SIZES

RUN_FOLDER = "runs"
"""Where vlmrl's commands write (the offline models, run directories): a path under it is local."""
_ON_THE_HUB: set[str] = set()
"""Hub ids the hub has confirmed in this process: asked once, not again when the model loads."""
_HUB_CONFIGS: dict[str, dict] = {}
"""What the hub said of a confirmed id's config.json (model_type, auto_map, ...), for the kind check."""


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) forbids the model hub."""
    return any(os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def looks_local(name_or_path: str) -> bool:
    """A path rather than a hub id ("org/name"): it starts with ".", "/" or "~", has more than one
    "/", a backslash, or a first part that is a folder here or vlmrl's run folder ("runs/...")."""
    first = Path(name_or_path).parts[0] if name_or_path else ""
    return (name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1 or "\\" in name_or_path
            or ("/" in name_or_path and (first == RUN_FOLDER or Path(first).is_dir())))


def build_hint(name_or_path: str) -> str:
    """What to do about a missing model: for a local path (or a name like runs/small-model), the
    command that builds the offline model there."""
    size = next((s for s in SIZES if Path(name_or_path).name.startswith(s)), None)
    if size is None and not looks_local(name_or_path):
        return "give a local model folder"
    return f"build the offline model with: vlmrl tiny-model {name_or_path} --size {size or 'small'}"


def check_model_source(name_or_path: str, trust_remote_code: bool = False) -> dict | None:
    """Fail at once, in one line, for a model that cannot load from here (`find_model_config`) or
    that vlmrl cannot train (`check_model_kind`, where its config is at hand); its config.json as a
    dict (None where the hub said nothing of it)."""
    config = find_model_config(name_or_path)
    if config is not None:
        check_model_kind(name_or_path, config, trust_remote_code)
    return config


def find_model_config(name_or_path: str) -> dict | None:
    """The model's config.json as a dict, after failing in one line for a model that cannot load
    from here: a local-looking path that does not exist, a folder without config.json (said what it
    is: describe_folder; a LoRA adapter folder gives its base's config), a hub id
    while the hub is off (HF_HUB_OFFLINE) and the id is not in the local cache, or a hub that cannot
    be reached (one quick request, no retries) or does not know the id. None where the hub said
    nothing of the config."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if (path / "config.json").exists():
            return _read_json(path / "config.json")
        if is_adapter_folder(path):  # a LoRA adapter stands for its base (adapter_folder.py)
            return adapter_base_config(path)
        raise VlmrlError(describe_folder(path))
    if path.exists():
        raise VlmrlError(f"{name_or_path!r} is a file, not a model folder")
    if looks_local(name_or_path):
        raise VlmrlError(f"model folder {name_or_path!r} does not exist; {build_hint(name_or_path)} (or give a hub id)")
    from huggingface_hub import model_info, try_to_load_from_cache

    cached = try_to_load_from_cache(name_or_path, "config.json")
    if isinstance(cached, str):
        return _read_json(Path(cached))  # in the hub cache: loads offline too
    if hub_offline():
        raise VlmrlError(f"model {name_or_path!r} is neither a local folder nor in the hub cache, and the hub is off "
                         f"(HF_HUB_OFFLINE=1): download it where the hub is reachable, or {build_hint(name_or_path)}")
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if name_or_path in _ON_THE_HUB:
        return _HUB_CONFIGS.get(name_or_path)
    try:
        info = model_info(name_or_path, timeout=10)
        _ON_THE_HUB.add(name_or_path)
    except GatedRepoError:
        return None  # the loader says what access it needs
    except RepositoryNotFoundError:
        raise VlmrlError(f"model {name_or_path!r} is neither a local folder nor a model on the hub; "
                         f"{build_hint(name_or_path)}") from None
    except Exception as error:  # no network, DNS, proxy, timeout: one line instead of minutes of retries
        raise VlmrlError(f"model {name_or_path!r} is not a local folder and the hub cannot be reached "
                         f"({first_line(error)}); set HF_HUB_OFFLINE=1 to use the hub cache only, or "
                         f"{build_hint(name_or_path)}") from None
    config = getattr(info, "config", None)
    if isinstance(config, dict) and config.get("model_type"):
        _HUB_CONFIGS[name_or_path] = config
        return config
    return None


def adapter_base_config(folder: Path) -> dict | None:
    """find_model_config of a LoRA adapter folder's base, each refusal naming the adapter and where it
    names its base; a local base that is gone says so and how to point the adapter at it again."""
    base = adapter_base(folder)
    where = f"{BASE_KEY} in {folder / ADAPTER_CONFIG}"
    if looks_local(base) and not Path(base).expanduser().exists():
        looked = ("" if Path(base).expanduser().is_absolute()
                  else f" (looked for from {str(folder)!r} and from the working directory)")
        raise VlmrlError(f"the base model of the LoRA adapter {str(folder)!r}, {base!r} ({where}), does not exist"
                         f"{looked}: put the base model back there, or set {BASE_KEY} to where it is now "
                         "(a model folder or hub id)")
    try:
        return find_model_config(base)
    except VlmrlError as error:
        raise VlmrlError(f"the base model of the LoRA adapter {str(folder)!r} ({where}): {error}") from None


ADAPTER_CONFIG = "adapter_config.json"
"""What peft writes beside a LoRA adapter's weights (a LoRA run's checkpoints and final/ hold one)."""


def adapter_folder_message(name_or_path: str) -> str:
    """What to do with a LoRA adapter folder given where a whole model belongs: vlmrl loads whole
    models; merge the adapter into its base model (named in adapter_config.json), or resume its run."""
    try:
        base = json.loads((Path(name_or_path).expanduser() / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    merged = f"its base model {base!r}" if isinstance(base, str) and base else "its base model"
    return (f"{name_or_path!r} is a LoRA adapter ({ADAPTER_CONFIG}), not a whole model, and vlmrl loads whole models: "
            f"merge it into {merged} (peft: PeftModel.from_pretrained(base, {name_or_path!r}).merge_and_unload()"
            ".save_pretrained(OUT), and save the processor there too) and give OUT, or continue its run with "
            "resume=true")


PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
"""Where a model folder keeps its image processor's settings (either name)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tokenizer.tiktoken")
"""The files a tokenizer is built from (a fast tokenizer's, or a slow one's to convert)."""


def missing_processor_part(name_or_path: str) -> str | None:
    """For a local folder whose processor does not load, the part it lacks in vlmrl's words (transformers'
    own message speaks of the hub, "If you were trying to load it from 'https://huggingface.co/models'",
    or lists conversions); None for a hub id or a folder that has both parts."""
    folder = Path(name_or_path).expanduser()
    if not folder.is_dir():
        return None
    copy = "copy it from the model it was made from"
    if not any((folder / name).exists() for name in PROCESSOR_FILES):
        return f"it has no image processor settings ({' or '.join(PROCESSOR_FILES)}); {copy}"
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        return f"it has no tokenizer (tokenizer.json); {copy}"
    return None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise VlmrlError(f"cannot read {path}: {first_line(error)}") from None
    if not isinstance(data, dict):
        raise VlmrlError(f"{path} does not hold a JSON object")
    return data


def check_model_kind(name_or_path: str, config: dict, trust_remote_code: bool) -> None:
    """Refuse, in one line, a model vlmrl cannot train, from its `config` (config.json) alone: an
    encoder-decoder, code that is not in transformers without `model.trust_remote_code=true` (or
    remote code without an image-text-to-text class), a model type outside transformers'
    image-text-to-text models, or a processor whose module does not import here."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as IMAGE_TEXT

    kind = config.get("model_type")
    name = f"{name_or_path!r} ({kind})" if kind else repr(name_or_path)
    if is_encoder_decoder(config):
        raise VlmrlError(f"vlmrl trains decoder-only image-text-to-text models; {name} is an encoder-decoder")
    if kind in IMAGE_TEXT:
        check_processor_imports(name_or_path, kind)
        return
    remote = config.get("auto_map")
    if remote and not trust_remote_code:
        raise VlmrlError(f"{name} needs the code that ships with it (auto_map in config.json), which runs only with "
                         "model.trust_remote_code=true; set it if you trust that code")
    if remote:
        if "AutoModelForImageTextToText" not in remote:
            raise VlmrlError(f"{name}'s own code has no image-text-to-text model (its auto_map offers "
                             f"{', '.join(sorted(remote))}); vlmrl loads AutoModelForImageTextToText")
        return
    if kind not in CONFIG_MAPPING_NAMES:
        raise VlmrlError(f"{name}: transformers {transformers.__version__} does not know model type {kind!r}; it needs "
                         "its own code (a folder with auto_map, and model.trust_remote_code=true) or a newer transformers")
    raise VlmrlError(f"{name} is not an image-text-to-text model (not among transformers' "
                     "AutoModelForImageTextToText types); vlmrl trains decoder-only image-text-to-text models")


def is_encoder_decoder(config: dict) -> bool:
    """Whether the config (or its type's default, as Florence-2's) says encoder-decoder."""
    if "is_encoder_decoder" in config:
        return bool(config["is_encoder_decoder"])
    from transformers import CONFIG_MAPPING

    kind = config.get("model_type")
    if kind not in CONFIG_MAPPING:
        return False
    try:
        return bool(CONFIG_MAPPING[kind].from_dict(config).is_encoder_decoder)
    except Exception:  # a config its class cannot build: the loader says why
        return False


def check_processor_imports(name_or_path: str, kind: str) -> None:
    """Refuse a family whose processor's module does not import here (a package it needs is not
    installed): vlmrl's image-only processors (PIL image processors, no video) cannot serve it."""
    class_name = saved_processor_class(name_or_path) or _mapped_processor(kind)
    module = _processor_module(class_name) if class_name else None
    if module is None:
        return
    try:
        import_processor_module(module)
    except ModuleNotFoundError as error:
        missing = (error.name or "a package").split(".")[0]
        raise VlmrlError(f"{name_or_path!r} ({kind}): its processor {class_name} needs {missing}, which is not "
                         f"installed; vlmrl's PIL image path does not cover this family yet (install {missing} "
                         "if it works here)") from None


def processor_class(class_name: str) -> type | None:
    """The processor class `class_name` from its module in transformers (imported as
    `import_processor_module` does, so a torchvision twin's PIL one stands in), or from the classes
    transformers registers otherwise; None for a name it does not know."""
    from transformers.models.auto.processing_auto import processor_class_from_name

    module = _processor_module(class_name)
    if module is None:
        return processor_class_from_name(class_name)
    return getattr(import_processor_module(module), class_name, None)


def saved_processor_class(name_or_path: str) -> str | None:
    """The processor class named in a local folder's processor or preprocessor config."""
    saved = saved_processor_file(name_or_path)
    return saved[1] if saved else None


def saved_processor_file(name_or_path: str) -> tuple[str, str] | None:
    """(file, processor class) of the processor or preprocessor config of a local folder that names
    its processor class."""
    for file in ("processor_config.json", "preprocessor_config.json"):
        path = Path(name_or_path).expanduser() / file
        if path.exists():
            name = _read_json(path).get("processor_class")
            if name:
                return file, name
    return None


def _mapped_processor(kind: str) -> str | None:
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = PROCESSOR_MAPPING_NAMES.get(kind)
    return name if isinstance(name, str) else None


def _processor_module(class_name: str) -> str | None:
    """The module of transformers that defines processor `class_name` ("...pixtral.processing_pixtral"),
    found through the lazy module of a model type that maps to it; None for a class not in transformers."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    for kind, name in PROCESSOR_MAPPING_NAMES.items():
        if name != class_name:
            continue
        package = f"transformers.models.{model_type_to_module_name(kind)}"
        submodule = getattr(importlib.import_module(package), "_class_to_module", {}).get(class_name)
        if submodule:
            return f"{package}.{submodule}"
    return None


def first_line(error: BaseException) -> str:
    """An error's message on one line, whole (its type's name when empty): errors.one_line."""
    return one_line(error)
