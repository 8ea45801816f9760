"""Checkpoints: the model in Hugging Face format, plus everything needed to continue exactly.

`checkpoints/step_000050/` holds the full model (save_pretrained) or the LoRA adapter, the
processor, and `trainer_state.pt`: optimizer, scheduler, RNG states, step and data position. The
reference copy, when there is one, is saved beside them. `final/` is the trained model alone.

A checkpoint is written into a temporary folder and renamed into place, so a kill while saving
never leaves a half-written `step_*` folder; the newest `keep` are kept. A disk that fills up while
saving is one DiskFull error: the temporary folder is removed, the previous checkpoint is left
intact, and `resume=true` continues from it once space is freed. Weights are safetensors,
and `trainer_state.pt` holds only tensors, numbers, strings and containers, read back with
`torch.load(weights_only=True)`: no checkpoint can run code. On resume, `find_resumable` takes the
newest checkpoint that is whole (trainer state readable, every safetensors file whole:
folder_check.safetensors_problem) and says which damaged ones it passed over.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vlmrl.disk import DiskFull, writing
from vlmrl.errors import VlmrlError, warn
from vlmrl.models.adapter_folder import no_base_config_warning, store_base_path
from vlmrl.models.folder_check import safetensors_problem

STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class Gathered:
    """The full state dicts of a sharded run (FSDP2), gathered on every process for the main one to
    write: the model's, the optimizer's (keyed by parameter name) and the reference copy's."""

    weights: dict
    optimizer: dict | None = None
    reference: dict | None = None


def save_model(folder: Path, model: torch.nn.Module, processor, weights: dict | None = None) -> None:
    """The model (or adapter) and processor, loadable with transformers (and peft); `weights`: the
    full state dict of a sharded model (default: the model's own). An adapter's base is stored as an
    absolute path, so that the folder can be moved (adapter_folder.py)."""
    folder.mkdir(parents=True, exist_ok=True)
    with no_base_config_warning():
        model.save_pretrained(folder, state_dict=weights)
    store_base_path(folder)
    processor.save_pretrained(folder)


def save_checkpoint(run_dir: Path, step: int, model, processor, optimizer, scheduler,
                    data_position: int, reference=None, keep: int = 2, extra: dict | None = None,
                    gathered: Gathered | None = None) -> Path:
    """Write checkpoints/step_{step}/ atomically (a temp folder renamed) and prune old ones.

    `extra` (numbers, strings, containers) is stored too and comes back from `read_checkpoint`.
    `gathered`: a sharded run's full states, written instead of the model's and optimizer's own."""
    root = run_dir / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with writing(f"checkpoint step {step}", tmp):
            save_model(tmp, model, processor, gathered and gathered.weights)
            torch.save({
                "step": step,
                "data_position": data_position,
                "optimizer": gathered.optimizer if gathered else optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": {"python": random.getstate(), "numpy": _numpy_rng_state(),
                        "torch": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
                "extra": extra or {},
            }, tmp / STATE_FILE)
            if reference is not None:
                reference.save(tmp, gathered and gathered.reference)
    except DiskFull as full:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(run_dir)
        kept = f"{previous} is intact" if previous is not None else "there is no earlier checkpoint"
        raise DiskFull(f"{full}. The partial checkpoint was removed and {kept}: free some space, then "
                       "rerun with resume=true") from full.__cause__
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Step checkpoint folders, oldest first (whole or damaged: see `read_checkpoint`)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


class DamagedCheckpoint(VlmrlError):
    """A checkpoint folder whose trainer state or weights cannot be read back."""


def read_checkpoint(folder: Path) -> dict:
    """The trainer state of checkpoint `folder`, after checking that its weights are whole.

    DamagedCheckpoint, naming the folder and the file, when trainer_state.pt is missing or cannot
    be read (truncated, or holding anything but tensors and plain data), when there are no model
    or adapter weights, or when a safetensors file is shorter than its header says.
    """
    folder = Path(folder)
    path = folder / STATE_FILE
    if not path.is_file():
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {STATE_FILE} is missing")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - truncated zip, refused pickle, ...: all mean damaged
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {STATE_FILE} cannot be read "
                                f"({type(error).__name__}: {first})") from error
    missing = [key for key in ("step", "data_position", "optimizer", "scheduler", "rng")
               if not isinstance(state, dict) or key not in state]
    if missing:
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {STATE_FILE} lacks {', '.join(missing)}")
    weights = sorted(folder.glob("*.safetensors"))
    if not any(p.name.startswith(("model", "adapter_model")) for p in weights):
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: no model weights "
                                "(model*.safetensors or adapter_model.safetensors)")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError) as error:
            raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {index.name} is unreadable") from error
        absent = sorted(s for s in shards if not (folder / s).is_file())
        if absent:
            raise DamagedCheckpoint(f"checkpoint {folder} is damaged: weight shard {absent[0]} is missing")
    for file in weights:
        problem = safetensors_problem(file)
        if problem:
            raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {file.name} {problem}")
    return state


def find_resumable(run_dir: Path) -> tuple[Path, dict] | None:
    """(folder, trainer state) of the newest whole checkpoint in run_dir, or None when there is none.

    A damaged newer one is passed over with a warning naming it; when every checkpoint is damaged,
    a VlmrlError lists them.
    """
    damaged = []
    for folder in reversed(list_checkpoints(run_dir)):
        try:
            state = read_checkpoint(folder)
        except DamagedCheckpoint as error:
            warn(f"{error}; trying the checkpoint before it")
            damaged.append(str(error))
            continue
        if damaged:
            warn(f"resuming from {folder}, the newest whole checkpoint")
        return folder, state
    if damaged:
        raise VlmrlError("no checkpoint to resume from is whole: " + "; ".join(damaged))
    return None


def restore_trainer_state(state: dict, optimizer, scheduler) -> dict:
    """Put a checkpoint's optimizer, scheduler and RNG states back; returns step, data position
    and the `extra` saved with it."""
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng = state["rng"]
    random.setstate(_as_tuples(rng["python"]))
    numpy_state = dict(rng["numpy"])
    numpy_state["state"] = {**numpy_state["state"], "key": np.asarray(numpy_state["state"]["key"], dtype=np.uint32)}
    np.random.set_state(numpy_state)
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return {"step": state["step"], "data_position": state["data_position"], "extra": state.get("extra", {})}


def load_trainer_state(folder: Path, optimizer, scheduler) -> dict:
    """Restore optimizer, scheduler and RNG from a checkpoint folder; returns step and data position."""
    return restore_trainer_state(read_checkpoint(folder), optimizer, scheduler)


def _numpy_rng_state() -> dict:
    """numpy's global RNG state as plain data (the key as a list of ints), for weights_only loading."""
    state = np.random.get_state(legacy=False)
    return {**state, "state": {**state["state"], "key": state["state"]["key"].tolist()}}


def _as_tuples(value):
    """Python's random state with its lists turned back into the tuples `random.setstate` wants."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
