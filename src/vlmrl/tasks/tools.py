"""Visual tools the model calls during a rollout ("thinking with images"), and the trajectory record.

The call format is Qwen's native one, which its tokenizer keeps whole (`<tool_call>` and
`</tool_call>` are single tokens in Qwen2/2.5(-VL)):

    <tool_call>
    {"name": "zoom", "arguments": {"box": [x1, y1, x2, y2]}}
    </tool_call>

Generation stops after `</tool_call>` (`ends_with_call` tells the rollout a turn ended in a call);
the rollout parses the call (`parse_tool_call`), runs the tool (`run_tool`) and appends its result
(`tool_result_text` and the images) as the next turn, then generation goes on, up to
`rollout.max_turns` turns and a token budget per trajectory. Since generation stops at the first
`</tool_call>`, a turn holds at most one call; given more, `parse_tool_call` reads the last complete
one, and text after the last `</tool_call>` is ignored.

Built in: `zoom` (alias `crop`): the region `box` of an example image, in the pixels of the
ORIGINAL image (`Example.originals`, the full-resolution images tools read), resized so that its
longest side is `ToolContext.max_side` (small regions are enlarged: that is the point of zooming).
`frames`: up to FRAMES_PER_CALL frames of a time window of an example's video at its full frame rate
and resolution (`Example.video_originals`: the example may show fewer, smaller frames), as a short
video (a `vlmrl.tasks.Video`), for a model that wants to look again at a moment. Your own tools: any
Python callable named by import path (`module:function`, known to the model as `function`), called
as `function(context, **arguments)` and returning text, a PIL image, a `vlmrl.tasks.Video`, or a
list of those. The rollout shows a returned video as a video where the model's family takes video,
else as its frames, each an image (frames as images). `resolve_tools` turns the configured names into the registry `run_tool` reads.

Where a tool runs: the built-in tools are trusted, total and quick (their cost is bounded by the
image and `max_side`), so they run in this process on the example's images as they are (they only
read them). Your own tools run in a worker process (tool_worker.py) that a timeout kills and
replaces, so a tool that computes past `ToolLimits.timeout_s` cannot stall training, and a tool
gets copies of the images, so drawing on them cannot change the prompt the model trains on.

Nothing a tool does can crash the run: a malformed call, an unknown tool, bad arguments, a tool
that raises, one that runs past its timeout or kills its worker, or a returned image larger than the
limit (all limits in `ToolLimits`) becomes a `ToolResult` with `error` set and a one-line message
starting "error: " as its text, which the model reads as the tool's answer; the rollout counts them.
A ValueError or TypeError from inside a tool counts as "bad_arguments": a tool says its arguments
are wrong by raising one (as `zoom` does). Every result is normalised (`_returned`): images decoded
now, converted to RGB and padded (never resampled) to a sane shape (`MIN_SIDE`, `MAX_ASPECT`: the
processors refuse extreme aspects); text made valid UTF-8 (a lone surrogate becomes "?"), cut to
the limit, and, in `tool_result_text`, with the call format's tags and the model family's own image
and control tokens (read from its processor by the rollout) defused, so a tool's text can neither
end its turn nor add an image placeholder.
No torch here: tasks import this module for the trajectory record.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import math
import pickle
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from PIL import Image

from vlmrl.errors import VlmrlError, warn
from vlmrl.data.images import to_rgb
from vlmrl.imports import is_file_spec, load_module
from vlmrl.tasks.video import Video
from vlmrl.tasks.cv_tools import find_objects, measure
from vlmrl.tasks.tool_worker import WORKER, WorkerFailed, WorkerTimeout

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "too_large")
"""Every value `ToolResult.error` takes on failure."""
MESSAGE_CHARS = 300
"""Longest error message (the exception text inside it is cut to fit)."""
TRUNCATED = "\n[truncated: {n} more characters]"
"""Appended to a tool's text cut to `ToolLimits.max_text_chars` ({n}: the characters dropped)."""
MIN_SIDE = 28
"""Shortest side of a returned image; a smaller image is padded (black, centred) to it."""
MAX_ASPECT = 20
"""Largest long side / short side of a returned image; a thinner one is padded (black, centred) to
it (Qwen2-VL's processor refuses 200 and more, and a 2 x 1000 strip is no picture for any model)."""
MAX_VIDEO_FRAMES = 64
"""Most frames of a video a tool returns; a longer one makes the call "too_large"."""


@dataclass
class ToolCall:
    """One parsed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]
    text: str = ""
    """The call as the model wrote it, between the tags (for logs and rewards)."""


@dataclass
class ToolResult:
    """What a tool gave back: text, images and/or videos; `error` set (and explained in `text`) on failure."""

    text: str = ""
    images: list[Image.Image] = field(default_factory=list)
    videos: list[Video] = field(default_factory=list)
    error: str | None = None
    """None on success, else a short kind: "malformed", "unknown_tool", "bad_arguments", "raised",
    "timeout", "too_large"."""


@dataclass
class ToolContext:
    """What a tool can read: the example's images at full resolution, and the limits it must keep."""

    images: list[Image.Image]
    """Full-resolution images of the example (`Example.originals`), in order: copies, for your own
    tools (they run in the tool worker); the built-in tools read the originals and never change them."""
    max_side: int = 448
    """Longest side, in pixels, of an image a built-in tool returns (crops are resized to fit)."""
    videos: list = field(default_factory=list)
    """The example's videos at their full frame rate and resolution (`Example.video_originals`, each a
    `vlmrl.tasks.Video`), in order: what `frames` reads."""


MAX_TOOL_TIMEOUT_S = 3600
"""Longest a call of your own tool may run, an hour: past about 10**8 s the worker's wait overflows.
The same bound as config.MAX_TOOL_TIMEOUT_S, which checks rollout.tool_timeout_s where the config is
read (tasks import no config; tests/test_tools.py holds the two equal)."""


@dataclass
class ToolLimits:
    """What `run_tool` allows a tool: its time, the size of the images and text it returns."""

    timeout_s: float = 5.0
    """Seconds a call of your own tool may run; past that it counts as "timeout" and its worker is killed
    and replaced. The built-in tools run in the process, untimed (they are quick and always return)."""
    max_image_pixels: int = 1024 * 1024
    """Largest width * height of a returned image; a larger one makes the call "too_large"."""
    max_text_chars: int = 2000
    """Longest text returned; longer text is cut to this and marked (`TRUNCATED`)."""

    def validate(self) -> None:
        """Raise VlmrlError unless every limit is positive."""
        if not (self.timeout_s > 0 and self.max_image_pixels >= 1 and self.max_text_chars >= 1):
            raise VlmrlError(f"tool limits must be > 0: timeout_s={self.timeout_s}, "
                             f"max_image_pixels={self.max_image_pixels}, max_text_chars={self.max_text_chars}")
        if not self.timeout_s <= MAX_TOOL_TIMEOUT_S:
            raise VlmrlError(f"tool timeout_s must be at most {MAX_TOOL_TIMEOUT_S:,} s; got {self.timeout_s}")


@dataclass
class Turn:
    """One turn of a trajectory after the prompt: the model's text, or a tool's result."""

    role: str  # "assistant" or "tool"
    text: str
    images: list[Image.Image] = field(default_factory=list)
    """Tool turns: the images shown, a returned video's frames included (for the logs and the report)."""
    call: ToolCall | None = None  # assistant turns that end in a call: the parsed call
    error: str | None = None  # tool turns: ToolResult.error


@dataclass
class Trajectory:
    """Everything after the prompt: the model's turns and the tools' results, in order."""

    turns: list[Turn] = field(default_factory=list)
    cut: bool = False
    """True when the turn limit or the token budget ended it before a final answer."""

    @property
    def final_text(self) -> str:
        """The model's last turn (where the final answer is)."""
        return next((t.text for t in reversed(self.turns) if t.role == "assistant"), "")

    @property
    def calls(self) -> list[ToolCall]:
        """Every parsed call, in order."""
        return [t.call for t in self.turns if t.call is not None]

    @property
    def errors(self) -> list[str]:
        """The error kind of every failed call, in order."""
        return [t.error for t in self.turns if t.role == "tool" and t.error is not None]


# --------------------------------------------------------------------------- the call format


def ends_with_call(text: str) -> bool:
    """True when the turn's last non-space content is `</tool_call>`: the rollout runs a tool, else it stops."""
    return text.rstrip().endswith(TOOL_CALL_CLOSE)


def _malformed(message: str) -> ToolResult:
    """A "malformed" result whose text is `error: <message>`, one line."""
    return ToolResult(text=_one_line(f"error: {message}"), error="malformed")


def parse_tool_call(text: str) -> ToolCall | ToolResult:
    """The last complete call in `text` (`<tool_call>` JSON `</tool_call>`; text after it is ignored), or a
    "malformed" ToolResult saying what is wrong. The JSON is `{"name": str, "arguments": {...}}`."""
    end = text.rfind(TOOL_CALL_CLOSE)
    if end < 0:
        return _malformed(f"no call: a call is {TOOL_CALL_OPEN}"
                          f'{{"name": ..., "arguments": {{...}}}}{TOOL_CALL_CLOSE}')
    start = text.rfind(TOOL_CALL_OPEN, 0, end)
    if start < 0:
        return _malformed(f"{TOOL_CALL_CLOSE} without {TOOL_CALL_OPEN} before it")
    inner = text[start + len(TOOL_CALL_OPEN):end].strip()
    try:
        data = json.loads(inner)
    except json.JSONDecodeError as error:
        return _malformed(f"the call is not valid JSON: {error}")
    if not (isinstance(data, dict) and isinstance(data.get("name"), str) and data["name"]
            and isinstance(data.get("arguments"), dict)):
        return _malformed('a call needs "name" (a string) and "arguments" (an object), '
                          'as in {"name": "zoom", "arguments": {"box": [0, 0, 100, 100]}}')
    return ToolCall(name=data["name"], arguments=data["arguments"], text=inner)


def valid_text(text: str) -> str:
    """`text` as valid UTF-8: a lone surrogate (which no tokenizer or file can take) becomes "?"."""
    return text.encode("utf-8", "replace").decode("utf-8")


def neutralise(text: str, markers: Iterable[str]) -> str:
    """`text` with every occurrence of a marker (a model family's image or control token, as its processor
    names them) broken by a space after its first character: no tokenizer reads it as the token and no
    processor counts it as an image placeholder. Markers shorter than 2 characters or blank are left."""
    words = sorted({m for m in markers if isinstance(m, str) and len(m) > 1 and m.strip()}, key=len, reverse=True)
    if not words:
        return text
    pattern = re.compile("|".join(re.escape(word) for word in words))
    for _ in range(4):  # a break could in theory form another marker: break that too
        if not pattern.search(text):
            return text
        text = pattern.sub(lambda match: match[0][0] + " " + match[0][1:], text)
    return pattern.sub("", text)


def tool_result_text(result: ToolResult, markers: Iterable[str] = ()) -> str:
    """The text shown to the model inside `<tool_response>` ... `</tool_response>`: the result's text (an
    error's message; empty for images alone, whose placeholders the rollout adds) as valid UTF-8, with
    the markers that could close the response or open a turn (`<tool_response>`, `<tool_call>`, `<|...|>`)
    and the family's own `markers` (its image and control tokens) defused."""
    text = re.sub(r"<(/?tool_(?:call|response))>", r"[\1]", valid_text(result.text))
    return neutralise(text.replace("<|", "< |").replace("|>", "| >"), markers)


# --------------------------------------------------------------------------- built-in tools


def _number(value: Any) -> float:
    """`value` as a finite float; ValueError for anything else (bools, strings, NaN, infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"box must be 4 numbers [x1, y1, x2, y2]; got {value!r} in it")
    return float(value)


def _pixel_box(box: Any, width: int, height: int) -> tuple[int, int, int, int]:
    """`box` = [x1, y1, x2, y2] clamped to a width x height image and rounded to whole pixels."""
    if not isinstance(box, (list, tuple)) or len(box) != 4:
        raise ValueError(f"box must be 4 numbers [x1, y1, x2, y2]; got {box!r}")
    x1, y1, x2, y2 = (_number(v) for v in box)
    x1, x2 = (round(min(max(x, 0.0), width)) for x in (x1, x2))
    y1, y2 = (round(min(max(y, 0.0), height)) for y in (y1, y2))
    if x2 <= x1 or y2 <= y1:
        raise ValueError(f"box {list(box)} is empty inside the {width}x{height} image "
                         f"(clamped: [{x1}, {y1}, {x2}, {y2}]); it needs x2 > x1 and y2 > y1")
    return x1, y1, x2, y2


def fit_side(width: int, height: int, max_side: int) -> tuple[int, int]:
    """(width, height) scaled, aspect kept, so that the longest side is `max_side` (others at least 1)."""
    scale = max_side / max(width, height)
    return max(1, round(width * scale)), max(1, round(height * scale))


def zoom(context: ToolContext, box: list[float], image: int = 0) -> Image.Image:
    """Region `box` = [x1, y1, x2, y2] of image number `image`, in the pixels of the full-resolution
    original, clamped to the image, as an RGB image resized (LANCZOS, aspect kept) so that its longest
    side is `context.max_side`: small regions are enlarged. ValueError for a bad box or image number."""
    count = len(context.images)
    if isinstance(image, bool) or not isinstance(image, int) or not 0 <= image < count:
        raise ValueError(f"image must be a whole number from 0 to {count - 1} (the example has {count} "
                         f"image{'s' if count != 1 else ''}); got {image!r}")
    original = context.images[image]
    x1, y1, x2, y2 = _pixel_box(box, *original.size)
    region = original.crop((x1, y1, x2, y2)).convert("RGB")
    return region.resize(fit_side(x2 - x1, y2 - y1, context.max_side), Image.Resampling.LANCZOS)


WINDOW_GRID = 3
"""`zoom_window` offers WINDOW_GRID x WINDOW_GRID windows."""


def window_box(width: int, height: int, window: int) -> list[float]:
    """Box [x1, y1, x2, y2] of window `window` (0..8, row-major): half the image's width and height,
    starting at 0, 1/4 and 1/2 of each side, so any region up to a quarter of the image's width and
    height lies wholly inside at least one window."""
    row, col = divmod(window, WINDOW_GRID)
    x1, y1 = col * width / 4, row * height / 4
    return [x1, y1, x1 + width / 2, y1 + height / 2]


def zoom_window(context: ToolContext, window: int, image: int = 0) -> Image.Image:
    """`zoom` on window number `window` (0..8, `window_box`) of image number `image`: a coarse zoom
    whose argument is a choice among 9, not four coordinates (easier for a small model).
    ValueError for a window outside 0..8 or a bad image number."""
    if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window < WINDOW_GRID ** 2:
        raise ValueError(f"window must be a whole number from 0 to {WINDOW_GRID ** 2 - 1}; got {window!r}")
    if isinstance(image, bool) or not isinstance(image, int) or not 0 <= image < len(context.images):
        return zoom(context, [0, 0, 1, 1], image)  # zoom's own message about the image number
    return zoom(context, window_box(*context.images[image].size, window), image)


FRAMES_PER_CALL = 4
"""Most frames one call of `frames` returns."""


def _seconds(name: str, value: Any) -> float:
    """`value` as a finite number of seconds; ValueError naming `name` for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number of seconds; got {value!r}")
    return float(value)


def frames(context: ToolContext, start: float, end: float, video: int = 0) -> list:
    """Look again at a time window: up to FRAMES_PER_CALL frames of video number `video` at its full
    frame rate and resolution (the original the example's video was sampled from), those whose times
    lie in [start, end] seconds, spread evenly from the first to the last of them, each resized
    (LANCZOS, aspect kept) so that its longest side is `context.max_side`, as a Video with their
    times; first a line naming the times. ValueError for a bad video number, a window that is not two numbers with start <= end,
    or one that holds no frame."""
    count = len(context.videos)
    if isinstance(video, bool) or not isinstance(video, int) or not 0 <= video < max(count, 1) or not count:
        raise ValueError(f"video must be a whole number from 0 to {count - 1} (the example has {count} "
                         f"video{'s' if count != 1 else ''}); got {video!r}" if count else
                         "the example has no video to look at")
    first, last = _seconds("start", start), _seconds("end", end)
    if first > last:
        raise ValueError(f"start must be <= end; got start={first:g}, end={last:g}")
    original = context.videos[video]
    inside = [k for k, t in enumerate(original.timestamps) if first - 1e-9 <= t <= last + 1e-9]
    if not inside:
        times = original.timestamps
        raise ValueError(f"no frame between {first:g} and {last:g} s; the video's frames run from {times[0]:g} "
                         f"to {times[-1]:g} s")
    if len(inside) > FRAMES_PER_CALL:
        inside = [inside[round(k * (len(inside) - 1) / (FRAMES_PER_CALL - 1))] for k in range(FRAMES_PER_CALL)]
    shown = [original.frames[k].convert("RGB") for k in inside]
    images = [frame.resize(fit_side(*frame.size, context.max_side), Image.Resampling.LANCZOS) for frame in shown]
    times = [original.timestamps[k] for k in inside]
    return [f"frames at {', '.join(f'{t:g}' for t in times)} s", Video(images, times)]


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"zoom": zoom, "crop": zoom, "zoom_window": zoom_window,
                                                "frames": frames, "find_objects": find_objects, "measure": measure}
"""Tools known by name alone; `crop` is another name for `zoom`; find_objects and measure: cv_tools.py."""


# --------------------------------------------------------------------------- the registry


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
    close = difflib.get_close_matches(name, list(BUILTIN_TOOLS), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return VlmrlError(f"unknown tool {name!r}; {hint}built-in: {', '.join(sorted(BUILTIN_TOOLS))}; "
                      "or your own as package.module:function")


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


def resolve_tools(names: list[str]) -> dict[str, Callable[..., Any]]:
    """The registry `run_tool` reads, keyed by the names the model writes: built-in names as they are,
    `module:function` as `function`. VlmrlError for an unknown name, a failed import or two tools
    with the same name (this runs when the config is read, before step 1)."""
    tools: dict[str, Callable[..., Any]] = {}
    given: dict[str, str] = {}
    for entry in names:
        if not isinstance(entry, str):
            raise VlmrlError(f"a tool is named by a string (zoom, package.module:function); got {entry!r}")
        if entry in BUILTIN_TOOLS:
            key, function = entry, BUILTIN_TOOLS[entry]
        elif ":" in entry:
            key, function = entry.partition(":")[2], _import_tool(entry)
            _check_takes_context(entry, function)
        else:
            raise _unknown_tool(entry)
        if key in tools:
            raise VlmrlError(f"two tools are named {key!r} ({given[key]!r} and {entry!r}); each needs its own name")
        tools[key], given[key] = function, entry
    return tools


# --------------------------------------------------------------------------- running a call


def _one_line(text: str, limit: int = MESSAGE_CHARS) -> str:
    """`text` on one line (whitespace runs become one space), cut to `limit` characters with "..."."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _failed(kind: str, message: str) -> ToolResult:
    """A failed call: `error` = kind, text = `error: <message>` on one line, valid UTF-8."""
    return ToolResult(text=_one_line(valid_text(f"error: {message}")), error=kind)


def sane_size(width: int, height: int) -> tuple[int, int]:
    """(width, height) with each side raised to at least MIN_SIDE and the long side / MAX_ASPECT."""
    floor = max(MIN_SIDE, math.ceil(max(width, height) / MAX_ASPECT))
    return max(width, floor), max(height, floor)


def sane_image(image: Image.Image) -> Image.Image:
    """`image` as RGB (`to_rgb`: transparency laid over white, 16-bit and float greys scaled), padded
    (black, centred; no pixel resampled) to `sane_size`."""
    rgb = to_rgb(image)
    size = sane_size(*rgb.size)
    if size == rgb.size:
        return rgb
    canvas = Image.new("RGB", size)
    canvas.paste(rgb, ((size[0] - rgb.width) // 2, (size[1] - rgb.height) // 2))
    return canvas


def _returned_image(name: str, image: Image.Image, limits: ToolLimits) -> Image.Image | ToolResult:
    """A returned image checked against the limit, decoded now (a lazily opened file that is truncated
    fails here, not in the processor), RGB and of a sane shape (`sane_image`); or the failed result."""
    width, height = image.size
    if width * height > limits.max_image_pixels:
        return _failed("too_large", f"tool {name} returned a {width}x{height} image ({width * height} "
                                    f"pixels); the limit is {limits.max_image_pixels} pixels")
    if width * height == 0:
        return _failed("raised", f"tool {name} returned an empty {width}x{height} image")
    width, height = sane_size(width, height)
    if width * height > limits.max_image_pixels:  # a strip too long to pad within the limit
        return _failed("too_large", f"tool {name} returned an image that is {width}x{height} pixels once "
                                    f"padded to a sane shape; the limit is {limits.max_image_pixels} pixels")
    try:
        image.load()
        return sane_image(image)
    except Exception as error:  # a truncated or corrupt file, a mode with no RGB form
        return _failed("raised", f"tool {name} returned an image that cannot be decoded: "
                                 f"{type(error).__name__}: {error}")


def _returned_video(name: str, video: Video, limits: ToolLimits) -> Video | ToolResult:
    """A returned video: at most MAX_VIDEO_FRAMES frames, each checked as a returned image; or the
    failed result."""
    if len(video.frames) > MAX_VIDEO_FRAMES:
        return _failed("too_large", f"tool {name} returned a video of {len(video.frames)} frames; the limit is "
                                    f"{MAX_VIDEO_FRAMES} frames")
    frames = [_returned_image(name, frame, limits) for frame in video.frames]
    failed = next((frame for frame in frames if isinstance(frame, ToolResult)), None)
    return failed if failed is not None else Video(frames, video.timestamps)


def _returned(name: str, value: Any, limits: ToolLimits) -> ToolResult:
    """A tool's return value as a normalised ToolResult: text valid and cut to the limit; images and
    each video's frames checked against the limits, decoded now, RGB and of a sane shape
    (`_returned_image`)."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    wrong = [item for item in items if not isinstance(item, (str, Image.Image, Video))]
    if wrong:
        return _failed("raised", f"tool {name} returned {type(wrong[0]).__name__}; a tool returns text, "
                                 "a PIL image, a vlmrl.tasks.Video, or a list of those")
    media = [_returned_image(name, item, limits) if isinstance(item, Image.Image) else _returned_video(name, item, limits)
             for item in items if not isinstance(item, str)]
    failed = next((item for item in media if isinstance(item, ToolResult)), None)
    if failed is not None:
        return failed
    text = valid_text("\n".join(item for item in items if isinstance(item, str)))
    if len(text) > limits.max_text_chars:
        text = text[:limits.max_text_chars] + TRUNCATED.format(n=len(text) - limits.max_text_chars)
    return ToolResult(text=text, images=[m for m in media if isinstance(m, Image.Image)],
                      videos=[m for m in media if isinstance(m, Video)])


def call_tool(name: str, function: Callable[..., Any], context: ToolContext, arguments: dict[str, Any],
              limits: ToolLimits) -> ToolResult:
    """`function(context, **arguments)` as a normalised ToolResult (`_returned`); never raises: "bad_arguments"
    for a ValueError or TypeError from the tool, "raised" for any other exception or a value that cannot
    be read. Module-level: the tool worker receives it by name."""
    try:
        value = function(context, **arguments)
    except (ValueError, TypeError) as error:
        return _failed("bad_arguments", f"bad arguments for {name}: {error}")
    except Exception as error:
        return _failed("raised", f"tool {name} raised {type(error).__name__}: {error}")
    try:
        return _returned(name, value, limits)
    except Exception as error:  # e.g. an image object whose size cannot be read
        return _failed("raised", f"tool {name} returned a value that cannot be read: "
                                 f"{type(error).__name__}: {error}")


def run_tool(call: ToolCall, tools: dict[str, Callable[..., Any]], context: ToolContext,
             limits: ToolLimits) -> ToolResult:
    """Run `call` against the registry `tools` within `limits`; never raises. A built-in tool runs here;
    any other in the tool worker (tool_worker.py), on copies of the context, killed at its timeout.
    Failures come back as a ToolResult with `error` set: "unknown_tool", "bad_arguments" (arguments that
    do not fit the signature, or a ValueError/TypeError from the tool), "raised" (any other exception, a
    return value that is not text, images or videos or cannot be decoded, a tool that cannot be sent to the
    worker or that killed it), "timeout", "too_large"."""
    function = tools.get(call.name)
    if function is None:
        return _failed("unknown_tool", f"unknown tool {call.name!r}; available: {', '.join(sorted(tools)) or 'none'}")
    if not isinstance(call.arguments, dict) or not all(isinstance(key, str) for key in call.arguments):
        return _failed("bad_arguments", f"arguments of {call.name} must be an object; got {call.arguments!r}")
    try:
        inspect.signature(function).bind(context, **call.arguments)
    except TypeError as error:
        return _failed("bad_arguments", f"bad arguments for {call.name}: {error}")
    except ValueError:  # no signature to read: the call itself will tell
        pass
    if function in BUILTIN_TOOLS.values():  # trusted, total and quick: in this process, on the originals
        return call_tool(call.name, function, context, call.arguments, limits)
    try:
        return WORKER.run(call_tool, (call.name, function, context, call.arguments, limits), limits.timeout_s)
    except WorkerTimeout:
        return _failed("timeout", f"tool {call.name} ran past its {limits.timeout_s:g} s limit and was stopped")
    except (WorkerFailed, OSError) as error:
        return _failed("raised", f"tool {call.name} could not run: {error}")
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        return _failed("raised", f"tool {call.name} cannot be sent to the tool worker (a tool is a module-level "
                                 f"function): {type(error).__name__}: {error}")
