"""The offline tiny VLM: a real Hugging Face architecture with random weights, built here.

Nothing may be downloaded on the machines vlmrl is tested on, so tests and the CPU demo use a model
that vlmrl builds itself from a real architecture's config (Qwen2.5-VL, Qwen2-VL, Idefics3 here;
the newer families from their recipes in tiny_families.py), a byte-level BPE tokenizer trained
offline on task-shaped text with the family's special tokens and a chat template of its shape, and
an image processor that needs no torchvision. The folder is written with `save_pretrained` and loads like any hub model, through
`vlmrl.models.loading.load_policy` or plain `transformers.AutoModelForImageTextToText.from_pretrained`.
Everything is deterministic from the seed.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from vlmrl.errors import VlmrlError
from vlmrl.models.tiny_families import FAMILIES

ARCHES = ("qwen2_5_vl", "qwen2_vl", "idefics3", *FAMILIES)
SIZES = ("tiny", "small")

# Tags the tasks and tool calls use; each becomes one token so a small model learns the format
# quickly (Qwen2.5's own tokenizer keeps the four tool tags whole too).
TAG_TOKENS = ("<think>", "</think>", "<answer>", "</answer>", "<chars>", "</chars>",
              "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
TINY_MODEL_VERSION = 2
"""Bumped when the same (size, arch, seed) builds a different model (2: tool tags, tool-call text)."""

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
)
IDEFICS3_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<image>", "<fake_token_around_image>",
    "<global-img>",
) + tuple(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))

# One chat template for both families: the image goes where the message puts it, no system prompt.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IDEFICS3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


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


def build_tokenizer(vocab_size: int, arch: str):
    """Train a byte-level BPE offline and wrap it as a `PreTrainedTokenizerFast` with a chat template."""
    from transformers import PreTrainedTokenizerFast

    if arch in FAMILIES:
        family = FAMILIES[arch]
        tok = PreTrainedTokenizerFast(
            tokenizer_object=train_bpe(vocab_size, family.specials), eos_token=family.eos, pad_token=family.pad,
            bos_token=family.bos, unk_token=None, chat_template=family.chat.template(),
            extra_special_tokens=dict(family.named))
        tok.padding_side = "left"
        return tok
    specials = QWEN_SPECIAL_TOKENS if arch.startswith("qwen") else IDEFICS3_SPECIAL_TOKENS
    bpe = train_bpe(vocab_size, specials)
    eos = "<|im_end|>" if arch.startswith("qwen") else "<end_of_utterance>"
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=eos,
        pad_token="<|endoftext|>",
        bos_token=None if arch.startswith("qwen") else "<|im_start|>",
        unk_token=None,
        chat_template=QWEN_CHAT_TEMPLATE if arch.startswith("qwen") else IDEFICS3_CHAT_TEMPLATE,
    )
    tok.padding_side = "left"
    return tok


def train_bpe(vocab_size: int, specials: tuple[str, ...]):
    """A byte-level BPE trained offline on `tokenizer_corpus`, the specials and task tags added whole."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
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


def _qwen_config(arch: str, spec: TinySpec, tok):
    """A Qwen2-VL / Qwen2.5-VL config at the tiny widths, special token ids set everywhere."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    head_dim = spec.hidden // spec.heads
    quarter = head_dim // 4  # mrope_section must sum to head_dim / 2
    mrope = [head_dim // 2 - 2 * quarter, quarter, quarter]
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    text = dict(
        vocab_size=len(tok), hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope},
        bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True, **ids,
    )
    vision = dict(
        depth=spec.vision_depth, hidden_size=spec.vision_hidden, num_heads=spec.vision_heads,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
    )
    if arch == "qwen2_5_vl":
        vision.update(intermediate_size=2 * spec.vision_hidden, out_hidden_size=spec.hidden,
                      window_size=112, fullatt_block_indexes=list(range(spec.vision_depth)))
        cls = Qwen2_5_VLConfig
    else:
        vision.update(embed_dim=spec.vision_hidden, mlp_ratio=2, hidden_size=spec.hidden)
        cls = Qwen2VLConfig
    return cls(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)


def _idefics3_config(spec: TinySpec, tok):
    """An Idefics3 (SmolVLM family) config at the tiny widths."""
    from transformers import Idefics3Config

    text = dict(
        model_type="llama", vocab_size=len(tok), hidden_size=spec.hidden,
        intermediate_size=spec.intermediate, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=4096, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True,
    )
    vision = dict(hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden,
                  num_hidden_layers=spec.vision_depth, num_attention_heads=spec.vision_heads,
                  image_size=IDEFICS3_TILE, patch_size=14)
    return Idefics3Config(text_config=text, vision_config=vision, scale_factor=2,
                          image_token_id=tok.convert_tokens_to_ids("<image>"),
                          pad_token_id=tok.pad_token_id, tie_word_embeddings=True)


IDEFICS3_TILE = 112  # pixels per image tile of the tiny Idefics3; real SmolVLM uses 384-512


def build_processor(arch: str, tok):
    """The image processor (PIL backend, no torchvision) and processor for `arch`."""
    from vlmrl.models.processing import image_text_processor_class

    if arch.startswith("qwen"):
        from transformers import Qwen2VLImageProcessorPil
        from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
        from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

        images = Qwen2VLImageProcessorPil(
            min_pixels=56 * 56, max_pixels=448 * 448, patch_size=14, merge_size=2, temporal_patch_size=2)
        base = Qwen2_5_VLProcessor if arch == "qwen2_5_vl" else Qwen2VLProcessor
        return image_text_processor_class(base)(image_processor=images, tokenizer=tok,
                                                chat_template=tok.chat_template)
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    images = Idefics3ImageProcessorPil(
        size={"longest_edge": 2 * IDEFICS3_TILE},
        max_image_size={"longest_edge": IDEFICS3_TILE},
        do_image_splitting=False,
    )
    seq_len = (IDEFICS3_TILE // 14) ** 2 // 4  # patches after the 2x2 pixel shuffle
    return Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=seq_len,
                             chat_template=tok.chat_template)


def build_tiny_model(out_dir: str | Path, size: str = "tiny", arch: str = "qwen2_5_vl",
                     seed: int = 0) -> Path:
    """Build a random-weight VLM of a real architecture and save model, tokenizer and processor.

    Returns the folder. The same (size, arch, seed) always gives the same weights and tokenizer.
    """
    import torch  # here, not at the top: `vlmrl --help` reads ARCHES and SIZES without torch
    from transformers import AutoModelForImageTextToText

    if size not in SPECS:
        raise VlmrlError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    if arch not in ARCHES:
        raise VlmrlError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHES)}")
    spec = SPECS[size]
    tok = build_tokenizer(spec.vocab, arch)
    if arch in FAMILIES:
        config = FAMILIES[arch].config(spec, tok, spec.image)
    else:
        config = _qwen_config(arch, spec, tok) if arch.startswith("qwen") else _idefics3_config(spec, tok)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    wake_zero_parameters(model, FAMILIES[arch].wake if arch in FAMILIES else {})
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor = FAMILIES[arch].processor(tok, spec.image) if arch in FAMILIES else build_processor(arch, tok)
    processor.save_pretrained(out)
    (out / "vlmrl_tiny.json").write_text(json.dumps(
        {"size": size, "arch": arch, "seed": seed, "version": TINY_MODEL_VERSION,
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
    return (f"wrote {folder}: {info['arch']} ({info['size']}, seed {info['seed']}), "
            f"{info['parameters'] / 1e6:.2f}M parameters")
