"""Completion log-probs under a model (training/logprobs.py), on families beyond vlmrl's own tiny
builder: every path reads the logits at the positions that predict the completion tokens."""

from __future__ import annotations

import pytest
import torch

import family_builders as fb
from vlmrl.models.support import takes_logits_to_keep
from vlmrl.models.token_inputs import join_prompt_and_completion
from vlmrl.rollout.completions import Completions
from vlmrl.rollout.prompts import encode_prompts
from vlmrl.tasks import Example
from vlmrl.training.logprobs import LogprobScorer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_unchunked_logprobs_of_a_model_without_logits_to_keep():
    # VideoLLaMA3's forward swallows `logits_to_keep` in **kwargs and returns logits at every position.
    model, processor = fb.videollama3_model_and_processor()
    assert not takes_logits_to_keep(model)
    rows = [Example(fb.square(56, "red"), "How many?", "1"), Example(fb.square(84, "blue"), "Count the squares.", "2")]
    ids = torch.tensor([[40, 41, 42, 43], [50, 51, 52, 53]])  # (2, 4)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        whole, _ = LogprobScorer(processor, chunk=0)(model, Completions(rows, ids, mask))
        chunked, _ = LogprobScorer(processor)(model, Completions(rows, ids, mask))
        inputs = join_prompt_and_completion(encode_prompts(processor, rows, torch.device("cpu")), ids, mask)
        logits = model(**inputs, use_cache=False).logits  # (2, P+4, V)
    expected = torch.log_softmax(logits[:, -5:-1], -1).gather(-1, ids[..., None]).squeeze(-1)  # (2, 4)
    torch.testing.assert_close(whole, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked, expected, atol=1e-5, rtol=0)
