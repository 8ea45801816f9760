"""Block attention computes the packed mask's allowed blocks only, with the dense mask's numbers.

The plan of a small layout is checked by hand; the attention of random layouts (left-padded
prompts, unpadded prefixes of different lengths, ragged segments, trailing padding, grouped heads)
equals one SDPA call under the dense mask at every position that is read, values and gradients;
in the tiny models the packed log-probs and gradients equal the dense-mask forward's (1e-5, cosine
0.9999), under gradient checkpointing too, and generation is unchanged by the switch. Marked gpu
(benchmarks/gpu_check.sh): on CUDA, the bf16 FlashAttention and masked calls against the
dense mask in fp32, and the tiny model's packed pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers.integrations.sdpa_attention import repeat_kv

from vlmrl.config import GenerationSettings
from vlmrl.models import block_attention as blocks_module
from vlmrl.models.block_attention import NAME, block_attention, plan_blocks
from vlmrl.models.loading import enable_checkpointing, load_policy
from vlmrl.rollout.completions import Completions
from vlmrl.rollout.generation import generate_groups
from vlmrl.safety.activation_memory import saved_bytes
from vlmrl.tasks import Example
from vlmrl.training.logprobs import LogprobScorer
from vlmrl.training.packing import segment_attention_mask

pytestmark = pytest.mark.usefixtures("one_thread")


def layout(prompts: list[int], segments: list[list[int]], left_padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """label and valid (U, L) of packs [prompt, segment 0, segment 1, ...]: prompts left-padded to one
    length (packing.py) or each at its own length (trajectories.py); then padding (-2)."""
    width = max(prompts)
    length = width + max(sum(s) for s in segments)
    label = torch.full((len(prompts), length), -2)
    valid = torch.zeros(len(prompts), length, dtype=torch.bool)
    for u, (prompt, lengths) in enumerate(zip(prompts, segments)):
        start = width if left_padded else prompt
        label[u, :start] = -1
        valid[u, start - prompt:start] = True
        for k, n in enumerate(lengths):
            label[u, start:start + n] = k
            valid[u, start:start + n] = True
            start += n
    return label, valid


def dense(query, key, value, label, valid):
    """One SDPA call under the packing's dense additive mask: (U, L, h, d)."""
    groups = query.shape[1] // key.shape[1]
    mask = segment_attention_mask(label, valid, query.dtype)  # (U, 1, L, L)
    return F.scaled_dot_product_attention(query, repeat_kv(key, groups), repeat_kv(value, groups),
                                          attn_mask=mask).transpose(1, 2)


def test_the_plan_of_a_small_pack_by_hand():
    # One pack: a prompt of 3 tokens (the first is left padding), two completions of 2 tokens.
    label = torch.tensor([[-1, -1, -1, 0, 0, 1, 1]])
    valid = torch.tensor([[0, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)  # completion 1's last token: padding
    plan = plan_blocks(label, valid)
    assert plan.prefix.queries.tolist() == [[0, 1, 2]]
    assert plan.segments.queries.tolist() == [[3, 4], [5, 6]]
    assert plan.segments.keys.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 5, 6]]
    # The padded prompt token is masked: no lower-right causal shortcut, boolean masks of the rule.
    assert plan.prefix.mask[0, 0].int().tolist() == [[1, 0, 0],  # padding sees itself only (no NaN)
                                                     [0, 1, 0],
                                                     [0, 1, 1]]
    assert plan.segments.mask[:, 0].int().tolist() == [[[0, 1, 1, 1, 0], [0, 1, 1, 1, 1]],
                                                       [[0, 1, 1, 1, 0], [0, 1, 1, 1, 1]]]  # padding sees itself
    assert plan.source.tolist() == [0, 1, 2, 3, 4, 5, 6]  # prefix rows, then segment rows, in place


def test_without_padding_in_the_prompt_the_calls_take_no_mask():
    label, valid = layout([4], [[3, 2, 3]], left_padded=True)
    plan = plan_blocks(label, valid)
    assert plan.prefix.mask is None and plan.segments.mask is None  # lower-right causal: a flash kernel
    assert plan.segments.keys.shape == (3, 4 + 3)
    # Rows: 4 prefix, then 3 per segment; segment 1 has 2 tokens, so row 9 is nobody's.
    assert plan.source.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12]


@pytest.mark.parametrize("prompts, segments, left_padded", [
    ([5], [[3, 3, 3]], True),
    ([5, 3], [[3, 1, 3], [2, 3]], True),  # a shorter prompt left-padded, ragged completions
    ([4, 6], [[2, 5, 1], [3]], False),  # trajectories: prefixes of their own lengths, padding at the end
    ([1], [[1, 4]], True),
])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_block_attention_equals_the_dense_mask(prompts, segments, left_padded, heads):
    torch.manual_seed(0)
    label, valid = layout(prompts, segments, left_padded)
    units, length = label.shape
    query = torch.randn(units, heads[0], length, 8, dtype=torch.float64, requires_grad=True)
    key, value = (torch.randn(units, heads[1], length, 8, dtype=torch.float64, requires_grad=True) for _ in "kv")
    expected = dense(query, key, value, label, valid)  # (U, L, h, d)
    got = block_attention(query, key, value, plan_blocks(label, valid))
    read = valid & (label != -2)  # (U, L): the positions anything valid depends on
    assert (expected - got)[read].abs().max() < 1e-12
    weight = torch.randn_like(expected) * read[:, :, None, None]
    for a, b in zip(torch.autograd.grad((expected * weight).sum(), (query, key, value)),
                    torch.autograd.grad((got * weight).sum(), (query, key, value))):
        assert (a - b).abs().max() < 1e-12


def test_grouped_heads_as_they_are_give_the_same_attention(monkeypatch):
    """The CPU's kernel (and FlashAttention on a GPU, mask-free calls) takes the grouped key heads
    as they are (enable_gqa, no repeated keys): the same numbers as repeating them, and less kept
    for backward."""
    label, valid = layout([5], [[3, 3, 3]], left_padded=True)
    torch.manual_seed(0)
    query = torch.randn(1, 4, label.shape[1], 8, dtype=torch.float64, requires_grad=True)
    key, value = (torch.randn(1, 2, label.shape[1], 8, dtype=torch.float64, requires_grad=True) for _ in "kv")
    plan = plan_blocks(label, valid)
    grouped = block_attention(query, key, value, plan)
    kept = saved_bytes(lambda: block_attention(query, key, value, plan), torch.nn.Linear(1, 1))
    monkeypatch.setattr(blocks_module, "_takes_grouped_heads", lambda *args: False)
    repeated = block_attention(query, key, value, plan)
    assert (repeated - grouped).abs().max() < 1e-12
    assert (dense(query, key, value, label, valid) - grouped).abs().max() < 1e-12
    assert kept < saved_bytes(lambda: block_attention(query, key, value, plan), torch.nn.Linear(1, 1))
    for a, b in zip(torch.autograd.grad(repeated.sum(), (query, key, value)),
                    torch.autograd.grad(grouped.sum(), (query, key, value))):
        assert (a - b).abs().max() < 1e-12


def examples() -> list[Example]:
    """Two prompts of different lengths (left padding in a shared micro-batch)."""
    return [Example(Image.new("RGB", (56, 84), (200, 10, 10)), "Count.", "1"),
            Example(Image.new("RGB", (112, 112), (20, 100, 10)),
                    "How many circles are in the image? Think step by step.", "2")]


def rollout_of(model, processor, group: int = 3):
    settings = GenerationSettings(group_size=group, max_new_tokens=8, temperature=0.9)
    rollout = generate_groups(model, processor, examples(), settings, seed=1)
    mask = rollout.completion_mask.clone()
    mask[::2, 5:] = 0  # ragged completions, as EOS makes them
    ids = rollout.completion_ids.masked_fill(mask == 0, processor.tokenizer.pad_token_id)
    return Completions(rollout.rows, ids, mask)


def scored(model, processor, completions, blocks: bool, rows: list[int] | None = None):
    """Log-probs (n, T) and the gradient of a loss on them, packed, blocks on or off."""
    if rows is not None:
        completions = Completions([completions.rows[i] for i in rows], completions.completion_ids[rows],
                                  completions.completion_mask[rows])
    model.zero_grad()
    logp, _ = LogprobScorer(processor, 0.7, True, 4, blocks)(model, completions)
    (logp.sum() + (logp ** 2).sum()).backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return logp.detach(), grad


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl", "idefics3"])
def test_packed_logprobs_and_gradients_equal_the_dense_mask(arch, tiny_model_factory, monkeypatch):
    model, processor = load_policy(tiny_model_factory(arch), device="cpu")
    completions = rollout_of(model, processor)
    model.train()
    calls = []
    real = blocks_module.block_attention
    monkeypatch.setattr(blocks_module, "block_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    for rows in (None, [0, 4, 1, 3]):  # whole groups; two groups split, as a micro-batch may hold them
        dense_logp, dense_grad = scored(model, processor, completions, False, rows)
        assert not calls
        block_logp, block_grad = scored(model, processor, completions, True, rows)
        assert calls  # the block kernel ran
        calls.clear()
        assert (dense_logp - block_logp).abs().max() < 1e-5
        assert F.cosine_similarity(dense_grad, block_grad, dim=0) >= 0.9999
    assert model.config.get_text_config()._attn_implementation == NAME


def test_under_gradient_checkpointing_the_recomputed_layers_compute_blocks_too(tiny_model_dir, monkeypatch):
    model, processor = load_policy(tiny_model_dir, device="cpu")
    completions = rollout_of(model, processor)
    model.train()
    dense_logp, dense_grad = scored(model, processor, completions, False)
    enable_checkpointing(model)
    calls = []
    real = blocks_module.block_attention
    monkeypatch.setattr(blocks_module, "block_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    block_logp, block_grad = scored(model, processor, completions, True)
    layers = model.config.get_text_config().num_hidden_layers
    assert len(calls) == 2 * layers  # each layer's forward, and again when backward recomputes it
    assert (dense_logp - block_logp).abs().max() < 1e-5
    assert F.cosine_similarity(dense_grad, block_grad, dim=0) >= 0.9999


def test_generation_is_unchanged_on_the_block_kernel(tiny_model_dir):
    model, processor = load_policy(tiny_model_dir, device="cpu")
    settings = GenerationSettings(group_size=2, max_new_tokens=8, temperature=0.0)
    before = generate_groups(model, processor, examples(), settings, seed=0).completion_ids
    LogprobScorer(processor)(model, rollout_of(model, processor))  # puts the model on the block kernel
    assert model.config.get_text_config()._attn_implementation == NAME
    assert torch.equal(generate_groups(model, processor, examples(), settings, seed=0).completion_ids, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("prompts, segments", [([1000], [[256] * 8]),  # no padding: FlashAttention, GQA
                                               ([1000, 900], [[256] * 4, [200, 256, 256, 100]])])  # masked
def test_on_cuda_in_bf16_the_blocks_give_the_dense_numbers(prompts, segments):
    """Qwen2.5-VL-3B's heads (16 query, 2 key/value, 128 wide) in bf16 against the dense mask in fp32:
    bf16's rounding, no more."""
    torch.manual_seed(0)
    label, valid = (t.cuda() for t in layout(prompts, segments, left_padded=True))
    units, length = label.shape
    shapes = [(units, 16, length, 128), (units, 2, length, 128), (units, 2, length, 128)]
    exact = [torch.randn(shape, device="cuda", requires_grad=True) for shape in shapes]
    half = [t.detach().bfloat16().requires_grad_() for t in exact]
    expected = dense(*exact, label, valid)  # (U, L, h, d) fp32
    got = block_attention(*half, plan_blocks(label, valid))
    read = valid & (label != -2)
    assert (expected - got.float())[read].abs().max() < 0.03
    weight = torch.randn_like(expected) * read[:, :, None, None]
    for a, b in zip(torch.autograd.grad((expected * weight).sum(), exact),
                    torch.autograd.grad((got.float() * weight).sum(), half)):
        assert F.cosine_similarity(a.flatten(), b.float().flatten(), dim=0) >= 0.999


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_packed_logprobs_with_blocks_equal_the_dense_mask(tiny_model_dir):
    model, processor = load_policy(tiny_model_dir, device="cuda")
    completions = rollout_of(model, processor)
    model.train()
    dense_logp, dense_grad = scored(model, processor, completions, False)
    block_logp, block_grad = scored(model, processor, completions, True)
    assert (dense_logp - block_logp).abs().max() < 1e-4
    assert F.cosine_similarity(dense_grad, block_grad, dim=0) >= 0.9999
