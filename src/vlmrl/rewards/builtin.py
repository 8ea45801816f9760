"""The built-in rewards, by name: the verifiers of verify.py as batched functions with TRL's call.

Each takes `completions` (TRL's conversational form: one `[{"role": "assistant", "content": text}]`
per completion) and, where it compares, `answer` (the gold answers), plus keyword-only options a
config sets in `kwargs`; it returns one value per completion: a number in [0, 1], or None where it
does not apply (a gold answer it cannot read: no number for `number`, no letter for `choice`, no box
for `iou`). The final answer is read from the completion by `extract`: `answer_tag` (the single
`<answer>...</answer>`, the house format; none: 0), `boxed` (the last `\\boxed{...}`) or `whole` (the
whole completion). Like every verifier they are total: any text in, never an exception.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Literal

from vlmrl.rewards.verify import (collapse_whitespace, extract_tag, iou as box_iou, last_number, math_equal,
                                  normalized_edit_similarity, parse_box, think_answer_format)

Extract = Literal["answer_tag", "boxed", "whole"]
_CHOICE_LEAD = re.compile(r"\s*\(?\s*([A-Za-z])\s*(?:[).:]|\s|$)")
_BOXED = "\\boxed{"


def completion_text(completion) -> str:
    """The text of one completion: a string, or the content of the last message of a conversation."""
    if isinstance(completion, str):
        return completion
    content = completion[-1].get("content", "") if completion else ""
    return content if isinstance(content, str) else " ".join(
        part.get("text", "") for part in content if isinstance(part, dict))


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text` (braces balanced), or None."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(_BOXED)
    for position in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[begin:position].strip()
    return None


def final_answer(completion, extract: Extract = "answer_tag") -> str | None:
    """The final answer written in `completion`, read as `extract` says; None when there is none."""
    text = completion_text(completion)
    if extract == "boxed":
        return last_boxed(text)
    if extract == "whole":
        return text.strip()
    return extract_tag(text, "answer")


def _compare(completions, answer, extract: Extract, score: Callable[[str, str], float | None]) -> list[float | None]:
    """score(predicted, gold) per completion; 0 without a final answer, None without a gold one."""
    values: list[float | None] = []
    for completion, gold in zip(completions, answer):
        gold = "" if gold is None else str(gold).strip()
        predicted = final_answer(completion, extract)
        if not gold:
            values.append(None)
        elif predicted is None:
            values.append(0.0 if score(gold, gold) is not None else None)
        else:
            values.append(score(predicted, gold))
    return values


def accuracy(completions, answer, *, extract: Extract = "answer_tag") -> list[float | None]:
    """1 when the final answer equals the gold one (math_equal: LaTeX, numbers, choice letters), else 0."""
    return _compare(completions, answer, extract, lambda p, g: float(math_equal(p, g)))


def _number(predicted: str, gold: str, rel_tol: float) -> float | None:
    target = last_number(gold)
    if target is None:
        return None
    value = last_number(predicted)
    return float(value is not None and math.isclose(value, target, rel_tol=rel_tol, abs_tol=rel_tol))


def number(completions, answer, *, extract: Extract = "answer_tag", rel_tol: float = 1e-6) -> list[float | None]:
    """1 when the last number of the final answer equals the gold answer's (within rel_tol), else 0."""
    return _compare(completions, answer, extract, lambda p, g: _number(p, g, rel_tol))


def _letter(text: str) -> str | None:
    match = _CHOICE_LEAD.match(text.strip().strip("$"))
    return match.group(1).upper() if match else None


def choice(completions, answer, *, extract: Extract = "answer_tag") -> list[float | None]:
    """1 when the final answer starts with the gold option letter ("B", "(B)", "B. 45°" for gold B), else 0."""
    def same(predicted: str, gold: str) -> float | None:
        letter = _letter(gold) if len(gold.strip("()$ .")) == 1 else None
        return None if letter is None else float(_letter(predicted) == letter)
    return _compare(completions, answer, extract, same)


def exact(completions, answer, *, extract: Extract = "answer_tag", case_sensitive: bool = True) -> list[float | None]:
    """1 when the final answer equals the gold one, whitespace runs collapsed (and case folded unless
    case_sensitive), else 0."""
    def same(predicted: str, gold: str) -> float:
        fold = (lambda s: s) if case_sensitive else str.casefold
        return float(fold(collapse_whitespace(predicted)) == fold(collapse_whitespace(gold)))
    return _compare(completions, answer, extract, same)


def iou(completions, answer, *, extract: Extract = "answer_tag") -> list[float | None]:
    """The intersection over union of the box `[x1, y1, x2, y2]` answered and the gold box (0 without one)."""
    def overlap(predicted: str, gold: str) -> float | None:
        target, box = parse_box(gold), parse_box(predicted)
        return None if target is None else (0.0 if box is None else box_iou(box, target))
    return _compare(completions, answer, extract, overlap)


def edit_similarity(completions, answer, *, extract: Extract = "answer_tag") -> list[float | None]:
    """1 - the Levenshtein distance between the final and the gold answer over the longer's length."""
    return _compare(completions, answer, extract, normalized_edit_similarity)


def format(completions) -> list[float]:  # noqa: A001 - the reward's name in configs
    """1 for the layout `<think>...</think> <answer>...</answer>` (verify.think_answer_format), else 0."""
    return [think_answer_format(completion_text(c)) for c in completions]


def length(completions, *, max_chars: int = 1000) -> list[float]:
    """1 - len(text) / max_chars, at least 0: shorter completions score higher (a brevity reward)."""
    limit = max(int(max_chars), 1)
    return [max(0.0, 1.0 - len(completion_text(c)) / limit) for c in completions]


BUILTIN: dict[str, Callable[..., list]] = {
    "accuracy": accuracy, "math": accuracy, "number": number, "choice": choice, "exact": exact, "iou": iou,
    "edit_similarity": edit_similarity, "format": format, "length": length,
}
"""Every built-in reward by the name a config gives it (`task`, the task's own score, is in reward.py)."""

COMPARING = ("accuracy", "math", "number", "choice", "exact", "iou", "edit_similarity")
"""The built-ins that compare with the gold answer: the gold answer itself must score 1 on them."""
