"""Appending completion tokens to processor outputs (models/token_inputs.py): per-token inputs are
extended as `generate` extends them, whatever their number of dims; pixel inputs pass through."""

from __future__ import annotations

import pytest
import torch

import family_builders as fb
from vlmrl.models.token_inputs import extend_tokens, per_token_keys
from vlmrl.rollout.completions import Completions
from vlmrl.rollout.prompts import encode_prompts
from vlmrl.tasks import Example
from vlmrl.training.logprobs import LogprobScorer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_per_token_inputs_are_extended_along_the_tokens_with_their_fill():
    cross = torch.tensor([[[[0, 0]], [[1, 0]], [[1, 1]]],
                          [[[0, 0]], [[0, 0]], [[1, 0]]]])  # (B=2, P=3, images=1, tiles=2)
    pixels = torch.randn(2, 5, 4)
    inputs = {"input_ids": torch.tensor([[7, 8, 9], [0, 8, 9]]), "attention_mask": torch.tensor([[1, 1, 1], [0, 1, 1]]),
              "mm_token_type_ids": torch.tensor([[0, 1, 1], [0, 1, 1]]), "cross_attention_mask": cross,
              "pixel_values": pixels}
    assert per_token_keys(inputs) == ["input_ids", "attention_mask", "mm_token_type_ids", "cross_attention_mask"]
    mask = torch.ones(2, 5, dtype=torch.long)
    joined = extend_tokens(inputs, torch.tensor([[3, 4], [5, 6]]), mask)
    assert joined["input_ids"].tolist() == [[7, 8, 9, 3, 4], [0, 8, 9, 5, 6]]
    assert joined["attention_mask"] is mask
    assert joined["mm_token_type_ids"].tolist() == [[0, 1, 1, 0, 0], [0, 1, 1, 0, 0]]  # text
    assert joined["cross_attention_mask"].shape == (2, 5, 1, 2)
    assert joined["cross_attention_mask"][:, 3:].tolist() == [[[[1, 1]], [[1, 1]]], [[[1, 0]], [[1, 0]]]]  # last row
    assert torch.equal(joined["cross_attention_mask"][:, :3], cross)
    assert joined["pixel_values"] is pixels


@pytest.fixture(scope="module")
def mllama():
    return fb.mllama_model_and_processor()


@pytest.mark.parametrize("chunk", [1024, 0])
def test_mllama_logprobs_are_the_ones_generate_sampled_from(mllama, chunk):
    """Its cross_attention_mask (B, P, images, tiles) runs along the tokens: completion tokens see the
    image as the last prompt token does, as in `generate`."""
    model, processor = mllama
    rows = [Example(fb.square(56, "red"), "How many?", "1"), Example(fb.square(84, "blue"), "Count the squares.", "2")]
    prompt = encode_prompts(processor, rows, torch.device("cpu"))
    assert prompt["cross_attention_mask"].dim() == 4
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                             return_dict_in_generate=True, output_logits=True)
    ids = out.sequences[:, prompt["input_ids"].shape[1]:]  # (2, 5)
    sampler = torch.stack([torch.log_softmax(step, -1).gather(-1, ids[:, t, None]).squeeze(-1)
                           for t, step in enumerate(out.logits)], dim=1)  # (2, 5)
    with torch.no_grad():
        logp, _ = LogprobScorer(processor, chunk=chunk)(model, Completions(rows, ids, torch.ones_like(ids)))
    torch.testing.assert_close(logp, sampler, atol=1e-5, rtol=0)
