"""The speedups compute each prompt once per group, with exactly the plain way's numbers.

Generation from one prefill per prompt (prefill.py) gives the same greedy completions and the same
sampling distribution as repeating the prompt G times; the packed log-prob forward (packing.py)
and the chunked output layer (output_layer.py) give the plain forward's log-probs (within 1e-5,
fp32) and gradients (cosine >= 0.9999), for Qwen2.5-VL and Qwen2-VL, Idefics3 included, prompts of
different lengths (left padding) and completions of different lengths. Every family whose row of
`support.FAMILIES` lists a fast path as exact is checked here on its tiny build; a family that has
it off must fall back to the plain path and say why.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image

from vlmrl.config import GenerationSettings, load_config
from vlmrl.models import support
from vlmrl.models.loading import counting_vision_rows, enable_checkpointing, load_policy
from vlmrl.models.tiny_model import ARCHES as BUILDABLE
from vlmrl.report.tracking import read_metrics
from vlmrl.rollout.completions import Completions
from vlmrl.rollout.generation import generate_groups
from vlmrl.tasks import Example
from vlmrl.training.logprobs import LogprobScorer
from vlmrl.training.trainer import train

PREFILL_EXACT = [a for a in BUILDABLE if support.FAMILIES[a].shared_prefill is None]
PACKING_EXACT = [a for a in BUILDABLE if support.FAMILIES[a].packing is None]
G = 3


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest (conftest.py)


@pytest.fixture(scope="module")
def examples() -> list[Example]:
    """Three prompts of different image sizes and question lengths: left padding differs per prompt."""
    return [Example(Image.new("RGB", (56, 84), (200, 10, 10)), "Count.", "1"),
            Example(Image.new("RGB", (112, 112), (20, 100, 10)),
                    "How many circles are in the image? Think step by step.", "2"),
            Example(Image.new("RGB", (84, 56), (0, 0, 200)), "What colour is it?", "3")]


def sampled(model, processor, examples, shared: bool, temperature: float = 0.9):
    settings = GenerationSettings(group_size=G, max_new_tokens=8, temperature=temperature,
                                  share_prompt_cache=shared)
    with counting_vision_rows(model) as vision_rows:
        rollout = generate_groups(model, processor, examples, settings, seed=3)
    return rollout, sum(vision_rows)


def sampling_logprobs(model, processor, examples, shared: bool, temperature: float = 0.9):
    """The rollout, and the log-prob (N, T) of each sampled token under the distribution `generate`
    sampled it from (its raw logits over the temperature), read from generate's own outputs."""
    plain_generate, steps = model.generate, []

    def generate(**kwargs):
        out = plain_generate(**{**kwargs, "return_dict_in_generate": True, "output_logits": True})
        steps.extend(out.logits)  # one (N, V) per step: fine for 8 tokens in a test
        return out.sequences

    model.generate = generate
    try:
        rollout, _ = sampled(model, processor, examples, shared, temperature)
    finally:
        del model.generate
    logp = torch.stack([torch.log_softmax(step.float() / temperature, -1).gather(-1, rollout.completion_ids[:, t, None])
                        .squeeze(-1) for t, step in enumerate(steps)], dim=1)  # (N, T)
    return rollout, logp * rollout.completion_mask


def logprobs(model, processor, rows, ids, mask, temperature=1.0, pack=True, chunk=1024, with_entropy=False):
    scorer = LogprobScorer(processor, temperature, pack, chunk)
    return scorer(model, Completions(rows, ids, mask), with_entropy=with_entropy)


def ragged(rollout, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rollout's completions cut to different lengths (as EOS would), padding after the cut."""
    mask = rollout.completion_mask.clone()
    mask[1, 4:] = 0
    mask[5, 1:] = 0
    mask[7, 6:] = 0
    return torch.where(mask.bool(), rollout.completion_ids, pad_id), mask


def flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("arch", PREFILL_EXACT)
def test_generation_from_one_prefill_per_prompt_matches_the_plain_way(arch, tiny_model_factory, examples):
    model, processor = load_policy(tiny_model_factory(arch), device="cpu")
    shared, shared_rows = sampled(model, processor, examples, shared=True, temperature=0)  # greedy
    plain, plain_rows = sampled(model, processor, examples, shared=False, temperature=0)
    assert torch.equal(shared.completion_ids, plain.completion_ids)
    assert shared_rows * G == plain_rows > 0  # the vision tower saw each image once, not G times

    rollout, sampling_logp = sampling_logprobs(model, processor, examples, shared=True)  # temperature 0.9
    plain_logp, _ = logprobs(model, processor, rollout.rows, rollout.completion_ids, rollout.completion_mask,
                             0.9, pack=False, chunk=0)
    assert (sampling_logp - plain_logp).abs().max() < 1e-5  # the sampling distribution is the plain one
    assert len(set(rollout.texts)) > 1  # really sampled


def test_generation_keeps_no_logits(tiny_model_dir, examples):
    """`generate` is asked for the sampled ids alone: no step's full-vocabulary logits are kept."""
    model, processor = load_policy(tiny_model_dir, device="cpu")
    plain_generate, asked = model.generate, []

    def generate(**kwargs):
        asked.append(kwargs)
        return plain_generate(**kwargs)

    model.generate = generate
    rollout, _ = sampled(model, processor, examples, shared=True)
    assert len(asked) == 1 and not asked[0].get("output_logits") and not asked[0].get("output_scores")
    assert not asked[0]["return_dict_in_generate"] and rollout.completion_ids.shape == (3 * G, 8)


@pytest.mark.parametrize("arch", PACKING_EXACT)
def test_packed_logprobs_and_gradients_equal_the_plain_forward(arch, tiny_model_factory, examples):
    model, processor = load_policy(tiny_model_factory(arch), device="cpu")
    rollout, _ = sampled(model, processor, examples, shared=True)
    ids, mask = ragged(rollout, processor.tokenizer.pad_token_id)
    rows = rollout.rows
    order = [4, 0, 8, 1, 5, 2]  # groups split and interleaved, as a micro-batch may hold them
    model.train()
    results = {}
    for shared, chunk in [(False, 0), (True, 5)]:
        model.zero_grad()
        logp, entropy = logprobs(model, processor, rows, ids, mask, 0.7, shared, chunk, with_entropy=True)  # (N, T)
        picked, _ = logprobs(model, processor, [rows[i] for i in order], ids[order], mask[order], 0.7, shared, chunk)
        (logp.sum() + (logp ** 2).sum() + picked.sum()).backward()
        results[shared] = (logp.detach(), entropy, picked.detach(), flat_grad(model))
    plain, packed = results[False], results[True]
    assert (plain[0] - packed[0]).abs().max() < 1e-5
    assert (plain[1] - packed[1]).abs().max() < 1e-5  # entropies
    assert (plain[2] - packed[2]).abs().max() < 1e-5
    assert torch.equal(packed[0] == 0, mask == 0)  # masked positions hold 0, the others do not
    assert torch.nn.functional.cosine_similarity(plain[3], packed[3], dim=0) >= 0.9999


@pytest.mark.parametrize("arch", ["gemma3", "mistral3"])
def test_packed_logprobs_keep_a_sliding_window_shorter_than_the_sequence(arch, windowed_model_factory, examples):
    """A window of 6 tokens (Gemma 3: on its sliding layers, AND'd with its image blocks; Mistral 3: on
    every layer), counted as each completion has it after its prompt alone."""
    model, processor = load_policy(windowed_model_factory(arch, 6), device="cpu")
    assert support.attention_rules(model).window == 6
    rollout, _ = sampled(model, processor, examples, shared=False)
    ids, mask = ragged(rollout, processor.tokenizer.pad_token_id)
    plain, _ = logprobs(model, processor, rollout.rows, ids, mask, pack=False, chunk=0)  # (N, T)
    packed, _ = logprobs(model, processor, rollout.rows, ids, mask, pack=True, chunk=5)
    assert (plain - packed).abs().max() < 1e-5
    model.config.get_text_config().sliding_window = 10_000  # the window matters here: without it, other numbers
    wide, _ = logprobs(model, processor, rollout.rows, ids, mask, pack=True, chunk=5)
    assert (wide - plain).abs().max() > 1e-3


def test_packed_forward_under_gradient_checkpointing_and_chunked_head(tiny_model_dir, examples):
    model, processor = load_policy(tiny_model_dir, device="cpu")
    rollout, _ = sampled(model, processor, examples, shared=True)
    ids, mask = ragged(rollout, processor.tokenizer.pad_token_id)
    model.train()
    model.zero_grad()
    plain, _ = logprobs(model, processor, rollout.rows, ids, mask, pack=False, chunk=0)
    plain.sum().backward()
    expected = flat_grad(model)

    enable_checkpointing(model)
    model.zero_grad()
    packed, _ = logprobs(model, processor, rollout.rows, ids, mask, pack=True, chunk=2)
    packed.sum().backward()
    assert (plain - packed).abs().max() < 1e-5
    assert torch.nn.functional.cosine_similarity(expected, flat_grad(model), dim=0) >= 0.9999


def test_a_family_without_support_falls_back_and_says_so_once(tiny_model_dir, examples, monkeypatch):
    model, processor = load_policy(tiny_model_dir, device="cpu")
    rollout, _ = sampled(model, processor, examples, shared=True)
    expected, _ = logprobs(model, processor, rollout.rows, rollout.completion_ids,
                           rollout.completion_mask, pack=False, chunk=0)  # full logits
    monkeypatch.setattr(support, "FAMILIES", {"llava": support.EXACT})
    monkeypatch.setattr(support, "_warned", set())
    with pytest.warns(UserWarning, match="packed log-probs off .*qwen2_5_vl"):
        logp, _ = logprobs(model, processor, rollout.rows, rollout.completion_ids,
                           rollout.completion_mask, chunk=4)  # plain forward, chunked output layer
    assert (logp - expected).abs().max() < 1e-6
    with pytest.warns(UserWarning, match="shared prompt cache off"):
        _, rows = sampled(model, processor, examples, shared=True, temperature=0)
    _, plain_rows = sampled(model, processor, examples, shared=False, temperature=0)
    assert rows == plain_rows  # every image encoded G times, as in the plain way
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once only
        logprobs(model, processor, rollout.rows, rollout.completion_ids, rollout.completion_mask)


def test_training_steps_are_the_same_with_the_speedups_off(tmp_path, tiny_model_dir, monkeypatch):
    """The config switches: two steps (KL to a reference, two updates per batch: old log-probs too)
    log the same rewards, losses and KL with the speedups on and off."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    runs = {}
    for on in (True, False):
        config = load_config(None, [
            f"model.name_or_path={tiny_model_dir}", "model.device=cpu", "task.name=letter_task:LetterTask",
            f"output_dir={tmp_path / str(on)}", "rollout.prompts_per_step=2", "rollout.group_size=4",
            "rollout.max_new_tokens=6", "rollout.generation_batch_size=2", "train.micro_batch_size=8",
            "train.steps=2", "train.lr=1e-3", "train.log_rollouts_every=0", "train.trackers=[]",
            "algorithm.beta=0.1", "algorithm.updates_per_batch=2", f"rollout.share_prompt_cache={str(on).lower()}",
            f"train.pack_groups={str(on).lower()}", f"train.logprob_chunk={5 if on else 0}"])
        runs[on] = read_metrics(train(config) / "metrics.jsonl")
    for fast, plain in zip(runs[True], runs[False]):
        assert fast["reward"] == plain["reward"]  # the same completions were sampled
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert fast[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key


@pytest.fixture(scope="module")
def two_image_examples() -> list[Example]:
    """Prompts of one and of two images ("which picture has more red?"), of different sizes."""
    red, green = Image.new("RGB", (56, 56), (200, 10, 10)), Image.new("RGB", (84, 56), (20, 160, 10))
    return [Example(prompt="Which picture is red, the first or the second?", answer="first", images=[red, green]),
            Example(Image.new("RGB", (56, 84), (0, 0, 200)), "What colour is it?", "blue"),
            Example(prompt="Compare them.", answer="same", images=[green, green])]


@pytest.mark.parametrize("arch", [a for a in PREFILL_EXACT if a in PACKING_EXACT])
def test_several_images_per_prompt_speedups_equal_the_plain_way(arch, tiny_model_factory, two_image_examples):
    model, processor = load_policy(tiny_model_factory(arch), device="cpu")
    shared, shared_rows = sampled(model, processor, two_image_examples, shared=True, temperature=0)
    plain, plain_rows = sampled(model, processor, two_image_examples, shared=False, temperature=0)
    assert torch.equal(shared.completion_ids, plain.completion_ids)
    assert shared_rows * G == plain_rows > 0
    rollout, _ = sampled(model, processor, two_image_examples, shared=True)
    ids, mask = ragged(rollout, processor.tokenizer.pad_token_id)
    results = {}
    for pack, chunk in [(False, 0), (True, 3)]:
        model.zero_grad()
        logp, _ = logprobs(model, processor, rollout.rows, ids, mask, 0.9, pack, chunk)  # (N, T)
        logp.sum().backward()
        results[pack] = (logp.detach(), flat_grad(model))
    assert (results[False][0] - results[True][0]).abs().max() < 1e-5
    assert torch.nn.functional.cosine_similarity(results[False][1], results[True][1], dim=0) >= 0.9999

