"""What a training forward keeps for backward: the saved-tensor count by hand, the probe's per-token
figures against whole training passes, and the estimate that `kept` makes of them."""

from __future__ import annotations

import pytest
import torch

from vlmrl.models.loading import enable_checkpointing, is_checkpointing, load_policy
from vlmrl.rollout.generation import Completions
from vlmrl.rollout.prompts import encode_prompts, image_token_id
from vlmrl.safety.activation_memory import (
    ActivationCosts,
    embedding_gradients,
    measure_activation_costs,
    saved_bytes,
    saved_bytes_by_place,
)
from vlmrl.tasks import Example
from vlmrl.training.logprobs import LogprobScorer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_saved_bytes_counts_each_storage_once_and_no_parameter():
    layer = torch.nn.Linear(8, 3, bias=False)
    x = torch.randn(5, 8)
    # Linear keeps its input (5 x 8; the weight is a parameter), relu its output (5 x 3): float32
    assert saved_bytes(lambda: torch.relu(layer(x)), layer) == (40 + 15) * 4
    y = torch.randn(2, 3, requires_grad=True)

    def square_of_exp():
        e = y.exp()  # keeps its result e
        return e * e  # keeps both operands: e again

    assert saved_bytes(square_of_exp, layer) == 6 * 4


def test_saved_bytes_by_place_tells_what_a_checkpointable_layer_saved():
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Block(GradientCheckpointingLayer):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4, bias=False)

        def forward(self, x):
            return torch.relu(self.linear(x))  # keeps x (2 x 4) and its output (2 x 4)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            return self.block(x.exp()).sum()  # exp keeps its output: the block's input, saved first outside

    model, x = Model(), torch.randn(2, 4, requires_grad=True)
    assert saved_bytes_by_place(lambda: model(x), model) == (8 * 4, 8 * 4)


def test_peak_adds_half_a_layer_or_the_readout_and_under_checkpointing_the_inputs_and_one_and_a_half():
    costs = ActivationCosts(per_token=450.0, per_image_token=1100.0, in_layers=400.0, in_blocks=1000.0, layers=4,
                            layer_input=8, vision_layers=2, vision_layer_input=16)
    # per layer: 100 bytes a text token, 500 an image token per vision block; 50 and 100 outside them
    assert costs.peak(10, 0) == 450 * 10 + 100 * 10 / 2
    assert costs.peak(10, 4) == 450 * 10 + 1100 * 4 + 500 * 4 / 2  # the vision block is the larger layer
    assert costs.peak(10, 4, readout=5000) == 450 * 10 + 1100 * 4 + 5000  # the output layer's chunk is larger
    assert costs.peak(10, 4, readout=5000, held=4000) == 450 * 10 + 1100 * 4 + 4000 + 500 * 4 / 2
    outside = 50 * 10 + 100 * 4
    assert costs.peak(10, 4, checkpointing=True) == outside + 4 * 8 * 10 + 2 * 16 * 4 + 1.5 * 500 * 4
    assert costs.peak(100, 0, checkpointing=True) == 50 * 100 + 4 * 8 * 100 + 1.5 * 100 * 100
    assert costs.peak(100, 0, checkpointing=True, readout=10 ** 5) == 50 * 100 + 4 * 8 * 100 + 10 ** 5


def test_embedding_gradients_tied_untied_and_frozen(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir, device="cpu", dtype="float32")
    embedding = model.get_input_embeddings().weight
    size = embedding.numel() * 4
    assert model.get_output_embeddings().weight is embedding  # the tiny models tie them, as the 3B does
    assert embedding_gradients(model) == (size, 3 * size)  # the output layer's waits for the embedding's: summed
    model.get_output_embeddings().weight = torch.nn.Parameter(embedding.detach().clone())
    assert embedding_gradients(model) == (0, size)  # untied: the embedding's own, at the end
    embedding.requires_grad_(False)
    assert embedding_gradients(model) == (0, 0)


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    model, processor = load_policy(tiny_model_dir, device="cpu", dtype="float32")
    model.train()
    return model, processor


def group_rows(circle_image, prompts: int, group: int, tokens: int) -> Completions:
    examples = [Example(circle_image.rotate(90 * p), f"Count the circles ({p}).", "2") for p in range(prompts)]
    rows = [example for example in examples for _ in range(group)]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 400, (len(rows), tokens), generator=generator)  # (N, T) plain text tokens
    return Completions(rows, ids, torch.ones_like(ids))


@pytest.mark.parametrize("packed", [False, True])
def test_the_probe_predicts_what_a_training_pass_keeps(policy, circle_image, packed):
    model, processor = policy
    costs = measure_activation_costs(model, processor)
    completions = group_rows(circle_image, prompts=2, group=4, tokens=16)
    # the dense-mask packed pass: the block kernel also keeps each completion's copy of its prompt's keys
    # and values, which estimate_memory adds (tests/test_preflight.py)
    scorer = LogprobScorer(processor, pack_groups=packed, block_attention=False)
    measured = saved_bytes(lambda: scorer(model, completions)[0].sum(), model)
    prompt = encode_prompts(processor, completions.rows[:1], torch.device("cpu"))["input_ids"]  # (1, P)
    image_tokens = int((prompt == image_token_id(processor, model.config)).sum())
    computed = 2 if packed else 8  # prompts and images the forward computes
    predicted = costs.per_token * (computed * prompt.shape[1] + 8 * 16) + costs.per_image_token * computed * image_tokens
    assert measured == pytest.approx(predicted, rel=0.1)
    assert 0.5 * costs.per_token < costs.in_layers < costs.per_token  # most of it inside the decoder layers
    assert 0 < costs.in_blocks < costs.per_image_token


def test_the_probe_leaves_the_random_state_and_checkpointing_as_they_were(tiny_model_dir):
    model, processor = load_policy(tiny_model_dir, device="cpu", dtype="float32")
    model.train()
    plain = measure_activation_costs(model, processor)
    enable_checkpointing(model)
    state = torch.get_rng_state()
    assert measure_activation_costs(model, processor) == plain  # measured with checkpointing paused
    assert torch.equal(torch.get_rng_state(), state) and is_checkpointing(model)
    assert (plain.layers, plain.layer_input) == (model.config.text_config.num_hidden_layers,
                                                 model.config.text_config.hidden_size * 4)


def test_a_frozen_tower_keeps_next_to_nothing_per_image_token(tiny_model_dir, policy):
    frozen, processor = load_policy(tiny_model_dir, device="cpu", dtype="float32", freeze_vision=True)
    frozen.train()
    trained = measure_activation_costs(*policy)
    costs = measure_activation_costs(frozen, processor)
    assert (costs.per_token, costs.in_layers) == (trained.per_token, trained.in_layers)
    assert costs.per_image_token < trained.per_image_token / 20 and costs.in_blocks <= costs.per_image_token


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl", "idefics3"])
def test_each_family_has_its_vision_blocks_measured_and_their_inputs_sized(tiny_model_factory, arch):
    model, processor = load_policy(tiny_model_factory(arch), device="cpu", dtype="float32")
    model.train()
    costs = measure_activation_costs(model, processor)
    # the tiny towers: 2 blocks of width 32, 4 patches per image token (2 x 2 merged, or pixel-shuffled)
    assert (costs.vision_layers, costs.vision_layer_input) == (2, 4 * 32 * 4)
    assert 0 < costs.in_blocks < costs.per_image_token and 0 < costs.in_layers < costs.per_token
