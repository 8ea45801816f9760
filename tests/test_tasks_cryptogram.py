"""cryptogram: the generator's facts, the reward of each hack, and totality of the score."""

from __future__ import annotations

import math
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from vlmrl.errors import VlmrlError
from vlmrl.tasks import Example, get_task
from vlmrl.tasks.cryptogram import (decoded_letter_cells, grid_cells, message_words, spaced, table_letter_cells,
                                    tile_colors, walk_letter_cells, word_list)

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


def test_ood_longer_words_are_longer_than_every_training_word():
    task = get_task("cryptogram", min_words=1, max_words=3, max_word_length=4, ood="longer_words",
                    ood_extra_letters=2)
    train = [task.example(i, "train").meta["message"].split() for i in range(40)]
    ood = [task.example(i, "ood").meta["message"].split() for i in range(40)]
    assert {len(word) for words in train for word in words} <= {1, 2, 3, 4}
    assert {len(word) for words in ood for word in words} == {5, 6}
    assert {len(words) for words in ood} == {1, 2, 3}  # as many words as training: only their length is new
    strings = get_task("cryptogram", letters="abc", layout="grid", vocabulary="strings", max_word_length=2,
                       ood="longer_words", ood_extra_letters=1)
    assert {len(word) for i in range(20) for word in strings.example(i, "ood").meta["message"].split()} == {3}


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
# the demo's readable setting (below): 9 letters, two 3-letter words, one cell per table entry
READABLE = dict(letters="etaoinshr", layout="grid", cell_px=28, entries_per_row=3, min_word_length=3,
                max_word_length=3, min_words=2, max_words=2, ood_extra_words=1, instructions=False,
                reference="pairs", held_out="messages_and_ciphers")
SMALL = get_task("cryptogram", **READABLE)
EXAMPLES += [SMALL.example(i, split) for i in range(2) for split in ("train", "test", "ood")]


@settings(max_examples=200, deadline=None)
@given(text=texts, example=st.sampled_from(EXAMPLES))
def test_score_is_total_and_in_range(text, example):
    scores = TASK.score(example, text)
    assert set(scores) == {"format", "decoding", "correctness", "accuracy", "total"}
    assert all(math.isfinite(v) for v in scores.values())
    assert scores["format"] in (0.0, 1.0) and scores["accuracy"] in (0.0, 1.0)
    assert 0.0 <= scores["decoding"] <= 1.0 and 0.0 <= scores["correctness"] <= 1.0
    assert 0.0 <= scores["total"] <= 3.0


# --- the readable setting: a small alphabet on the merged-patch grid ---------------------------

def test_small_alphabet_messages_and_derangements_use_only_its_letters():
    words = message_words(SMALL.params)
    assert words[:6] == ("the", "are", "not", "his", "one", "has") and len(words) == 30
    for idx in range(40):
        meta = SMALL.example(idx, "train").meta
        assert sorted(meta["cipher"]) == sorted("etaoinshr")
        assert all(plain != coded for plain, coded in zip("etaoinshr", meta["cipher"]))
        assert all(word in words for word in meta["message"].split()) and meta["n_words"] == 2


def test_grid_layout_puts_each_entry_in_one_28_px_cell_sorted_by_coded_letter():
    example = SMALL.example(0, "test")
    assert example.image.size == (84, 84)
    assert example.meta["cells"] == {"a": [0, 0, 28, 28], "e": [28, 0, 56, 28], "h": [56, 0, 84, 28],
                                     "i": [0, 28, 28, 56], "n": [28, 28, 56, 56], "o": [56, 28, 84, 56],
                                     "r": [0, 56, 28, 84], "s": [28, 56, 56, 84], "t": [56, 56, 84, 84]}
    assert grid_cells("abc", 56, 2) == {"a": (0, 0, 56, 56), "b": (56, 0, 112, 56), "c": (0, 56, 56, 112)}
    # the coded letters (left halves) are the same in every image; the plain letters (right halves) follow the cipher
    other = next(e for e in (SMALL.example(i, "test") for i in range(1, 20))
                 if e.meta["cipher"][0] != example.meta["cipher"][0])
    left, right = (0, 0, 14, 84), (14, 0, 28, 28)
    assert example.image.crop(left).tobytes() == other.image.crop(left).tobytes()
    decode = {coded: plain for plain, coded in zip("etaoinshr", example.meta["cipher"])}
    decode_other = {coded: plain for plain, coded in zip("etaoinshr", other.meta["cipher"])}
    same_plain_half = example.image.crop(right).tobytes() == other.image.crop(right).tobytes()
    assert same_plain_half == (decode["a"] == decode_other["a"])


def test_short_prompt_and_pairs_reference():
    example = SMALL.example(0, "test")
    assert example.prompt == "Coded message: a o s _ o t r"
    assert example.reference_completion == ("<think> a t, o h, s e, _ o h, t i, r s, <chars> t h e _ h i s </chars> "
                                            "</think> <answer> the his </answer>")
    assert SMALL.score(example, example.reference_completion)["total"] == 3.0
    chars_only = get_task("cryptogram", **{**READABLE, "reference": "chars"}).example(0, "test")
    assert chars_only.reference_completion == ("<think> <chars> t h e _ h i s </chars> </think> "
                                               "<answer> the his </answer>")


def test_echoing_the_coded_message_earns_nothing_in_the_readable_setting():
    for idx in range(20):
        example = SMALL.example(idx, "test")
        coded = example.meta["coded"]
        words = coded.replace(" ", "").replace("_", " ")
        echo = f"<think> <chars> {coded} </chars> </think> <answer> {words} </answer>"
        assert SMALL.score(example, echo) == {"format": 1.0, "decoding": 0.0, "correctness": 0.0,
                                              "accuracy": 0.0, "total": 1.0}


def test_held_out_messages_and_ciphers_never_occur_in_training():
    def drawn(task, split):
        metas = [task.example(i, split).meta for i in range(300)]
        return {m["message"] for m in metas}, {m["cipher"] for m in metas}

    train_messages, train_ciphers = drawn(SMALL, "train")
    test_messages, test_ciphers = drawn(SMALL, "test")
    assert not train_messages & test_messages and not train_ciphers & test_ciphers
    assert len(test_messages) > 100 and len(test_ciphers) == 300
    # by pairs (the default), a test message may be a training message with another cipher
    pairs = get_task("cryptogram", **{**READABLE, "held_out": "pairs"})
    assert drawn(pairs, "train")[0] & drawn(pairs, "test")[0]


def test_readable_examples_are_deterministic_from_seed_split_and_index():
    a, b = SMALL.example(5, "test"), get_task("cryptogram", **READABLE).example(5, "test")
    assert (a.prompt, a.reference_completion, a.meta) == (b.prompt, b.reference_completion, b.meta)
    assert a.image.tobytes() == b.image.tobytes()
    assert SMALL.example(5, "train").meta["message"] != a.meta["message"]


def test_a_pairs_reference_is_measured_where_each_letter_is_looked_up():
    """With reference=pairs a letter is decoded in the walk ("a t,": coded a, plain t), right after
    its coded letter; the <chars> block copies the walk. The attention measure reads the walk."""
    example = SMALL.example(0, "test")  # "t h e _ h i s" coded "a o s _ o t r"
    walk = walk_letter_cells(example)
    text = example.reference_completion
    assert [text[a:b] for a, b, _ in walk] == list("thehis")
    assert all(b <= text.index("<chars>") for _, b, _ in walk)
    assert [box for *_, box in walk] == [box for *_, box in decoded_letter_cells(example)]
    assert SMALL.answer_regions(example) == walk


def test_decoded_letter_cells_point_each_letter_of_chars_at_its_coded_letters_cell():
    example = SMALL.example(0, "test")  # "t h e _ h i s" coded "a o s _ o t r"
    spans = decoded_letter_cells(example)
    text = example.reference_completion
    assert [text[a:b] for a, b, _ in spans] == list("thehis")
    assert [box for _, _, box in spans] == [(0, 0, 28, 28), (56, 28, 84, 56), (28, 56, 56, 84),
                                            (56, 28, 84, 56), (56, 56, 84, 84), (0, 56, 28, 84)]
    chars = get_task("cryptogram", **(READABLE | {"reference": "chars"}))
    assert chars.answer_regions(chars.example(0, "test")) == decoded_letter_cells(chars.example(0, "test"))
    default = TASK.example(0)
    assert len(decoded_letter_cells(default)) == len(default.meta["message"].replace(" ", ""))


def test_default_task_keeps_its_table_and_reports_its_cells():
    example = TASK.example(0)
    assert example.image.size == (224, 224) and len(example.meta["cells"]) == 26
    assert example.reference_completion.startswith("<think> Using the decoder, I look up each coded letter: ")
    # the plain half of an entry (its right 40%) on the 4 x 7 table inside a 5-px margin
    assert example.meta["cells"]["a"] == [37, 5, 58, 36] and example.meta["cells"]["z"] == [91, 188, 112, 219]


@pytest.mark.parametrize("params, message", [
    ({"letters": "ab1"}, "letters must be 2 or more distinct letters a..z, got 'ab1'"),
    ({"letters": "etaoinshr"}, "the table layout shows all 26 letters; letters='etaoinshr' needs layout=grid"),
    ({"letters": "xq", "layout": "grid"},
     "only 0 of the 2000 words fit letters='xq' and word lengths 1..20; allow more"),
    ({"layout": "spiral"}, "layout must be one of table, grid, got 'spiral'"),
    ({"reference": "essay"}, "reference must be one of walk, pairs, chars, table, got 'essay'"),
    ({"reference": "table"}, "reference=table reads the grid decoder entry by entry; it needs layout=grid, "
                             "got layout=table"),
    ({"held_out": "none"}, "held_out must be one of pairs, messages_and_ciphers, got 'none'"),
    ({"min_word_length": 4, "max_word_length": 3}, "need 1 <= min_word_length <= max_word_length, got 4, 3"),
    ({"ood": "harder"}, "ood must be one of more_words, longer_words, got 'harder'"),
    ({"ood": "longer_words"},
     "ood=longer_words: only 0 of the 2000 words fit letters='abcdefghijklmnopqrstuvwxyz' with 21..23 letters; "
     "allow more"),
])
def test_bad_parameters_are_one_line_errors(params, message):
    with pytest.raises(VlmrlError) as error:
        get_task("cryptogram", **params)
    assert str(error.value) == message


def test_message_entries_show_only_the_plain_letters_the_message_needs():
    task = get_task("cryptogram", **{**READABLE, "entries": "message"})
    example = task.example(0, "test")  # coded "a o s _ o t r": cells a, o, r, s, t filled
    full = SMALL.example(0, "test")
    assert example.meta == full.meta and example.prompt == full.prompt
    for coded, (x0, y0, x1, y1) in example.meta["cells"].items():
        plain_half = (x0 + 14, y0, x1, y1)
        same = example.image.crop(plain_half).tobytes() == full.image.crop(plain_half).tobytes()
        blank = [color for _, color in example.image.crop(plain_half).getcolors()] == [(255, 255, 255)]
        assert (same, blank) == ((True, False) if coded in "aorst" else (False, True)), coded
    with pytest.raises(VlmrlError, match="^entries=message and tiles=true need layout=grid$"):
        get_task("cryptogram", entries="message")


def test_alone_entries_draw_only_the_message_s_entries_packed():
    task = get_task("cryptogram", **{**READABLE, "entries": "alone"})
    example, full = task.example(0, "test"), SMALL.example(0, "test")  # coded "a o s _ o t r"
    assert example.prompt == full.prompt and example.reference_completion == full.reference_completion
    assert example.image.size == (84, 56)  # five entries, three to a row
    assert example.meta["cells"] == {"a": [0, 0, 28, 28], "o": [28, 0, 56, 28], "r": [56, 0, 84, 28],
                                     "s": [0, 28, 28, 56], "t": [28, 28, 56, 56]}
    for coded, box in example.meta["cells"].items():  # each entry drawn as in the full table, moved
        assert example.image.crop(tuple(box)).tobytes() == full.image.crop(tuple(full.meta["cells"][coded])).tobytes()
    one = get_task("cryptogram", letters="abcdefgh", layout="grid", cell_px=56, entries="alone",
                   vocabulary="strings", min_word_length=1, max_word_length=1, max_words=1)
    single = one.example(0, "train")
    assert single.image.size == (56, 56) and list(single.meta["cells"]) == [single.meta["coded"]]
    with pytest.raises(VlmrlError, match="^entries=alone and tiles=true need layout=grid$"):
        get_task("cryptogram", entries="alone")


ONE_LETTER = dict(layout="grid", cell_px=28, entries_per_row=6, vocabulary="strings", min_word_length=1,
                  max_word_length=1, min_words=1, max_words=1, instructions=False, reference="pairs")


def filled_cells(example: Example, message: Example, full: Example) -> set[str]:
    """The coded letters whose cell's plain half in `example` is drawn as in `full` (plain letter
    shown), each other one checked to be drawn as in `message` (blank: not one of the message's)."""
    filled = set()
    for coded, (x0, y0, x1, y1) in example.meta["cells"].items():
        half = ((x0 + x1) // 2, y0, x1, y1)  # a wide glyph may reach the next cell's coded half
        cell = example.image.crop(half).tobytes()
        shown, bare = full.image.crop(half).tobytes(), message.image.crop(half).tobytes()
        if cell == shown:
            filled.add(coded)
        else:
            assert cell == bare, coded
    return filled


def test_some_entries_fill_the_message_s_and_exactly_k_others_drawn_per_example():
    def made(entries, k=0):
        return get_task("cryptogram", **ONE_LETTER, entries=entries, extra_entries=k)

    message, full = made("message"), made("all")
    drawn = {}
    for k in (0, 1, 3, 25):
        task, again = made("some", k), made("some", k)
        for split, idx in (("train", 0), ("train", 1), ("test", 0), ("test", 5)):
            example = task.example(idx, split)
            reference = full.example(idx, split)
            assert {**example.meta, "filled": None} == {**reference.meta, "filled": None}
            assert example.prompt == reference.prompt
            filled = filled_cells(example, message.example(idx, split), reference)
            assert example.meta["coded"] in filled and len(filled) == k + 1, (k, split, idx)
            assert example.meta["filled"] == sorted(filled)
            assert again.example(idx, split).image.tobytes() == example.image.tobytes()  # deterministic
            drawn[k, split, idx] = filled - {example.meta["coded"]}
    assert len({frozenset(drawn[3, split, idx]) for split, idx in (("train", 0), ("train", 1), ("test", 0),
                                                                   ("test", 5))}) == 4  # drawn per example
    # a message of many letters leaves fewer others than asked: all of them are filled
    words = get_task("cryptogram", **{**READABLE, "entries": "some", "extra_entries": 8})
    assert words.example(0, "test").image.tobytes() == SMALL.example(0, "test").image.tobytes()
    for params, error in (({"entries": "some", "extra_entries": 26}, "extra_entries must be in 0..25, got 26"),
                          ({"extra_entries": 3}, "extra_entries=3 needs entries=some, got entries=all"),
                          ({"entries": "some"}, "entries=some and tiles=true need layout=grid")):
        with pytest.raises(VlmrlError) as raised:
            get_task("cryptogram", **params)
        assert str(raised.value) == error


def test_min_extra_entries_draws_the_number_of_others_per_example_within_its_range():
    def made(**params):
        return get_task("cryptogram", **ONE_LETTER, entries="some", **params)

    message, full = get_task("cryptogram", **ONE_LETTER, entries="message"), get_task("cryptogram", **ONE_LETTER)
    mixed, again = made(extra_entries=3, min_extra_entries=1), made(extra_entries=3, min_extra_entries=1)
    counts = []
    for idx in range(24):
        example = mixed.example(idx, "train")
        filled = filled_cells(example, message.example(idx, "train"), full.example(idx, "train"))
        assert example.meta["filled"] == sorted(filled) and example.meta["coded"] in filled
        assert again.example(idx, "train").image.tobytes() == example.image.tobytes()  # deterministic
        counts.append(len(filled) - 1)
    assert set(counts) == {1, 2, 3}  # every number of the range drawn, none outside it
    # a range of one number is that number of others, as without the range
    assert [len(made(extra_entries=2, min_extra_entries=2).example(idx, "test").meta["filled"])
            for idx in range(5)] == [3] * 5
    for params, error in (({"extra_entries": 1, "min_extra_entries": 2},
                           "min_extra_entries=2 needs entries=some and 0 <= min_extra_entries <= extra_entries=1"),
                          ({"extra_entries": 1, "min_extra_entries": -1},
                           "min_extra_entries=-1 needs entries=some and 0 <= min_extra_entries <= extra_entries=1")):
        with pytest.raises(VlmrlError) as raised:
            made(**params)
        assert str(raised.value) == error
    with pytest.raises(VlmrlError, match="min_extra_entries=0 needs entries=some"):
        get_task("cryptogram", **ONE_LETTER, entries="message", min_extra_entries=0)


def test_tiles_colour_each_plain_letter_by_its_own_hue():
    assert tile_colors("ab") == {"a": (204, 31, 31), "b": (31, 204, 204)}
    task = get_task("cryptogram", **{**READABLE, "tiles": True})
    example, plain_ink = task.example(0, "test"), SMALL.example(0, "test")
    colors = tile_colors("etaoinshr")
    decode = {coded: plain for plain, coded in zip("etaoinshr", example.meta["cipher"])}
    for coded, (x0, y0, x1, y1) in example.meta["cells"].items():
        assert example.image.getpixel((x0 + 14, y0)) == colors[decode[coded]]  # the tile's corner
        coded_half = (x0, y0, x0 + 14, y1)
        assert example.image.crop(coded_half).tobytes() == plain_ink.image.crop(coded_half).tobytes()


def test_string_messages_are_random_strings_of_the_letters():
    task = get_task("cryptogram", **{**READABLE, "vocabulary": "strings", "min_word_length": 2})
    words = [word for i in range(40) for word in task.example(i, "train").meta["message"].split()]
    assert all(set(word) <= set("etaoinshr") and 2 <= len(word) <= 3 for word in words)
    assert {len(word) for word in words} == {2, 3} and len(set(words)) > 30
    assert task.example(3, "test").meta["message"] == get_task(
        "cryptogram", **{**READABLE, "vocabulary": "strings", "min_word_length": 2}).example(3, "test").meta["message"]


def test_walk_letter_cells_point_each_looked_up_letter_at_its_cell():
    from vlmrl.tasks.cryptogram import walk_letter_cells

    example = SMALL.example(0, "test")  # "<think> a t, o h, s e, _ o h, t i, r s, <chars> ..."
    spans = walk_letter_cells(example)
    text = example.reference_completion
    assert [text[a:b] for a, b, _ in spans] == list("thehis")
    assert [box for _, _, box in spans] == [box for _, _, box in decoded_letter_cells(example)]
    assert spans[0][:2] == (10, 11) and walk_letter_cells(TASK.example(0)) == []


def test_a_table_reference_reads_every_filled_entry_in_grid_order_then_walks_the_message():
    """reference=table: "decoder: a q, b x, ... message:" (every filled cell, sorted by coded letter),
    then the pairs walk and <chars>; the attention measure reads each message letter's table entry,
    where it is read from the image (the walk copies it from the text)."""
    task = get_task("cryptogram", **{**READABLE, "reference": "table"})
    example, pairs = task.example(0, "test"), SMALL.example(0, "test")  # "t h e _ h i s" coded "a o s _ o t r"
    assert {**example.meta} == {**pairs.meta} and example.image.tobytes() == pairs.image.tobytes()
    decode = {coded: plain for plain, coded in zip(example.meta["letters"], example.meta["cipher"])}
    table = " ".join(f"{coded} {decode[coded]}," for coded in sorted(decode))
    assert example.reference_completion == pairs.reference_completion.replace(
        "<think> ", f"<think> decoder: {table} message: ")
    text, read = example.reference_completion, table_letter_cells(example)
    assert [text[a:b] for a, b, _ in read] == [decode[c] for c in sorted(decode)]
    assert [box for *_, box in read] == [tuple(example.meta["cells"][c]) for c in sorted(decode)]
    walk = walk_letter_cells(example)
    assert [text[a:b] for a, b, _ in walk] == list("thehis") and walk[0][0] > text.index("message:")
    regions = task.answer_regions(example)
    assert [text[a:b] for a, b, _ in regions] == list("thehis") and all(b < text.index("message:")
                                                                        for _, b, _ in regions)
    assert [box for *_, box in regions] == [box for *_, box in walk]
    assert task.score(example, text)["total"] == 3.0
    # only the filled cells are read: the message's entries and the k others
    some = get_task("cryptogram", **{**ONE_LETTER, "reference": "table"}, entries="some", extra_entries=2).example(3, "train")
    listed = some.reference_completion.split("decoder: ")[1].split(" message:")[0]
    assert [pair.split()[0] for pair in listed.split(", ")] == some.meta["filled"]
    assert table_letter_cells(pairs) == [] and table_letter_cells(TASK.example(0)) == []


def test_pair_breaks_write_each_word_break_of_the_walk_as_a_pair_and_walk_commas_drop_its_commas():
    """pair_breaks=true: "_ _," in the walk where a lone "_" was, so every item of the walk is a
    pair (a regular stride); the decoder, the <chars> block, the letters' regions and the score
    are those of the lone "_". walk_commas=false: the walk's pairs without commas ("a t o h _ _"),
    read back letter for letter; the table keeps its commas."""
    for reference in ("pairs", "table"):
        lone = get_task("cryptogram", **{**READABLE, "reference": reference}).example(0, "test")
        paired = get_task("cryptogram", **{**READABLE, "reference": reference, "pair_breaks": True}).example(0, "test")
        assert lone.reference_completion.count(" _ ") == 2  # "t h e _ h i s": one in the walk, one in <chars>
        assert paired.reference_completion == lone.reference_completion.replace("e, _ o", "e, _ _, o", 1)
        assert paired.meta == lone.meta and paired.image.tobytes() == lone.image.tobytes()
        text, walk = paired.reference_completion, walk_letter_cells(paired)
        assert [text[a:b] for a, b, _ in walk] == list("thehis")
        assert [box for *_, box in walk] == [box for *_, box in walk_letter_cells(lone)]
        assert get_task("cryptogram", **{**READABLE, "reference": reference, "pair_breaks": True}).score(
            paired, text)["total"] == 3.0
        bare = get_task("cryptogram", **{**READABLE, "reference": reference, "pair_breaks": True,
                                         "walk_commas": False}).example(0, "test")
        walk = bare.reference_completion.split("<chars>")[0].split("message: ")[-1].split("<think> ")[-1]
        assert walk == "a t o h s e _ _ o h t i r s "  # the coded letters "a o s _ o t r" with their plain ones
        assert [bare.reference_completion[a:b] for a, b, _ in walk_letter_cells(bare)] == list("thehis")
        assert [box for *_, box in walk_letter_cells(bare)] == [box for *_, box in walk_letter_cells(lone)]
    assert len(table_letter_cells(bare)) == 9  # the table keeps its commas
    with pytest.raises(VlmrlError, match="pair_breaks .* needs reference=pairs or table, got reference=walk"):
        get_task("cryptogram", pair_breaks=True)
    with pytest.raises(VlmrlError, match="walk_commas=false needs pair_breaks=true"):
        get_task("cryptogram", **{**READABLE, "reference": "pairs"}, walk_commas=False)


def test_decoder_last_puts_the_image_after_the_coded_message():
    """decoder_last=true: the prompt ends with the `<image>` marker, so the chat turn holds the text
    first and the image after it (the completion as far from each cell whatever the message's
    length); the example is otherwise the same."""
    from vlmrl.rollout.prompts import chat_messages

    last = get_task("cryptogram", **{**READABLE, "decoder_last": True}).example(0, "test")
    first = SMALL.example(0, "test")
    assert last.prompt == first.prompt + "\n<image>" and last.meta == first.meta
    assert last.image.tobytes() == first.image.tobytes()
    assert last.reference_completion == first.reference_completion
    assert [part["type"] for part in chat_messages(last)[0]["content"]] == ["text", "image"]
    assert [part["type"] for part in chat_messages(first)[0]["content"]] == ["image", "text"]


@pytest.mark.parametrize("reference", ["walk", "pairs", "chars", "table"])
def test_a_one_letter_message_s_reference_scores_the_maximum(reference):
    """A one-letter message is its own spaced form: the reference's <chars> equals its answer, which
    was therefore never "strictly closer" than the <chars>, and correctness was never paid (2 of 3)."""
    task = get_task("cryptogram", vocabulary="strings", min_words=1, max_words=1, max_word_length=1,
                    reference=reference, **({"layout": "grid"} if reference == "table" else {}))
    for idx in range(20):
        example = task.example(idx, "train")
        assert len(example.answer) == 1
        assert task.score(example, example.reference_completion) == {
            "format": 1.0, "decoding": 1.0, "correctness": 1.0, "accuracy": 1.0, "total": 3.0}
    copied = f"<think> <chars> {example.answer} </chars> </think> <answer> x </answer>"
    assert task.score(example, copied)["correctness"] == 0.0  # a wrong answer still earns nothing


@pytest.mark.parametrize("letters", ["ab", "abc"])
def test_a_message_space_too_small_to_split_is_a_parameter_error(letters):
    """held_out=messages_and_ciphers over 2 or 3 one-letter messages and 1 or 2 ciphers puts every
    draw on one side: a RuntimeError ("no message landed in the split") at the first example of the
    other side, before; now one line when the task is made."""
    params = {"letters": letters, "layout": "grid", "vocabulary": "strings", "max_word_length": 1, "max_words": 1}
    with pytest.raises(VlmrlError, match=r"^held_out=messages_and_ciphers leaves the (train|test) split 0\.0% of the "
                                         r"\(message, cipher\) draws: \d messages and \d ciphers? of \d letters are too "
                                         r"few to split between train and test; .* or use held_out=pairs$"):
        get_task("cryptogram", held_out="messages_and_ciphers", **params)
    task = get_task("cryptogram", held_out="pairs", **params)  # pairs split these spaces: both sides draw
    assert task.example(0, "train") and task.example(0, "test")


def test_split_shares_count_small_spaces_draw_by_draw():
    from vlmrl.tasks.cryptogram import derangement_count, split_shares

    assert [derangement_count(n) for n in (2, 3, 4, 5, 26)][:4] == [1, 2, 9, 44]
    four = get_task("cryptogram", letters="abcd", layout="grid", vocabulary="strings", max_word_length=1,
                    max_words=1, held_out="messages_and_ciphers")
    shares = split_shares(four.params)
    assert 0.03 < shares["train"] < 0.5 and 0.03 < shares["test"] < 0.5  # both sides draw
    for split in ("train", "test"):
        assert {four.example(i, split).meta["split"] for i in range(5)} == {split}
    assert split_shares(TASK.params) == {"train": 0.5, "test": 0.5}  # 2000 words, 26 letters: too many to count
