"""Checkpoints: the model in Hugging Face format, plus everything needed to continue exactly.

`checkpoints/step_000050/` holds the full model (save_pretrained) or the LoRA adapter, the
processor, and `trainer_state.pt`: optimizer, scheduler, RNG states, step and data position. The
reference copy, when there is one, is saved beside them. `final/` is the trained model alone.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from vlmrl.errors import VlmrlError

STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def save_model(folder: Path, model: torch.nn.Module, processor) -> None:
    """The model (or adapter) and processor, loadable with transformers (and peft)."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)


def save_checkpoint(run_dir: Path, step: int, model, processor, optimizer, scheduler,
                    data_position: int, reference=None, keep: int = 2) -> Path:
    """Write checkpoints/step_{step}/ atomically (a temp folder renamed) and prune old ones."""
    root = run_dir / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(tmp, model, processor)
    torch.save({
        "step": step,
        "data_position": data_position,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
    }, tmp / STATE_FILE)
    if reference is not None:
        reference.save(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete step checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / STATE_FILE).exists()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_adapter_weights(model: torch.nn.Module, folder: Path) -> None:
    """Put a saved LoRA adapter's weights into a peft model."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = folder / "adapter_model.safetensors"
    if not path.exists():
        raise VlmrlError(f"checkpoint {folder} has no adapter_model.safetensors")
    result = set_peft_model_state_dict(model, load_file(path))
    if getattr(result, "unexpected_keys", None):
        raise VlmrlError(f"adapter in {folder} does not fit the model: {result.unexpected_keys[:3]}")


def load_trainer_state(folder: Path, optimizer, scheduler) -> dict:
    """Restore optimizer, scheduler and RNG from a checkpoint; returns step and data position."""
    state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return {"step": state["step"], "data_position": state["data_position"]}
