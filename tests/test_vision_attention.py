"""The vision tower's windows in one attention call per window length (vision_attention.py).

`window_attention` against a plain loop over the windows (one SDPA call each, as transformers
computes them): values and gradients, windows of one length (a view) and of several (gathered).
Then whole vision towers, patched against their own forward: Qwen2.5-VL with window layers and
images whose windows differ in size, and Qwen2-VL (attention over each image), the tower's output
and its gradients, and a model's log-probs through the patched tower; which modules are patched,
off restores them, and an eager tower keeps transformers' own loop.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from test_block_attention import rollout_of, scored

import vlmrl.models.vision_attention as vision_attention
from vlmrl.models import load_policy
from vlmrl.models.support import hf_model
from vlmrl.models.vision_attention import (
    batched_vision_unsupported,
    computes_batched,
    use_batched_vision_attention,
    window_attention,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def looped(query, key, value, cu_seqlens, scaling):
    """One SDPA call per window, as transformers' vision attention does outside FlashAttention."""
    bounds = cu_seqlens.tolist()
    outs = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1)[None] for t in (query, key, value)),
                                           scale=scaling)[0].transpose(0, 1)  # (b - a, h, d)
            for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs)  # (S, h, d)


@pytest.mark.parametrize("bounds", [[0, 4, 8, 12], [0, 4, 6, 10, 13, 13, 16], [0, 16]])
def test_windows_batched_give_the_loops_values_and_gradients(bounds):
    torch.manual_seed(0)
    inputs = [torch.randn(bounds[-1], 3, 8, requires_grad=True) for _ in range(3)]  # (S, h, d) q, k, v
    cu_seqlens = torch.tensor(bounds)
    upstream = torch.randn(bounds[-1], 3, 8)
    expected = looped(*inputs, cu_seqlens, 0.3)
    got = window_attention(*inputs, cu_seqlens, 0.3)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    for a, b in zip(torch.autograd.grad((expected * upstream).sum(), inputs),
                    torch.autograd.grad((got * upstream).sum(), inputs)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_a_query_sees_only_its_own_window():
    """Keys of another window leave an output unchanged; keys of its own change it."""
    torch.manual_seed(1)
    query, key, value = (torch.randn(10, 2, 4) for _ in range(3))
    cu_seqlens = torch.tensor([0, 3, 7, 10])  # windows of 3, 4 and 3: two lengths, gathered
    before = window_attention(query, key, value, cu_seqlens, 0.5)
    value[7:] += 1.0  # the last window's values
    after = window_attention(query, key, value, cu_seqlens, 0.5)
    assert torch.equal(before[:7], after[:7]) and not torch.allclose(before[7:], after[7:])


def images_of_mixed_sizes() -> list[Image.Image]:
    """Two 448 px squares (16 whole windows each) and a 308 x 196 one (windows cut at its edges)."""
    return [Image.new("RGB", (448, 448), (200, 40 * i, 90)) for i in range(2)] + [Image.new("RGB", (308, 196), "red")]


def tower_output_and_gradients(model, processor, images):
    """The vision tower's merged features for `images` and the gradients of their squared sum."""
    encoded = processor.image_processor(images=images, return_tensors="pt")
    visual = hf_model(model).model.visual
    model.zero_grad(set_to_none=True)
    out = visual(encoded["pixel_values"], grid_thw=encoded["image_grid_thw"]).pooler_output  # (tokens, hidden)
    out.pow(2).sum().backward()
    return out.detach(), [p.grad.clone() for p in visual.parameters()]


@pytest.mark.parametrize("arch, window_layers", [("qwen2_5_vl", [0, 2]), ("qwen2_vl", [])])
def test_the_patched_tower_computes_exactly_its_own_forward(arch, window_layers, tiny_model_factory, monkeypatch):
    model, processor = load_policy(tiny_model_factory(arch), device="cpu")
    visual = hf_model(model).model.visual
    if window_layers:  # the tiny model attends over whole images in every layer: make some attend in windows
        visual.fullatt_block_indexes = [i for i in range(len(visual.blocks)) if i not in window_layers]
    expected, expected_grads = tower_output_and_gradients(model, processor, images_of_mixed_sizes())
    assert use_batched_vision_attention(model, True) == len(visual.blocks)
    calls = []
    monkeypatch.setattr(vision_attention, "window_attention",
                        lambda *args: calls.append(args[3]) or window_attention(*args))
    got, got_grads = tower_output_and_gradients(model, processor, images_of_mixed_sizes())
    assert len(calls) == len(visual.blocks)  # every layer's attention went through the batched path
    if window_layers:
        assert len(calls[window_layers[0]]) > len(calls[1])  # more windows than images: windows were batched
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    for a, b in zip(expected_grads, got_grads):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_log_probs_and_gradients_through_the_patched_tower_are_the_models(tiny_model_dir):
    model, processor = load_policy(tiny_model_dir, device="cpu")
    completions = rollout_of(model, processor)
    model.train()
    own_logp, own_grad = scored(model, processor, completions, True)
    use_batched_vision_attention(model, True)
    batched_logp, batched_grad = scored(model, processor, completions, True)
    torch.testing.assert_close(batched_logp, own_logp, rtol=0, atol=1e-6)
    assert F.cosine_similarity(own_grad, batched_grad, dim=0) >= 0.99999


def test_which_modules_are_patched_and_off_restores_them(tiny_model_factory):
    qwen, _ = load_policy(tiny_model_factory("qwen2_5_vl"), device="cpu")
    assert not computes_batched(qwen)
    assert use_batched_vision_attention(qwen, True) == hf_model(qwen).config.vision_config.depth
    assert computes_batched(qwen) and use_batched_vision_attention(qwen, True) > 0  # twice: still one patch each
    assert use_batched_vision_attention(qwen, False) == 0 and not computes_batched(qwen)
    assert all("forward" not in module.__dict__ for module in qwen.modules())
    idefics, _ = load_policy(tiny_model_factory("idefics3"), device="cpu")
    assert use_batched_vision_attention(idefics, True) == 0  # its tower has no windows to batch


def test_an_eager_tower_keeps_transformers_loop(tiny_model_dir, monkeypatch):
    """Attention maps (report/attention.py) load the model on eager: the patch then defers."""
    model, processor = load_policy(tiny_model_dir, device="cpu", attn_implementation="eager")
    use_batched_vision_attention(model, True)
    monkeypatch.setattr(vision_attention, "window_attention", lambda *args: pytest.fail("batched under eager"))
    out, _ = tower_output_and_gradients(model, processor, images_of_mixed_sizes()[:1])
    assert torch.isfinite(out).all()


def test_a_deep_copy_keeps_the_patch_on_its_own_modules(tiny_model_dir):
    """The reference policy is a deep copy of the patched policy (reference.py)."""
    import copy

    model, _ = load_policy(tiny_model_dir, device="cpu")
    use_batched_vision_attention(model, True)
    twin = copy.deepcopy(model)
    assert computes_batched(twin)
    patched = [m for m in twin.modules() if "forward" in m.__dict__]
    assert patched and all(m.forward.args[0] is m for m in patched)


def test_a_batched_forward_that_computes_something_else_is_refused(tiny_model_dir, monkeypatch):
    """As if a transformers release changed its vision attention: the self-check compares, and the
    model keeps its own forward, with the reason in the speed line."""
    model, _ = load_policy(tiny_model_dir, device="cpu")
    assert batched_vision_unsupported(model) is None
    monkeypatch.setattr(vision_attention, "window_attention", lambda q, k, v, cu, scaling: v)  # no attention
    assert "off transformers' by" in batched_vision_unsupported(model)
    assert use_batched_vision_attention(model, True) == 0 and not computes_batched(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_on_cuda_the_batched_tower_gives_the_loops_numbers(dtype, tolerance, tiny_model_dir):
    """On CUDA SDPA may pick another kernel for a batch than for one window: the numbers then differ
    by rounding only (relative to the norm), values and gradients."""
    model, processor = load_policy(tiny_model_dir, device="cuda", dtype=dtype)
    visual = hf_model(model).model.visual
    visual.fullatt_block_indexes = [1]
    encoded = processor.image_processor(images=images_of_mixed_sizes(), return_tensors="pt").to("cuda")

    def run():
        model.zero_grad(set_to_none=True)
        out = visual(encoded["pixel_values"].to(model.dtype), grid_thw=encoded["image_grid_thw"]).pooler_output
        out.float().pow(2).sum().backward()
        return [out.detach().float()] + [p.grad.float() for p in visual.parameters()]

    expected = run()
    assert use_batched_vision_attention(model, True) > 0  # the self-check passes on CUDA too
    for a, b in zip(expected, run()):
        assert float((a - b).norm() / a.norm().clamp(min=1e-12)) <= tolerance
