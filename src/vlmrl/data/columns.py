"""Which columns of a dataset hold the prompt, the answer, the images, the reference completion and
the system prompt, and one row read through that mapping.

The layouts detected, first match wins (an explicit mapping wins over all of them, key by key):
- `messages` (chat data): the system turn is the system prompt, the user turns the prompt, the last
  assistant turn the reference completion; the answer comes from an answer/solution/ground_truth
  column, else from the reference (its <answer> or \\boxed{}, else its text);
- verl: `prompt` (chat messages) with `reward_model.ground_truth` (a dotted path reads inside a dict);
- TRL: `prompt` (a string, or chat messages with no assistant turn) with answer/solution/ground_truth;
- EasyR1 / Geometry3K: `problem` with answer (or solution);
- `question` with answer (or solution).
Images come from `images` (a list) or `image`. A column named `solution` holds a worked solution: its
answer is the last <answer> block (a \\boxed{} inside it wins), else its last \\boxed{}, else the
`answer_fallback` column, else (unless `strict_solution`) the solution's text. Image parts of chat
content become `<image>` markers in the prompt text. No torch here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from vlmrl.data.paths import preview
from vlmrl.errors import VlmrlError

KEYS = ("prompt", "answer", "images", "reference", "system", "videos")
"""What a column mapping names (task.params.columns)."""
ANSWER_COLUMNS = ("answer", "solution", "ground_truth")
IMAGE_COLUMNS = ("images", "image")
VIDEO_COLUMNS = ("videos", "video")
MARKER = "<image>"
VIDEO_MARKER = "<video>"
SYSTEM_ROLES = ("system", "developer")
"""Chat roles read as the system prompt (OpenAI's `developer` turn is its system turn)."""
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class BadRow(VlmrlError):
    """A row that cannot become an example; the message says what is wrong."""


@dataclass(frozen=True)
class Columns:
    """Column names (a dotted path reads inside a dict column) of each part of an example."""

    prompt: str
    answer: str = ""
    images: str = ""
    reference: str = ""
    system: str = ""
    videos: str = ""
    """A column of video file paths (one path or a list of them per row)."""
    layout: str = "explicit"
    """Which layout was detected (or "explicit"), for the one-line report."""
    answer_fallback: str = ""
    """Column read when a solution column holds no answer (open_r1's original_answer)."""
    strict_solution: bool = False
    """A solution with no <answer> or \\boxed{} (and no fallback) is a bad row, not its own answer."""

    def line(self) -> str:
        """`prompt<-problem, answer<-answer, images<-images (EasyR1 layout)`."""
        parts = [f"{key}<-{getattr(self, key)}" for key in KEYS if getattr(self, key)]
        return f"{', '.join(parts)} ({self.layout} layout)"

    def used(self) -> set[str]:
        """The top-level columns this mapping reads."""
        names = [self.prompt, self.answer, self.images, self.reference, self.system, self.videos, self.answer_fallback]
        return {name.split(".")[0] for name in names if name}

    def missing(self, names: list[str]) -> list[str]:
        """The mapped columns the data does not have."""
        return [name for name in (self.prompt, self.answer, self.images, self.reference, self.system, self.videos)
                if name and name.split(".")[0] not in names]


def detect(names: list[str], explicit: dict[str, str] | None = None) -> Columns:
    """The mapping of a dataset with columns `names`: the detected layout, overridden key by key by
    `explicit`; VlmrlError naming the columns when no prompt or answer is found."""
    explicit = dict(explicit or {})
    unknown = sorted(set(explicit) - set(KEYS))
    if unknown:
        raise VlmrlError(f"columns: unknown key(s) {unknown}; valid: {', '.join(KEYS)}")
    found = _detected(names)
    if found and (videos := next((c for c in VIDEO_COLUMNS if c in names), "")):
        found["videos"] = videos
    if explicit:
        found = {**found, **explicit, "layout": "explicit" if not found else f"{found['layout']} + explicit"}
    if not found.get("prompt"):
        raise VlmrlError(f"cannot tell which column holds the prompt among {names}; name it: "
                         "task.params.columns={prompt: COLUMN, answer: COLUMN, images: COLUMN}")
    columns = Columns(**found)
    missing = columns.missing(names)
    if missing:
        raise VlmrlError(f"the column mapping names {missing} but the data has {names}")
    if not columns.answer and columns.reference != columns.prompt:
        raise VlmrlError(f"cannot tell which column holds the answer among {names}; "
                         "name it: task.params.columns={answer: COLUMN}")
    shows_answer(columns)
    return columns


def shows_answer(columns: Columns) -> None:
    """VlmrlError when the prompt or the system prompt would be read from the gold answer's column
    (or from a dict column holding it): the model would be shown what it is scored against."""
    for key in ("prompt", "system"):
        shown = getattr(columns, key)
        for gold in (columns.answer, columns.answer_fallback):
            if shown and gold and (gold == shown or gold.startswith(shown + ".")):
                raise VlmrlError(f"columns: {key}<-{shown} would show the model the gold answer (answer<-{gold}); "
                                 f"map {key} to the question's column: task.params.columns={{{key}: COLUMN}}")


def _detected(names: list[str]) -> dict[str, str]:
    """The first known layout that `names` fit, as Columns fields ({} when none does)."""
    first = lambda options: next((c for c in options if c in names), "")  # noqa: E731
    images, answer = first(IMAGE_COLUMNS), first(ANSWER_COLUMNS)
    if "messages" in names and "prompt" not in names:
        return {"prompt": "messages", "reference": "messages", "system": "messages", "answer": answer,
                "images": images, "layout": "messages"}
    if "prompt" in names and "reward_model" in names and not answer:
        return {"prompt": "prompt", "answer": "reward_model.ground_truth", "images": images, "layout": "verl"}
    for prompt, layout in (("prompt", "TRL"), ("problem", "EasyR1"), ("question", "question/answer")):
        if prompt in names:
            return {"prompt": prompt, "answer": answer, "images": images, "layout": layout}
    return {}


def value_at(row: dict[str, Any], path: str) -> Any:
    """The value at column `path` of `row` ("a.b" reads key b of dict column a); None when absent."""
    value: Any = row
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} in `text` (nested braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def answer_from_solution(solution: str) -> str:
    """The final answer written in a solution: last <answer> block (its \\boxed{} if any), else the
    last \\boxed{}, else "" (the caller may fall back to another column)."""
    blocks = _ANSWER_BLOCK.findall(solution)
    if blocks:
        return last_boxed(blocks[-1]) or blocks[-1].strip()
    return last_boxed(solution) or ""


@dataclass
class RowText:
    """The text parts of one row, read through a mapping (images are read apart: data/images.py)."""

    prompt: str
    answer: str
    reference: str
    system: str
    solution: str = ""
    """The worked solution the answer was read from ("" when the answer column is no solution)."""


def read_text(row: dict[str, Any], columns: Columns) -> RowText:
    """The prompt, answer, reference and system prompt of `row`; BadRow saying what is missing."""
    system, prompt, reference = "", value_at(row, columns.prompt), ""
    if isinstance(prompt, list):
        system, prompt, reference = split_chat(prompt, columns.prompt, keep_reference=columns.reference == columns.prompt)
    elif columns.reference:
        reference = _text(value_at(row, columns.reference), columns.reference)
    if columns.system and columns.system != columns.prompt:
        system = _text(value_at(row, columns.system), columns.system)
    prompt = _text(prompt, columns.prompt)
    if not prompt.strip():
        raise BadRow(f"column {columns.prompt!r} is empty")
    solution, answer = _answer(row, columns, reference)
    return RowText(prompt=prompt, answer=answer, reference=reference, system=system, solution=solution)


def _answer(row: dict[str, Any], columns: Columns, reference: str) -> tuple[str, str]:
    """(the solution read, the gold answer) of `row`."""
    if not columns.answer:  # messages with no answer column: the reference's answer
        answer = answer_from_solution(reference) or reference.strip()
        if not answer:
            raise BadRow("the conversation has no assistant turn to read the answer from")
        return reference, answer
    value = _text(value_at(row, columns.answer), columns.answer).strip()
    if columns.answer.split(".")[-1] != "solution":
        if not value:
            raise BadRow(f"column {columns.answer!r} is empty")
        return "", value
    fallback = columns.answer_fallback
    answer = answer_from_solution(value) or _text(value_at(row, fallback) if fallback else None, fallback).strip()
    if not answer and not columns.strict_solution:
        answer = value
    if not answer:
        empty = f" and {fallback} is empty" if fallback else ""
        raise BadRow(f"its solution has no <answer> or \\boxed{{}} answer{empty}")
    return value, answer


def split_chat(messages: list[Any], column: str, keep_reference: bool) -> tuple[str, str, str]:
    """(system, prompt, reference) of chat messages: system (and `developer`, OpenAI's system) turns,
    user turns (image and video parts as `<image>` and `<video>` markers), and with `keep_reference`
    the last assistant turn; BadRow for a turn that is no {role, content} dict, a role other than
    these, or any other assistant turn (multi-turn prompts are not RL prompts)."""
    for k, turn in enumerate(messages):
        if not isinstance(turn, dict):
            raise BadRow(f"turn {k} of column {column!r} is {preview(turn)}, not a {{role, content}} dict")
    turns = list(messages)
    reference = ""
    if keep_reference and turns and turns[-1].get("role") == "assistant":
        reference = _content(turns.pop().get("content"), column)
    for k, turn in enumerate(turns):
        role = turn.get("role")
        if role == "assistant":
            raise BadRow("the prompt holds an assistant turn: give the prompt as user (and system) turns only, "
                         "the assistant's answer apart")
        if role not in (*SYSTEM_ROLES, "user"):
            raise BadRow(f"turn {k} of column {column!r} has role {preview(role)}; a prompt's turns are system "
                         "(or developer), user and a last assistant turn")
    system = "\n".join(_content(t.get("content"), column) for t in turns if t.get("role") in SYSTEM_ROLES)
    prompt = "\n".join(_content(t.get("content"), column) for t in turns if t.get("role") == "user")
    return system, prompt, reference


PART_MARKERS = {"image": MARKER, "video": VIDEO_MARKER}
"""Chat content parts that stand for media, as the markers that place them."""


def _content(content: Any, column: str) -> str:
    """A chat turn's content as text: a string, or a list of parts (text parts, image and video parts
    as markers); BadRow for any other part."""
    if not isinstance(content, list):
        return _text(content, column)
    text = []
    for part in content:
        if isinstance(part, str):
            text.append(part)
        elif isinstance(part, dict) and part.get("type") in PART_MARKERS:
            text.append(PART_MARKERS[part["type"]])
        elif isinstance(part, dict) and part.get("type") in ("text", None) and isinstance(part.get("text"), (str, type(None))):
            text.append(part.get("text") or "")
        else:
            what = f"of type {part.get('type')!r}" if isinstance(part, dict) else preview(part)
            raise BadRow(f"column {column!r} holds a content part {what}; parts are text, image or video "
                         "(the images themselves in the image column)")
    return "".join(text)


def _text(value: Any, column: str) -> str:
    """A cell as text: a string as it is, "" for null, an integer or a float as the number it is
    (JSON has no other way to write 7; NaN, a missing cell, is ""), a list's items joined (verl's ground truth may be a list);
    BadRow naming the column for any other value (a dict or a bool is no text: `str()` made
    `{'x': 1}` and `True` answers silently)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):  # a missing cell of a float column
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, (list, tuple)):
        return ", ".join(_text(v, column) for v in value)
    raise BadRow(f"column {column!r} holds {preview(value)}, not text or a number")
