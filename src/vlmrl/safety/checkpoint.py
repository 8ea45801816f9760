"""Checkpoints: the model in Hugging Face format, plus everything needed to continue exactly.

`checkpoints/step_000050/` holds the full model (save_pretrained) or the LoRA adapter, the
processor, and `trainer_state.pt`: optimizer, scheduler, RNG states, step and data position. The
reference copy, when there is one, is saved beside them. `final/` is the trained model alone.

A checkpoint is written into a temporary folder, made durable (every file and the folder fsynced)
and renamed into place, so a kill while saving never leaves a half-written `step_*` folder; the
newest `keep` are kept. What a checkpoint holds is taken first (`Contents`: `save_checkpoint` reads
the live model and optimizer while it writes; `host_copy` makes a copy that training may go on
changing while a background thread writes it: checkpoint_writer.py) and written by
`write_checkpoint`, the same either way. A disk that fills up while
saving is one DiskFull error (any other OSError one VlmrlError): the temporary folder is removed,
the previous checkpoint is left intact, and `resume=true` continues from it once space is freed.
`check_checkpoint_room` says before step 1 when the run could not write its checkpoints (a
`checkpoints/` that is a file or not writable, a `step_N` place taken by a file or a link). Weights
are safetensors, and `trainer_state.pt` holds only tensors, numbers, strings and containers, read
back with `torch.load(weights_only=True)`: no checkpoint can run code. On resume, `find_resumable`
takes the newest checkpoint that is whole (trainer state readable and able to go back:
`state_problem`; every safetensors file whole: folder_check.safetensors_problem; the reference
copy when the run needs one; the optimizer state fitting the run's model: `optimizer_problem`,
checked by the caller) and says which damaged ones it passed over. A state keyed by position (one process, DDP)
is keyed by name for FSDP2 and ZeRO-3 (`name_keyed`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vlmrl.disk import DiskFull, output_folder, writing
from vlmrl.errors import VlmrlError, one_line, warn
from vlmrl.models.adapter_folder import no_base_config_warning, store_base_path
from vlmrl.models.folder_check import safetensors_problem

STATE_FILE = "trainer_state.pt"
REFERENCE_FILE = "reference.safetensors"
"""The reference copy of the KL term, saved beside the model when the run keeps one (reference.py)."""
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


@dataclass
class Contents:
    """What one checkpoint holds, taken at a step's end: trainer_state.pt's `state`, the model's
    full state dict `weights` and the reference copy's `reference` (None: the live model's or
    copy's own, read while writing)."""

    step: int
    state: dict
    weights: dict | None = None
    reference: dict | None = None


def trainer_state(step: int, data_position: int, optimizer_state: dict, scheduler, extra: dict | None) -> dict:
    """trainer_state.pt's contents: `optimizer_state`, the scheduler's, the RNG states as they are
    now, the step, the data position and `extra`."""
    return {
        "step": step,
        "data_position": data_position,
        "optimizer": optimizer_state,
        "scheduler": scheduler.state_dict(),
        "rng": {"python": random.getstate(), "numpy": _numpy_rng_state(),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
        "extra": extra or {},
    }


def host_copy(value):
    """`value` with every tensor copied to the CPU and every container rebuilt (other values deep
    copied): a checkpoint's state that training may go on changing while it is written."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: host_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [host_copy(item) for item in value]
    if type(value) is tuple:
        return tuple(host_copy(item) for item in value)
    return copy.deepcopy(value)


def live_storages(optimizer: torch.optim.Optimizer) -> set[int]:
    """The storages (data pointers) of `optimizer`'s live state tensors (a DTensor's local shard)."""
    tensors = [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]
    return {getattr(value, "_local_tensor", value).untyped_storage().data_ptr() for value in tensors}


def unshared(value, storages: set[int]):
    """`value` with every tensor whose storage is in `storages` cloned (containers rebuilt, the
    others as they are): FSDP2's full optimizer state hands a 0-d CPU tensor (AdamW's `step`) back
    as the live one, which the next step increments in place while a background write reads it."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone() if value.untyped_storage().data_ptr() in storages else value
    if isinstance(value, dict):
        return {key: unshared(item, storages) for key, item in value.items()}
    if isinstance(value, list):
        return [unshared(item, storages) for item in value]
    if type(value) is tuple:
        return tuple(unshared(item, storages) for item in value)
    return value


def save_checkpoint(run_dir: Path, step: int, model, processor, optimizer, scheduler,
                    data_position: int, reference=None, keep: int = 2, extra: dict | None = None,
                    gathered: Gathered | None = None) -> Path:
    """Write checkpoints/step_{step}/ atomically (a temp folder renamed) and prune old ones.

    `extra` (numbers, strings, containers) is stored too and comes back from `read_checkpoint`.
    `gathered`: a sharded run's full states, written instead of the model's and optimizer's own.
    Whatever stops the writing (a full disk, torch's writer failing, a folder that cannot be
    written) removes the temporary folder and leaves the previous checkpoints as they were; a full
    disk is a DiskFull error, any other OSError a one-line VlmrlError."""
    state = trainer_state(step, data_position, gathered.optimizer if gathered else optimizer.state_dict(),
                          scheduler, extra)
    contents = Contents(step, state, gathered and gathered.weights, gathered and gathered.reference)
    return write_checkpoint(run_dir, contents, (model, processor, reference), keep)


def write_checkpoint(run_dir: Path, contents: Contents, owners: tuple, keep: int) -> Path:
    """`save_checkpoint`'s writing of `contents`, with `owners` (model, processor, reference or None)
    saving what they own: checkpoints/step_{step}/ made whole and durable, then old ones pruned."""
    model, processor, reference = owners
    step = contents.step
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    for stale in root.glob(".tmp_step_*") if root.is_dir() else []:  # left by a kill while saving
        with contextlib.suppress(OSError):
            _remove(stale)
    taken = slot_taken(final)
    if taken:
        raise VlmrlError(f"cannot save checkpoint step {step}: {taken}; move it away, then rerun with resume=true")
    try:
        with writing(f"checkpoint step {step}", tmp):
            save_model(tmp, model, processor, contents.weights)
            torch.save(contents.state, tmp / STATE_FILE)
            if reference is not None:
                reference.save(tmp, contents.reference)
            make_durable(tmp)
            _remove(final)
            tmp.rename(final)
            _sync_folder(root)
    except BaseException as error:
        with contextlib.suppress(OSError):
            _remove(tmp)
        if not isinstance(error, (DiskFull, OSError)):
            raise  # a bug, or Ctrl-C: as it was
        raise _not_saved(error, step, run_dir, tmp) from (error.__cause__ if isinstance(error, DiskFull) else error)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def make_durable(folder: Path) -> None:
    """fsync every file under `folder`, then `folder` itself: what is renamed into place after this
    is on the disk, not only in the page cache, when a power cut or a kill of the machine follows."""
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink():
            _sync(path)
    _sync_folder(folder)


def _sync_folder(path: Path) -> None:
    """fsync a folder where the filesystem allows it: some refuse to open or fsync one (EINVAL on
    FUSE and network filesystems, PermissionError on Windows), which says nothing against the files
    in it (each fsynced, strictly) nor against a rename already done."""
    with contextlib.suppress(OSError):
        _sync(path)


def _sync(path: Path) -> None:
    """fsync one file or folder."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _not_saved(error: DiskFull | OSError, step: int, run_dir: Path, tmp: Path) -> VlmrlError:
    """The one-line error of a full disk or an OSError that stopped checkpoint `step` (its temporary
    folder gone), saying that the previous checkpoint is intact."""
    previous = latest_checkpoint(run_dir)
    kept = f"{previous} is intact" if previous is not None else "there is no earlier checkpoint"
    if isinstance(error, DiskFull):
        return DiskFull(f"{error}. The partial checkpoint was removed and {kept}: free some space, then rerun "
                        "with resume=true")
    where = getattr(error, "filename", None) or tmp
    return VlmrlError(f"cannot save checkpoint step {step}: {error.strerror or type(error).__name__} ({where}). The "
                      f"partial checkpoint was removed and {kept}: fix that, then rerun with resume=true")


def slot_taken(folder: Path) -> str | None:
    """Why a checkpoint cannot be written at `folder` (a file, or a symbolic link, there), or None."""
    if folder.is_symlink():
        target = os.readlink(folder)
        return (f"{folder} is a symbolic link to {target}" if folder.exists()
                else f"{folder} is a symbolic link to {target}, which does not exist")
    if folder.exists() and not folder.is_dir():
        return f"{folder} is a file, not a checkpoint folder"
    return None


def check_checkpoint_room(run_dir: Path, after: int, last: int) -> None:
    """VlmrlError in one line, before step 1, when the run could not save its checkpoints: its
    checkpoints/ folder is a file, a link to nothing or not writable, or the place of a checkpoint
    it may save (a step in (after, last]) is taken by a file or a link."""
    root = Path(run_dir) / "checkpoints"
    if root.is_symlink() and not root.exists():
        raise VlmrlError(f"cannot write checkpoints to {root}: it is a symbolic link to {os.readlink(root)}, which "
                         "does not exist; remove it or choose another output_dir")
    if not root.exists():
        return
    output_folder(root, "checkpoints")  # a folder, writable: one line if not
    for entry in sorted(root.iterdir()):
        match = _STEP_DIR.match(entry.name)
        taken = slot_taken(entry) if match and after < int(match.group(1)) <= last else None
        if taken:
            raise VlmrlError(f"cannot write checkpoints to {root}: {taken}, where this run may save its step "
                             f"{int(match.group(1))} checkpoint; move it away or choose another output_dir")


def _remove(path: Path) -> None:
    """Remove a folder, a file or a link (not what it points to); nothing if absent."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


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


def read_checkpoint(folder: Path, needs_reference: bool = False) -> dict:
    """The trainer state of checkpoint `folder`, after checking that it is whole and its weights too.

    DamagedCheckpoint, naming the folder and the file, when trainer_state.pt is missing or cannot
    be read (truncated, or holding anything but tensors and plain data), when what it holds cannot
    be put back (`state_problem`: a step other than its folder's, optimizer moments of two shapes,
    no param groups, RNG or scheduler states that do not restore...), when there are no model or
    adapter weights, when a safetensors file is shorter than its header says, when a JSON file of it
    (config.json first) is missing or does not parse (`settings_problem`), or, with
    `needs_reference` (a run whose KL term keeps a reference copy), when reference.safetensors is
    missing.
    """
    folder = Path(folder)
    state = _load_state(folder)
    problem = state_problem(state, folder)
    if problem:
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {STATE_FILE} {problem}")
    weights = sorted(folder.glob("*.safetensors"))
    if not any(p.name.startswith(("model", "adapter_model")) for p in weights):
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: no model weights "
                                "(model*.safetensors or adapter_model.safetensors)")
    missing = reference_missing(folder) if needs_reference else None
    if missing:
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {missing}")
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
    problem = settings_problem(folder, adapter=not any(p.name.startswith("model") for p in weights))
    if problem:
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {problem}")
    return state


def settings_problem(folder: Path, adapter: bool) -> str | None:
    """What is wrong with the JSON files of checkpoint `folder` (the model's or adapter's config.json,
    the processor's and tokenizer's settings), in words naming the file, or None: the model's config
    missing, or a file that is not a JSON object (truncated, overwritten...)."""
    needed = folder / ("adapter_config.json" if adapter else "config.json")
    if not needed.is_file():
        return f"{needed.name} is missing"
    for file in sorted(folder.glob("*.json")):
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as error:
            return f"{file.name} is unreadable ({one_line(error)})"
        if not isinstance(data, dict):
            return f"{file.name} holds a JSON {type(data).__name__}, not an object"
    return None


def reference_missing(folder: Path) -> str | None:
    """For a run whose KL term keeps a reference copy: the words saying that checkpoint `folder`
    lacks it, or None."""
    if (folder / REFERENCE_FILE).is_file():
        return None
    return f"{REFERENCE_FILE} is missing (this run's KL term needs the reference copy saved with it)"


def _load_state(folder: Path) -> dict:
    """trainer_state.pt of `folder`, read without running code, with every key it must have."""
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
    return state


# --------------------------------------------------------------------------- what the state holds


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def state_problem(state: dict, folder: Path | None = None) -> str | None:
    """What in a trainer state cannot be put back, as words after "trainer_state.pt", or None. Needs
    no model: the optimizer state is checked against itself here, against the model by
    `optimizer_problem`. `folder`: the checkpoint's, whose name says the step it must hold."""
    for key in ("step", "data_position"):
        if not _is_count(state[key]):
            return f"holds {key}={state[key]!r}, not a count"
    match = _STEP_DIR.match(folder.name) if folder is not None else None
    if match and state["step"] != int(match.group(1)):
        return f"holds step {state['step']}, not its folder's {int(match.group(1))}"
    extra = state.get("extra", {})
    if not isinstance(extra, dict):
        return f"holds extra state that is not a mapping ({type(extra).__name__})"
    faults = extra.get("faults", {})
    if not isinstance(faults, dict) or not all(_is_count(v) for v in faults.values()):
        return f"holds fault counts that are not counts (extra.faults={faults!r})"
    return (_optimizer_state_problem(state["optimizer"]) or _scheduler_problem(state["scheduler"], state["optimizer"])
            or _rng_problem(state["rng"]))


def _optimizer_state_problem(optimizer) -> str | None:
    """The optimizer state dict against itself: param groups listing each parameter once, state only
    for listed parameters, a mapping of tensors and numbers each, moments of one shape."""
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("state"), dict) \
            or not isinstance(optimizer.get("param_groups"), list):
        return "holds no optimizer state and param groups"
    groups = optimizer["param_groups"]
    if not groups:
        return "holds an optimizer with no param groups"
    if not all(isinstance(g, dict) and isinstance(g.get("params"), list) and _is_number(g.get("lr")) for g in groups):
        return "holds an optimizer param group without its parameters or learning rate"
    listed = [key for group in groups for key in group["params"]]
    if not all(isinstance(key, (int, str)) for key in listed) or len(set(listed)) != len(listed):
        return "holds optimizer param groups whose parameters are not distinct names or positions"
    for key, entry in optimizer["state"].items():
        if key not in set(listed):
            return f"holds optimizer state for parameter {key!r}, which no param group lists"
        if not isinstance(entry, dict) or not all(isinstance(v, (torch.Tensor, int, float)) for v in entry.values()):
            return f"holds a malformed optimizer state for parameter {key!r}"
        shapes = {tuple(v.shape) for v in entry.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
        if len(shapes) > 1:
            return f"holds optimizer moments of different shapes for parameter {key!r}: {sorted(shapes)}"
    return None


def _scheduler_problem(scheduler, optimizer: dict) -> str | None:
    """The learning-rate schedule's state (LambdaLR's): a step count and one entry per param group."""
    if not isinstance(scheduler, dict) or not _is_count(scheduler.get("last_epoch")):
        return "holds no scheduler state with its step count"
    groups = len(optimizer["param_groups"])
    for key in ("base_lrs", "_last_lr"):
        values = scheduler.get(key, [1.0] * groups)
        if not isinstance(values, list) or len(values) != groups or not all(_is_number(v) for v in values):
            return f"holds scheduler {key}={values!r}, not {groups} learning rates (one per param group)"
    lambdas = scheduler.get("lr_lambdas")
    if not isinstance(lambdas, list) or len(lambdas) != groups or not all(f is None or isinstance(f, dict) for f in lambdas):
        return f"holds a scheduler whose lr_lambdas do not fit its {groups} param groups"
    return None


def _rng_problem(rng) -> str | None:
    """The RNG states, tried: each is set, then the current ones put back."""
    if not isinstance(rng, dict) or not all(key in rng for key in ("python", "numpy", "torch", "cuda")):
        return "holds no python, numpy, torch and cuda RNG states"
    if not isinstance(rng["cuda"], list) or not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8
                                                    for t in rng["cuda"]):
        return "holds CUDA RNG states that are not byte tensors"
    current = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        _set_rng(rng, cuda=False)
    except Exception as error:  # noqa: BLE001 - a wrong type, length or value: the state cannot go back
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"holds an RNG state that cannot be restored ({type(error).__name__}: {first})"
    finally:
        random.setstate(current[0])
        np.random.set_state(current[1])
        torch.set_rng_state(current[2])
    return None


def optimizer_problem(optimizer: dict, layout: list[list[tuple[str, tuple[int, ...]]]]) -> str | None:
    """What keeps a checkpoint's optimizer state from fitting the run's optimizer, or None.

    `layout`: (name, full shape) of each parameter of each of the optimizer's groups, in its order
    (training/optim.py `optimizer_layout`). The state is keyed by position (one process, DDP) or by
    name (FSDP2, ZeRO-3); either way the groups must match in number and size, named parameters must
    be the layout's, and every moment must have its parameter's shape (a moment of another shape
    makes fused AdamW write out of bounds: a crash, or worse, at the first step)."""
    saved = optimizer["param_groups"]
    if len(saved) != len(layout):
        return f"holds {len(saved)} optimizer param group(s) where this run's optimizer has {len(layout)}"
    for index, (group, wanted) in enumerate(zip(saved, layout)):
        if len(group["params"]) != len(wanted):
            return (f"holds {len(group['params'])} parameters in optimizer param group {index} where this run trains "
                    f"{len(wanted)}")
        for key, (name, shape) in zip(group["params"], wanted):
            if isinstance(key, str) and key != name:
                return f"holds optimizer state for {key} where this run's optimizer has {name}"
            for moment, value in optimizer["state"].get(key, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != tuple(shape):
                    return f"holds {moment} of shape {list(value.shape)} for {name}, whose shape is {list(shape)}"
    return None


def name_keyed(optimizer: dict, layout: list[list[tuple[str, tuple[int, ...]]]]) -> dict:
    """A fitting optimizer state (`optimizer_problem` said None) keyed by parameter name, as FSDP2
    and ZeRO-3 restore it: a position-keyed one (saved by one process or DDP) gets the layout's names."""
    names = {}
    for group, wanted in zip(optimizer["param_groups"], layout):
        names |= {key: name for key, (name, _) in zip(group["params"], wanted)}
    return {"state": {names[key]: value for key, value in optimizer["state"].items()},
            "param_groups": [{**group, "params": [names[key] for key in group["params"]]}
                             for group in optimizer["param_groups"]]}


def find_resumable(run_dir: Path, needs_reference: bool = False,
                   fits: Callable[[Path, dict], str | None] | None = None) -> tuple[Path, dict] | None:
    """(folder, trainer state) of the newest whole checkpoint in run_dir, or None when there is none.

    A damaged newer one (`read_checkpoint`, with `needs_reference`) is passed over with a warning
    naming it, as is one that `fits(folder, state)` finds fault with (what it returns names the
    file and its fault: "trainer_state.pt holds ...", say, of its optimizer state against the run's
    model); when every checkpoint is damaged, a VlmrlError lists them.
    """
    damaged = []
    for folder in reversed(list_checkpoints(run_dir)):
        try:
            state = read_checkpoint(folder, needs_reference)
            problem = fits(folder, state) if fits is not None else None
            if problem:
                raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {problem}")
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
    _set_rng(state["rng"], cuda=True)
    return {"step": state["step"], "data_position": state["data_position"], "extra": state.get("extra", {})}


def _set_rng(rng: dict, cuda: bool) -> None:
    """Set python's, numpy's and torch's RNG states (and CUDA's, with `cuda`, on the devices there are)."""
    random.setstate(_as_tuples(rng["python"]))
    numpy_state = dict(rng["numpy"])
    numpy_state["state"] = {**numpy_state["state"], "key": np.asarray(numpy_state["state"]["key"], dtype=np.uint32)}
    np.random.set_state(numpy_state)
    torch.set_rng_state(rng["torch"])
    if cuda and rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"][:torch.cuda.device_count()])


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
