"""Model files that are damaged, incomplete or from two models (models/folder_check.py): each one
line naming the file, the tensors or the part that disagrees, where vlmrl loads a policy, a LoRA
adapter or a reference copy, and from `vlmrl check`, `eval` and `sft`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vlmrl.cli import main
from vlmrl.config import AlgorithmConfig, LoraConfig
from vlmrl.errors import VlmrlError
from vlmrl.models.loading import load_adapter_weights, load_policy
from vlmrl.training.reference import REFERENCE_FILE, ReferencePolicy

pytestmark = pytest.mark.usefixtures("one_thread")

WEIGHTS = "model.safetensors"
UP = "model.layers.0.mlp.up_proj.weight"
"""A tensor of the tiny Qwen2.5-VL as its file names it (the model calls it model.language_model...)."""
LOADED_UP = "model.language_model.layers.0.mlp.up_proj.weight"


def copy_of(folder: str, tmp_path: Path, name: str = "m") -> Path:
    return Path(shutil.copytree(folder, tmp_path / name))


def rewrite(path: Path, change) -> None:
    """Save the safetensors file at `path` again with `change(tensors)` applied."""
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "garbage": b"not weights " * 100,
                      "trailing bytes": data + b"\0" * 16}[how])


def shard(folder: Path, listed: float = 1.0) -> list[str]:
    """Split model.safetensors into two shards and an index that lists the first `listed` share of
    the tensors; the shards' names."""
    tensors = load_file(folder / WEIGHTS)
    (folder / WEIGHTS).unlink()
    names = sorted(tensors)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    for file, half in zip(files, halves):
        save_file({name: tensors[name] for name in half}, folder / file, metadata={"format": "pt"})
    placed = {name: files[names.index(name) >= len(names) // 2] for name in names[: int(len(names) * listed)]}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": placed}))
    return files


def refusal(folder) -> str:
    with pytest.raises(VlmrlError) as error:
        load_policy(str(folder), device="cpu")
    message = str(error.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------ weights that do not load


@pytest.mark.parametrize("how", ["truncated", "empty", "garbage", "trailing bytes"])
def test_a_damaged_weights_file_is_one_line_naming_it(tiny_model_dir, tmp_path, how):
    folder = copy_of(tiny_model_dir, tmp_path)
    damage(folder / WEIGHTS, how)
    assert str(folder / WEIGHTS) in refusal(folder)


def test_a_damaged_shard_is_named(tiny_model_dir, tmp_path):
    folder = copy_of(tiny_model_dir, tmp_path)
    files = shard(folder)
    load_policy(str(folder), device="cpu")  # whole, the shards load
    damage(folder / files[1], "truncated")
    message = refusal(folder)
    assert str(folder / files[1]) in message and "truncated" in message


def test_an_index_that_lists_half_the_weights_names_the_missing_ones(tiny_model_dir, tmp_path):
    folder = copy_of(tiny_model_dir, tmp_path)
    shard(folder, listed=0.5)  # the second shard is listed nowhere: transformers would start its half at random
    message = refusal(folder)
    assert "would start from random values" in message and "visual.blocks" in message
    assert "the shards model.safetensors.index.json lists" in message


def test_a_shard_without_a_tensor_its_index_places_there_is_named(tiny_model_dir, tmp_path):
    folder = copy_of(tiny_model_dir, tmp_path)
    files = shard(folder)
    rewrite(folder / files[0], lambda tensors: tensors.pop(UP))
    message = refusal(folder)
    assert str(folder / files[0]) in message and UP in message


def test_a_weight_missing_from_the_file_is_named(tiny_model_dir, tmp_path):
    folder = copy_of(tiny_model_dir, tmp_path)
    rewrite(folder / WEIGHTS, lambda tensors: tensors.pop(UP))
    message = refusal(folder)
    assert "1 weight is not in model.safetensors" in message and LOADED_UP in message


def test_a_tensor_of_another_shape_names_it_and_both_shapes(tiny_model_dir, tmp_path):
    folder = copy_of(tiny_model_dir, tmp_path)
    rewrite(folder / WEIGHTS, lambda tensors: tensors.update({UP: torch.zeros(3, 3)}))
    message = refusal(folder)
    assert f"tensor {LOADED_UP} is [3, 3] in model.safetensors but [128, 64] by config.json" in message


def test_a_tensor_the_model_has_no_place_for_is_named(tiny_model_dir, tmp_path):
    folder = copy_of(tiny_model_dir, tmp_path)
    rewrite(folder / WEIGHTS, lambda tensors: tensors.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    assert "no place for (1): model.language_model.layers.0.extra.weight" in refusal(folder)


@pytest.mark.parametrize("command", [["check", "configs/shapes_sft_tiny.yaml"], ["sft", "configs/shapes_sft_tiny.yaml"],
                                     ["eval", "{folder}", "--task", "shapes"]])
def test_the_commands_report_a_model_that_loads_half_in_one_line(tiny_model_dir, tmp_path, capsys, command):
    folder = copy_of(tiny_model_dir, tmp_path)
    rewrite(folder / WEIGHTS, lambda tensors: tensors.pop(UP))
    args = [part.format(folder=folder) for part in command]
    if args[0] != "eval":
        args += [f"model.name_or_path={folder}", f"output_dir={tmp_path / 'run'}", "model.device=cpu"]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert "ok" not in out.split()
    line = [text for text in err.splitlines() if text.startswith("error:")]
    assert len(line) == 1 and LOADED_UP in line[0] and "Traceback" not in err and "LOAD REPORT" not in err


def test_a_lora_adapter_that_is_damaged_or_does_not_fit_is_named(tiny_model_dir, tmp_path):
    saved, _ = load_policy(tiny_model_dir, device="cpu", lora=LoraConfig(enabled=True, r=8))
    saved.save_pretrained(tmp_path / "r8")
    policy, _ = load_policy(tiny_model_dir, device="cpu", lora=LoraConfig(enabled=True, r=8))
    load_adapter_weights(policy, tmp_path / "r8")  # whole and fitting: loads
    adapter = "adapter_model.safetensors"
    first = sorted(load_file(tmp_path / "r8" / adapter))[0]
    stray = {"stray.weight": torch.ones(1)}
    for name, change in [("truncated", lambda f: damage(f, "truncated")),
                         ("missing", lambda f: rewrite(f, lambda tensors: tensors.pop(first))),
                         ("extra", lambda f: rewrite(f, lambda tensors: tensors.update(stray)))]:
        folder = copy_of(tmp_path / "r8", tmp_path, name)
        change(folder / adapter)
        with pytest.raises(VlmrlError) as error:
            load_adapter_weights(policy, folder)
        expected = {"truncated": str(folder / adapter), "missing": first, "extra": "stray.weight"}[name]
        assert expected in str(error.value)
    smaller, _ = load_policy(tiny_model_dir, device="cpu", lora=LoraConfig(enabled=True, r=4))
    with pytest.raises(VlmrlError, match=r"is \[8, 128\] in adapter_model.safetensors but \[4, 128\]"):
        load_adapter_weights(smaller, tmp_path / "r8")


def test_reference_weights_that_are_damaged_or_do_not_fit_are_named(tiny_model_dir, tmp_path):
    policy, _ = load_policy(tiny_model_dir, device="cpu")
    reference = ReferencePolicy(policy, AlgorithmConfig(beta=0.04))
    saved = tmp_path / "saved"
    saved.mkdir()
    reference.save(saved)
    reference.load(saved)  # the tied lm_head saved once: loads
    name = "model.language_model.layers.1.mlp.down_proj.weight"
    for case, change in [("truncated", lambda f: damage(f, "truncated")),
                         ("missing", lambda f: rewrite(f, lambda tensors: tensors.pop(name))),
                         ("shape", lambda f: rewrite(f, lambda tensors: tensors.update({name: torch.zeros(2, 2)})))]:
        folder = copy_of(saved, tmp_path, case)
        change(folder / REFERENCE_FILE)
        with pytest.raises(VlmrlError) as error:
            reference.load(folder)
        expected = {"truncated": str(folder / REFERENCE_FILE), "missing": f"not in {REFERENCE_FILE} and would start "
                    f"from random values: {name}", "shape": f"{name} is [2, 2] in {REFERENCE_FILE} but [64, 128]"}[case]
        assert expected in str(error.value)


# ------------------------------------------------------------------ parts of two models in one folder


@pytest.mark.parametrize("other, files, said", [
    ("llava", ["processor_config.json"], "config.json's model type is qwen2_5_vl (processor Qwen2_5_VLProcessor) but "
                                         "processor_config.json names LlavaProcessor"),
    ("gemma3", ["processor_config.json"], "processor_config.json names Gemma3Processor"),
    ("llava", ["config.json"], "config.json's model type is llava (processor LlavaProcessor) but processor_config.json "
                               "names Qwen2_5_VLProcessor"),
    ("llava", ["tokenizer.json"], "config.json's image token id is 500 ('</s>' in the tokenizer), the processor writes "
                                  "'<|image_pad|>' (not in the tokenizer)"),
    ("gemma3", ["tokenizer.json", "tokenizer_config.json"], "the processor writes '<image_soft_token>' (id 501)"),
    ("llava", ["config.json", "processor_config.json", "tokenizer.json", "tokenizer_config.json"],
     "model.safetensors and config.json are of different models: 64 weights are not in model.safetensors "
     "(lm_head.weight, model.language_model.embed_tokens.weight"),  # all but the weights
])
def test_parts_of_another_family_are_refused_naming_the_part(tiny_model_dir, tiny_model_factory, tmp_path, other,
                                                              files, said):
    folder = copy_of(tiny_model_dir, tmp_path)
    for file in files:
        shutil.copy(Path(tiny_model_factory(other)) / file, folder / file)
    assert said in refusal(folder)


def test_a_tokenizer_larger_than_the_embedding_is_refused(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    folder = copy_of(tiny_model_dir, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(8)])  # ids 512-519, past the 512 rows
    tokenizer.save_pretrained(folder)
    assert "the tokenizer has 520 tokens but the model's embedding has 512 rows (config.json's vocab_size 512)" \
        in refusal(folder)


def test_a_config_of_other_widths_names_the_embedding_and_both_shapes(tiny_model_dir, tmp_path):
    folder = copy_of(tiny_model_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["vocab_size"] = 1024  # another Qwen2.5-VL's config.json
    (folder / "config.json").write_text(json.dumps(config))
    assert "is [512, 64] in model.safetensors but [1024, 64] by config.json" in refusal(folder)


def test_a_teachers_damaged_weights_are_one_line_in_check_and_train(tiny_model_dir, tmp_path, capsys, letter_task):
    """algorithm.teacher gets the policy's file check, before any model loads (else a SafetensorError
    traceback where the preflight reads the headers for the teacher's size)."""
    from vlmrl.config import load_config
    from vlmrl.training.trainer import train

    teacher = copy_of(tiny_model_dir, tmp_path, "teacher")
    damage(teacher / WEIGHTS, "truncated")
    lora_base, _ = load_policy(tiny_model_dir, device="cpu", lora=LoraConfig(enabled=True, r=2))
    lora_base.save_pretrained(tmp_path / "adapter")
    damage(tmp_path / "adapter" / "adapter_model.safetensors", "truncated")
    settings = [f"model.name_or_path={tiny_model_dir}", "model.device=cpu", "task.name=letter_task:LetterTask",
                "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4", "eval.every=0",
                f"output_dir={tmp_path / 'run'}"]
    for damaged, file in ((teacher, teacher / WEIGHTS), (tmp_path / "adapter", tmp_path / "adapter" / "adapter_model.safetensors")):
        assert main(["check", *settings, f"algorithm.teacher={damaged}"]) == 2
        out, err = capsys.readouterr()
        line = [text for text in err.splitlines() if text.startswith("error:")]
        assert len(line) == 1 and "Traceback" not in err and "preflight" not in out
        assert line[0].startswith(f"error: algorithm.teacher: ") and f"{file} is truncated" in line[0]
        with pytest.raises(VlmrlError, match=f"^algorithm.teacher: .*{file} is truncated"):
            train(load_config(None, [*settings, f"algorithm.teacher={damaged}"]))
        assert not (tmp_path / "run").exists()


def test_pickled_weights_alone_are_refused_unread_with_the_line_that_converts_them(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    import re

    folder = copy_of(tiny_model_dir, tmp_path)
    weights = load_file(folder / WEIGHTS)
    torch.save(weights, folder / "pytorch_model.bin")
    (folder / WEIGHTS).unlink()
    with monkeypatch.context() as patched:
        patched.setattr(torch, "load", lambda *args, **kwargs: pytest.fail("a pickle was read"))
        message = refusal(folder)
    assert message.startswith(f"{str(folder)!r} holds its weights as pytorch_model.bin (PyTorch pickle) and no "
                              "model.safetensors: vlmrl loads safetensors weights only")
    exec(re.search(r'python -c "(.*)"$', message).group(1), {})  # the line the message gives, as given
    model, _ = load_policy(str(folder), device="cpu")
    assert torch.equal(model.state_dict()[LOADED_UP], weights[UP])
