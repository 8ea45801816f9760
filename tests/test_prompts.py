"""Prompts become model inputs through the model's own chat template and processor
(rollout/prompts.py); processor outputs that are not model inputs are dropped."""

from __future__ import annotations

import pytest
import torch

import family_builders as fb
from vlmrl.rollout.completions import Completions
from vlmrl.rollout.prompts import encode_prompts
from vlmrl.tasks import Example
from vlmrl.training.logprobs import LogprobScorer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # PaliGemma's processor
def test_labels_from_the_processor_never_reach_the_model():
    # PaliGemma's processor returns `labels` (all -100 without a suffix) with every batch.
    model, processor = fb.paligemma_model_and_processor()
    rows = [Example(fb.square(56, "red"), "How many?", "1"), Example(fb.square(84, "blue"), "Count the squares.", "2")]
    texts = [processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": r.prompt}]}],
                                           tokenize=False) for r in rows]
    assert "labels" in processor(images=[[r.image] for r in rows], text=texts, return_tensors="pt", padding=True)
    prompt = encode_prompts(processor, rows, torch.device("cpu"))
    assert sorted(prompt) == ["attention_mask", "input_ids", "pixel_values", "token_type_ids"]
    with torch.no_grad():
        assert model(**prompt).loss is None
        ids = torch.tensor([[40, 41, 42, 43], [50, 51, 52, 53]])  # (2, 4)
        mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
        chunked, _ = LogprobScorer(processor)(model, Completions(rows, ids, mask))
        whole, _ = LogprobScorer(processor, chunk=0)(model, Completions(rows, ids, mask))
    assert chunked.shape == (2, 4) and bool((chunked[mask.bool()] < 0).all())
    torch.testing.assert_close(whole, chunked, atol=1e-5, rtol=0)
