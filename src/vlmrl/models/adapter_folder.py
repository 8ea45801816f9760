"""LoRA adapter folders: recognised wherever a model folder is taken, and their base model found.

An adapter folder (adapter_config.json + adapter_model.safetensors, as peft and vlmrl save it) stands
for its base model with the adapter merged in: `vlmrl eval`, `vlmrl attention`, `vlmrl train` /
`sft` (model.name_or_path) and `vlmrl merge` take one where they take a model folder. Its base is
adapter_config.json's base_model_name_or_path: a hub id, an absolute path (what vlmrl stores,
`store_base_path`, so that the adapter folder can be moved), or a relative path, looked for first
from the adapter folder and then from the working directory (peft writes the path the base was
loaded by, relative to the directory training ran in).

A folder that is neither a model nor an adapter is refused in one line that says what it is and what
it lacks (`describe_folder`): a run folder, a checkpoints folder, an adapter without its weights, ...
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

from vlmrl.errors import VlmrlError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"
BASE_KEY = "base_model_name_or_path"
SHOWN_FILES = 4
"""How many of a folder's files a message names before "and N more"."""


def is_adapter_folder(name_or_path: str | Path) -> bool:
    """Whether `name_or_path` is a local folder holding a LoRA adapter and no model of its own
    (adapter_config.json, no config.json)."""
    folder = Path(name_or_path).expanduser()
    return folder.is_dir() and (folder / ADAPTER_CONFIG).is_file() and not (folder / "config.json").is_file()


def adapter_settings(folder: str | Path) -> dict:
    """adapter_config.json of an adapter folder, as a dict; one line when it cannot be read."""
    path = Path(folder).expanduser() / ADAPTER_CONFIG
    try:
        settings = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise VlmrlError(f"cannot read the LoRA adapter's {path}: {error}; save the adapter again") from None
    if not isinstance(settings, dict):
        raise VlmrlError(f"the LoRA adapter's {path} does not hold a JSON object; save the adapter again")
    return settings


def adapter_base(folder: str | Path) -> str:
    """The base model of adapter `folder`: base_model_name_or_path as an absolute path where it is a
    local folder (relative paths looked for from the adapter folder, then from the working
    directory), else as written (a hub id). One line for an adapter without a base, or without
    its weights file."""
    folder = Path(folder).expanduser()
    if not (folder / ADAPTER_FILE).is_file():
        raise VlmrlError(f"{str(folder)!r} is a LoRA adapter folder without its weights: it has {ADAPTER_CONFIG} but "
                         f"no {ADAPTER_FILE}; copy the whole adapter folder")
    base = adapter_settings(folder).get(BASE_KEY)
    if not isinstance(base, str) or not base.strip():
        raise VlmrlError(f"the LoRA adapter {str(folder)!r} does not name its base model ({BASE_KEY} in "
                         f"{ADAPTER_CONFIG} is {base!r}); set it to the base model's folder or hub id")
    written = Path(base).expanduser()
    found = next((c for c in ([written] if written.is_absolute() else [folder / written, written]) if c.is_dir()), None)
    if found is None:
        return base  # a hub id, or a folder that is not there: find_model_config says which
    if found.resolve() == folder.resolve():
        raise VlmrlError(f"the LoRA adapter {str(folder)!r} names itself as its base model ({BASE_KEY} in "
                         f"{ADAPTER_CONFIG}); set it to the base model's folder or hub id")
    return str(found.resolve())


def adapter_line(name_or_path: str | Path) -> str | None:
    """For a LoRA adapter folder, the line a command prints before it loads one: which base the
    adapter is merged into (and from where adapter_config.json names it); None for anything else."""
    if not is_adapter_folder(name_or_path):
        return None
    base = adapter_base(name_or_path)
    return (f"{str(name_or_path)!r} is a LoRA adapter: loading its base model {base!r} ({BASE_KEY} in its "
            f"{ADAPTER_CONFIG}) with the adapter merged in")


def store_base_path(folder: str | Path) -> None:
    """Rewrite the base path of the adapter saved in `folder` (when there is one) as an absolute path,
    where it names a local folder, so that the adapter folder can be moved. A hub id stays."""
    path = Path(folder) / ADAPTER_CONFIG
    if not path.is_file():
        return
    settings = adapter_settings(folder)
    base = settings.get(BASE_KEY)
    if isinstance(base, str) and base and not Path(base).is_absolute() and Path(base).expanduser().is_dir():
        settings[BASE_KEY] = str(Path(base).expanduser().resolve())
        path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


def describe_folder(folder: Path) -> str:
    """What a folder that is neither a model nor a LoRA adapter folder is, and what it lacks, in a
    phrase: "'runs/a' is a vlmrl run folder, not a model: its model is in 'runs/a/final'"."""
    name = repr(str(folder))
    lacks = f"it has neither config.json (a model folder) nor {ADAPTER_CONFIG} (a LoRA adapter folder)"
    if (folder / "config.yaml").is_file() or (folder / "metrics.jsonl").is_file():
        final = folder / "final"
        where = (f"its model is in {str(final)!r}" if final.is_dir()
                 else "it has no final/ model yet: give one of its checkpoints/step_* folders, or finish the run")
        return f"{name} is a vlmrl run folder, not a model: {where}"
    steps = sorted(p.name for p in folder.glob("step_*") if p.is_dir())
    if steps:
        return f"{name} is a checkpoints folder, not a model: give one of its checkpoints, e.g. {str(folder / steps[-1])!r}"
    files = sorted(p.name for p in folder.iterdir())
    if not files:
        return f"{name} is an empty folder: {lacks}"
    shown = ", ".join(files[:SHOWN_FILES]) + (f" and {len(files) - SHOWN_FILES} more" if len(files) > SHOWN_FILES else "")
    return f"{name} is not a model folder: {lacks}; it holds {shown}"


@contextlib.contextmanager
def no_base_config_warning():
    """Within: peft's warning that the base has no config.json, when it looks there for the base's
    vocabulary (saving an adapter, reading its state dict), is held back: a base that is an adapter
    folder has none, and vlmrl never changes the vocabulary."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Could not find a config file in", UserWarning)
        yield
