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
  when decoding is exact and the answer is strictly closer to the truth than the <chars> content is.
- accuracy (0/1, not in the total): the answer equals the message (lower case, whitespace collapsed).
The OOD split has max_words+1..max_words+ood_extra_words words.
"""

from __future__ import annotations

import functools
import string
from dataclasses import dataclass
from importlib import resources

from PIL import Image, ImageDraw, ImageFont

from vlmrl.tasks.base import Example, Task, TaskParams, check, in_split, register_task
from vlmrl.tasks.rewards import (
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


@functools.lru_cache(maxsize=1)
def word_list() -> tuple[str, ...]:
    """The shipped English words, most frequent first (read once)."""
    text = resources.files("vlmrl").joinpath("data/words.txt").read_text(encoding="utf-8")
    return tuple(word for word in (line.strip().lower() for line in text.splitlines())
                 if word and word.isascii() and word.isalpha())


def spaced(message: str) -> str:
    """"i can see" -> "i _ c a n _ s e e"."""
    return " _ ".join(" ".join(word) for word in message.split())


@functools.lru_cache(maxsize=8)
def _decoder_template(size: int) -> tuple[Image.Image, ImageFont.FreeTypeFont, tuple[tuple[int, int], ...]]:
    """The decoder image without its plain letters (coded letters a..z, arrows, grid), the font,
    and where each plain letter goes."""
    margin = max(2, size // 40)
    cell_w, cell_h = (size - 2 * margin) / _COLUMNS, (size - 2 * margin) / _ROWS
    font = ImageFont.load_default(size=max(8, int(cell_h * 0.62)))
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    slots = []
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
    return image, font, tuple(slots)


def decoder_image(decode: dict[str, str], size: int) -> Image.Image:
    """The decoder: for each coded letter a..z, an arrow to its plain letter (in blue)."""
    template, font, slots = _decoder_template(size)
    image = template.copy()
    draw = ImageDraw.Draw(image)
    for letter, slot in zip(LETTERS, slots):
        draw.text(slot, decode[letter], font=font, fill=(20, 40, 200), anchor="mm")
    return image


@dataclass
class CryptogramParams(TaskParams):
    """Parameters of the cryptogram task."""

    min_words: int = 1
    """Fewest words in a train or test message."""
    max_words: int = 3
    """Most words in a train or test message."""
    ood_extra_words: int = 2
    """OOD messages have max_words+1 .. max_words+ood_extra_words words."""
    vocab_size: int = 2000
    """Words are drawn from this many most frequent words of the shipped list."""
    image_size: int = 224
    """Side of the square decoder image in pixels (letters stay legible from about 160)."""

    def validate(self) -> None:
        super().validate()
        check(1 <= self.min_words <= self.max_words <= 50,
              f"need 1 <= min_words <= max_words <= 50, got {self.min_words}, {self.max_words}")
        check(1 <= self.ood_extra_words <= 50, f"ood_extra_words must be in 1..50, got {self.ood_extra_words}")
        words = len(word_list())
        check(10 <= self.vocab_size <= words, f"vocab_size must be in 10..{words}, got {self.vocab_size}")
        check(112 <= self.image_size <= 2048, f"image_size must be in 112..2048, got {self.image_size}")


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
        vocab = word_list()[:p.vocab_size]
        low, high = (p.max_words + 1, p.max_words + p.ood_extra_words) if split == "ood" else (p.min_words, p.max_words)
        for _ in range(1000):
            message = " ".join(rng.choice(vocab) for _ in range(rng.randint(low, high)))
            coded_letters = list(LETTERS)
            while True:  # a derangement: expected e ~ 2.7 shuffles
                rng.shuffle(coded_letters)
                if all(a != b for a, b in zip(LETTERS, coded_letters)):
                    break
            cipher = "".join(coded_letters)
            if in_split(f"{message}|{cipher}", split):
                break
        else:  # pragma: no cover - probability 2**-1000
            raise RuntimeError("no message landed in the split")
        encode = dict(zip(LETTERS, cipher))
        decode = {coded: plain for plain, coded in encode.items()}
        plain_spaced = spaced(message)
        coded_spaced = " ".join(encode.get(ch, ch) for ch in plain_spaced.split(" "))
        prompt = ("The image is a decoder: each coded letter has an arrow pointing to the plain letter it "
                  "stands for.\n"
                  f"Coded message (letters separated by spaces, _ between words): {coded_spaced}\n"
                  "Decode it. Inside <think> </think>, write the decoded letters inside <chars> </chars>, "
                  "spaced the same way with _ between words; then give the decoded message as plain words "
                  "inside <answer> </answer>.\n"
                  "Format: <think> ... <chars> d e c o d e d _ t e x t </chars> ... </think> "
                  "<answer> decoded text </answer>")
        seen: dict[str, str] = {}
        for ch in coded_spaced.split(" "):
            if ch != "_" and ch not in seen:
                seen[ch] = decode[ch]
        walk = ", ".join(f"{c}->{d}" for c, d in seen.items())
        reference = (f"<think> Using the decoder, I look up each coded letter: {walk}. The decoded letters are "
                     f"<chars> {plain_spaced} </chars> and joining them into words gives the message. </think> "
                     f"<answer> {message} </answer>")
        meta = {"idx": idx, "split": split, "message": message, "spaced": plain_spaced,
                "coded": coded_spaced, "cipher": cipher, "n_words": len(message.split()),
                "image_size": [p.image_size, p.image_size]}
        return Example(image=decoder_image(decode, p.image_size), prompt=prompt, answer=message, meta=meta,
                       reference_completion=reference)

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
        if chars == truth and answer is not None and closer_than(answer, message, chars):
            correctness = normalized_edit_similarity(answer, message)
        return RUBRIC({"format": float(well_formed), "decoding": decoding, "correctness": correctness,
                       "accuracy": float(answer == message)})
