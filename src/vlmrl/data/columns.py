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

import re
from dataclasses import dataclass
from typing import Any

from vlmrl.errors import VlmrlError

KEYS = ("prompt", "answer", "images", "reference", "system", "videos")
"""What a column mapping names (task.params.columns)."""
ANSWER_COLUMNS = ("answer", "solution", "ground_truth")
IMAGE_COLUMNS = ("images", "image")
VIDEO_COLUMNS = ("videos", "video")
MARKER = "<image>"
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
    return columns


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
        system, prompt, reference = split_chat(prompt, keep_reference=columns.reference == columns.prompt)
    elif columns.reference:
        reference = _text(value_at(row, columns.reference))
    if columns.system and columns.system != columns.prompt:
        system = _text(value_at(row, columns.system))
    prompt = _text(prompt)
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
    value = _text(value_at(row, columns.answer)).strip()
    if columns.answer.split(".")[-1] != "solution":
        if not value:
            raise BadRow(f"column {columns.answer!r} is empty")
        return "", value
    answer = answer_from_solution(value) or _text(value_at(row, columns.answer_fallback) if columns.answer_fallback
                                                  else None).strip()
    if not answer and not columns.strict_solution:
        answer = value
    if not answer:
        fallback = f" and {columns.answer_fallback} is empty" if columns.answer_fallback else ""
        raise BadRow(f"its solution has no <answer> or \\boxed{{}} answer{fallback}")
    return value, answer


def split_chat(messages: list[Any], keep_reference: bool) -> tuple[str, str, str]:
    """(system, prompt, reference) of chat messages: system turns, user turns (image parts as
    `<image>` markers), and with `keep_reference` the last assistant turn; BadRow for any other
    assistant turn (multi-turn prompts are not RL prompts)."""
    turns = [m for m in messages if isinstance(m, dict)]
    reference = ""
    if keep_reference and turns and turns[-1].get("role") == "assistant":
        reference = _content(turns.pop().get("content"))
    if any(t.get("role") not in ("system", "user") for t in turns):
        raise BadRow("the prompt holds an assistant turn: give the prompt as user (and system) turns only, "
                     "the assistant's answer apart")
    system = "\n".join(_content(t.get("content")) for t in turns if t.get("role") == "system")
    prompt = "\n".join(_content(t.get("content")) for t in turns if t.get("role") == "user")
    return system, prompt, reference


def _content(content: Any) -> str:
    """A chat turn's content as text: a string, or a list of parts (image parts -> `<image>`)."""
    if isinstance(content, list):
        return "".join(MARKER if isinstance(part, dict) and part.get("type") == "image"
                       else str(part.get("text") or "") if isinstance(part, dict) else str(part)
                       for part in content)
    return _text(content)


def _text(value: Any) -> str:
    """A cell as text: "" for null, a list's items joined (verl's ground truth may be a list)."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return ", ".join(_text(v) for v in value)
    return str(value)
