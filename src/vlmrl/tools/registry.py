"""The registry: the configured tool names (`rollout.tools`) turned into the tools `run_tool` reads.

Built-in names (builtin.py) are known by name alone. Model tools (model_table.py: `detect`) are known
by name and need their model's folder in `rollout.tool_models`, checked here. Your own tools: any
Python callable named by import path (`module:function`, known to the model as `function`), called as
`function(context, **arguments)`; its module is imported first in the tool worker (worker.py), so a
module that hangs, exits or kills its process at import stops there in one line. This runs when the
config is read, before step 1: an unknown name, a failed import or two tools of one name is a
VlmrlError.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import threading
from typing import Any, Callable

from vlmrl.errors import VlmrlError, warn
from vlmrl.imports import is_file_spec, load_module
from vlmrl.tools.builtin import BUILTIN_TOOLS
from vlmrl.tools.model_table import MODEL_TOOLS
from vlmrl.tools.model_tools import ModelTool, tool_model_folder
from vlmrl.tools.worker import WORKER, WorkerFailed, WorkerTimeout


IMPORT_S = 60.0
"""Seconds a tool's module may take to import, tried first in the tool worker: a module that hangs,
exits or kills its process at import stops there, in one line, and never takes the trainer along."""


SLOW_IMPORT_S = 5.0
"""Seconds after which a tool's module still importing is said in one line (which module, and the
limit, IMPORT_S), rather than a silent wait."""


def import_only(module_name: str) -> None:
    """Import `module_name` (a tool worker's job: nothing comes back but success)."""
    importlib.import_module(module_name)


def _import_tool(path: str) -> Callable[..., Any]:
    """The callable at `package.module:function` (only that module is imported), once its import has
    succeeded in the tool worker within IMPORT_S. A tool runs in the worker, which finds it by its
    module's name, so a tool cannot be a `file.py:function` (put its folder on PYTHONPATH instead)."""
    module_name, _, attribute = path.partition(":")
    if is_file_spec(path):
        raise VlmrlError(f"tool {path!r} must be written package.module:function (a tool runs in a worker process "
                         "that imports it by module name): put the file's folder on PYTHONPATH")
    if not module_name or not attribute.isidentifier():
        raise VlmrlError(f"tool {path!r} must be written package.module:function")
    slow = threading.Timer(SLOW_IMPORT_S, warn, [f"the module {module_name} of tool {path!r} is slow to import "
                                                 f"({SLOW_IMPORT_S:g} s so far, in the tool worker); it is stopped "
                                                 f"at {IMPORT_S:g} s"])
    slow.daemon = True
    try:
        WORKER.run(import_only, (__name__,), IMPORT_S)  # the worker up (it imports this module first): not timed
        slow.start()
        WORKER.run(import_only, (module_name,), IMPORT_S)
    except WorkerTimeout:
        raise VlmrlError(f"the module of tool {path!r} did not finish importing within {IMPORT_S:g} s") from None
    except WorkerFailed as error:
        raise VlmrlError(f"cannot import the module of tool {path!r}: {error}") from None
    finally:
        slow.cancel()
    function = getattr(load_module(module_name, "tool", path), attribute, None)
    if not callable(function):
        raise VlmrlError(f"tool {path!r} must name a function in {module_name}; got {function!r}")
    return function


def _unknown_tool(name: str) -> VlmrlError:
    """The error for a name that is neither built in nor an import path, with "did you mean"."""
    close = difflib.get_close_matches(name, list(BUILTIN_TOOLS) + list(MODEL_TOOLS), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return VlmrlError(f"unknown tool {name!r}; {hint}built-in: {', '.join(sorted(BUILTIN_TOOLS))}; "
                      f"model tools (rollout.tool_models): {', '.join(MODEL_TOOLS)}; or your own as package.module:function")


def _check_takes_context(name: str, function: Callable[..., Any]) -> None:
    """VlmrlError unless `function` can be called with the context as its one positional argument,
    and its first parameter is the context: annotated ToolContext, or named so (`context`, `ctx`,
    `tool_context`, `_`...). A first parameter named for an argument (`def zoom(box)`) would take
    the context in its place and every call would fail as bad arguments, silently."""
    try:
        signature = inspect.signature(function)
        signature.bind_partial(None)
    except ValueError:  # no signature to read (some builtins): trust it
        return
    except TypeError as error:
        raise VlmrlError(f"tool {name!r} must take the context as its first parameter: {error}") from error
    first = next(iter(signature.parameters.values()))
    if first.kind is inspect.Parameter.VAR_POSITIONAL:
        return
    annotation = first.annotation if isinstance(first.annotation, str) else getattr(first.annotation, "__name__", "")
    if annotation.endswith("ToolContext") or first.name.strip("_") in ("", "c") or any(
            word in first.name.lower() for word in ("context", "ctx")):
        return
    raise VlmrlError(f"tool {name!r} must take the context as its first parameter (def f(context, ...)); its first "
                     f"parameter is {first.name!r}, which would receive the context instead of the model's argument")


def _model_tools(names: list[str], models: dict[str, str] | None) -> dict[str, ModelTool]:
    """The model tools among `names` and in `models` (rollout.tool_models), each bound to its checked folder
    (a folder configured is checked even when no tool names it); VlmrlError for a model named for a tool
    that is not a model tool, a model tool without a folder, or a missing or damaged folder."""
    models = models or {}
    if not isinstance(models, dict):
        raise VlmrlError(f"rollout.tool_models maps a model tool to its folder ({{detect: PATH}}); got {models!r}")
    unknown = sorted(str(name) for name in models if name not in MODEL_TOOLS)
    if unknown:
        raise VlmrlError(f"rollout.tool_models names {', '.join(unknown)}; the model tools are {', '.join(MODEL_TOOLS)}")
    wanted = dict.fromkeys([*models, *(name for name in names if isinstance(name, str) and name in MODEL_TOOLS)])
    return {name: MODEL_TOOLS[name](tool_model_folder(name, models.get(name))) for name in wanted}


def resolve_tools(names: list[str], models: dict[str, str] | None = None) -> dict[str, Callable[..., Any]]:
    """The registry `run_tool` reads, keyed by the names the model writes: built-in names as they are,
    model tools (`detect`) bound to their folder in `models` (rollout.tool_models), `module:function` as
    `function`. VlmrlError for an unknown name, a missing or damaged model folder, a failed import or two
    tools with the same name (this runs when the config is read, before step 1)."""
    tools: dict[str, Callable[..., Any]] = {}
    given: dict[str, str] = {}
    bound = _model_tools(names, models)
    for entry in names:
        if not isinstance(entry, str):
            raise VlmrlError(f"a tool is named by a string (zoom, package.module:function); got {entry!r}")
        if entry in BUILTIN_TOOLS:
            key, function = entry, BUILTIN_TOOLS[entry]
        elif entry in bound:
            key, function = entry, bound[entry]
        elif ":" in entry:
            key, function = entry.partition(":")[2], _import_tool(entry)
            _check_takes_context(entry, function)
        else:
            raise _unknown_tool(entry)
        if key in tools:
            raise VlmrlError(f"two tools are named {key!r} ({given[key]!r} and {entry!r}); each needs its own name")
        tools[key], given[key] = function, entry
    return tools
