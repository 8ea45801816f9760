"""LoRA adapter folders: merged into a plain model folder, taken by eval, attention and train in place
of a model, their base stored so that they can be moved, and a folder that is neither named for
what it is."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText

from vlmrl.cli import main
from vlmrl.config import LoraConfig, load_config
from vlmrl.errors import VlmrlError
from vlmrl.models.adapter_folder import ADAPTER_CONFIG, BASE_KEY
from vlmrl.models.loading import load_policy
from vlmrl.safety.checkpoint import save_model

pytestmark = pytest.mark.usefixtures("one_thread")
TOKENS = torch.tensor([[5, 9, 17, 23, 42, 7]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    """A LoRA adapter of the tiny model saved as vlmrl saves one, loaded by the base's path relative
    to the working directory (as `model.name_or_path=runs/...` is), with non-zero weights; and the
    adapted model's logits."""
    base = Path(tiny_model_dir)
    folder = tmp_path_factory.mktemp("adapter") / "final"
    with contextlib.chdir(base.parent):
        policy, processor = load_policy(base.name, device="cpu", lora=LoraConfig(enabled=True, r=4))
        torch.manual_seed(0)
        with torch.no_grad():
            for name, parameter in policy.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.5)
        save_model(folder, policy, processor)
    return folder, logits(policy.eval())


def test_the_adapter_stores_its_base_as_an_absolute_path(adapter, tiny_model_dir):
    folder, _ = adapter
    stored = json.loads((folder / ADAPTER_CONFIG).read_text())[BASE_KEY]
    assert stored == str(Path(tiny_model_dir).resolve())


def test_merge_writes_a_model_folder_plain_transformers_loads(adapter, tiny_model_dir, tmp_path, capsys):
    folder, adapted = adapter
    out = tmp_path / "merged"
    assert main(["merge", str(folder), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    merged = AutoModelForImageTextToText.from_pretrained(out).eval()
    assert not hasattr(merged, "peft_config")
    torch.testing.assert_close(logits(merged), adapted, rtol=1e-4, atol=1e-4)
    base = AutoModelForImageTextToText.from_pretrained(tiny_model_dir).eval()
    assert not torch.allclose(logits(base), adapted, atol=1e-3)  # the adapter changed the model
    _, processor = load_policy(str(out), device="cpu")  # the processor and tokenizer files are there
    assert processor.tokenizer("a b").input_ids


def test_merge_refuses_a_model_folder_and_a_full_output(adapter, tiny_model_dir, tmp_path, capsys):
    assert main(["merge", tiny_model_dir, str(tmp_path / "x")]) == 2
    assert "is a model folder (config.json), not a LoRA adapter" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert main(["merge", str(adapter[0]), str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().err


def test_a_moved_adapter_folder_loads_as_its_merged_model(adapter, tmp_path, monkeypatch):
    folder, adapted = adapter
    moved = shutil.copytree(folder, tmp_path / "elsewhere" / "adapter")
    monkeypatch.chdir(tmp_path)  # neither where training ran nor beside the base
    model, processor = load_policy(str(moved), device="cpu")
    assert not hasattr(model, "peft_config") and model.name_or_path == str(moved.resolve())
    torch.testing.assert_close(logits(model.eval()), adapted, rtol=1e-4, atol=1e-4)


def test_a_relative_base_is_found_from_the_adapter_folder(adapter, tiny_model_dir, tmp_path, monkeypatch):
    folder, adapted = adapter
    copy = shutil.copytree(folder, tmp_path / "runs" / "adapter")
    shutil.copytree(tiny_model_dir, tmp_path / "runs" / "base")
    settings = json.loads((copy / ADAPTER_CONFIG).read_text())
    (copy / ADAPTER_CONFIG).write_text(json.dumps({**settings, BASE_KEY: "../base"}))
    monkeypatch.chdir(tmp_path.parent)
    model, _ = load_policy(str(copy), device="cpu")
    torch.testing.assert_close(logits(model.eval()), adapted, rtol=1e-4, atol=1e-4)


def test_eval_and_attention_take_an_adapter_folder(adapter, tiny_model_dir, tmp_path, capsys):
    folder, _ = adapter
    assert main(["eval", str(folder), "--task", "shapes", "--n", "2", "--k", "0", "--no-blind",
                 "--max-new-tokens", "2", "--device", "cpu", "--out", str(tmp_path / "eval")]) == 0
    assert (tmp_path / "eval" / "eval.json").is_file()
    base = str(Path(tiny_model_dir).resolve())
    assert capsys.readouterr().out.startswith(  # which base the adapter was merged into
        f"{str(folder)!r} is a LoRA adapter: loading its base model {base!r} ({BASE_KEY} in its {ADAPTER_CONFIG})")
    assert main(["attention", str(folder), "--task", "shapes", "--max-new-tokens", "1", "--device", "cpu",
                 "--out", str(tmp_path / "attention")]) == 0
    assert (tmp_path / "attention" / "index.json").is_file()


def test_train_starts_from_an_adapter_folder_and_its_adapter_names_it(adapter, tmp_path, letter_task):
    from vlmrl.training.trainer import train

    folder, _ = adapter
    config = load_config(None, [f"model.name_or_path={folder}", "model.device=cpu", "task.name=letter_task:LetterTask",
                                f"output_dir={tmp_path / 'run'}", "rollout.prompts_per_step=2", "rollout.group_size=2",
                                "rollout.max_new_tokens=4", "train.steps=1", "model.lora.enabled=true",
                                "model.lora.r=2", "eval.every=0"])
    run = train(config)
    stored = json.loads((run / "final" / ADAPTER_CONFIG).read_text())[BASE_KEY]
    assert stored == str(folder.resolve())  # the model it trained from: the first adapter, merged
    load_policy(str(run / "final"), device="cpu")  # an adapter on an adapter loads


def test_a_folder_that_is_neither_says_what_it_is(adapter, tmp_path):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(VlmrlError, match=r"is a vlmrl run folder, not a model: its model is in '.*run/final'"):
        load_policy(str(run))
    weightless = shutil.copytree(adapter[0], tmp_path / "weightless")
    (weightless / "adapter_model.safetensors").unlink()
    with pytest.raises(VlmrlError, match="LoRA adapter folder without its weights: .* no adapter_model.safetensors"):
        load_policy(str(weightless))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    with pytest.raises(VlmrlError, match=r"has neither config.json \(a model folder\) nor adapter_config.json .* a.txt"):
        load_policy(str(tmp_path / "notes"))


@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_full_fine_tune_starts_from_an_adapter_folder(adapter, tmp_path, letter_task, command):
    """The merged model trains whole, as a model folder does (peft's frozen base once crashed step 1)."""
    from vlmrl.training.sft import sft
    from vlmrl.training.trainer import train

    folder, _ = adapter
    config = load_config(None, [f"model.name_or_path={folder}", "model.device=cpu", "task.name=letter_task:LetterTask",
                                f"output_dir={tmp_path / 'run'}", "rollout.prompts_per_step=4", "rollout.group_size=4",
                                "rollout.max_new_tokens=8", "sft.batch_size=2", "train.micro_batch_size=16",
                                "train.steps=1", "train.lr=1e-2", "eval.every=0"])
    run = (train if command == "train" else sft)(config)
    merged, _ = load_policy(str(folder), device="cpu")
    trained, _ = load_policy(str(run / "final"), device="cpu")
    before = merged.state_dict()
    changed = [name for name, value in trained.state_dict().items() if not torch.equal(before[name], value)]
    assert any("layers.0.self_attn.q_proj" in name for name in changed)  # the whole model trained


def test_a_run_with_nothing_to_train_is_one_line_before_step_one(tiny_model_dir, letter_task):
    from vlmrl.safety.preflight import preflight
    from vlmrl.tasks import get_task

    config = load_config(None, [f"model.name_or_path={tiny_model_dir}", "model.device=cpu",
                                "task.name=letter_task:LetterTask", "rollout.prompts_per_step=2",
                                "rollout.group_size=2", "rollout.max_new_tokens=4"])
    policy, processor = load_policy(tiny_model_dir, device="cpu")
    policy.requires_grad_(False)
    with pytest.raises(VlmrlError, match=r"^no parameter of the model would train \(0 of 0.\d\dM trainable\)"):
        preflight(config, policy, processor, get_task("letter_task:LetterTask"), "train")


def test_an_adapter_whose_base_is_gone_says_so_and_how_to_point_it_again(adapter, tmp_path, capsys):
    folder, _ = adapter
    for base in (str(tmp_path / "gone" / "tiny-model"), "runs/tiny-model"):
        copy = shutil.copytree(folder, tmp_path / f"adapter-{len(base)}")
        settings = json.loads((copy / ADAPTER_CONFIG).read_text())
        (copy / ADAPTER_CONFIG).write_text(json.dumps({**settings, BASE_KEY: base}))
        with pytest.raises(VlmrlError) as caught:
            load_policy(str(copy), device="cpu")
        message = str(caught.value)
        assert message.startswith(f"the base model of the LoRA adapter {str(copy)!r}, {base!r} ({BASE_KEY} in ")
        assert "does not exist" in message and f"set {BASE_KEY} to where it is now" in message
        assert "tiny-model runs" not in message and "\n" not in message  # not the offline model's build hint
    assert main(["eval", str(copy), "--task", "shapes", "--n", "1", "--device", "cpu",
                 "--out", str(tmp_path / "eval")]) == 2
    assert "the base model of the LoRA adapter" in capsys.readouterr().err


@pytest.mark.parametrize("failing", ["model", "processor"])
def test_a_merge_that_fills_the_disk_leaves_no_folder_that_looks_like_a_model(adapter, tmp_path, capsys, monkeypatch,
                                                                              failing):
    import errno

    from transformers import PreTrainedModel, ProcessorMixin

    owner = PreTrainedModel if failing == "model" else ProcessorMixin
    real = owner.save_pretrained

    def full_disk(self, folder, *args, **kwargs):  # half the files written, then the disk is full
        if failing == "processor":
            real(self, folder, *args, **kwargs)
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "config.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(owner, "save_pretrained", full_disk)
    out = tmp_path / "merged"
    assert main(["merge", str(adapter[0]), str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error: the disk is full: writing the merged model to {out} failed" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither OUT nor the partial folder
    (tmp_path / "empty").mkdir()  # an OUT the user made stays, empty
    assert main(["merge", str(adapter[0]), str(tmp_path / "empty")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and not any((tmp_path / "empty").iterdir())


def documented_lines() -> list[str]:
    """The Python blocks of models.md's "Loading a folder vlmrl wrote", as a user copies them."""
    import re

    text = (Path(__file__).parents[1] / "docs" / "models.md").read_text()
    section = text.split("## Loading a folder vlmrl wrote\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.fixture(params=["tiny-model", "final", "merged"])
def written_folder(request, adapter, tiny_model_dir, tmp_path_factory, capsys):
    """A folder vlmrl wrote (the offline model, a full run's final/, a merge), and what `vlmrl merge`
    printed about it ("" for the others)."""
    out = tmp_path_factory.mktemp("written") / request.param
    printed = ""
    if request.param == "tiny-model":
        shutil.copytree(tiny_model_dir, out)
    elif request.param == "final":
        policy, processor = load_policy(tiny_model_dir, device="cpu")
        save_model(out, policy, processor)  # what a full fine-tune writes to final/
    else:
        capsys.readouterr()
        assert main(["merge", str(adapter[0]), str(out)]) == 0
        printed = capsys.readouterr().out
    return out, printed


def test_the_documented_lines_load_and_use_a_folder_vlmrl_wrote(written_folder, tmp_path, monkeypatch, capsys,
                                                                circle_image):
    from transformers import AutoProcessor

    from vlmrl.models.merge import plain_processor_note

    folder, printed = written_folder
    shutil.copytree(folder, tmp_path / "runs" / "shapes_lora" / "merged")
    circle_image.save(tmp_path / "image.png")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(documented_lines()[0], scope)  # the lines as the docs give them
    inputs, model, processor = scope["inputs"], scope["model"], scope["processor"]
    grid = inputs["image_grid_thw"]
    assert grid.shape == (1, 3) and inputs["pixel_values"].shape[0] == int(grid.prod())  # the image was processed
    image_tokens = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert image_tokens == int(grid.prod()) // processor.image_processor.merge_size ** 2 > 0
    assert scope["out"].shape[1] > inputs["input_ids"].shape[1] and capsys.readouterr().out.startswith("[")
    # what plain AutoProcessor does with the folder here, as the note (and `vlmrl merge`) says
    try:
        plain = AutoProcessor.from_pretrained(str(folder))
        takes_images = getattr(plain, "image_processor", None) is not None
    except OSError as error:
        assert "video processor" in str(error)
        takes_images = False
    note = plain_processor_note(folder)
    assert (note is None) == takes_images
    if not takes_images:
        assert "load_processor(" in note and "torchvision for its video processor" in note
    if folder.name == "merged":
        assert (f"note: {note}" in printed) == (note is not None)


@pytest.mark.slow
def test_the_documented_trl_lines_train_a_folder_vlmrl_wrote(adapter, tmp_path, monkeypatch, circle_image):
    out = tmp_path / "runs" / "shapes_lora" / "merged"
    assert main(["merge", str(adapter[0]), str(out)]) == 0
    circle_image.save(tmp_path / "image.png")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(documented_lines()[1], scope)
    assert scope["trainer"].state.global_step == 1
