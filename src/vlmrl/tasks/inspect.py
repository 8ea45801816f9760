"""`vlmrl tasks list` and `vlmrl tasks show`: look at the tasks before training on them.

`format_task_list` describes each registered task and its parameters; `show_task` prints a few
examples (the system turn when there is one, prompt, answer, reference completion and the score it gets) and saves their images (every
image shown, and the full-resolution originals tools read when they differ) and their videos (as
animated GIFs), so a person can check
the images are legible and the rewards sensible. A reference trajectory's calls (`meta["reference_turns"]`)
are run with the built-in tools, as SFT runs them: each tool's text is printed and its images saved.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from PIL import Image

from vlmrl.disk import output_folder, safe_filename, write_file
from vlmrl.errors import VlmrlError
from vlmrl.tasks.base import Example, get_task, list_tasks, param_table, task_class
from vlmrl.tools.builtin import BUILTIN_TOOLS
from vlmrl.tools.calls import ends_with_call, parse_tool_call
from vlmrl.tools.contract import ToolContext, ToolLimits, ToolResult
from vlmrl.tools.running import run_tool


def format_task_list() -> str:
    """Each task's name, one-line description, and parameters with type, default and meaning."""
    lines: list[str] = []
    for name in list_tasks():
        cls = task_class(name)
        lines.append(f"{name}: {cls.description}")
        for param, type_name, default, doc in param_table(cls.Params):
            lines.append(f"    {param}: {type_name} = {default!r}  # {doc}")
        lines.append("")
    lines.append("Show examples: vlmrl tasks show NAME [--split S] [--n 4] [--out DIR] [key=value ...]")
    return "\n".join(lines)


def _indent(text: str) -> str:
    return textwrap.indent(text, "    ")


MAX_SHOWN = 10_000
"""Most examples `vlmrl tasks show` prints: far more than anyone reads, and its text is built whole
before it prints (a 20-digit --n would fill the memory first)."""


def show_task(name: str, params: dict[str, Any], split: str = "train", n: int = 4, out_dir: str | None = None) -> str:
    """Text describing examples 0..n-1 of `split`; when `out_dir` is given their images are written
    to `out_dir/{name}_{split}_{i}.png` (the first image; `:` and other characters a file name
    should not hold become `_`: safe_filename), `..._{i}_{k}.png` (image k >= 1 of an
    example that shows several) and `..._{i}_original.png` / `..._{i}_original_{k}.png` (the
    full-resolution originals tools read, when they differ from the images shown)."""
    if not 0 <= n <= MAX_SHOWN:
        raise VlmrlError(f"--n must be in [0, {MAX_SHOWN:,}], got {n}")
    task = get_task(name, **params)
    task.check_split(split)
    folder = output_folder(out_dir, "the example images") if out_dir else None  # a bad --out: one line, now
    shown = ", ".join(f"{k}={v!r}" for k, v in params.items()) or "defaults"
    lines = [f"task {name} ({shown}), split {split}, splits: {', '.join(task.splits)}"]
    for i in range(n):
        example = task.example(i, split=split)
        scores = task.score(example, example.reference_completion)
        lines.append(f"\n=== example {i} ===")
        if example.system:  # the system turn the model is shown before the prompt (the data's, or task system=)
            lines += ["system:", _indent(example.system)]
        lines += ["prompt:", _indent(example.prompt), f"answer: {example.answer}"]
        turns = example.meta.get("reference_turns")
        if isinstance(turns, list) and len(turns) > 1:
            lines.append("reference turns (a tool runs between them):")
            lines += [_indent(f"[{k}] {turn}") for k, turn in enumerate(turns)]
            lines += _tool_lines(example, turns, folder, safe_filename(f"{name}_{split}_{i}"))
        lines += ["reference completion:", _indent(example.reference_completion),
                  "reference score: " + ", ".join(f"{k}={v:.3f}" for k, v in scores.items())]
        lines += _image_lines(example, folder, safe_filename(f"{name}_{split}_{i}"))
    return "\n".join(lines)


def _tool_lines(example: Example, turns: list[Any], folder: Path | None, stem: str) -> list[str]:
    """What the built-in tools answer to the reference turns' calls, run on the example's originals as SFT
    runs them: each result's text, and each image it returns (saved under `folder` as
    `{stem}_tool_{k}.png`, `..._tool_{k}_{j}.png` for its image j >= 1, k the turn that called)."""
    context = ToolContext(images=list(example.originals), videos=list(example.video_originals))
    lines = []
    for k, text in enumerate(turns):
        if not (isinstance(text, str) and ends_with_call(text)):
            continue
        call = parse_tool_call(text)
        result = call if isinstance(call, ToolResult) else run_tool(call, BUILTIN_TOOLS, context, ToolLimits())
        lines += [f"tool result of turn [{k}]:", _indent(result.text or "(no text)")]
        for j, image in enumerate(result.images):
            where = ""
            if folder is not None:
                path = folder / f"{stem}_tool_{k}{'' if j == 0 else f'_{j}'}.png"
                write_file(path, "a tool's image", lambda temporary, image=image: image.save(temporary, format="PNG"))
                where = f" -> {path}"
            lines.append(_indent(f"tool image: {image.size[0]}x{image.size[1]}{where}"))
        lines += [_indent(f"tool video: {len(video.frames)} frames") for video in result.videos]
    return lines


def _same_image(a: Image.Image, b: Image.Image) -> bool:
    """Whether two images hold the same pixels (the same object, or equal size, mode and bytes)."""
    return a is b or (a.size == b.size and a.mode == b.mode and a.tobytes() == b.tobytes())


def _image_lines(example: Example, folder: Path | None, stem: str) -> list[str]:
    """One line per image shown (and per original that differs from its image), saving each as
    PNG under `folder` when given."""
    named = [("image" if k == 0 else f"image {k}", stem if k == 0 else f"{stem}_{k}", image)
             for k, image in enumerate(example.images)]
    for k, original in enumerate(example.originals):
        if k >= len(example.images) or not _same_image(original, example.images[k]):
            suffix = "" if k == 0 else f"_{k}"
            named.append(("original" if k == 0 else f"original {k}", f"{stem}_original{suffix}", original))
    lines = _video_lines(example, folder, stem)
    for label, file_stem, image in named:
        where = ""
        if folder is not None:
            path = folder / f"{file_stem}.png"
            write_file(path, "an example image", lambda temporary, image=image: image.save(temporary, format="PNG"))
            where = f" -> {path}"
        lines.append(f"{label}: {image.size[0]}x{image.size[1]}{where}")
    return lines


def _video_lines(example: Example, folder: Path | None, stem: str) -> list[str]:
    """One line per video (frames, size, times), saving each as an animated GIF under `folder` when
    given (`{stem}_video.gif`, `{stem}_video_{k}.gif` for video k >= 1), each frame held until the next
    one's time (the last as long as the one before it)."""
    lines = []
    for k, video in enumerate(example.videos):
        times = list(video.timestamps)
        gaps = [b - a for a, b in zip(times, times[1:])] or [1.0]
        durations = [max(20, round(1000 * gap)) for gap in gaps + gaps[-1:]]  # ms; GIF players floor at 20
        where = ""
        if folder is not None:
            path = folder / f"{stem}_video{'' if k == 0 else f'_{k}'}.gif"
            first, *rest = video.frames
            write_file(path, "an example video", lambda temporary, first=first, rest=rest, durations=durations:
                       first.save(temporary, format="GIF", save_all=True, append_images=rest, duration=durations,
                                  loop=0))
            where = f" -> {path}"
        width, height = video.frames[0].size
        shown = ", ".join(f"{t:g}" for t in times)
        lines.append(f"{'video' if k == 0 else f'video {k}'}: {len(video.frames)} frames {width}x{height} at "
                     f"{shown} s{where}")
    return lines
