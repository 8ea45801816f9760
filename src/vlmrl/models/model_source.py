"""Where a model comes from, checked before anything heavy is imported or loaded.

`check_model_source` fails at once, in one line, for a model that cannot load from here: a path
that looks local and does not exist (with the command that builds the offline model there), a
folder without config.json, a hub id while HF_HUB_OFFLINE is set and the id is not in the local
cache, or a hub that cannot be reached (one quick request instead of minutes of retries) or does
not know the id. No torch here: `vlmrl train`, `sft` and `check` call it before loading anything.
"""

from __future__ import annotations

import os
from pathlib import Path

from vlmrl.errors import VlmrlError
from vlmrl.models.tiny_model import SIZES

RUN_FOLDER = "runs"
"""Where vlmrl's commands write (the offline models, run directories): a path under it is local."""
_ON_THE_HUB: set[str] = set()
"""Hub ids the hub has confirmed in this process: asked once, not again when the model loads."""


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


def check_model_source(name_or_path: str) -> None:
    """Fail at once, in one line, for a model that cannot load from here: a local-looking path that
    does not exist, a folder without config.json, a hub id while the hub is off (HF_HUB_OFFLINE) and
    the id is not in the local cache, or a hub that cannot be reached (one quick request, no
    retries) or does not know the id."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise VlmrlError(f"{name_or_path!r} is not a model folder: it has no config.json")
        return
    if path.exists():
        raise VlmrlError(f"{name_or_path!r} is a file, not a model folder")
    if looks_local(name_or_path):
        raise VlmrlError(f"model folder {name_or_path!r} does not exist; {build_hint(name_or_path)} (or give a hub id)")
    from huggingface_hub import model_info, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name_or_path, "config.json"), str):
        return  # in the hub cache: loads offline too
    if hub_offline():
        raise VlmrlError(f"model {name_or_path!r} is neither a local folder nor in the hub cache, and the hub is off "
                         f"(HF_HUB_OFFLINE=1): download it where the hub is reachable, or {build_hint(name_or_path)}")
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if name_or_path in _ON_THE_HUB:
        return
    try:
        model_info(name_or_path, timeout=10)
        _ON_THE_HUB.add(name_or_path)
    except GatedRepoError:
        return  # the loader says what access it needs
    except RepositoryNotFoundError:
        raise VlmrlError(f"model {name_or_path!r} is neither a local folder nor a model on the hub; "
                         f"{build_hint(name_or_path)}") from None
    except Exception as error:  # no network, DNS, proxy, timeout: one line instead of minutes of retries
        raise VlmrlError(f"model {name_or_path!r} is not a local folder and the hub cannot be reached "
                         f"({first_line(error)}); set HF_HUB_OFFLINE=1 to use the hub cache only, or "
                         f"{build_hint(name_or_path)}") from None


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its type's name when empty)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
