"""load_policy on tiny folders of several real families: forward, generation, LoRA, freezing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText

from vlmrl.config import LoraConfig
from vlmrl.errors import VlmrlError
from vlmrl.models.loading import is_vision_parameter, load_policy, load_processor, trainable_parameters

ARCHES = ["qwen2_5_vl", "qwen2_vl", "idefics3"]


def _inputs(processor, image, question="How many circles are in the image?"):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(images=[[image], [image]], text=[text, text], return_tensors="pt", padding=True)


@pytest.mark.parametrize("arch", ARCHES)
def test_load_policy_forward_and_generate_on_a_real_image(tiny_model_factory, circle_image, arch):
    model, processor = load_policy(tiny_model_factory(arch), device="cpu")
    assert type(model).__name__.endswith("ForConditionalGeneration")
    assert model.dtype == torch.float32  # "auto" on a CPU
    inputs = _inputs(processor, circle_image)
    with torch.no_grad():
        logits = model(**inputs).logits  # (2, T, V)
    assert logits.shape[:2] == inputs["input_ids"].shape
    assert torch.isfinite(logits).all()
    # The image changes the output: the model reads pixels, not only text.
    blank = _inputs(processor, circle_image.point(lambda _: 255))
    with torch.no_grad():
        assert not torch.allclose(model(**blank).logits[:, -1], logits[:, -1])
    out = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    new = out[:, inputs["input_ids"].shape[1]:]  # (2, 8)
    assert new.shape == (2, 8)
    texts = processor.batch_decode(new, skip_special_tokens=False)
    assert all(isinstance(t, str) and t for t in texts)


def test_plain_transformers_loads_the_tiny_folder(tiny_model_dir, circle_image):
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)
    processor = load_processor(tiny_model_dir)
    ours, _ = load_policy(tiny_model_dir, device="cpu")
    inputs = _inputs(processor, circle_image)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, ours(**inputs).logits)
    out = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4


def test_lora_trains_only_adapters_and_leaves_vision_out(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir, device="cpu", lora=LoraConfig(enabled=True, r=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any(is_vision_parameter(n) for n in trainable)
    assert any("q_proj" in n for n in trainable)


def test_lora_can_include_the_vision_tower(tiny_model_dir):
    lora = LoraConfig(enabled=True, r=4, target_modules=["q_proj", "v_proj", "qkv"], include_vision=True)
    model, _ = load_policy(tiny_model_dir, device="cpu", lora=lora)
    assert any(is_vision_parameter(n) for n, p in model.named_parameters() if p.requires_grad)


def test_lora_with_unknown_target_is_a_clear_error(tiny_model_dir):
    with pytest.raises(VlmrlError, match="LoRA"):
        load_policy(tiny_model_dir, device="cpu", lora=LoraConfig(enabled=True, target_modules=["nope"]))


def test_freeze_vision(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir, device="cpu", freeze_vision=True)
    for name, param in model.named_parameters():
        assert param.requires_grad == (not is_vision_parameter(name)), name
    trainable, total = trainable_parameters(model)
    assert 0 < trainable < total


def test_gradient_checkpointing_still_backpropagates(tiny_model_dir, circle_image):
    model, processor = load_policy(tiny_model_dir, device="cpu", gradient_checkpointing=True)
    model.train()
    inputs = _inputs(processor, circle_image)
    loss = model(**inputs, labels=inputs["input_ids"]).loss
    loss.backward()
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert all(p.grad is not None for n, p in model.named_parameters() if "embed_tokens" in n)


def test_dtype_option(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir, device="cpu", dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    with pytest.raises(VlmrlError, match="unknown dtype 'fp8'"):
        load_policy(tiny_model_dir, device="cpu", dtype="fp8")


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(VlmrlError, match="does not exist"):
        load_policy(str(tmp_path / "nowhere"))


def test_folder_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(VlmrlError, match=r"is an empty folder: it has neither config.json \(a model folder\) nor "
                                         r"adapter_config.json \(a LoRA adapter folder\)"):
        load_policy(str(tmp_path))


def test_folder_without_processor_is_a_clear_error(tmp_path, tiny_model_dir):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (bare / name).write_bytes((Path(tiny_model_dir) / name).read_bytes())
    with pytest.raises(VlmrlError, match="processor"):
        load_policy(str(bare))


def test_remote_code_is_off_unless_asked(tmp_path, tiny_model_dir):
    folder = tmp_path / "remote"
    folder.mkdir()
    for path in Path(tiny_model_dir).iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForImageTextToText": "modeling_evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_evil.py").write_text("raise SystemExit('remote code ran')\n")
    model, _ = load_policy(str(folder), device="cpu")  # the stock class, the file never runs
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows the checks aimed at a GPU this machine lacks")
def test_a_policy_kept_in_cpu_memory_for_a_gpu_is_settled_for_the_gpu(tiny_model_dir):
    """FSDP2 loads into CPU memory and shards onto the device a unit at a time: the dtype ("auto")
    and the speedups' self-checks are still those of the device the run trains on, not the CPU's."""
    from vlmrl.config import load_config
    from vlmrl.models.fused_kernels import computes_fused, fused_kernels_unsupported
    from vlmrl.models.loading import load_trainable_policy
    from vlmrl.models.vision_attention import batched_vision_unsupported, computes_batched

    config = load_config(None, [f"model.name_or_path={tiny_model_dir}", "train.fused_kernels=true"])
    gpu = torch.device("cuda")
    model, _ = load_trainable_policy(config, gpu, None, place="host")
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # auto on a GPU; float32 on a CPU
    assert not computes_fused(model) and not computes_batched(model)  # checked on the GPU, which is not here
    assert fused_kernels_unsupported(model, device=gpu) != fused_kernels_unsupported(model)
    assert fused_kernels_unsupported(model) == "needs a CUDA device: the kernels are Triton's"
    assert batched_vision_unsupported(model, gpu).startswith("not checked on cuda: ")
    assert batched_vision_unsupported(model) is None
    model, _ = load_trainable_policy(config, torch.device("cpu"), None)
    assert {p.dtype for p in model.parameters()} == {torch.float32} and computes_batched(model)
