"""Preflight: first batches encoded, prompt lengths against max_prompt_length, a memory estimate
whose parts add up, and `vlmrl check`."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from vlmrl.cli import main
from vlmrl.config import load_config
from vlmrl.disk import gib
from vlmrl.errors import VlmrlError
from vlmrl.models.loading import is_checkpointing, load_policy
from vlmrl.safety import preflight as preflight_module
from vlmrl.safety.activation_memory import ActivationCosts
from vlmrl.safety.early_checks import check_before_loading
from vlmrl.safety.preflight import check, estimate_memory, micro_batch_candidates, packed_prompts, preflight
from vlmrl.tasks import Example, get_task


def overrides(model_dir: str, *extra: str) -> list[str]:
    return [f"model.name_or_path={model_dir}", "model.device=cpu", "task.name=letter_task:LetterTask",
            "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8",
            "rollout.generation_batch_size=2", "train.micro_batch_size=8", *extra]


def test_check_reports_the_longest_prompt_and_a_memory_estimate(tiny_model_dir, letter_task):
    report = check(load_config(None, overrides(tiny_model_dir, "eval.every=5", "eval.splits=[test]",
                                               "eval.batch_size=3")))
    train, test = report.splits
    assert (train.split, train.prompts, test.split, test.prompts) == ("train", 4, "test", 3)
    assert 0 < train.image_tokens < train.longest <= 4096  # 56x56 images: a few image tokens
    m = report.memory
    policy, _ = load_policy(tiny_model_dir, device="cpu")
    weights = sum(p.numel() * p.element_size() for p in policy.parameters())
    assert m.weights == weights and m.gradients == weights and m.optimizer == 2 * weights  # all trainable, fp32
    assert m.reference == weights  # beta > 0 by default: a frozen copy
    assert m.peak == 5 * weights + max(m.generation, m.activations) and m.activations > 0 and m.generation > 0
    assert m.free > 0 and m.fits
    text = "\n".join(report.lines())
    assert "longest" in text and f"{train.image_tokens} image tokens" in text and "fits" in text
    assert f"activations measured: {report.costs.per_token / 1024:.0f} KiB per token" in text


def test_the_report_says_which_speedups_the_run_takes_and_why_not(tiny_model_dir, letter_task):
    def speed(*extra):
        return check(load_config(None, overrides(tiny_model_dir, *extra))).speed

    assert speed() == ("shared prompt cache; packed log-prob passes; block attention; "
                       "output layer in chunks of 1024; vision windows batched; decode dynamic")
    assert speed("model.attn_implementation=eager", "train.logprob_chunk=0") == (
        "shared prompt cache; packed log-prob passes; no block attention (attention kernel 'eager'); "
        "no chunked output layer (off); no vision windows batched (the vision tower runs on eager); decode dynamic")
    assert speed("train.pack_groups=false", "rollout.share_prompt_cache=false", "rollout.decode=static",
                 "train.batched_vision_attention=false") == (
        "no shared prompt cache (off); no packed log-prob passes (off); output layer in chunks of 1024; "
        "no vision windows batched (off); decode static")
    assert speed("train.fused_kernels=true") == (  # the CPU: liger's Triton kernels cannot serve
        "shared prompt cache; packed log-prob passes; block attention; output layer in chunks of 1024; "
        "vision windows batched; no fused kernels (needs a CUDA device: the kernels are Triton's); decode dynamic")


def test_the_report_says_how_bf16_weights_take_their_updates(tiny_model_dir, letter_task):
    def dtype(*extra):
        return check(load_config(None, overrides(tiny_model_dir, *extra))).dtype

    assert dtype() == "float32"
    assert dtype("model.dtype=bfloat16") == "bfloat16 (updates stochastically rounded)"
    assert dtype("model.dtype=bfloat16", "train.stochastic_rounding=false") == (
        "bfloat16 (updates rounded to nearest: those under |w| / 512 are lost)")
    assert dtype("model.dtype=bfloat16", "model.lora.enabled=true") == "bfloat16"  # float32 adapters train


def test_memory_estimate_follows_the_settings(tiny_model_dir, letter_task):
    def memory(*extra):
        return check(load_config(None, overrides(tiny_model_dir, *extra))).memory

    base = memory()
    assert memory("train.micro_batch_size=16").activations > 1.9 * base.activations
    assert memory("rollout.group_size=8").generation > 1.9 * base.generation
    assert memory("model.gradient_checkpointing=true").activations < base.activations
    assert memory("algorithm.beta=0").reference == 0
    frozen = memory("model.freeze_vision=true")
    assert frozen.gradients < base.gradients and frozen.optimizer == 2 * frozen.gradients


def test_the_activation_estimate_counts_each_packed_prompt_and_image_once(tiny_model_dir, letter_task):
    config = load_config(None, overrides(tiny_model_dir))  # 4 prompts x G=4, micro-batches of 8 rows, 8 tokens
    policy, _ = load_policy(tiny_model_dir, device="cpu", dtype="float32")
    costs = ActivationCosts(per_token=1000.0, per_image_token=300.0, in_layers=800.0, in_blocks=200.0, layers=2,
                            layer_input=8, vision_layers=1, vision_layer_input=4)
    text = policy.config.get_text_config()
    readout = 8 * 8 * text.vocab_size * 12  # the 64 completion positions, one chunk
    key_value = 2 * text.num_key_value_heads * (text.hidden_size // text.num_attention_heads) * 4  # bytes a token
    copies = 8 * 50 * key_value  # the block kernel: each of the 8 completions' calls copies its prompt's keys

    def activations(*extra):
        trial = load_config(None, overrides(tiny_model_dir, *extra))
        return estimate_memory(trial, policy, "train", 1, 50, 8, 10, costs).activations

    packed = 2 * 50 + 8 * 8  # 2 prompts of 50 tokens computed once, then 8 completions of 8 tokens
    # per token 1000 bytes, per image token 300 (2 images x 10 tokens), then the output layer's chunk
    assert readout > 400 * packed  # larger than half a layer's
    assert activations() == 1000 * packed + 300 * 2 * 10 + readout + 2 * copies  # in each of 2 layers
    assert activations("train.block_attention=false") == 1000 * packed + 300 * 2 * 10 + readout
    plain = 8 * (50 + 8)
    assert activations("train.pack_groups=false") == 1000 * plain + 300 * 8 * 10 + readout
    assert activations("model.freeze_vision=true") == 1000 * packed + readout + 2 * copies
    assert packed_prompts(config, policy, "train", 1) == 2
    nothing = ActivationCosts(0.0, 0.0, 0.0, 0.0, layers=2, layer_input=0, vision_layers=1, vision_layer_input=0)
    trial = load_config(None, overrides(tiny_model_dir, "train.logprob_chunk=16", "train.block_attention=false"))
    embedding = policy.get_input_embeddings().weight.numel() * 4  # tied to the output layer
    assert estimate_memory(trial, policy, "train", 1, 50, 8, 10, nothing).activations == 3 * embedding
    # outside the layers 200 and 100 bytes, the layers' inputs, then the readout (over 1.5 layers)
    assert activations("model.gradient_checkpointing=true") == 200 * packed + 100 * 20 + 2 * 8 * packed + 4 * 20 \
        + readout + copies  # in the one layer recomputed


def test_the_compiled_decode_path_counts_the_cache_it_keeps_into_the_training_phase(tiny_model_dir, letter_task):
    """A static cache is CACHE_BUCKET-rounded; the compiled path keeps it from one step's generation
    through the training phase (decoding.py), so it adds to the activations' side of the peak."""
    policy, _ = load_policy(tiny_model_dir, device="cpu", dtype="float32")
    costs = ActivationCosts(per_token=1000.0, per_image_token=300.0, in_layers=800.0, in_blocks=200.0, layers=2,
                            layer_input=8, vision_layers=1, vision_layer_input=4)
    text = policy.config.get_text_config()
    head_dim = text.hidden_size // text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * 4  # keys and values, fp32

    def memory(decode: str):
        config = load_config(None, overrides(tiny_model_dir, f"rollout.decode={decode}", "eval.every=0"))
        return estimate_memory(config, policy, "train", 1, 50, 8, 10, costs)

    dynamic, static, compiled = memory("dynamic"), memory("static"), memory("compiled")
    logits = 8 * text.vocab_size * (4 + 8)  # 2 prompts x G=4 rows a call
    assert dynamic.generation == 8 * 58 * per_token + logits and dynamic.kept_cache == 0
    assert static.generation == compiled.generation == 8 * 256 * per_token + logits  # 58 tokens -> 256
    assert static.kept_cache == 0 and compiled.kept_cache == 8 * 256 * per_token
    assert compiled.activations == static.activations
    fixed = static.weights + static.gradients + static.optimizer + static.reference
    assert static.peak == fixed + max(static.generation, static.activations)
    assert compiled.peak == fixed + max(compiled.generation, compiled.activations + compiled.kept_cache)
    assert compiled.peak > static.peak
    report = check(load_config(None, overrides(tiny_model_dir, "rollout.decode=compiled")))
    assert any("+ the decode cache kept" in line for line in report.lines())
    assert "rollout.decode=static" in preflight_module.memory_advice(compiled)
    assert "rollout.decode" not in preflight_module.memory_advice(static)


def test_under_fsdp2_each_process_holds_its_part_plus_what_it_gathers(tiny_model_dir, letter_task):
    """Two shards: weights, gradients, AdamW and the reference halved; generation adds the other
    half of the weights (gathered whole per call); training adds the other half of the root unit
    and of two decoder layers (the one computing, the next prefetched)."""
    policy, _ = load_policy(tiny_model_dir, device="cpu", dtype="float32")
    costs = ActivationCosts(per_token=1000.0, per_image_token=300.0, in_layers=800.0, in_blocks=200.0, layers=2,
                            layer_input=8, vision_layers=1, vision_layer_input=4)
    config = load_config(None, overrides(tiny_model_dir, "eval.every=0"))
    whole = estimate_memory(config, policy, "train", 2, 50, 8, 10, costs)
    split = estimate_memory(config, policy, "train", 2, 50, 8, 10, costs, sharding=preflight_module.Sharding(2))
    weights = sum(p.numel() * 4 for p in policy.parameters())
    layer = sum(p.numel() * 4 for p in policy.model.language_model.layers[0].parameters())
    block = sum(p.numel() * 4 for p in policy.model.visual.blocks[0].parameters())
    root = weights - 2 * layer - 2 * block
    assert (whole.weights, whole.gathered_generation, whole.gathered_training) == (weights, 0, 0)
    assert (split.weights, split.gradients, split.optimizer) == (weights // 2, weights // 2, weights)
    assert split.reference == weights // 2 and split.gathered_generation == weights - weights // 2
    assert split.gathered_training == (root + 2 * max(layer, block)) // 2
    assert split.peak == (split.weights + split.gradients + split.optimizer + split.reference
                          + max(split.generation + split.gathered_generation,
                                split.activations + split.gathered_training))
    assert split.peak < whole.peak
    short = dataclasses.replace(split, free=weights)  # the model whole fits, not with 10% spare
    assert preflight_module.memory_advice(short).startswith(
        "this model cannot generate here gathered whole: FSDP2 gathers it")
    assert preflight_module.memory_advice(short).endswith("set rollout.fsdp_generation=layers (one block at a time)")
    by_layers = estimate_memory(load_config(None, overrides(tiny_model_dir, "eval.every=0", "rollout.fsdp_generation=layers")),
                                policy, "train", 2, 50, 8, 10, costs, sharding=preflight_module.Sharding(2))
    assert by_layers.gathered_generation == split.gathered_training and not by_layers.whole_generation
    tiny = dataclasses.replace(by_layers, free=weights // 2)
    assert preflight_module.memory_advice(tiny).startswith("this model cannot generate here even layer by layer")
    assert preflight_module.memory_advice(dataclasses.replace(short, shards=1)).startswith("this run may not fit")


def test_under_zero3_the_reference_stays_whole_and_deepspeed_keeps_an_fp32_copy(tiny_model_dir, letter_task):
    """Two ZeRO-3 partitions: weights and gradients halved, AdamW's two moments and DeepSpeed's fp32
    copy of the partition, the reference copy whole on each process (training/zero3.py), generation
    always gathered whole, the output layer read from whole logits (no chunk)."""
    policy, _ = load_policy(tiny_model_dir, device="cpu", dtype="float32")
    costs = ActivationCosts(per_token=1000.0, per_image_token=300.0, in_layers=800.0, in_blocks=200.0, layers=2,
                            layer_input=8, vision_layers=1, vision_layer_input=4)
    settings = overrides(tiny_model_dir, "eval.every=0", "rollout.fsdp_generation=layers", "train.logprob_chunk=1")
    config = load_config(None, settings)
    fsdp2 = estimate_memory(config, policy, "train", 2, 50, 8, 10, costs, sharding=preflight_module.Sharding(2))
    zero3 = estimate_memory(config, policy, "train", 2, 50, 8, 10, costs,
                            sharding=preflight_module.Sharding(2, deepspeed=True))
    weights = sum(p.numel() * 4 for p in policy.parameters())
    assert (zero3.weights, zero3.gradients, zero3.optimizer) == (weights // 2, weights // 2, weights + weights // 2)
    assert zero3.reference == weights and fsdp2.reference == weights // 2
    assert zero3.whole_generation and zero3.gathered_generation == weights - weights // 2
    assert zero3.activations > fsdp2.activations  # whole logits, not a chunk of 1 position
    short = dataclasses.replace(zero3, free=weights)
    assert preflight_module.memory_advice(short).startswith("this model cannot generate here gathered whole: ZeRO-3")


def test_the_3b_shapes_run_fits_an_80_gb_gpu_without_checkpointing_when_packed():
    """configs/shapes_grpo_3b.yaml's batch (micro-batches of one group of 8, 256 new tokens) with
    the issues' benchmark images (~1100-token prompts of 1024 image tokens) on the Qwen2.5-VL-3B
    architecture, with the costs the probe measured on bf16 builds of it (RESULTS.md): packed, the
    activations fit next to the weights, AdamW and the reference; each row computing its own
    prompt and image, they would not."""
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

    text = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True)
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                  fullatt_block_indexes=[7, 15, 23, 31])
    with torch.device("meta"):
        policy = AutoModelForImageTextToText.from_config(
            Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True), dtype=torch.bfloat16)
    kib = 1024
    costs = ActivationCosts(per_token=(16.5 + 36 * 127.1) * kib, per_image_token=(71.7 + 32 * 257.2) * kib,
                            in_layers=36 * 127.1 * kib, in_blocks=32 * 257.2 * kib, layers=36, layer_input=2048 * 2,
                            vision_layers=32, vision_layer_input=4 * 1280 * 2)

    def needed(*extra) -> float:
        config = load_config(str(Path(__file__).resolve().parents[1] / "configs/shapes_grpo_3b.yaml"), list(extra))
        return estimate_memory(config, policy, "train", 1, 1100, 256, 1024, costs).needed / 2 ** 30

    packed, plain = needed("model.gradient_checkpointing=false"), needed("model.gradient_checkpointing=false",
                                                                         "train.pack_groups=false")
    free = 79.1 - 0.5 - 7.0  # GiB: an 80 GB H100, less the CUDA context and the loaded bf16 weights
    assert 45 < packed <= free * (1 - preflight_module.HEADROOM) and plain > 120
    assert needed("model.gradient_checkpointing=true") < packed - 15


def test_a_prompt_longer_than_max_prompt_length_is_an_error(tiny_model_dir, letter_task):
    with pytest.raises(VlmrlError, match=r"prompt of train example 0 is \d+ tokens \(\d+ of them image tokens\) > "
                                         r"rollout.max_prompt_length=10; image and video tokens are never truncated"):
        check(load_config(None, overrides(tiny_model_dir, "rollout.max_prompt_length=10")))


class PlaceholderTask:
    """A task whose question carries an image placeholder of its own (a common data bug)."""

    name = "placeholder"
    splits = ("train", "test")

    def example(self, idx, split="train"):
        from PIL import Image

        return Example(image=Image.new("RGB", (56, 56)), prompt="What is in <|image_pad|> this?", answer="a")


def test_a_special_token_in_the_question_is_an_error(tiny_model_dir):
    config = load_config(None, overrides(tiny_model_dir))
    policy, processor = load_policy(tiny_model_dir, device="cpu")
    with pytest.raises(VlmrlError, match=r"question of train example 0 contains the special token '<\|image_pad\|>'"):
        preflight(config, policy, processor, PlaceholderTask(), "train")


def test_a_marker_that_places_an_image_is_no_special_token_but_one_left_over_is(tiny_model_factory):
    """Idefics3's image token is `<image>`, the marker that places an image: one marker per image is
    consumed (the image goes there); a second marker for one image stays in the question: refused."""
    from PIL import Image

    from vlmrl.safety.preflight import check_prompts

    _, processor = load_policy(tiny_model_factory("idefics3"), device="cpu")
    image = Image.new("RGB", (56, 56))
    placed = Example(image=image, prompt="Is <image> dark?", answer="yes")
    assert check_prompts(processor, [placed], [0], "train", 4096).image_tokens == 16
    with pytest.raises(VlmrlError, match=r"question of train example 3 contains the special token '<image>'"):
        check_prompts(processor, [Example(image=image, prompt="Is <image> like <image>?", answer="yes")], [3],
                      "train", 4096)


def test_an_unknown_eval_split_is_an_error_before_training(tiny_model_dir, letter_task):
    with pytest.raises(VlmrlError, match=r"eval.splits names 'ood', which task 'letters' does not have; "
                                         r"valid: train, test"):
        check(load_config(None, overrides(tiny_model_dir, "eval.every=1", "eval.splits=[ood]")))


def test_a_task_that_fails_is_named_with_split_and_index(tiny_model_dir):
    class Broken(PlaceholderTask):
        def example(self, idx, split="train"):
            raise KeyError("image")

    config = load_config(None, overrides(tiny_model_dir))
    policy, processor = load_policy(tiny_model_dir, device="cpu")
    with pytest.raises(VlmrlError, match=r"task 'placeholder' cannot make train example 0: KeyError: 'image'"):
        preflight(config, policy, processor, Broken(), "train")


def test_sft_preflight_measures_the_reference_completions(tiny_model_dir):
    config = load_config(None, overrides(tiny_model_dir, "task.name=shapes", "sft.batch_size=6"))
    policy, processor = load_policy(tiny_model_dir, device="cpu")
    task = get_task("shapes")
    report = preflight(config, policy, processor, task, "sft")
    assert report.splits[0].prompts == 6 and report.memory.generation == 0 and report.memory.reference == 0
    assert report.speed == "output layer in chunks of 1024; vision windows batched"  # no generation, no packing
    config = load_config(None, overrides(tiny_model_dir, "task.name=shapes", "train.fused_kernels=true"))
    assert preflight(config, policy, processor, task, "sft").speed == (
        "output layer in chunks of 1024; vision windows batched; "
        "no fused kernels (needs a CUDA device: the kernels are Triton's)")


def test_vlmrl_check_prints_the_report_and_warns_when_it_will_not_fit(tiny_model_dir, letter_task, capsys,
                                                                      monkeypatch):
    assert main(["check", *overrides(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("model ") and "train " in out and out.strip().endswith("ok")
    monkeypatch.setattr(preflight_module, "free_memory", lambda device: 1024)
    assert main(["check", *overrides(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "ok, but this run may not fit" in out and "gradient_checkpointing" in out
    assert main(["check", *overrides(tiny_model_dir, "rollout.max_prompt_length=5")]) == 2
    assert "error: the prompt of train example 0" in capsys.readouterr().err


def test_training_warns_before_step_one_when_memory_is_short(tmp_path, tiny_model_dir, letter_task, capsys,
                                                             monkeypatch):
    from vlmrl.training.trainer import train

    monkeypatch.setattr(preflight_module, "free_memory", lambda device: 1024)
    train(load_config(None, overrides(tiny_model_dir, f"output_dir={tmp_path / 'run'}", "train.steps=1",
                                      "train.trackers=[]", "train.log_rollouts_every=0")))
    captured = capsys.readouterr()
    assert "preflight: train " in captured.out and "preflight: memory" in captured.out
    assert "warning: this run may not fit" in captured.err


def test_the_checkpoints_host_copy_is_counted_against_the_ram_beside_the_run(tiny_model_dir, letter_task,
                                                                              monkeypatch):
    """The copy a background checkpoint makes: the weights, AdamW's two moments, the reference copy
    (beta > 0); on a CPU device it must fit, 10% spare, beside what the run itself still takes in the
    same RAM; else the run writes on the step's path and the line says why. Never a refusal."""
    policy, _ = load_policy(tiny_model_dir, device="cpu", dtype="float32")
    weights = sum(p.numel() * 4 for p in policy.parameters())
    report = check(load_config(None, overrides(tiny_model_dir)))
    plan, needed = report.checkpoints, report.memory.needed
    assert (plan.copy, plan.run, plan.available) == (4 * weights, needed, report.memory.free)
    assert plan.background and f"checkpoints written in the background (host copy {gib(4 * weights)} of " \
        f"{gib(report.memory.free)} available beside the run's {gib(needed)})" in report.lines()
    config = load_config(None, overrides(tiny_model_dir))
    plan_for = lambda config, memory, **sharding: preflight_module.checkpoint_plan(  # noqa: E731
        config, policy, "train", memory, **sharding)
    assert plan_for(load_config(None, overrides(tiny_model_dir, "algorithm.beta=0")), report.memory).copy == 3 * weights
    fitting = math.ceil((needed + 4 * weights) / (1 - preflight_module.HEADROOM)) + 1  # the copy fits, just
    for free, background in ((fitting, True), (fitting - 2, False)):
        plan = plan_for(config, dataclasses.replace(report.memory, free=free))
        assert (plan.background, plan.asked, plan.run) == (background, True, needed), free
    assert plan.line() == (f"written on the step's path, not in the background: their host copy ({gib(4 * weights)}) "
                           f"does not fit in the {gib(fitting - 2)} available beside the run's {gib(needed)} (10% "
                           "kept spare)")
    off = plan_for(load_config(None, overrides(tiny_model_dir, "train.background_checkpoints=false")), report.memory)
    assert not off.background and off.line() == "written on the step's path (train.background_checkpoints=false)"
    # on a GPU the host's RAM holds only the copy; ZeRO-3's full state gives AdamW's moments in float32
    memory = dataclasses.replace(report.memory, device="cuda:0")
    monkeypatch.setattr(preflight_module, "host_available", lambda: 5 * weights)
    on_gpu = plan_for(config, memory)
    assert (on_gpu.copy, on_gpu.run, on_gpu.background) == (4 * weights, 0, True)
    policy.to(torch.bfloat16)
    zero3 = plan_for(config, memory, sharding=preflight_module.Sharding(2, deepspeed=True))
    assert zero3.copy == weights // 2 + 2 * weights + weights // 2 and zero3.background  # bf16 weights, fp32 moments
    monkeypatch.setattr(preflight_module, "host_available", lambda: 3 * weights)  # 3 x 0.9 < 3
    assert not plan_for(config, memory, sharding=preflight_module.Sharding(2, deepspeed=True)).background


def test_an_unknown_tool_is_an_error_before_the_model_loads(tiny_model_dir, letter_task):
    config = load_config(None, overrides(tiny_model_dir, "rollout.tools=[zom]"))
    with pytest.raises(VlmrlError, match="unknown tool 'zom'; did you mean zoom"):
        check_before_loading(config, "train")



# --------------------------------------------------------------------------- "auto" memory settings


def estimates(model_dir: str, *extra: str) -> dict[tuple[int, bool], int]:
    """The memory needed for every (micro-batch, checkpointing) the auto settings choose from."""
    config = load_config(None, overrides(model_dir, *extra))
    needed = {}
    for recompute in (False, True):
        for micro in (16, 12, 8, 4):
            fixed = load_config(None, overrides(model_dir, *extra, f"train.micro_batch_size={micro}",
                                                f"model.gradient_checkpointing={str(recompute).lower()}"))
            needed[micro, recompute] = check(fixed).memory.needed
    assert micro_batch_candidates(config, "train", 1) == [16, 12, 8, 4]  # 4 prompts x G=4, whole groups
    return needed


def room(needed: int) -> int:
    """The least free memory in which `needed` bytes fit, a tenth of it kept spare."""
    return math.ceil(needed / (1 - preflight_module.HEADROOM)) + 1


def test_auto_picks_the_largest_micro_batch_that_fits_then_checkpointing(tiny_model_dir, letter_task,
                                                                           monkeypatch):
    auto = ("train.micro_batch_size=auto", "model.gradient_checkpointing=auto")
    needed = estimates(tiny_model_dir)
    assert needed[16, False] > needed[8, False] > needed[4, False] > needed[4, True]
    config = lambda: load_config(None, overrides(tiny_model_dir, *auto))  # noqa: E731
    for free, settled in [(room(needed[16, False]), (16, False)),  # all fits: the largest, no recompute
                          (room(needed[8, False]), (8, False)),  # a smaller micro-batch before recomputation
                          (room(needed[4, True]), (4, True)),  # only with checkpointing
                          (room(needed[4, True]) - 2, (4, True))]:  # nothing fits: the smallest, and a warning
        monkeypatch.setattr(preflight_module, "free_memory", lambda device, free=free: free)
        report = check(config())
        assert (report.settled.micro_batch_size, report.settled.gradient_checkpointing) == settled, free
        assert report.memory.fits == (free >= room(needed[4, True]))
    assert "free on cpu (10% kept spare): DOES NOT FIT" in "\n".join(report.lines())
    assert "auto       model.gradient_checkpointing, train.micro_batch_size: micro-batch 4, gradient " \
           "checkpointing on" in "\n".join(report.lines())
    fixed = check(load_config(None, overrides(tiny_model_dir, "model.gradient_checkpointing=auto")))
    assert fixed.settled.micro_batch_size == 8 and fixed.settled.automatic == ("model.gradient_checkpointing",)


def test_a_run_trains_with_what_auto_settled(tmp_path, tiny_model_dir, letter_task, monkeypatch, capsys):
    from vlmrl.training.trainer import train

    no_reference = "algorithm.beta=0"  # else the run has its reference loaded when it measures, and `check` not
    needed = estimates(tiny_model_dir, no_reference)
    monkeypatch.setattr(preflight_module, "free_memory", lambda device: room(needed[4, True]))
    config = load_config(None, overrides(tiny_model_dir, no_reference, "train.micro_batch_size=auto", "train.steps=1",
                                         "model.gradient_checkpointing=auto", f"output_dir={tmp_path / 'run'}",
                                         "train.trackers=[]"))
    seen = []
    real = preflight_module.Settled.apply

    def apply(self, config, policy):
        real(self, config, policy)
        seen.append((config.train.micro_batch_size, is_checkpointing(policy)))

    monkeypatch.setattr(preflight_module.Settled, "apply", apply)
    train(config)
    assert seen == [(4, True)]
    assert "preflight: auto       model.gradient_checkpointing, train.micro_batch_size: micro-batch 4" in \
        capsys.readouterr().out


def test_vlmrl_check_plans_one_process_of_n_under_fsdp2(tiny_model_dir, letter_task):
    """`vlmrl check --processes 2 --strategy FSDP2`: the first line says what is planned, the
    memory is one process's share (half of the weights, gradients and AdamW); a batch that does not
    split over the processes is the run's own one-line error."""
    config = load_config(None, overrides(tiny_model_dir, "rollout.prompts_per_step=4", "rollout.generation_batch_size=2"))
    alone = check(config)
    planned = check(config, processes=2, strategy="FSDP2")
    assert planned.lines()[0] == "processes: 2, strategy: FSDP2 (planned: vlmrl check runs one)"
    assert alone.lines()[0].startswith("model ")
    assert planned.memory.weights == alone.memory.weights // 2 and planned.memory.shards == 2
    assert planned.splits[0].prompts == alone.splits[0].prompts // 2  # one process's share of the batch
    with pytest.raises(VlmrlError, match="rollout.prompts_per_step=4 must be divisible by the 3 processes"):
        check(config, processes=3, strategy="FSDP2")


def test_check_planning_zero3_says_log_probs_come_from_the_logits(tiny_model_dir):
    """`vlmrl check --strategy ZeRO-3` runs on a model it has not partitioned: its speed line still
    says what the run will do (no chunked output layer under ZeRO-3), as the run's own preflight does."""
    from vlmrl.models.support import ZERO3_UNTAPPABLE

    config = load_config(None, overrides(tiny_model_dir, "eval.every=0"))
    planned = check(config, processes=2, strategy="ZeRO-3").speed
    assert f"no output layer in chunks of 1024 ({ZERO3_UNTAPPABLE})" in planned
    assert "; output layer in chunks of 1024;" in check(config, processes=2, strategy="FSDP2").speed


@pytest.mark.parametrize("extra, message", [
    (["rollout.max_new_tokens=5000"], r"^rollout.max_new_tokens=5000 after the longest train prompt \((\d+) tokens\) would "
                                      r"reach \d+ positions, past the model's context of 4096 positions "
                                      r"\(max_position_embeddings in its config.json\): set rollout.max_new_tokens to at "
                                      r"most \d+$"),
    (["eval.every=1", "eval.max_new_tokens=4096"], r"^eval.max_new_tokens=4096 after the longest eval/test prompt"),
    (["rollout.tools=[zoom]", "rollout.max_trajectory_tokens=8000"], r"^rollout.max_trajectory_tokens=8000 after the "
                                                                     r"longest train prompt"),
])
def test_a_generation_past_the_model_s_context_is_one_line_before_step_one(tiny_model_dir, letter_task, extra, message):
    """The tiny model reads 4096 positions (max_position_embeddings): a longer completion was
    accepted, and generated past them (or allocated a static cache of the whole length)."""
    with pytest.raises(VlmrlError, match=message) as error:
        check(load_config(None, overrides(tiny_model_dir, *extra)))
    if extra == ["rollout.max_new_tokens=5000"]:
        prompt = int(error.value.args[0].split("(")[1].split(" ")[0])
        fits = 4096 - prompt
        check(load_config(None, overrides(tiny_model_dir, f"rollout.max_new_tokens={fits}")))  # the most is accepted
