"""`cryptogram`: decode a substitution-ciphered message with the decoder drawn in the image.

After the Groundlight cryptogram work. A message of min_words..max_words English words (from the
word list shipped in `vlmrl/data/words.txt`) is enciphered with a fresh random derangement of a..z
(no letter maps to itself, so copying the coded text is never right). The image is the decoder: a
grid of the 26 pairs "coded letter -> plain letter", sorted by coded letter. The prompt gives the
coded message with spaced letters and `_` for spaces ("i can see" is "i _ c a n _ s e e" before
each letter is replaced by its code).

Completion: `<think> ... <chars> d e c o d e d _ t e x t </chars> ... </think> <answer> decoded text </answer>`

Reward components (total = format + decoding + correctness, in [0, 3]):
- format (0/1): one think block holding one chars block, then one non-blank answer block, nothing else.
- decoding [0, 1]: 1 - normalized edit distance between the <chars> content and the true spaced
  message, and 0 unless it is strictly closer to the truth than the coded message is.
- correctness [0, 1]: 1 - normalized edit distance between the answer and the true message, paid only
  when decoding is exact and the answer is strictly closer to the truth than the <chars> content is,
  or is the message itself (a one-letter message is its own spaced form: its <chars> is the answer).
- accuracy (0/1, not in the total): the answer equals the message (lower case, whitespace collapsed).
The OOD split has max_words+1..max_words+ood_extra_words words (`ood="more_words"`, the default),
or, with `ood="longer_words"`, min_words..max_words words each longer than any training word
(max_word_length+1..max_word_length+ood_extra_letters letters).

Readable by a small model (what `vlmrl demo --preset cryptogram` uses; defaults keep the task as
above): `letters` restricts the alphabet of the messages and the cipher (words made of other letters
are skipped, `min_word_length`/`max_word_length` bound the words), `layout="grid"` draws each table
entry as one square cell of `cell_px` pixels, the coded letter (black) in its left half and its
plain letter (blue) in its right half, cells sorted by coded letter, `entries_per_row` to a row:
with cell_px=28 an entry is exactly one merged patch of a Qwen2-VL-family tower (14-px patches
merged 2 x 2), so one image token holds both letters of the entry.
`entries="message"` leaves out the plain letters of coded letters the message does not use;
`entries="alone"` draws the message's entries alone, packed in order of coded letter with no empty
cell (a one-letter message's decoder is one cell: the letter shown alone, a reading stage of a
curriculum; the coded letter then says which cell is which, not its place in the full table).
`entries="some"` fills the message's entries and `extra_entries` others, drawn per example from its
seed, split and index (all the others where the message leaves fewer): a stage of a curriculum
between one filled cell among 26 (`message`, or `extra_entries=0`) and the whole table (`all`, or
`extra_entries=25` with a one-letter message), where the right cell must be looked up among
several filled ones; with `min_extra_entries` the number of others is drawn per example from
min_extra_entries..extra_entries (a mixed stage).
`instructions=false` gives the coded message alone as the prompt; `reference` picks the reference's
<think>: the prose walk over distinct letters (default), "pairs" (every coded letter of the message
in order followed by its plain letter, "a t, o h,", before the <chars> block; `pair_breaks=true`
writes a word break as a pair, "_ _,", and `walk_commas=false` drops the commas), the <chars> block
alone, or "table" (grid layout: the decoder read entry by entry in its order first, "decoder: a q,
b x, ... message:", every filled cell's coded and plain letter, then the pairs and <chars>: each
letter is read from the image in a fixed order, 26 reads an example with every entry filled, then
the pairs, which a model trained on it reads from the image again rather than copy from the text). `decoder_last=true` puts the image after the prompt's text.
`held_out="messages_and_ciphers"` keeps every test message and every test cipher out of training
(default "pairs": a test (message, cipher) pair never occurs in training, its message may).
A space of messages and ciphers so small that one split would get (almost) none of the draws is a
parameter error when the task is made (`split_shares`), not a failure at the example that finds out.
`meta["cells"]` maps each coded letter (each drawn one, with entries="alone") to the pixel box
[x0, y0, x1, y1] of its table cell, where its plain letter is drawn (the attention measure reads it);
with entries="some", `meta["filled"]` lists the coded letters whose plain letter is drawn.
"""

from __future__ import annotations

import colorsys
import functools
import itertools
import math
import re
import string
from dataclasses import dataclass
from importlib import resources

from PIL import Image, ImageDraw, ImageFont

from vlmrl.data.columns import MARKER as IMAGE_MARKER
from vlmrl.errors import VlmrlError
from vlmrl.tasks.base import Example, Task, TaskParams, check, in_split, register_task
from vlmrl.rewards.verify import (
    Rubric,
    closer_than,
    collapse_whitespace,
    count_tag,
    extract_tag,
    normalized_edit_similarity,
    think_answer_format,
)

LETTERS = string.ascii_lowercase
RUBRIC = Rubric({"format": 1.0, "decoding": 1.0, "correctness": 1.0})
_COLUMNS, _ROWS = 4, 7
LAYOUTS = ("table", "grid")
HELD_OUT = ("pairs", "messages_and_ciphers")
REFERENCES = ("walk", "pairs", "chars", "table")
ENTRIES = ("all", "message", "alone", "some")
VOCABULARIES = ("words", "strings")
OOD_FORMS = ("more_words", "longer_words")
TABLE_OPEN, TABLE_CLOSE = "decoder:", "message:"
"""reference=table: the words before and after the decoder's entries in the reference's <think>."""


@functools.lru_cache(maxsize=1)
def word_list() -> tuple[str, ...]:
    """The shipped English words, most frequent first (read once)."""
    text = resources.files("vlmrl").joinpath("data/words.txt").read_text(encoding="utf-8")
    return tuple(word for word in (line.strip().lower() for line in text.splitlines())
                 if word and word.isascii() and word.isalpha())


def message_words(params: "CryptogramParams") -> tuple[str, ...]:
    """The words messages are drawn from: of the vocab_size most frequent, those made of `letters`
    within the word lengths, in frequency order."""
    return _message_words(params.vocab_size, params.letters, params.min_word_length, params.max_word_length)


@functools.lru_cache(maxsize=16)
def _message_words(vocab_size: int, letters: str, shortest: int, longest: int) -> tuple[str, ...]:
    allowed = set(letters)
    return tuple(word for word in word_list()[:vocab_size]
                 if set(word) <= allowed and shortest <= len(word) <= longest)


def ood_words(params: "CryptogramParams") -> tuple[str, ...]:
    """The words of OOD messages with ood=longer_words: of the vocab_size most frequent, those made
    of `letters` and longer than max_word_length, by at most ood_extra_letters letters."""
    longest = params.max_word_length
    return _message_words(params.vocab_size, params.letters, longest + 1, longest + params.ood_extra_letters)


def derangement(letters: str, rng) -> str:
    """`letters` shuffled so that no letter keeps its place: expected e ~ 2.7 shuffles."""
    coded = list(letters)
    while True:
        rng.shuffle(coded)
        if all(a != b for a, b in zip(letters, coded)):
            return "".join(coded)


def spaced(message: str) -> str:
    """"i can see" -> "i _ c a n _ s e e"."""
    return " _ ".join(" ".join(word) for word in message.split())


Box = tuple[int, int, int, int]


@functools.lru_cache(maxsize=8)
def _decoder_template(size: int) -> tuple[Image.Image, ImageFont.FreeTypeFont, tuple[tuple[int, int], ...],
                                          tuple[Box, ...]]:
    """The decoder image without its plain letters (coded letters a..z, arrows, grid), the font,
    where each plain letter goes (its centre) and the box of its cell's plain half."""
    margin = max(2, size // 40)
    cell_w, cell_h = (size - 2 * margin) / _COLUMNS, (size - 2 * margin) / _ROWS
    font = ImageFont.load_default(size=max(8, int(cell_h * 0.62)))
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    slots, boxes = [], []
    for i, letter in enumerate(LETTERS):
        col, row = i % _COLUMNS, i // _COLUMNS
        left, top = margin + col * cell_w, margin + row * cell_h
        middle = top + cell_h / 2
        draw.rectangle((left + 1, top + 1, left + cell_w - 2, top + cell_h - 2), outline=(200, 200, 200))
        draw.text((left + cell_w * 0.2, middle), letter, font=font, fill=(0, 0, 0), anchor="mm")
        x0, x1 = left + cell_w * 0.38, left + cell_w * 0.55
        head = max(2.0, cell_h * 0.12)
        draw.line((x0, middle, x1, middle), fill=(110, 110, 110), width=max(1, size // 160))
        draw.polygon([(x1 + head, middle), (x1 - head / 2, middle - head), (x1 - head / 2, middle + head)],
                     fill=(110, 110, 110))
        slots.append((round(left + cell_w * 0.8), round(middle)))
        boxes.append((round(left + cell_w * 0.6), round(top), round(left + cell_w), round(top + cell_h)))
    return image, font, tuple(slots), tuple(boxes)


def decoder_image(decode: dict[str, str], size: int) -> Image.Image:
    """The decoder: for each coded letter a..z, an arrow to its plain letter (in blue)."""
    template, font, slots, _ = _decoder_template(size)
    image = template.copy()
    draw = ImageDraw.Draw(image)
    for letter, slot in zip(LETTERS, slots):
        draw.text(slot, decode[letter], font=font, fill=(20, 40, 200), anchor="mm")
    return image


def table_cells(size: int) -> dict[str, Box]:
    """Where the table layout draws each coded letter's plain letter: {coded: (x0, y0, x1, y1)}."""
    return dict(zip(LETTERS, _decoder_template(size)[3]))


def grid_size(n_letters: int, cell_px: int, entries_per_row: int) -> tuple[int, int]:
    """(width, height) of the grid layout: rows of `entries_per_row` square cells."""
    return min(n_letters, entries_per_row) * cell_px, -(-n_letters // entries_per_row) * cell_px


def grid_cells(coded_letters: str, cell_px: int, entries_per_row: int) -> dict[str, Box]:
    """The cell of each coded letter in the grid layout: {coded: (x0, y0, x1, y1)}, in the order of
    `coded_letters`, left to right then top to bottom."""
    cells = {}
    for i, letter in enumerate(coded_letters):
        row, column = divmod(i, entries_per_row)
        cells[letter] = (column * cell_px, row * cell_px, (column + 1) * cell_px, (row + 1) * cell_px)
    return cells


@functools.lru_cache(maxsize=4)
def _glyph_font(cell_px: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=max(8, round(cell_px * 0.75)))


Color = tuple[int, int, int]


def tile_colors(letters: str) -> dict[str, Color]:
    """A colour per letter: hues evenly spaced around the circle, in the order of `letters`."""
    return {letter: tuple(round(255 * c) for c in colorsys.hsv_to_rgb(i / len(letters), 0.85, 0.8))
            for i, letter in enumerate(letters)}


def grid_decoder_image(decode: dict[str, str], cell_px: int, entries_per_row: int,
                       shown: set[str] | None = None, tiles: dict[str, Color] | None = None) -> Image.Image:
    """The grid decoder: for each coded letter (sorted), one square cell with the coded letter (black)
    in its left half and its plain letter (blue) in its right half; with `shown`, only the coded
    letters in it get their plain letter (the other cells hold the coded letter alone); with
    `tiles`, a plain letter is white on a tile of its colour filling the right half."""
    coded_letters = "".join(sorted(decode))
    image = Image.new("RGB", grid_size(len(coded_letters), cell_px, entries_per_row), "white")
    draw = ImageDraw.Draw(image)
    font = _glyph_font(cell_px)
    for coded, (x0, y0, x1, y1) in grid_cells(coded_letters, cell_px, entries_per_row).items():
        middle = (y0 + y1) / 2
        draw.text((x0 + cell_px / 4, middle), coded, font=font, fill=(0, 0, 0), anchor="mm")
        if shown is not None and coded not in shown:
            continue
        plain = decode[coded]
        if tiles is not None:
            draw.rectangle((x0 + cell_px // 2, y0, x1 - 1, y1 - 1), fill=tiles[plain])
        draw.text((x0 + 3 * cell_px / 4, middle), plain, font=font, anchor="mm",
                  fill=(255, 255, 255) if tiles is not None else (20, 40, 200))
    return image


def decoded_letter_cells(example: Example) -> list[tuple[int, int, Box]]:
    """For each decoded letter in the reference's <chars> block: its (start, end) characters in
    `example.reference_completion` and the box of the table cell that decodes it (`meta["cells"]`
    of its coded letter)."""
    text, meta = example.reference_completion, example.meta
    start = text.index("<chars>") + len("<chars>")
    end = text.index("</chars>", start)
    coded = [ch for ch in meta["coded"].split(" ") if ch != "_"]
    spans = [(start + m.start(), start + m.end()) for m in re.finditer(r"[a-z]", text[start:end])]
    return [(a, b, tuple(meta["cells"][c])) for (a, b), c in zip(spans, coded, strict=True)]


def walk_letter_cells(example: Example) -> list[tuple[int, int, Box]]:
    """With reference="pairs" or "table": for each plain letter of the walk before <chars> ("a t, o
    h,"; after the table's entries with "table"), where the letter is looked up, its (start, end)
    characters in `example.reference_completion` and the box of the table cell of the coded letter
    before it; [] for the other references."""
    text = example.reference_completion
    closed = text.find(TABLE_CLOSE)
    return _pair_cells(example, closed + len(TABLE_CLOSE) if closed >= 0 else 0, text.find("<chars>"))


def table_letter_cells(example: Example) -> list[tuple[int, int, Box]]:
    """With reference="table": for each plain letter of the decoder's entries ("decoder: a q, b x,
    ... message:"), in the grid's order, its (start, end) characters in
    `example.reference_completion` and the box of its cell; [] for the other references."""
    text = example.reference_completion
    opened = text.find(TABLE_OPEN)
    return [] if opened < 0 else _pair_cells(example, opened, text.find(TABLE_CLOSE))


def _pair_cells(example: Example, start: int, end: int) -> list[tuple[int, int, Box]]:
    """The "coded plain," pairs in `example.reference_completion[start:end]` (or, where the span has
    no comma, consecutive "coded plain" pairs, word breaks "_ _" among them: walk_commas=false):
    each plain letter's (start, end) characters and the box of its coded letter's cell."""
    text, cells = example.reference_completion, example.meta["cells"]
    pair = r"\b([a-z]) ([a-z])," if "," in text[start:end] else r"(?<!\S)([a-z_]) ([a-z_])(?!\S)"
    return [(start + m.start(2), start + m.end(2), tuple(cells[m.group(1)]))
            for m in re.finditer(pair, text[start:end]) if m.group(1) != "_"]


MIN_SPLIT_SHARE = 0.03
"""Least share of the generator's draws that must land in each of train and test: an example is
redrawn until one lands in its split, at most 1000 times, and 0.97**1000 is below 1e-13."""
ENUMERABLE = 20_000
"""Largest space of messages, ciphers or pairs that `split_shares` counts draw by draw; a larger one
splits about evenly (each member's side is a hash of it)."""


def derangement_count(n: int) -> int:
    """Derangements of n letters (the ciphers): 1, 2, 9, 44, ... for n = 2, 3, 4, 5."""
    count = 1  # D(0)
    for k in range(1, n + 1):
        count = k * count + (-1) ** k
    return count


def _message_draws(p: "CryptogramParams") -> list[tuple[str, float]] | None:
    """Every train or test message with the probability that `_example` draws it (a number of words,
    then each word), or None when there are more than ENUMERABLE."""
    if p.vocabulary == "words":
        words = [(word, 1 / len(message_words(p))) for word in message_words(p)]
    else:
        lengths = range(p.min_word_length, p.max_word_length + 1)
        if sum(len(p.letters) ** n for n in lengths) > ENUMERABLE:
            return None
        words = [("".join(letters), 1 / len(lengths) / len(p.letters) ** n)
                 for n in lengths for letters in itertools.product(p.letters, repeat=n)]
    counts = range(p.min_words, p.max_words + 1)
    if sum(len(words) ** k for k in counts) > ENUMERABLE:
        return None
    return [(" ".join(word for word, _ in drawn), math.prod(chance for _, chance in drawn) / len(counts))
            for k in counts for drawn in itertools.product(words, repeat=k)]


def _ciphers(letters: str) -> list[str] | None:
    """Every derangement of `letters` (all equally likely), or None when there are more than ENUMERABLE."""
    if derangement_count(len(letters)) > ENUMERABLE:
        return None
    return ["".join(c) for c in itertools.permutations(letters) if all(a != b for a, b in zip(letters, c))]


def split_shares(p: "CryptogramParams") -> dict[str, float]:
    """The share of the generator's (message, cipher) draws that belongs to each of train and test
    under `held_out`, counted where the spaces are small (ENUMERABLE); a large space splits about
    evenly and counts as 0.5."""
    return dict(_split_shares(p.held_out, p.vocabulary, p.letters, p.vocab_size, p.min_word_length,
                              p.max_word_length, p.min_words, p.max_words))


@functools.lru_cache(maxsize=16)
def _split_shares(held_out: str, vocabulary: str, letters: str, vocab_size: int, shortest: int, longest: int,
                  fewest: int, most: int) -> tuple[tuple[str, float], ...]:
    p = CryptogramParams(held_out=held_out, vocabulary=vocabulary, letters=letters, vocab_size=vocab_size,
                         min_word_length=shortest, max_word_length=longest, min_words=fewest, max_words=most)
    messages, ciphers = _message_draws(p), _ciphers(letters)
    shares = []
    for split in ("train", "test"):
        if held_out == "pairs":
            if messages is None or ciphers is None or len(messages) * len(ciphers) > ENUMERABLE:
                share = 0.5
            else:
                share = sum(chance for message, chance in messages for cipher in ciphers
                            if in_split(f"{message}|{cipher}", split)) / len(ciphers)
        else:
            message_share = 0.5 if messages is None else sum(
                chance for message, chance in messages if in_split(f"message:{message}", split))
            cipher_share = 0.5 if ciphers is None else (
                sum(in_split(f"cipher:{cipher}", split) for cipher in ciphers) / len(ciphers))
            share = message_share * cipher_share
        shares.append((split, share))
    return tuple(shares)


@dataclass
class CryptogramParams(TaskParams):
    """Parameters of the cryptogram task."""

    min_words: int = 1
    """Fewest words in a train or test message."""
    max_words: int = 3
    """Most words in a train or test message."""
    ood_extra_words: int = 2
    """OOD messages have max_words+1 .. max_words+ood_extra_words words (ood=more_words)."""
    ood: str = "more_words"
    """What makes the OOD split out of distribution: more_words (more words than any training
    message) or longer_words (as many words as training, each of max_word_length+1 ..
    max_word_length+ood_extra_letters letters: longer than any training word)."""
    ood_extra_letters: int = 3
    """ood=longer_words: OOD words are up to this many letters longer than max_word_length."""
    vocab_size: int = 2000
    """Words are drawn from this many most frequent words of the shipped list."""
    image_size: int = 224
    """Side of the square decoder image in pixels (letters stay legible from about 160); table layout."""
    letters: str = LETTERS
    """The alphabet of the messages and the cipher: words with other letters are never drawn, and
    the decoder shows these letters only."""
    vocabulary: str = "words"
    """words: English words from the shipped list; strings: random strings of `letters` (no word
    to guess from the first letters: the decoder is the only way to the message)."""
    min_word_length: int = 1
    """Shortest word a message may hold."""
    max_word_length: int = 20
    """Longest word a message may hold."""
    layout: str = "table"
    """table: a 4 x 7 table of "coded -> plain" on an image_size square; grid: per coded letter
    (sorted) one square cell of cell_px, the coded letter in its left half and its plain letter in
    its right half, entries_per_row cells to a row (the image size follows)."""
    cell_px: int = 28
    """Side of a cell in the grid layout (28: one merged patch of a Qwen2-VL-family tower, 14-px
    patches merged 2 x 2, holds both letters of an entry)."""
    entries_per_row: int = 2
    """Table entries (cells) per row in the grid layout."""
    tiles: bool = False
    """Grid layout: each plain letter in white on a tile of its own colour filling the cell's right
    half (hues evenly spaced over `letters`), so a random vision tower tells the letters apart by
    colour as well as by shape."""
    entries: str = "all"
    """Grid layout: all (every coded letter shows its plain letter), message (only the coded
    letters of the message do; the other cells hold the coded letter alone) or alone (only the
    message's entries are drawn, packed in order of coded letter: a one-letter message's decoder is
    a single cell) or some (the message's entries and `extra_entries` others, drawn per example)."""
    extra_entries: int = 0
    """entries=some: how many coded letters besides the message's also show their plain letter,
    drawn per example from its seed, split and index (all the others where the message leaves
    fewer); 0 is entries=message. With `min_extra_entries`, the most drawn."""
    min_extra_entries: int | None = None
    """entries=some: when set, the number of other filled entries is drawn per example, uniformly
    from min_extra_entries..extra_entries (a mixed stage of a curriculum: the easier decoders keep
    the reading paid while the harder ones teach the lookup); unset, every example has
    `extra_entries`."""
    instructions: bool = True
    """false: the prompt is the coded message alone (a model that learns the format from SFT)."""
    decoder_last: bool = False
    """true: the decoder image comes after the prompt's text (an `<image>` marker at its end), so
    the completion is as far from each cell whatever the message's length (a lookup learnt by place
    on one-letter messages then holds for words); false: before it, the chat template's default."""
    reference: str = "walk"
    """The reference completion's <think>: walk (each distinct coded letter looked up in prose, then
    the <chars> block), pairs (each coded letter of the message in order followed by its plain
    letter, "a t, o h,", then the <chars> block), chars (the <chars> block alone) or table (grid
    layout: "decoder: a q, b x, ... message:" reads every filled cell in the grid's order, then the
    pairs and the <chars> block)."""
    pair_breaks: bool = False
    """reference=pairs or table: true writes each word break of the walk as a pair of its own,
    "_ _,", so every item of the walk is a pair ("a t, _ _, o h,": the same number of tokens
    apart, a regular stride for the walk's in-order copies of the prompt and for the <chars> block's
    of the walk); false: a lone "_" ("a t, _ o h,")."""
    walk_commas: bool = True
    """reference=pairs or table: false writes the walk's pairs without their commas ("a t _ _ o
    h", with pair_breaks): the token before each coded letter is then the letter before it in the
    walk, as the token before it in the prompt is the coded letter before it, so copying the coded
    message into the walk is the plain in-order copy a transformer learns first (find the last
    letter written, copy the one after it; from text alone the small model copies 95.6% of the
    coded letters after 300 steps, against 65.4% with the commas: docs/results.md)."""
    held_out: str = "pairs"
    """pairs: a test (message, cipher) pair never occurs in training; messages_and_ciphers: no test
    message and no test cipher does (each is split by its own hash)."""

    def validate(self) -> None:
        super().validate()
        check(1 <= self.min_words <= self.max_words <= 50,
              f"need 1 <= min_words <= max_words <= 50, got {self.min_words}, {self.max_words}")
        check(1 <= self.ood_extra_words <= 50, f"ood_extra_words must be in 1..50, got {self.ood_extra_words}")
        check(self.ood in OOD_FORMS, f"ood must be one of {', '.join(OOD_FORMS)}, got {self.ood!r}")
        check(1 <= self.ood_extra_letters <= 20, f"ood_extra_letters must be in 1..20, got {self.ood_extra_letters}")
        words = len(word_list())
        check(10 <= self.vocab_size <= words, f"vocab_size must be in 10..{words}, got {self.vocab_size}")
        check(112 <= self.image_size <= 2048, f"image_size must be in 112..2048, got {self.image_size}")
        check(len(self.letters) >= 2 and set(self.letters) <= set(LETTERS)
              and len(set(self.letters)) == len(self.letters),
              f"letters must be 2 or more distinct letters a..z, got {self.letters!r}")
        check(1 <= self.min_word_length <= self.max_word_length,
              f"need 1 <= min_word_length <= max_word_length, got {self.min_word_length}, {self.max_word_length}")
        check(self.layout in LAYOUTS, f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        check(14 <= self.cell_px <= 256, f"cell_px must be in 14..256, got {self.cell_px}")
        check(1 <= self.entries_per_row <= 26, f"entries_per_row must be in 1..26, got {self.entries_per_row}")
        check(self.layout == "grid" or sorted(self.letters) == list(LETTERS),
              f"the table layout shows all 26 letters; letters={self.letters!r} needs layout=grid")
        check(self.entries in ENTRIES, f"entries must be one of {', '.join(ENTRIES)}, got {self.entries!r}")
        check(0 <= self.extra_entries < len(self.letters),
              f"extra_entries must be in 0..{len(self.letters) - 1}, got {self.extra_entries}")
        check(self.extra_entries == 0 or self.entries == "some",
              f"extra_entries={self.extra_entries} needs entries=some, got entries={self.entries}")
        check(self.min_extra_entries is None or (self.entries == "some"
                                                 and 0 <= self.min_extra_entries <= self.extra_entries),
              f"min_extra_entries={self.min_extra_entries} needs entries=some and 0 <= min_extra_entries <= "
              f"extra_entries={self.extra_entries}")
        check((self.entries == "all" and not self.tiles) or self.layout == "grid",
              f"entries={self.entries} and tiles=true need layout=grid")
        check(self.reference in REFERENCES,
              f"reference must be one of {', '.join(REFERENCES)}, got {self.reference!r}")
        check(self.reference != "table" or self.layout == "grid",
              f"reference=table reads the grid decoder entry by entry; it needs layout=grid, got layout={self.layout}")
        check(not self.pair_breaks or self.reference in ("pairs", "table"),
              f"pair_breaks writes the walk's word breaks as pairs; it needs reference=pairs or table, "
              f"got reference={self.reference}")
        check(self.walk_commas or self.pair_breaks,
              "walk_commas=false needs pair_breaks=true (a lone _ between pairs without commas is ambiguous)")
        check(self.held_out in HELD_OUT, f"held_out must be one of {', '.join(HELD_OUT)}, got {self.held_out!r}")
        check(self.vocabulary in VOCABULARIES,
              f"vocabulary must be one of {', '.join(VOCABULARIES)}, got {self.vocabulary!r}")
        words = len(message_words(self)) if self.vocabulary == "words" else 2
        check(words >= 2, f"only {words} of the {self.vocab_size} words fit letters={self.letters!r} and "
                          f"word lengths {self.min_word_length}..{self.max_word_length}; allow more")
        if self.ood == "longer_words" and self.vocabulary == "words":
            longer = len(ood_words(self))
            check(longer >= 2, f"ood=longer_words: only {longer} of the {self.vocab_size} words fit letters="
                               f"{self.letters!r} with {self.max_word_length + 1}.."
                               f"{self.max_word_length + self.ood_extra_letters} letters; allow more")
        split, share = min(split_shares(self).items(), key=lambda item: item[1])
        if share < MIN_SPLIT_SHARE:
            messages, ciphers = _message_draws(self), derangement_count(len(self.letters))
            raise VlmrlError(
                f"held_out={self.held_out} leaves the {split} split {share:.1%} of the (message, cipher) draws: "
                f"{len(messages) if messages is not None else f'over {ENUMERABLE:,}'} messages and "
                f"{ciphers:,} cipher{'s' if ciphers != 1 else ''} of {len(self.letters)} letters are too few to split "
                "between train and test; allow more words, longer messages or more letters"
                + (", or use held_out=pairs" if self.held_out != "pairs" else ""))


@register_task
class CryptogramTask(Task):
    """Decode a substitution cipher."""

    name = "cryptogram"
    description = "decode a substitution-ciphered message using the decoder image; OOD: longer messages"
    Params = CryptogramParams
    params: CryptogramParams

    @property
    def splits(self) -> tuple[str, ...]:
        return ("train", "test", "ood")

    def _example(self, idx: int, split: str) -> Example:
        p, rng = self.params, self.rng(split, idx)
        longer = split == "ood" and p.ood == "longer_words"
        vocab = (ood_words(p) if longer else message_words(p)) if p.vocabulary == "words" else ()
        more = split == "ood" and p.ood == "more_words"
        low, high = (p.max_words + 1, p.max_words + p.ood_extra_words) if more else (p.min_words, p.max_words)
        letters = p.letters
        for _ in range(1000):
            message = " ".join(self._word(rng, vocab, longer) for _ in range(rng.randint(low, high)))
            cipher = derangement(letters, rng)
            if self._belongs(message, cipher, split):
                break
        else:  # pragma: no cover - probability 2**-1000
            raise RuntimeError("no message landed in the split")
        encode = dict(zip(letters, cipher))
        decode = {coded: plain for plain, coded in encode.items()}
        plain_spaced = spaced(message)
        coded_spaced = " ".join(encode.get(ch, ch) for ch in plain_spaced.split(" "))
        prompt = f"Coded message: {coded_spaced}" if not p.instructions else (
                  "The image is a decoder: each coded letter has an arrow pointing to the plain letter it "
                  "stands for.\n"
                  f"Coded message (letters separated by spaces, _ between words): {coded_spaced}\n"
                  "Decode it. Inside <think> </think>, write the decoded letters inside <chars> </chars>, "
                  "spaced the same way with _ between words; then give the decoded message as plain words "
                  "inside <answer> </answer>.\n"
                  "Format: <think> ... <chars> d e c o d e d _ t e x t </chars> ... </think> "
                  "<answer> decoded text </answer>")
        if p.decoder_last:
            prompt += f"\n{IMAGE_MARKER}"
        seen: dict[str, str] = {}
        for ch in coded_spaced.split(" "):
            if ch != "_" and ch not in seen:
                seen[ch] = decode[ch]
        walk = ", ".join(f"{c}->{d}" for c, d in seen.items())
        comma = "," if p.walk_commas else ""
        word_break = f"_ _{comma}" if p.pair_breaks else "_"
        pairs = " ".join(word_break if ch == "_" else f"{ch} {decode[ch]}{comma}" for ch in coded_spaced.split(" "))
        image, cells, shown = self._decoder(rng, decode, set(coded_spaced.split(" ")) - {"_"})
        table = " ".join(f"{c} {decode[c]}," for c in sorted(cells) if shown is None or c in shown)
        think = {"walk": (f"Using the decoder, I look up each coded letter: {walk}. The decoded letters are "
                          f"<chars> {plain_spaced} </chars> and joining them into words gives the message."),
                 "pairs": f"{pairs} <chars> {plain_spaced} </chars>",
                 "table": f"{TABLE_OPEN} {table} {TABLE_CLOSE} {pairs} <chars> {plain_spaced} </chars>",
                 "chars": f"<chars> {plain_spaced} </chars>"}[p.reference]
        reference = f"<think> {think} </think> <answer> {message} </answer>"
        meta = {"idx": idx, "split": split, "message": message, "spaced": plain_spaced,
                "coded": coded_spaced, "cipher": cipher, "letters": letters, "n_words": len(message.split()),
                "image_size": list(image.size), "cells": {letter: list(cells[letter]) for letter in sorted(cells)}}
        if p.layout == "grid" and p.entries == "some":
            meta["filled"] = sorted(shown)
        return Example(image=image, prompt=prompt, answer=message, meta=meta, reference_completion=reference)

    def _decoder(self, rng, decode: dict[str, str], used: set[str]) -> tuple[Image.Image, dict[str, Box], set[str] | None]:
        """(the decoder image, each drawn coded letter's cell, the coded letters whose plain letter is
        filled in or None for every drawn one) for a message using the coded letters `used`; the
        grid's extra entries (entries=some) are drawn with the example's `rng`."""
        p = self.params
        if p.layout != "grid":
            return decoder_image(decode, p.image_size), table_cells(p.image_size), None
        drawn = {coded: decode[coded] for coded in used} if p.entries == "alone" else decode
        shown = None  # every drawn entry filled (all, alone)
        if p.entries == "message":
            shown = used
        elif p.entries == "some":
            shown = used | self._extra_entries(rng, used)
        image = grid_decoder_image(drawn, p.cell_px, p.entries_per_row, shown,
                                   tile_colors(p.letters) if p.tiles else None)
        return image, grid_cells("".join(sorted(drawn)), p.cell_px, p.entries_per_row), shown

    def answer_regions(self, example: Example) -> list[tuple[int, int, Box]]:
        """Each letter where it is decoded, and the table cell that decodes it: with reference="pairs"
        the walk's plain letters, each written right after its coded letter (`walk_letter_cells`;
        the <chars> block then copies them from the walk); with "table" the decoder's entries of the
        message's coded letters, where each is read from its cell (the walk after them copies the
        text), one per letter of the message; otherwise the <chars> block's letters
        (`decoded_letter_cells`)."""
        if self.params.reference == "pairs":
            return walk_letter_cells(example)
        if self.params.reference == "table":
            read = {box: (a, b, box) for a, b, box in table_letter_cells(example)}
            return [read[box] for _, _, box in walk_letter_cells(example)]
        return decoded_letter_cells(example)

    def image_only_spans(self, example: Example) -> list[tuple[int, int]]:
        """The plain letters the decoder tells: the table's entries (reference="table") and the
        walk's plain letters (a model that reads the decoder looks each up in the image again, not
        in the table's text: docs/results.md); with neither (reference=chars, or walk, whose
        prose lookups are not located and stay in the loss) the <chars> block's letters."""
        read = table_letter_cells(example) + walk_letter_cells(example) or decoded_letter_cells(example)
        return [(a, b) for a, b, _ in read]

    def _extra_entries(self, rng, used: set[str]) -> set[str]:
        """entries=some: `extra_entries` coded letters the message does not use (with
        `min_extra_entries`, a number drawn from min_extra_entries..extra_entries; all of them where
        there are fewer), drawn with the example's own `rng` after its message and cipher."""
        p = self.params
        k = p.extra_entries if p.min_extra_entries is None else rng.randint(p.min_extra_entries, p.extra_entries)
        others = sorted(set(p.letters) - used)
        return set(rng.sample(others, min(k, len(others))))

    def _word(self, rng, vocab: tuple[str, ...], longer: bool = False) -> str:
        """One word of a message: from the vocabulary, or a random string of `letters` (`longer`: of
        the OOD lengths past max_word_length)."""
        p = self.params
        if p.vocabulary == "words":
            return rng.choice(vocab)
        shortest, longest = ((p.max_word_length + 1, p.max_word_length + p.ood_extra_letters) if longer
                             else (p.min_word_length, p.max_word_length))
        return "".join(rng.choice(p.letters) for _ in range(rng.randint(shortest, longest)))

    def _belongs(self, message: str, cipher: str, split: str) -> bool:
        """Whether (message, cipher) may be drawn for `split` under `held_out`."""
        if self.params.held_out == "pairs":
            return in_split(f"{message}|{cipher}", split)
        return in_split(f"message:{message}", split) and in_split(f"cipher:{cipher}", split)

    def score(self, example: Example, completion: str) -> dict[str, float]:
        """format + decoding + correctness, total in [0, 3]; accuracy 0/1 (module docstring)."""
        message, truth, coded = example.meta["message"], example.meta["spaced"], example.meta["coded"]
        think = extract_tag(completion, "think")
        well_formed = (think_answer_format(completion) == 1.0 and count_tag(completion, "chars") == 1
                       and think is not None and extract_tag(think, "chars") is not None)
        chars_raw = extract_tag(completion, "chars")
        chars = collapse_whitespace(chars_raw.lower()) if chars_raw is not None else None
        decoding = 0.0
        if chars is not None and closer_than(chars, truth, coded):
            decoding = normalized_edit_similarity(chars, truth)
        answer_raw = extract_tag(completion, "answer")
        answer = collapse_whitespace(answer_raw.lower()) if answer_raw is not None else None
        correctness = 0.0
        if chars == truth and answer is not None and (answer == message or closer_than(answer, message, chars)):
            correctness = normalized_edit_similarity(answer, message)
        return RUBRIC({"format": float(well_formed), "decoding": decoding, "correctness": correctness,
                       "accuracy": float(answer == message)})
