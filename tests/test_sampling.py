"""The sampler's log-probs (sampling.py): recorded while `generate` decodes, equal to the training
pass's in fp32 on the CPU (single-turn and tool rollouts, three architectures), banned tokens
never drawn, nothing recorded for greedy decoding."""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image
from torch.testing import assert_close

from vlmrl.config import GenerationSettings, load_config
from vlmrl.models import load_policy
from vlmrl.rollout.generation import Rollout, generate_groups
from vlmrl.rollout.sampling import SampledLogprobs
from vlmrl.rollout.tool_rollout import ToolBox, generate_trajectories
from vlmrl.tasks import Example
from vlmrl.training.logprobs import LogprobScorer

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest (conftest.py)


@pytest.fixture(scope="module")
def examples() -> list[Example]:
    return [Example(Image.new("RGB", (56, 84), (200, 10, 10)), "Count.", "1"),
            Example(Image.new("RGB", (112, 112), (20, 100, 10)), "How many circles are in the image?", "2")]


def test_the_recorder_bans_tokens_and_picks_the_drawn_tokens_logprob():
    recorder = SampledLogprobs(temperature=2.0, banned=[1, 99])  # 99: beyond the vocabulary, ignored
    first = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2 * math.log(3), 0.0, 0.0, 0.0]])  # (2, 4)
    out = recorder(torch.tensor([[7], [7]]), first)
    assert torch.isinf(out[:, 1]).all() and torch.equal(out[:, [0, 2, 3]], first[:, [0, 2, 3]])
    # step 2 shows the drawn tokens 2 and 0: log(1/4); softmax([ln 3, 0, 0, 0]) = [1/2, 1/6, 1/6, 1/6] -> log(1/2)
    recorder(torch.tensor([[7, 2], [7, 0]]), torch.zeros(2, 4))
    logp = recorder.logprobs(torch.tensor([[2, 3], [0, 3]]))  # the last token is picked at the end
    assert_close(logp, torch.tensor([[math.log(1 / 4), math.log(1 / 4)], [math.log(1 / 2), math.log(1 / 4)]]))


def scored(model, processor, rollout: Rollout, temperature: float) -> torch.Tensor:
    return LogprobScorer(processor, temperature=temperature)(model, rollout)[0]  # (N, T)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl", "idefics3"])
def test_recorded_logprobs_are_the_training_passes(arch, tiny_model_factory, examples):
    model, processor = load_policy(tiny_model_factory(arch), device="cpu")
    for shared, decode in ((True, "dynamic"), (False, "dynamic"), (True, "static")):
        settings = GenerationSettings(group_size=3, max_new_tokens=10, temperature=0.7, top_p=0.9,
                                      share_prompt_cache=shared, decode=decode)
        rollout = generate_groups(model, processor, examples, settings, seed=3)
        mask = rollout.completion_mask.bool()
        assert rollout.sampler_logp.shape == mask.shape and (rollout.sampler_logp[~mask] == 0).all()
        gap = (rollout.sampler_logp - scored(model, processor, rollout, 0.7)).abs()[mask].max()
        assert gap < 1e-5, (shared, decode, float(gap))
        assert (rollout.sampler_logp[mask] < 0).all()


def test_greedy_decoding_records_nothing_and_selection_keeps_the_logprobs(tiny_model_dir, examples):
    model, processor = load_policy(tiny_model_dir, device="cpu")
    greedy = generate_groups(model, processor, examples, GenerationSettings(group_size=2, max_new_tokens=6,
                                                                            temperature=0), seed=1)
    assert greedy.sampler_logp is None
    sampled = generate_groups(model, processor, examples, GenerationSettings(group_size=2, max_new_tokens=6), seed=1)
    part = sampled.select([3, 0])
    assert torch.equal(part.sampler_logp, sampled.sampler_logp[[3, 0]])
    both = Rollout.concat([part, sampled], processor.tokenizer.pad_token_id)
    assert torch.equal(both.sampler_logp[2:], sampled.sampler_logp)
    assert Rollout.concat([greedy, sampled], processor.tokenizer.pad_token_id).sampler_logp is None


def test_tool_rollouts_record_the_model_turns_logprobs(tiny_model_dir, monkeypatch):
    """Every first turn counts as a call (the random model writes none): its result (a parse error)
    sits between two sampled turns, whose log-probs are recorded turn by turn."""
    from vlmrl.rollout import tool_rollout

    monkeypatch.setattr(tool_rollout, "ends_with_call", lambda text: True)
    model, processor = load_policy(tiny_model_dir, device="cpu")
    original = Image.new("RGB", (112, 56), (255, 255, 255))
    example = Example(original.resize((56, 28)), "What is the code?", "3", originals=[original])
    settings = load_config(None, ["rollout.group_size=4", "rollout.max_new_tokens=16", "rollout.tools=[zoom]",
                                  "rollout.max_turns=2", "rollout.temperature=0.8"]).rollout
    rollout = generate_trajectories(model, processor, [example], ToolBox.from_config(settings), seed=2)
    assert all([s.model for s in row] == [True, False, True] for row in rollout.segments)
    mask = rollout.completion_mask.bool()
    assert (rollout.sampler_logp[~mask] == 0).all()  # tool results and padding
    gap = (rollout.sampler_logp - scored(model, processor, rollout, 0.8)).abs()[mask].max()
    assert gap < 1e-5, float(gap)
    assert rollout.select([1]).segments == [rollout.segments[1]]
