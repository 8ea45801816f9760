"""The reward pieces: exact values on hand-made inputs, and totality on arbitrary strings."""

from __future__ import annotations

import math
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmrl.rewards.verify import (
    Rubric,
    closer_than,
    collapse_whitespace,
    compose,
    count_tag,
    edit_distance,
    extract_tag,
    iou,
    last_number,
    math_equal,
    normalize_math_string,
    normalized_edit_similarity,
    parse_box,
    think_answer_format,
)

FRAGMENTS = ["<think>", "</think>", "<answer>", "</answer>", "<chars>", "</chars>", "<", ">", "/", "[", "]",
             ",", "_", " ", "\n", "3", "-1.5", "[1, 2, 3, 4]", "\\boxed{", "}", "{", "$", "A", "(A)", "x",
             "\\frac{1}{2}", "°", "1e400", "9" * 40, "so", "circle"]
texts = st.lists(st.one_of(st.text(max_size=12), st.sampled_from(FRAGMENTS)), max_size=10).map("".join)
SETTINGS = settings(max_examples=200, deadline=None)


# --- tags and format ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("<answer> 42 </answer>", "42"),
    ("pre <answer></answer> post", ""),
    ("<answer>1</answer><answer>2</answer>", None),          # repeated
    ("<answer><answer>1</answer></answer>", None),           # nested
    ("</answer>1<answer>", None),                            # closed before opened
    ("<answer>1", None),                                     # never closed
    ("<Answer>1</Answer>", None),                            # tags are exact, lower case
    ("no tags at all", None),
])
def test_extract_tag(text, expected):
    assert extract_tag(text, "answer") == expected


def test_count_tag_counts_the_larger_of_openings_and_closings():
    assert count_tag("<a>x</a>", "a") == 1
    assert count_tag("<a><a>x</a>", "a") == 2
    assert count_tag("x</a></a></a>", "a") == 3
    assert count_tag("nothing", "a") == 0


@pytest.mark.parametrize("text, expected", [
    ("<think>reason</think><answer>3</answer>", 1.0),
    ("  \n<think> a <chars> b </chars> </think>\n <answer> 3 </answer>\n", 1.0),
    ("<think></think><answer>3</answer>", 1.0),              # an empty think is allowed
    ("<think>r</think><answer>  </answer>", 0.0),            # a blank answer is not
    ("<think>r</think>", 0.0),
    ("<answer>3</answer>", 0.0),
    ("<answer>3</answer><think>r</think>", 0.0),             # wrong order
    ("so <think>r</think><answer>3</answer>", 0.0),          # text before
    ("<think>r</think><answer>3</answer> 3", 0.0),           # text after
    ("<think>r</think> x <answer>3</answer>", 0.0),          # text between
    ("<think>r</think><answer>3</answer><answer>3</answer>", 0.0),
    ("<think><think>r</think></think><answer>3</answer>", 0.0),
    ("<think>r <answer>3</answer></think><answer>3</answer>", 0.0),
])
def test_think_answer_format(text, expected):
    assert think_answer_format(text) == expected


# --- edit distance and the gate ----------------------------------------------------------------

def test_normalized_edit_similarity_exact_values():
    assert edit_distance("kitten", "sitting") == 3
    assert normalized_edit_similarity("kitten", "sitting") == pytest.approx(1 - 3 / 7)
    assert normalized_edit_similarity("", "") == 1.0
    assert normalized_edit_similarity("abc", "") == 0.0
    assert normalized_edit_similarity("abc", "abc") == 1.0


def test_closer_than_is_strict():
    truth, coded = "i _ c a n", "j _ d b o"
    assert closer_than("i _ c a o", truth, coded)       # 1 edit < 4 edits
    assert not closer_than(coded, truth, coded)         # copying the input never passes
    assert not closer_than("x _ y z w", truth, coded)   # as far as the input: no credit


def test_collapse_whitespace():
    assert collapse_whitespace("  i \t can\n\nsee ") == "i can see"


# --- numbers and boxes -------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("there are 3 circles", 3.0), ("1, 2, then 4.5.", 4.5), ("-2 and -7", -7.0), ("none", None),
    ("9" * 400, None),  # overflows to infinity: not a number we return
])
def test_last_number(text, expected):
    assert last_number(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("[1, 2, 30, 40]", (1.0, 2.0, 30.0, 40.0)),
    ("the box is [ 1.5 ,2,30 , 40 ]", (1.5, 2.0, 30.0, 40.0)),
    ("[1, 2, 30, 40] [5, 6, 7, 8]", None),      # two boxes
    ("[1, 2, 30, 40, 50]", None),               # five numbers
    ("[1, 2, 30, 40] or 7", None),              # another number outside the box
    ("(1, 2, 30, 40)", None),                   # not bracketed
    ("1 2 30 40", None),
    ("", None),
])
def test_parse_box(text, expected):
    assert parse_box(text) == expected


def test_iou_exact_values():
    assert iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
    assert iou([0, 0, 10, 10], [5, 0, 15, 10]) == pytest.approx(50 / 150)
    assert iou([0, 0, 10, 10], [10, 10, 20, 20]) == 0.0
    assert iou([0, 0, 168, 168], [10, 20, 40, 50]) == pytest.approx(900 / 168 ** 2)
    assert iou([10, 10, 0, 0], [0, 0, 10, 10]) == 0.0            # inverted box
    assert iou([0, 0, float("nan"), 1], [0, 0, 1, 1]) == 0.0
    assert iou([0, 0, 1], [0, 0, 1, 1]) == 0.0                   # not four numbers
    assert iou("abcd", [0, 0, 1, 1]) == 0.0


# --- math --------------------------------------------------------------------------------------

@pytest.mark.parametrize("pred, gold, expected", [
    ("5", "5", True), ("5.", "5", True), ("0.5", "\\frac{1}{2}", True), ("\\sqrt{12}", "2\\sqrt{3}", True),
    ("145", "145°", True), ("145^\\circ", "145", True), ("x = 3", "3", True), ("$\\frac{3}{2}$", "1.5", True),
    ("(B)", "B", True), ("B.", "B", True), ("B", "(B)", True), ("A", "B", False), ("4", "B", False),
    ("6", "5", False), ("", "5", False), ("   ", "5", False),
    ("1 2 3 4 5", "5", False),                       # stuffed numbers
    ("The answer is 5, or maybe 6", "5", False),     # buried in text with another number
    ("1 2", "12", False),                            # spaces between digits are not dropped
    ("5" * 400, "5", False),
])
def test_math_equal(pred, gold, expected):
    assert math_equal(pred, gold) is expected


def test_math_equal_works_off_the_main_thread():
    results = []
    thread = threading.Thread(target=lambda: results.append(math_equal("0.5", "\\frac{1}{2}")))
    thread.start()
    thread.join()
    assert results == [True]


def test_normalize_math_string():
    assert normalize_math_string(" $145^{\\circ}$. ") == "145"
    assert normalize_math_string("(a)") == "a"
    assert normalize_math_string("\\text{cm}") == "cm"


# --- composition -------------------------------------------------------------------------------

def test_compose_and_rubric():
    scores = compose({"format": 1.0, "iou": 0.25, "accuracy": 0.0}, {"iou": 1.0, "format": 0.5})
    assert scores == {"format": 1.0, "iou": 0.25, "accuracy": 0.0, "total": 0.75}
    rubric = Rubric({"a": 1.0, "b": 0.5, "c": -1.0})
    assert rubric.max_total == 1.5
    assert rubric({"a": 1.0, "b": 1.0, "c": 1.0})["total"] == 0.5
    with pytest.raises(ValueError, match="missing|not computed"):
        compose({"a": 1.0}, {"b": 1.0})


# --- totality ----------------------------------------------------------------------------------

@SETTINGS
@given(text=texts, tag=st.sampled_from(["think", "answer", "chars", ""]))
def test_tag_functions_are_total(text, tag):
    content = extract_tag(text, tag)
    assert content is None or (isinstance(content, str) and content == content.strip())
    assert count_tag(text, tag) >= 0
    assert think_answer_format(text) in (0.0, 1.0)


@SETTINGS
@given(a=texts, b=texts, c=texts)
def test_distance_functions_are_total(a, b, c):
    value = normalized_edit_similarity(a, b)
    assert 0.0 <= value <= 1.0 and math.isfinite(value)
    assert isinstance(closer_than(a, b, c), bool)
    assert collapse_whitespace(a) == collapse_whitespace(collapse_whitespace(a))


@SETTINGS
@given(text=texts)
def test_number_and_box_parsers_are_total(text):
    number = last_number(text)
    assert number is None or math.isfinite(number)
    box = parse_box(text)
    assert box is None or (len(box) == 4 and all(math.isfinite(v) for v in box))


@SETTINGS
@given(a=st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=5),
       b=st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=5))
def test_iou_is_total(a, b):
    value = iou(a, b)
    assert 0.0 <= value <= 1.0 and math.isfinite(value)


@settings(max_examples=100, deadline=None)
@given(pred=texts, gold=st.one_of(texts, st.sampled_from(["5", "\\frac{1}{2}", "B", "145°", "2\\sqrt{3}"])))
def test_math_equal_is_total(pred, gold):
    assert isinstance(math_equal(pred, gold), bool)
    assert isinstance(normalize_math_string(pred), str)
