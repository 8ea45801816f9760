"""Running one call: `run_tool` against the registry, within the limits; it never raises.

Where a tool runs: the built-in tools (builtin.py) and the model tools (model_tools.py: their model loads
once per process, on the run's device) run in this process on the example's images as they are (they
only read them). Your own tools run in a worker process (worker.py) that a timeout kills and
replaces, so a tool that computes past `ToolLimits.timeout_s` cannot stall training, and a tool gets
copies of the images, so drawing on them cannot change the prompt the model trains on. A ValueError
or TypeError from inside a tool counts as "bad_arguments": a tool says its arguments are wrong by
raising one (as `zoom` does).
"""

from __future__ import annotations

import inspect
import pickle
from typing import Any, Callable

from vlmrl.tools.builtin import BUILTIN_TOOLS
from vlmrl.tools.calls import ToolCall
from vlmrl.tools.contract import ToolContext, ToolLimits, ToolResult, error_result
from vlmrl.tools.model_tools import ModelTool
from vlmrl.tools.results import _returned
from vlmrl.tools.worker import WORKER, WorkerFailed, WorkerTimeout


def call_tool(name: str, function: Callable[..., Any], context: ToolContext, arguments: dict[str, Any],
              limits: ToolLimits) -> ToolResult:
    """`function(context, **arguments)` as a normalised ToolResult (`_returned`); never raises: "bad_arguments"
    for a ValueError or TypeError from the tool, "raised" for any other exception or a value that cannot
    be read. Module-level: the tool worker receives it by name."""
    try:
        value = function(context, **arguments)
    except (ValueError, TypeError) as error:
        return error_result("bad_arguments", f"bad arguments for {name}: {error}")
    except Exception as error:
        return error_result("raised", f"tool {name} raised {type(error).__name__}: {error}")
    try:
        return _returned(name, value, limits)
    except Exception as error:  # e.g. an image object whose size cannot be read
        return error_result("raised", f"tool {name} returned a value that cannot be read: "
                                 f"{type(error).__name__}: {error}")


def run_tool(call: ToolCall, tools: dict[str, Callable[..., Any]], context: ToolContext,
             limits: ToolLimits) -> ToolResult:
    """Run `call` against the registry `tools` within `limits`; never raises. A built-in tool runs here;
    any other in the tool worker (worker.py), on copies of the context, killed at its timeout.
    Failures come back as a ToolResult with `error` set: "unknown_tool", "bad_arguments" (arguments that
    do not fit the signature, or a ValueError/TypeError from the tool), "raised" (any other exception, a
    return value that is not text, images or videos or cannot be decoded, a tool that cannot be sent to the
    worker or that killed it), "timeout", "too_large"."""
    function = tools.get(call.name)
    if function is None:
        return error_result("unknown_tool", f"unknown tool {call.name!r}; available: {', '.join(sorted(tools)) or 'none'}")
    if not isinstance(call.arguments, dict) or not all(isinstance(key, str) for key in call.arguments):
        return error_result("bad_arguments", f"arguments of {call.name} must be an object; got {call.arguments!r}")
    try:
        inspect.signature(function).bind(context, **call.arguments)
    except TypeError as error:
        return error_result("bad_arguments", f"bad arguments for {call.name}: {error}")
    except ValueError:  # no signature to read: the call itself will tell
        pass
    if function in BUILTIN_TOOLS.values() or isinstance(function, ModelTool):  # trusted: here, on the originals
        return call_tool(call.name, function, context, call.arguments, limits)
    try:
        return WORKER.run(call_tool, (call.name, function, context, call.arguments, limits), limits.timeout_s)
    except WorkerTimeout:
        return error_result("timeout", f"tool {call.name} ran past its {limits.timeout_s:g} s limit and was stopped")
    except (WorkerFailed, OSError) as error:
        return error_result("raised", f"tool {call.name} could not run: {error}")
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        return error_result("raised", f"tool {call.name} cannot be sent to the tool worker (a tool is a module-level "
                                 f"function): {type(error).__name__}: {error}")
