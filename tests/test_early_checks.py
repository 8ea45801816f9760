"""Before anything loads (early_checks.py, model_source.py): the layout over the launched
processes, the task, its eval splits, tools, trackers and the model's source each fail in one line,
and the model is never loaded for them."""

from __future__ import annotations

import time

import pytest

from vlmrl.cli import main
from vlmrl.config import load_config
from vlmrl.errors import VlmrlError
from vlmrl.models import model_source
from vlmrl.safety.early_checks import check_before_loading


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model is a test failure: everything here must be refused before."""
    import vlmrl.models.loading

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(vlmrl.models.loading, "load_policy", refuse)
    monkeypatch.setattr(vlmrl.models.loading, "load_processor", refuse)


@pytest.mark.parametrize("overrides, message", [
    (["task.name=shapez"], "unknown task 'shapez'"),
    (["task.params={max_count: -3}"], "max_count"),
    (["eval.every=1", "eval.splits=[validation]"], "eval.splits names 'validation', which task 'shapes' does not have"),
    (["rollout.tools=[zom]"], "unknown tool 'zom'"),
    (["train.trackers=[wandb]"], "train.trackers asks for wandb, but wandb is not installed"),
    (["model.name_or_path=runs/nowhere-model"], "model folder 'runs/nowhere-model' does not exist"),
])
def test_what_needs_no_model_fails_before_it_loads(overrides, message, no_model_load, tiny_model_dir):
    config = load_config(None, [f"model.name_or_path={tiny_model_dir}", *overrides])
    if "wandb" in message and __import__("importlib").util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    with pytest.raises(VlmrlError, match=message):
        check_before_loading(config, "train")


def test_the_layout_is_checked_against_the_launched_processes(tiny_model_dir, monkeypatch, no_model_load):
    config = load_config(None, [f"model.name_or_path={tiny_model_dir}", "rollout.prompts_per_step=6",
                                "rollout.generation_batch_size=3", "sft.batch_size=6"])
    check_before_loading(config, "train")  # one process: 6 prompts in two calls of 3
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(VlmrlError, match="rollout.prompts_per_step=6 must be divisible by the 4 processes"):
        check_before_loading(config, "train")
    with pytest.raises(VlmrlError, match="sft.batch_size=6 must be divisible by the 4 processes"):
        check_before_loading(config, "sft")


def test_a_missing_local_model_fails_at_once_with_the_command_that_builds_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a fresh clone: no runs/ folder yet
    started = time.perf_counter()
    assert main(["check", "configs/none.yaml"]) == 2  # (the config file itself is missing: also one line)
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  name_or_path: runs/small-model\n")
    assert main(["check", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: model folder 'runs/small-model' does not exist; build the offline model with: "
                       "vlmrl tiny-model runs/small-model --size small (or give a hub id)")
    assert time.perf_counter() - started < 30  # no hub retries (the imports take a few seconds)


def test_hub_ids_offline_and_unreachable(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(VlmrlError, match=r"^model 'org/some-vlm' is neither a local folder nor in the hub cache, "
                                         r"and the hub is off \(HF_HUB_OFFLINE=1\)"):
        model_source.check_model_source("org/some-vlm")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    import huggingface_hub

    def unreachable(name, timeout):
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)
    with pytest.raises(VlmrlError, match=r"^model 'org/some-vlm' is not a local folder and the hub cannot be "
                                         r"reached \(Name or service not known\); set HF_HUB_OFFLINE=1 to use the hub cache only, "
                                         r"or give a local model folder$"):
        model_source.check_model_source("org/some-vlm")
    asked = []
    monkeypatch.setattr(huggingface_hub, "model_info", lambda name, timeout: asked.append(name))
    monkeypatch.setattr(model_source, "_ON_THE_HUB", set())
    model_source.check_model_source("org/some-vlm")
    model_source.check_model_source("org/some-vlm")  # the loader asks again: no second request
    assert asked == ["org/some-vlm"]


def test_what_looks_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    local = ["./m", "/abs/m", "~/m", "runs/small-model", "models/mine", "a/b/c"]
    assert all(model_source.looks_local(name) for name in local)
    assert not any(model_source.looks_local(name) for name in ["Qwen/Qwen2.5-VL-3B-Instruct", "gpt2"])
    assert model_source.build_hint("runs/tiny-model").endswith("vlmrl tiny-model runs/tiny-model --size tiny")
    assert model_source.build_hint("Qwen/Qwen2.5-VL-3B-Instruct") == "give a local model folder"
