"""Toy tools for tests/test_tools.py, loaded by import path (`tool_helpers:echo_tool`) with this
folder on sys.path: one of each way a tool can answer or fail. They run in the tool worker process,
so what they leave behind for a test to read goes to a file."""

from __future__ import annotations

import os
import time
from pathlib import Path

from PIL import Image, ImageDraw

from vlmrl.tools import ToolContext

NOT_A_TOOL = 3
MARKERS = ("<image> <|image_pad|> <start_of_image> <end_of_image> <image_soft_token> <fake_token_around_image> "
           "<global-img> <row_1_col_1> <end_of_utterance> <end_of_turn> <start_of_turn> <|im_end|> </s> <bos>")
"""Image and control tokens of the Qwen, Idefics3, Gemma 3 and LLaVA families, as a tool might write them."""


def echo_tool(context, text: str) -> str:
    """The text it was given."""
    return text


def size_tool(context) -> str:
    """The size of the example's first image, as WIDTHxHEIGHT (reads the context)."""
    width, height = context.images[0].size
    return f"{width}x{height}"


def counted_tool(context, word: str, log: str) -> str:
    """Appends `word` to the file `log`, then returns it."""
    with open(log, "a") as file:
        file.write(word + "\n")
    return word


def picky_tool(context, level: int) -> str:
    """ValueError for a negative level (a tool that checks its own arguments)."""
    if level < 0:
        raise ValueError(f"level must be >= 0; got {level}")
    return f"level {level}"


def failing_tool(context, message: str = "out of paint") -> str:
    """Always raises RuntimeError(message)."""
    raise RuntimeError(message)


def slow_tool(context, seconds: float = 5.0) -> str:
    """Sleeps `seconds`, then returns "done"."""
    time.sleep(seconds)
    return "done"


def busy_tool(context, pid_file: str) -> str:
    """Writes its process id to `pid_file`, then computes forever (holding the GIL)."""
    Path(pid_file).write_text(str(os.getpid()))
    while True:
        pass


def pid_tool(context) -> str:
    """The id of the process it runs in."""
    return str(os.getpid())


def exit_tool(context) -> str:
    """Ends its process at once (as a crash in native code would)."""
    os._exit(3)


def draw_tool(context) -> Image.Image:
    """Paints the first context image black in place and returns it."""
    ImageDraw.Draw(context.images[0]).rectangle((0, 0, *context.images[0].size), fill=(0, 0, 0))
    return context.images[0]


def strip_tool(context, width: int, height: int) -> Image.Image:
    """A red image of the size asked for (a thin strip when one side is small)."""
    return Image.new("RGB", (width, height), (255, 0, 0))


def mode_tool(context, mode: str) -> Image.Image:
    """A 4x4 image in `mode`: F filled with 300.0, I with 128, CMYK with (0, 0, 0, 0) (white), P with
    palette index 1 (green), LA with (100, 255), 1 with 1 (white), I;16 with 40000; others their default."""
    fill = {"F": 300.0, "I": 128, "CMYK": (0, 0, 0, 0), "P": 1, "LA": (100, 255), "1": 1, "I;16": 40000}.get(mode, 0)
    image = Image.new(mode, (4, 4), fill)
    if mode == "P":
        image.putpalette([0, 0, 0, 0, 255, 0] + [0] * 762)
    return image


def file_tool(context, path: str) -> Image.Image:
    """The image file at `path`, opened lazily (PIL reads its pixels only when asked)."""
    return Image.open(path)


def surrogate_tool(context) -> str:
    """Text with a lone surrogate (no UTF-8 for it)."""
    return "left \ud800 right"


def marker_tool(context) -> str:
    """Text holding the image and control tokens of several families (MARKERS)."""
    return MARKERS


def huge_tool(context, width: int, height: int) -> Image.Image:
    """A black image of the size asked for."""
    return Image.new("RGB", (width, height))


def clip_tool(context, frames: int, side: int) -> list:
    """A line of text and a video of `frames` frames, side x side, 0.1 s apart, frame k a flat grey 20 * k
    (from 2 x 1: padded to a sane shape on the way back)."""
    from vlmrl.tasks import Video

    pictures = [Image.new("RGB", (side, max(side // 2, 1)), (20 * k,) * 3) for k in range(frames)]
    return ["a clip", Video(pictures, [k / 10 for k in range(frames)])]


def long_text_tool(context, n: int) -> str:
    """n letters 'a'."""
    return "a" * n


def mixed_tool(context) -> list:
    """Text, a 2x1 red image, text."""
    return ["left", Image.new("RGB", (2, 1), (255, 0, 0)), "right"]


def number_tool(context) -> int:
    """An int: not something a tool may return."""
    return 42


def zoom(context, box) -> str:
    """Shares its name with the built-in zoom (to test a clash)."""
    return "mine"


def no_context() -> str:
    """Takes no context: not a tool."""
    return "nothing"


def argument_first(box: list) -> str:
    """Its one parameter is an argument the model gives: the context would land in it."""
    return f"{box}"


def annotated_context(view: ToolContext, box: list) -> str:
    """The context under another name, told by its annotation: a tool."""
    return f"{box}"


def paint_tool(context, colour: list, width: int, height: int) -> Image.Image:
    """A `colour` (r, g, b) image of the size asked for, its top-left quarter white: no two images of
    other colours or sizes alike, and not every patch of one alike."""
    image = Image.new("RGB", (width, height), tuple(colour))
    ImageDraw.Draw(image).rectangle((0, 0, width // 2 - 1, height // 2 - 1), fill=(255, 255, 255))
    return image
