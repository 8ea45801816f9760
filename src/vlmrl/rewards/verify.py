"""Reusable reward pieces: tags and format, edit distance, the "closer than the input" gate,
math equivalence, boxes and IoU, and weighted composition of named components.

Every function here is total: any string in, a finite value in its documented range out, never an
exception. Tasks build their `score()` from these so that the hack-resistance rules live in one
place and are tested once (tests/test_rewards.py). No torch here.

Tag rule (used by every task): a tag counts only when it occurs exactly once, written exactly
`<tag>` and `</tag>` (lower case, no spaces or attributes), the opening before the closing. A repeated
tag, a nested one (`<answer><answer>3</answer></answer>`) or a missing one extracts nothing.
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field
from typing import Sequence

from rapidfuzz.distance import Levenshtein

__all__ = [
    "Rubric", "closer_than", "collapse_whitespace", "compose", "count_tag", "edit_distance",
    "extract_tag", "iou", "last_number", "math_equal", "normalize_math_string",
    "normalized_edit_similarity", "parse_box", "think_answer_format",
]

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_UNSIGNED_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_BOX = re.compile(r"\[\s*([-+]?\d+(?:\.\d+)?)\s*,\s*([-+]?\d+(?:\.\d+)?)\s*,\s*([-+]?\d+(?:\.\d+)?)"
                  r"\s*,\s*([-+]?\d+(?:\.\d+)?)\s*\]")
_THINK_ANSWER = re.compile(r"\s*<think>(.*)</think>\s*<answer>(.*)</answer>\s*", re.DOTALL)
_MAX_MATH_CHARS = 300  # longer answers are compared as strings only (sympy can stall on them)


def collapse_whitespace(text: str) -> str:
    """Strip and turn every run of whitespace into one space: "  i   can " -> "i can"."""
    return " ".join(text.split())


def count_tag(text: str, tag: str) -> int:
    """How many times the tag appears, counting openings and closings separately, the larger."""
    return max(text.count(f"<{tag}>"), text.count(f"</{tag}>"))


def extract_tag(text: str, tag: str) -> str | None:
    """The stripped content of the single `<tag>...</tag>` in `text`.

    None when the tag is missing, repeated, nested or closed before it opens (see the module
    docstring). The content may be an empty string.
    """
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    if text.count(open_tag) != 1 or text.count(close_tag) != 1:
        return None
    start = text.index(open_tag) + len(open_tag)
    end = text.index(close_tag)
    if end < start:
        return None
    return text[start:end].strip()


def think_answer_format(text: str) -> float:
    """1.0 for the strict layout `<think>...</think> <answer>...</answer>`, else 0.0.

    Only whitespace may come before `<think>`, between the blocks and after `</answer>`; each tag
    appears exactly once (so nothing is nested or repeated) and the answer is not blank. Other
    tags (for example `<chars>`) may appear inside the think block.
    """
    if count_tag(text, "think") != 1 or count_tag(text, "answer") != 1:
        return 0.0
    match = _THINK_ANSWER.fullmatch(text)
    if match is None or not match.group(2).strip():
        return 0.0
    return 1.0


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions each cost 1)."""
    return int(Levenshtein.distance(a, b))


def normalized_edit_similarity(a: str, b: str) -> float:
    """1 - Levenshtein distance / length of the longer string, in [0, 1]; two empty strings: 1."""
    value = 1.0 - float(Levenshtein.normalized_distance(a, b))
    return min(1.0, max(0.0, value))


def closer_than(candidate: str, target: str, baseline: str) -> bool:
    """The gate: True only when `candidate` is strictly closer to `target` than `baseline` is.

    With `baseline` = the model's input (the coded message), copying the input never passes.
    """
    return edit_distance(candidate, target) < edit_distance(baseline, target)


def last_number(text: str) -> float | None:
    """The last number written with digits in `text` ("so 3 circles." -> 3.0), or None."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    try:
        value = float(matches[-1])
    except (ValueError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def parse_box(text: str) -> tuple[float, float, float, float] | None:
    """The box `[x1, y1, x2, y2]` written in `text`, or None.

    Rule against stuffing: the text must hold exactly one bracketed four-number box and no other
    number outside it ("the box is [1, 2, 30, 40]" parses; two boxes, a five-number list or an extra
    number anywhere else does not). Values must be finite.
    """
    boxes = list(_BOX.finditer(text))
    if len(boxes) != 1:
        return None
    outside = text[:boxes[0].start()] + " " + text[boxes[0].end():]
    if _UNSIGNED_NUMBER.search(outside):
        return None
    try:
        values = tuple(float(v) for v in boxes[0].groups())
    except (ValueError, OverflowError):
        return None
    if not all(math.isfinite(v) for v in values):
        return None
    return values  # type: ignore[return-value]


def iou(box_a: Sequence[float], box_b: Sequence[float]) -> float:
    """Intersection over union of two `[x1, y1, x2, y2]` boxes, in [0, 1].

    A malformed box (not four finite numbers, or x2 <= x1 or y2 <= y1) has IoU 0 with anything.
    """
    try:
        ax1, ay1, ax2, ay2 = (float(v) for v in box_a)
        bx1, by1, bx2, by2 = (float(v) for v in box_b)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    values = (ax1, ay1, ax2, ay2, bx1, by1, bx2, by2)
    if not all(math.isfinite(v) for v in values) or ax2 <= ax1 or ay2 <= ay1 or bx2 <= bx1 or by2 <= by1:
        return 0.0
    inter_w = max(0.0, min(ax2, bx2) - max(ax1, bx1))
    inter_h = max(0.0, min(ay2, by2) - max(ay1, by1))
    inter = inter_w * inter_h
    union = (ax2 - ax1) * (ay2 - ay1) + (bx2 - bx1) * (by2 - by1) - inter
    if not math.isfinite(union) or union <= 0.0:
        return 0.0
    value = inter / union
    return min(1.0, max(0.0, value)) if math.isfinite(value) else 0.0


_CHOICE = re.compile(r"\(?\s*([A-Za-z])\s*[).:]?")
_STRIP_LATEX = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\ |\^\{?\\circ\}?|°|\$|\\%|%")
_SPACED_NUMBERS = re.compile(r"\d\s+[-+]?\.?\d")
_SPACE_BETWEEN_DIGITS = re.compile(r"(?<=\d)\s+(?=\d)")
_TEXT_WRAPPER = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{([^{}]*)\}")


def normalize_math_string(text: str) -> str:
    """A canonical string for answer comparison: lower case, no spaces, `$`, degree signs,
    `\\left`/`\\right`, `\\text{}` wrappers or trailing period; "(A)", "A." and "A" all become "a"."""
    text = _TEXT_WRAPPER.sub(r"\1", text.strip())
    text = _STRIP_LATEX.sub("", text)
    text = _SPACE_BETWEEN_DIGITS.sub("|", text)  # "1 2" must not become "12"
    text = "".join(text.split()).lower().rstrip(".")
    choice = _CHOICE.fullmatch(text)
    return choice.group(1).lower() if choice else text


def _choice_letter(text: str) -> str | None:
    """"A", "(A)", "A.", "A)" -> "A"; anything else -> None."""
    match = _CHOICE.fullmatch(text.strip().strip("$").strip())
    return match.group(1).upper() if match else None


def _wrap_latex(text: str) -> str:
    return text if ("$" in text or "\\boxed" in text) else f"${text}$"


def math_equal(pred: str, gold: str) -> bool:
    """Whether the predicted final answer equals the gold one (LaTeX, plain numbers, choices).

    Order: equal normalized strings; for a multiple-choice gold ("A", "(B)") the same letter;
    otherwise math-verify on both (plain text wrapped as inline LaTeX). Against stuffing, the
    prediction is wrong when it has numbers separated only by spaces ("1 2 3") and the gold has
    not, more than two numbers beyond the gold's count, or a digit outside the expression
    math-verify extracted verbatim ("5, or maybe 6"); one longer than 300 characters is compared
    as a string only. Every math-verify error is caught and counts as "not equal". On the main
    thread math-verify runs with its 5 s signal timeout; elsewhere (signals only work on the main
    thread) without one.
    """
    try:
        pred, gold = str(pred).strip(), str(gold).strip()
        if not pred or not gold:
            return False
        if normalize_math_string(pred) == normalize_math_string(gold):
            return True
        gold_letter = _choice_letter(gold)
        if gold_letter is not None:
            return _choice_letter(pred) == gold_letter
        if len(pred) > _MAX_MATH_CHARS or len(gold) > _MAX_MATH_CHARS:
            return False
        if _SPACED_NUMBERS.search(pred) and not _SPACED_NUMBERS.search(gold):
            return False
        if len(_UNSIGNED_NUMBER.findall(pred)) > len(_UNSIGNED_NUMBER.findall(gold)) + 2:
            return False
        return _math_verify(pred, gold)
    except Exception:  # noqa: BLE001 - a reward must never raise
        return False


def _math_verify(pred: str, gold: str) -> bool:
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(_wrap_latex(gold), parsing_timeout=timeout)
    wrapped = _wrap_latex(pred)
    pred_parsed = parse(wrapped, parsing_timeout=timeout)
    if not gold_parsed or not pred_parsed:
        return False
    matched = [item for item in pred_parsed if isinstance(item, str) and item and item in wrapped]
    if matched and any(ch.isdigit() for ch in wrapped.replace(matched[0], " ", 1)):
        return False  # a number outside the extracted expression: "5, or maybe 6"
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def compose(components: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
    """All components by name plus "total" = sum of weight * component over `weights`.

    Components without a weight (like "accuracy") are reported but add nothing to the total.
    A weight naming a missing component is a programming error (ValueError).
    """
    missing = sorted(set(weights) - set(components))
    if missing:
        raise ValueError(f"weights name components that were not computed: {missing}")
    scores = {name: float(value) for name, value in components.items()}
    scores["total"] = float(sum(weight * scores[name] for name, weight in weights.items()))
    return scores


@dataclass(frozen=True)
class Rubric:
    """Named components with weights: `rubric(components)` -> components + "total".

    Each component is expected in [0, 1], so `max_total` is the sum of the positive weights.
    """

    weights: dict[str, float] = field(default_factory=dict)

    def __call__(self, components: dict[str, float]) -> dict[str, float]:
        return compose(components, self.weights)

    @property
    def max_total(self) -> float:
        """The largest total, reached when every weighted component is 1."""
        return float(sum(w for w in self.weights.values() if w > 0))
