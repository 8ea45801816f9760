"""The offline tiny VLM: a real Hugging Face architecture with random weights, built here.

Nothing may be downloaded on the machines vlmrl is tested on, so tests and the CPU demo use a model
that vlmrl builds itself from a real architecture's config (one recipe per family in
tiny_families.py), a byte-level BPE tokenizer trained offline on task-shaped text with the
family's special tokens and a chat template of its shape, and an image processor that needs no
torchvision. The folder is written with `save_pretrained` and loads like any hub model, through
`vlmrl.models.loading.load_policy` or plain `transformers.AutoModelForImageTextToText.from_pretrained`.
Everything is deterministic from the seed.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from vlmrl.disk import output_folder, write_text, writing
from vlmrl.config import seed_rule
from vlmrl.errors import VlmrlError, require
from vlmrl.models.tiny_families import FAMILIES

ARCHES = tuple(FAMILIES)
SIZES = ("tiny", "small")
TOKENIZERS = ("bpe", "letters")
"""How the tiny tokenizer splits text: "bpe" merges letters into word pieces as real tokenizers do;
"letters" keeps every letter a token of its own (a space may join the letter after it: " q" is one
token), so a word is its spelling. A pretrained model knows how its word pieces are spelled; a random
one must learn each word's pieces from its letters, which the cryptogram's answer (spaced letters
joined into words) asks of it on every message (docs/results.md, "The cryptogram read from its letters")."""

# Tags the tasks and tool calls use; each becomes one token so a small model learns the format
# quickly (Qwen2.5's own tokenizer keeps the four tool tags whole too).
TAG_TOKENS = ("<think>", "</think>", "<answer>", "</answer>", "<chars>", "</chars>",
              "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
TINY_MODEL_VERSION = 3
"""Bumped when the same (size, arch, seed) builds a different model (2: tool tags, tool-call text; 3: a
video part in the Qwen chat templates)."""


@dataclass(frozen=True)
class TinySpec:
    """Widths and depths of one size of the tiny model."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vision_hidden: int
    vision_depth: int
    vision_heads: int
    vocab: int
    image: int
    """Side in pixels of the fixed-size families' images (the Qwen families resize dynamically)."""


SPECS = {
    # ~0.2M parameters: unit tests, builds in about a second.
    "tiny": TinySpec(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
                     vision_hidden=32, vision_depth=2, vision_heads=2, vocab=512, image=112),
    # ~4M parameters: learns the built-in tasks on a CPU (the demo).
    "small": TinySpec(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768,
                      vision_hidden=128, vision_depth=4, vision_heads=4, vocab=1024, image=224),
}


def tokenizer_corpus() -> list[str]:
    """Text the tiny tokenizer learns its merges from: task-shaped English, spaced letters, tags."""
    words = resources.files("vlmrl").joinpath("data/words.txt").read_text().split()
    sentences = [
        "How many circles are in the image? How many triangles? How many squares?",
        "Count the red triangles, the blue circles and the green squares in the image.",
        "I count the shapes one by one. So the total is 3. Therefore the answer is 4.",
        "The count is 5. The answer is 2. There are 6 circles, 7 squares and 1 triangle.",
        "Decode the message using the decoder image. Each coded letter maps to a plain letter.",
        "Give the bounding box of the blue square as [x1, y1, x2, y2] in pixels.",
        "Think step by step, then give the final answer inside the answer tags.",
        "Read the 1-digit code of the red tag. The blue tag is in the top left panel. It reads 7.",
        "Solve the geometry problem. Find the angle, the length, the area of the triangle.",
    ]
    spaced = [" ".join(w) for w in words]  # "h e l l o": the cryptogram's spelling
    numbers = [f"[{a}, {b}, {a + 40}, {b + 30}]" for a in range(0, 200, 7) for b in range(0, 200, 29)]
    calls = [json.dumps({"name": "zoom_window", "arguments": {"window": w}}) for w in range(9)]
    calls += [json.dumps({"name": "zoom", "arguments": {"box": [a, b, a + 56, b + 40]}}) for a in range(0, 400, 37)
              for b in range(0, 400, 53)]
    charset = string.ascii_letters + string.digits + string.punctuation
    return sentences * 20 + words + spaced + numbers + calls * 4 + [charset, " ".join(charset)]


def build_tokenizer(vocab_size: int, arch: str, split: str = "bpe"):
    """Train a byte-level BPE offline (`split`: one of TOKENIZERS) and wrap it as a
    `PreTrainedTokenizerFast` with the family's special tokens, the attributes its processor reads
    and a chat template of its shape."""
    from transformers import PreTrainedTokenizerFast

    family = FAMILIES[arch]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(vocab_size, family.specials, split), eos_token=family.eos, pad_token=family.pad,
        bos_token=family.bos, unk_token=None, chat_template=family.chat.template(),
        extra_special_tokens=dict(family.named))
    tok.padding_side = "left"
    return tok


def train_bpe(vocab_size: int, specials: tuple[str, ...], split: str = "bpe"):
    """A byte-level BPE trained offline on `tokenizer_corpus`, the specials and task tags added whole;
    with split="letters", text is first cut before every letter (and the space in front of it), so no
    merge joins two letters (the vocabulary may then stop short of `vocab_size`: 539 of 1,024 at size small)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.pre_tokenizer = byte_level if split == "bpe" else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(" ?[A-Za-z]"), behavior="isolated"), byte_level])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials) - len(TAG_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    # Tags are ordinary tokens: decoding with skip_special_tokens must keep them.
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return bpe


def build_tiny_model(out_dir: str | Path, size: str = "tiny", arch: str = "qwen2_5_vl",
                     seed: int = 0, tokenizer: str = "bpe") -> Path:
    """Build a random-weight VLM of a real architecture and save model, tokenizer and processor.

    Returns the folder. The same (size, arch, seed, tokenizer) always gives the same weights and
    tokenizer; `tokenizer` is one of TOKENIZERS.
    """
    import torch  # here, not at the top: `vlmrl --help` reads ARCHES and SIZES without torch
    from transformers import AutoModelForImageTextToText

    if size not in SPECS:
        raise VlmrlError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    if arch not in ARCHES:
        raise VlmrlError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHES)}")
    if tokenizer not in TOKENIZERS:
        raise VlmrlError(f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")
    require(seed_rule("--seed", seed))  # the run's range: torch's seed overflows past 2**64
    out = output_folder(out_dir, "the model")  # a bad OUT in one line, before the model is built
    spec = SPECS[size]
    tok = build_tokenizer(spec.vocab, arch, tokenizer)
    family = FAMILIES[arch]
    config = family.config(spec, tok, spec.image)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    wake_zero_parameters(model, family.wake)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    with writing("the model", out):  # a full disk: one line
        model.save_pretrained(out)
        family.processor(tok, spec.image).save_pretrained(out)
    write_text(out / "vlmrl_tiny.json", "the model", json.dumps(
        {"size": size, "arch": arch, "seed": seed, "tokenizer": tokenizer, "version": TINY_MODEL_VERSION,
         "parameters": sum(p.numel() for p in model.parameters())}, indent=2))
    return out


def wake_zero_parameters(model, wake: dict[str, float]) -> None:
    """Draw the parameters a family starts at zero (projectors, gates) from N(0, std), so the
    image reaches the output of a random build; `wake` maps a name's ending to its std."""
    import torch

    params = dict(model.named_parameters())
    for name, std in wake.items():
        matches = [p for key, p in params.items() if key.endswith(name)]
        if not matches:
            raise VlmrlError(f"no parameter named {name!r} to initialise in {type(model).__name__}")
        with torch.no_grad():
            for param in matches:
                param.normal_(0.0, std)


def model_summary(folder: str | Path) -> str:
    """One line about a tiny-model folder: where, which architecture, how many parameters."""
    info = json.loads((Path(folder) / "vlmrl_tiny.json").read_text())
    letters = ", letter tokenizer" if info.get("tokenizer") == "letters" else ""
    return (f"wrote {folder}: {info['arch']} ({info['size']}, seed {info['seed']}{letters}), "
            f"{info['parameters'] / 1e6:.2f}M parameters")
