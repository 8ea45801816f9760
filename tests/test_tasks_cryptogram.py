"""cryptogram: the generator's facts, the reward of each hack, and totality of the score."""

from __future__ import annotations

import math
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from vlmrl.tasks import Example, get_task
from vlmrl.tasks.cryptogram import spaced, word_list

TASK = get_task("cryptogram", seed=0)
# "i can see" under the shift cipher a->b, b->c, ...: 7 letters, each substituted.
HAND = Example(image=Image.new("RGB", (8, 8)), prompt="", answer="i can see",
               meta={"message": "i can see", "spaced": "i _ c a n _ s e e", "coded": "j _ d b o _ t f f"})
TRUTH, CODED = "i _ c a n _ s e e", "j _ d b o _ t f f"


def score(text: str) -> dict[str, float]:
    return TASK.score(HAND, text)


def test_spaced_writes_letters_apart_and_underscores_between_words():
    assert spaced("i can see") == "i _ c a n _ s e e"
    assert spaced("a") == "a"


def test_word_list_is_the_shipped_one():
    words = word_list()
    assert len(words) == 2000 and words[:3] == ("the", "to", "and")


def test_examples_encode_the_message_with_a_derangement():
    task = get_task("cryptogram", seed=4, min_words=2, max_words=3, vocab_size=50)
    vocabulary = set(word_list()[:50])
    for idx in range(30):
        example = task.example(idx)
        meta = example.meta
        cipher = meta["cipher"]
        assert sorted(cipher) == list(string.ascii_lowercase)
        assert all(plain != coded for plain, coded in zip(string.ascii_lowercase, cipher))
        encode = dict(zip(string.ascii_lowercase, cipher))
        assert meta["coded"] == " ".join(encode.get(ch, ch) for ch in spaced(meta["message"]).split(" "))
        assert meta["coded"] in example.prompt and meta["message"] not in example.prompt
        assert 2 <= meta["n_words"] <= 3 and set(meta["message"].split()) <= vocabulary
        assert example.answer == meta["message"] and example.image.size == (224, 224)


def test_ood_messages_are_longer_than_training():
    task = get_task("cryptogram", max_words=2, ood_extra_words=3)
    counts = {task.example(i, "ood").meta["n_words"] for i in range(60)}
    assert counts == {3, 4, 5}


def test_image_size_is_configurable_and_the_image_depends_on_the_cipher():
    task = get_task("cryptogram", image_size=160)
    a, b = task.example(0), task.example(1)
    assert a.image.size == (160, 160)
    assert a.meta["cipher"] != b.meta["cipher"] and a.image.tobytes() != b.image.tobytes()


# --- the reward each case deserves -------------------------------------------------------------

def test_perfect_completion():
    assert score(f"<think> look up <chars> {TRUTH} </chars> </think> <answer> i can see </answer>") == {
        "format": 1.0, "decoding": 1.0, "correctness": 1.0, "accuracy": 1.0, "total": 3.0}


def test_copying_the_coded_message_into_chars_earns_no_decoding():
    scores = score(f"<think> <chars> {CODED} </chars> </think> <answer> jdbo tff </answer>")
    assert scores == {"format": 1.0, "decoding": 0.0, "correctness": 0.0, "accuracy": 0.0, "total": 1.0}


def test_right_answer_with_copied_chars_earns_no_correctness():
    scores = score(f"<think> <chars> {CODED} </chars> </think> <answer> i can see </answer>")
    assert scores == {"format": 1.0, "decoding": 0.0, "correctness": 0.0, "accuracy": 1.0, "total": 1.0}


def test_partial_decoding_is_paid_by_edit_distance():
    scores = score("<think> <chars> i _ c a n _ s e f </chars> </think> <answer> i can sef </answer>")
    assert scores["decoding"] == pytest.approx(1 - 1 / 17)
    assert scores["correctness"] == 0.0            # decoding is not exact
    assert scores["total"] == pytest.approx(1 + 16 / 17) and scores["accuracy"] == 0.0


def test_near_miss_answer_is_paid_by_edit_distance():
    scores = score(f"<think> <chars> {TRUTH} </chars> </think> <answer> i can sea </answer>")
    assert scores["correctness"] == pytest.approx(1 - 1 / 9)
    assert scores["total"] == pytest.approx(3 - 1 / 9) and scores["accuracy"] == 0.0


def test_copying_chars_into_the_answer_earns_no_correctness():
    scores = score(f"<think> <chars> {TRUTH} </chars> </think> <answer> {TRUTH} </answer>")
    assert scores == {"format": 1.0, "decoding": 1.0, "correctness": 0.0, "accuracy": 0.0, "total": 2.0}


@pytest.mark.parametrize("answer", ["", "   ", "\n"])
def test_empty_or_whitespace_answer(answer):
    scores = score(f"<think> <chars> {TRUTH} </chars> </think> <answer>{answer}</answer>")
    assert scores == {"format": 0.0, "decoding": 1.0, "correctness": 0.0, "accuracy": 0.0, "total": 1.0}


def test_answer_buried_in_extra_text_is_not_closer_than_chars():
    # distance 15 to the message, while the spaced <chars> are 8 away: the gate pays nothing
    scores = score(f"<think> <chars> {TRUTH} </chars> </think> <answer> the message is i can see </answer>")
    assert scores == {"format": 1.0, "decoding": 1.0, "correctness": 0.0, "accuracy": 0.0, "total": 2.0}


@pytest.mark.parametrize("text, expected", [
    (f"<think> <chars> {TRUTH} </chars> </think> <answer> i can see </answer> <answer> i can see </answer>",
     {"format": 0.0, "decoding": 1.0, "correctness": 0.0, "accuracy": 0.0, "total": 1.0}),
    (f"<think> <chars> {TRUTH} </chars> </think> <answer> <answer> i can see </answer> </answer>",
     {"format": 0.0, "decoding": 1.0, "correctness": 0.0, "accuracy": 0.0, "total": 1.0}),
    (f"<think> <chars> {TRUTH} </chars> <chars> {TRUTH} </chars> </think> <answer> i can see </answer>",
     {"format": 0.0, "decoding": 0.0, "correctness": 0.0, "accuracy": 1.0, "total": 0.0}),
    (f"<think> <chars> <chars> {TRUTH} </chars> </chars> </think> <answer> i can see </answer>",
     {"format": 0.0, "decoding": 0.0, "correctness": 0.0, "accuracy": 1.0, "total": 0.0}),
])
def test_repeated_or_nested_tags(text, expected):
    assert score(text) == expected


def test_chars_outside_the_think_block_breaks_only_the_format():
    scores = score(f"<chars> {TRUTH} </chars> <think> done </think> <answer> i can see </answer>")
    assert scores == {"format": 0.0, "decoding": 1.0, "correctness": 1.0, "accuracy": 1.0, "total": 2.0}


@pytest.mark.parametrize("text", ["i can see", f"{TRUTH} i can see", "<think> i can see </think>"])
def test_right_answer_outside_the_tags_earns_nothing(text):
    assert score(text) == {"format": 0.0, "decoding": 0.0, "correctness": 0.0, "accuracy": 0.0, "total": 0.0}


def test_answer_is_compared_after_lowercase_and_whitespace_collapse():
    scores = score(f"<think> <chars> {TRUTH.upper()} </chars> </think> <answer>  I   CAN\nSEE </answer>")
    assert scores["total"] == 3.0 and scores["accuracy"] == 1.0


# --- totality ----------------------------------------------------------------------------------

FRAGMENTS = ["<think>", "</think>", "<answer>", "</answer>", "<chars>", "</chars>", "_", " ", "\n",
             "i can see", TRUTH, CODED, "i", "e"]
texts = st.lists(st.one_of(st.text(max_size=12), st.sampled_from(FRAGMENTS)), max_size=12).map("".join)
EXAMPLES = [HAND] + [TASK.example(i, split) for i in range(2) for split in ("train", "ood")]


@settings(max_examples=200, deadline=None)
@given(text=texts, example=st.sampled_from(EXAMPLES))
def test_score_is_total_and_in_range(text, example):
    scores = TASK.score(example, text)
    assert set(scores) == {"format", "decoding", "correctness", "accuracy", "total"}
    assert all(math.isfinite(v) for v in scores.values())
    assert scores["format"] in (0.0, 1.0) and scores["accuracy"] in (0.0, 1.0)
    assert 0.0 <= scores["decoding"] <= 1.0 and 0.0 <= scores["correctness"] <= 1.0
    assert 0.0 <= scores["total"] <= 3.0
