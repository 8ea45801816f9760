"""The offline tiny VLM: real architectures, deterministic, a tokenizer that covers the tasks."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vlmrl.errors import VlmrlError
from vlmrl.models.loading import load_processor
from vlmrl.models.tiny_model import TAG_TOKENS, build_tiny_model, model_summary


def test_tiny_model_folder_has_model_tokenizer_and_processor(tiny_model_dir):
    files = {p.name for p in Path(tiny_model_dir).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "vlmrl_tiny.json"} <= files
    assert {"processor_config.json", "preprocessor_config.json"} & files
    info = json.loads((Path(tiny_model_dir) / "vlmrl_tiny.json").read_text())
    assert info["arch"] == "qwen2_5_vl"
    assert 0.1e6 < info["parameters"] < 0.3e6  # "about 0.2M"
    assert "0.1" in model_summary(tiny_model_dir) or "0.2" in model_summary(tiny_model_dir)


def test_same_seed_gives_same_weights_other_seed_differs(tmp_path, tiny_model_dir):
    again = build_tiny_model(tmp_path / "again", size="tiny", seed=0)
    other = build_tiny_model(tmp_path / "other", size="tiny", seed=1)
    reference = load_file(Path(tiny_model_dir) / "model.safetensors")
    same = load_file(again / "model.safetensors")
    different = load_file(other / "model.safetensors")
    assert reference.keys() == same.keys()
    assert all(torch.equal(reference[k], same[k]) for k in reference)
    assert any(not torch.equal(reference[k], different[k]) for k in reference)
    assert (Path(tiny_model_dir) / "tokenizer.json").read_text() == (again / "tokenizer.json").read_text()


def test_tokenizer_round_trips_everything_the_tasks_write(tiny_model_dir):
    tokenizer = load_processor(tiny_model_dir).tokenizer
    text = ("<think> q w e _ r t y " + string.ascii_letters + string.digits + string.punctuation
            + " <chars> i _ c a n _ s e e </chars> </think> <answer> [12, 30, 56, 88] </answer>")
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    for tag in TAG_TOKENS:  # one token each, so a small model learns the format fast
        assert len(tokenizer(tag)["input_ids"]) == 1
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") != tokenizer.unk_token_id


def test_a_tool_call_is_a_few_tokens_with_its_tags_whole(tiny_model_dir):
    from vlmrl.tasks.zoom import call_text, window_call_text

    tokenizer = load_processor(tiny_model_dir).tokenizer
    for text in (window_call_text(6), call_text([224, 0, 448, 224])):
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text and len(ids) <= 30  # 49 and 58 tokens before the tool tags
        assert ids[0] == tokenizer.convert_tokens_to_ids("<tool_call>")
        assert ids[-1] == tokenizer.convert_tokens_to_ids("</tool_call>")


def test_chat_template_renders_image_and_generation_prompt(tiny_model_dir):
    processor = load_processor(tiny_model_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many?<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_small_size_is_in_the_demo_range(tmp_path):
    info = json.loads((build_tiny_model(tmp_path / "s", size="small") / "vlmrl_tiny.json").read_text())
    assert 2e6 <= info["parameters"] <= 10e6


def test_unknown_size_arch_or_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(VlmrlError, match="unknown size 'huge'"):
        build_tiny_model(tmp_path, size="huge")
    with pytest.raises(VlmrlError, match="unknown arch 'florence2'.*qwen2_5_vl"):
        build_tiny_model(tmp_path, arch="florence2")
    with pytest.raises(VlmrlError, match="unknown tokenizer 'words'.*bpe, letters"):
        build_tiny_model(tmp_path, tokenizer="words")


def test_letter_tokenizer_spells_every_word_and_keeps_the_rest(tmp_path, tiny_model_dir):
    folder = build_tiny_model(tmp_path / "letters", size="tiny", tokenizer="letters")
    letters = load_processor(folder).tokenizer
    words = load_processor(tiny_model_dir).tokenizer
    answer = "people and more"
    # A word is its letters; the space joins the letter after it, so the spaced form is as short.
    assert letters.tokenize(answer) == ["p", "e", "o", "p", "l", "e", "Ġa", "n", "d", "Ġm", "o", "r", "e"]
    assert letters.tokenize("p e o p l e") == ["p", "Ġe", "Ġo", "Ġp", "Ġl", "Ġe"]
    assert len(words.tokenize(answer)) < 13  # the default merges letters into word pieces
    text = ("<think> decoder: a q, b x, message: q a </think> <answer> " + string.ascii_letters
            + string.digits + string.punctuation + " [12, 30, 56, 88] </answer>")
    ids = letters(text)["input_ids"]
    assert letters.unk_token_id not in ids and letters.decode(ids) == text
    assert all(len(letters(tag)["input_ids"]) == 1 for tag in TAG_TOKENS)
    assert "letter tokenizer" in model_summary(folder) and "letter" not in model_summary(tiny_model_dir)
    assert json.loads((folder / "vlmrl_tiny.json").read_text())["tokenizer"] == "letters"
