"""The models behind the model tools (vlmrl/tools/model_tools.py): the dispatch to one module per model kind
(`RUNNERS`: detect_model.py, ...), imported at the first call, and what is the same for every kind:
loading from a checked folder on the run's device, the tiny random builds of the tests, the weights'
bytes for the preflight and the early checks of the folders.

Each runner module defines `RUNNER` (a class: `RUNNER(folder, device)` loads the checkpoint with a PIL image
processor, no torchvision; `run(crops, args)` computes a batch of calls, one forward where the architecture
allows, each output in its crop's own pixels), `ARCHES` (the architectures `build_tiny` builds, the first
the default) and `build_tiny(out, arch, seed)` (a tiny random model saved into `out`, loadable like a hub
checkpoint; returns what vlmrl_tiny.json records of it). A runner that runs out of device memory frees the
cache and raises (`freed_on_oom`), which the tool call turns into an error turn.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from vlmrl.disk import output_folder, write_text, writing
from vlmrl.errors import VlmrlError
from vlmrl.models.folder_check import check_weight_files, tensor_shapes
from vlmrl.tools.model_table import MODEL_TOOLS
from vlmrl.tools.model_tools import ModelTool, tool_model_folder

RUNNERS = {"detect": "vlmrl.models.detect_model", "segment": "vlmrl.models.segment_model",
           "depth": "vlmrl.models.depth_model", "keypoints": "vlmrl.models.keypoint_model"}
"""Each model tool's model code, by module name (imported at the first call; the tools are MODEL_TOOLS')."""


def run_device() -> torch.device:
    """The run's device: the current CUDA device (each process's own under accelerate) where there is one."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@contextmanager
def freed_on_oom(what: str, device: torch.device) -> Iterator[None]:
    """Running out of device memory inside frees the cache and raises a RuntimeError saying `what` ran out."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as error:
        torch.cuda.empty_cache()
        raise RuntimeError(f"{what} ran out of memory on {device}: {error}") from None


def runner_module(tool: str) -> ModuleType:
    """The model code of model tool `tool` (RUNNERS); VlmrlError for a name that is not a model tool."""
    if tool not in MODEL_TOOLS:
        raise VlmrlError(f"unknown model tool {tool!r}; model tools: {', '.join(MODEL_TOOLS)}")
    return importlib.import_module(RUNNERS[tool])


def tool_model_bytes(tools: list, models: dict) -> int:
    """Bytes of the float32 weights of the model tools `tools` names (rollout.tools) with a folder in `models`
    (rollout.tool_models), read from their safetensors headers; 0 for one whose folder cannot be read (the
    early checks refuse it)."""
    total = 0
    for name in [name for name in dict.fromkeys(tools) if name in MODEL_TOOLS and name in (models or {})]:
        try:
            folder = tool_model_folder(name, models[name])
        except VlmrlError:
            continue
        for file in sorted(folder.glob("*.safetensors")):
            total += sum(4 * math.prod(shape) for shape in tensor_shapes(file).values())
    return total


def check_tool_model_weights(name: str, folder: Path) -> None:
    """VlmrlError in one line unless tool `name`'s weights in `folder` are whole safetensors files (folder_check's
    `check_weight_files`, as for the policy: a truncated or pickled file is refused, never loaded)."""
    try:
        check_weight_files(str(folder))
    except VlmrlError as error:
        raise VlmrlError(f"the {name} model (rollout.tool_models.{name}): {error}") from None


def check_tool_models(tools: dict) -> None:
    """`check_tool_model_weights` for each model tool of a resolved registry (the early checks, before step 1)."""
    for tool in tools.values():
        if isinstance(tool, ModelTool):
            check_tool_model_weights(tool.name, tool.folder)


def load_tool_model(name: str, folder: Path, device: str | None = None) -> Any:
    """Tool `name`'s model runner from its folder, checked again (`tool_model_folder`, its weights whole), on
    `device` (the policy's; None: `run_device`)."""
    module = runner_module(name)
    folder = tool_model_folder(name, str(folder))
    check_tool_model_weights(name, folder)
    return module.RUNNER(folder, torch.device(device) if device else run_device())


def build_tiny_tool_model(out_dir: str | Path, tool: str, seed: int = 0, arch: str | None = None) -> Path:
    """A tiny random-weight model of model tool `tool` (`arch`: one of its runner's ARCHES; None: the first),
    saved so that it loads like a hub checkpoint, with vlmrl_tiny.json (tool, arch, seed, parameters).
    Returns the folder."""
    module = runner_module(tool)
    arch = module.ARCHES[0] if arch is None else arch
    if arch not in module.ARCHES:
        raise VlmrlError(f"unknown {tool} model architecture {arch!r}; choose one of {', '.join(module.ARCHES)}")
    out = output_folder(out_dir, "the tool model")
    torch.manual_seed(seed)
    with writing("the tool model", out):
        info = module.build_tiny(out, arch, seed)
    write_text(out / "vlmrl_tiny.json", "the tool model",
               json.dumps({"tool": tool, "arch": arch, "seed": seed, **info}, indent=2))
    return out
