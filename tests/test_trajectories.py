"""Trajectories as model inputs: the model's sampled ids kept as they are, tool turns tokenized by the
processor, and the whole equal to the processor's encoding of the same conversation in one call
(images included; for the Qwen families also the chat template's own rendering of it), with the
same logits, for Qwen2.5-VL, Qwen2-VL and Idefics3."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from vlmrl.models import load_policy
from vlmrl.models import tiny_families
from vlmrl.models.support import FAMILIES
from vlmrl.models.tiny_model import ARCHES as BUILDABLE
from vlmrl.rollout.prompts import chat_messages
from vlmrl.rollout.trajectories import Segment, encode_trajectories, prompt_text, tool_turn
from vlmrl.tasks import Example

ARCHES = [a for a in BUILDABLE if FAMILIES[a].tool_rollouts is None]  # every family with tool rollouts
FIRST = 'Let me look.<tool_call>\n{"name": "zoom", "arguments": {"box": [0, 0, 28, 28]}}\n</tool_call>'
FINAL = "<answer>3</answer>"


def conversation(processor, example: Example, crop: Image.Image) -> str:
    """The whole conversation as the chat template writes it when the model is asked for its second
    turn, followed by that turn."""
    messages = chat_messages(example) + [
        {"role": "assistant", "content": [{"type": "text", "text": FIRST}]},
        {"role": "user", "content": [{"type": "text", "text": "<tool_response>\n"}, {"type": "image"},
                                     {"type": "text", "text": "zoomed\n</tool_response>"}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + FINAL


@pytest.mark.parametrize("arch", ARCHES)
def test_a_trajectory_is_the_conversation_the_template_writes(arch, tiny_model_factory):
    model, processor = load_policy(tiny_model_factory(arch), device="cpu")
    example = Example(Image.new("RGB", (56, 84), (200, 10, 10)), "Count the circles.", "3")
    crop = Image.new("RGB", (56, 56), (20, 160, 10))
    tokens = processor.tokenizer
    turns = [Segment(tokens(FIRST, add_special_tokens=False).input_ids, model=True),
             tool_turn(processor, example, "zoomed", [crop]),
             Segment(tokens(FINAL, add_special_tokens=False).input_ids, model=True)]
    inputs = encode_trajectories(processor, [example], [turns], torch.device("cpu"))
    text = prompt_text(processor, example) + FIRST + turns[1].text + FINAL  # the same turns, as one text
    if tiny_families.FAMILIES[arch].chat is not tiny_families.IDEFICS3_CHAT:  # Idefics3's and SmolVLM's template
        # opens a finished assistant turn unlike a generation prompt
        assert text == conversation(processor, example, crop)
    expected = processor(text=[text], images=[[*example.images, crop]], return_tensors="pt")  # one call
    ours = inputs["input_ids"][0]
    assert torch.equal(ours, expected["input_ids"][0, :len(ours)])
    for key, value in expected.items():
        if key not in ("input_ids", "attention_mask"):
            theirs = value[:, :len(ours)] if value.shape[:2] == expected["input_ids"].shape else value
            assert torch.equal(inputs[key], theirs), key
    with torch.no_grad():
        a = model(**inputs).logits[0]  # (L, V)
        b = model(**{k: (v[:, :len(ours)] if v.shape[:2] == expected["input_ids"].shape else v)
                     for k, v in expected.items()}).logits[0]
    assert (a - b).abs().max() < 1e-5


def test_left_padding_keeps_each_row_exact(tiny_model_factory):
    """Two trajectories of different lengths in one batch: each row's logits equal its own alone."""
    model, processor = load_policy(tiny_model_factory("qwen2_5_vl"), device="cpu")
    examples = [Example(Image.new("RGB", (56, 56), (200, 10, 10)), "Count.", "1"),
                Example(Image.new("RGB", (84, 56), (0, 0, 200)), "How many circles are there?", "2")]
    crop = Image.new("RGB", (28, 56), (20, 160, 10))
    ids = processor.tokenizer(FIRST, add_special_tokens=False).input_ids
    rows = [[Segment(ids, model=True), tool_turn(processor, examples[0], "zoomed", [crop])],
            [Segment(ids[:5], model=True)]]
    batch = encode_trajectories(processor, examples, rows, torch.device("cpu"))
    with torch.no_grad():
        together = model(**batch).logits  # (2, L, V)
        for i in range(2):
            alone = model(**encode_trajectories(processor, [examples[i]], [rows[i]], torch.device("cpu"))).logits[0]
            assert (together[i, -len(alone):] - alone).abs().max() < 1e-4
