"""Before anything loads (early_checks.py, model_source.py): the layout over the launched
processes, the task, its eval splits, tools, trackers and the model's source each fail in one line,
and the model is never loaded for them."""

from __future__ import annotations

import time

import pytest
from read_only import read_only_probe

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


def model_folder(tmp_path, name: str, **config) -> str:
    """A folder with only a config.json: all that the kind check reads."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(__import__("json").dumps(config))
    return str(folder)


@pytest.mark.parametrize("config, message", [
    ({"model_type": "florence2"}, r"^vlmrl trains decoder-only image-text-to-text models; '.*/m' \(florence2\) is an "
                                  r"encoder-decoder$"),
    ({"model_type": "llava", "is_encoder_decoder": True}, r"\(llava\) is an encoder-decoder$"),
    ({"model_type": "my_vlm", "auto_map": {"AutoConfig": "c.C", "AutoModelForImageTextToText": "m.M"}},
     r"\(my_vlm\) needs the code that ships with it \(auto_map in config.json\), which runs only with "
     r"model.trust_remote_code=true; set it if you trust that code$"),
    ({"model_type": "my_vlm"}, r"transformers \S+ does not know model type 'my_vlm'; it needs its own code \(a folder "
                               r"with auto_map, and model.trust_remote_code=true\) or a newer transformers$"),
    ({"model_type": "llama"}, r"^'.*/m' \(llama\) is not an image-text-to-text model \(not among transformers' "
                              r"AutoModelForImageTextToText types\)"),
    ({"model_type": "phi4_multimodal"}, r"\(phi4_multimodal\) is not an image-text-to-text model"),
])
def test_a_model_vlmrl_cannot_train_is_refused_from_its_config(tmp_path, config, message, no_model_load):
    with pytest.raises(VlmrlError, match=message):
        model_source.check_model_source(model_folder(tmp_path, "m", **config))


def test_remote_code_is_checked_once_allowed(tmp_path, no_model_load):
    allowed = model_folder(tmp_path, "ok", model_type="my_vlm", auto_map={"AutoModelForImageTextToText": "m.M"})
    model_source.check_model_source(allowed, trust_remote_code=True)  # its own code: nothing more to check here
    causal = model_folder(tmp_path, "causal", model_type="my_lm", auto_map={"AutoConfig": "c.C",
                                                                           "AutoModelForCausalLM": "m.M"})
    with pytest.raises(VlmrlError, match=r"\(my_lm\)'s own code has no image-text-to-text model \(its auto_map "
                                         r"offers AutoConfig, AutoModelForCausalLM\); vlmrl loads AutoModelForImageTextToText$"):
        model_source.check_model_source(causal, trust_remote_code=True)


def test_a_processor_that_needs_a_missing_package_is_refused(tmp_path, no_model_load, monkeypatch):
    def missing(module):
        raise ModuleNotFoundError("No module named 'somepackage'", name="somepackage.sub")

    monkeypatch.setattr(model_source, "import_processor_module", missing)
    folder = model_folder(tmp_path, "llava", model_type="llava")
    with pytest.raises(VlmrlError, match=r"^'.*/llava' \(llava\): its processor LlavaProcessor needs somepackage, "
                                         r"which is not installed; vlmrl's PIL image path does not cover this family "
                                         r"yet \(install somepackage if it works here\)$"):
        model_source.check_model_source(folder)


def test_a_processor_module_that_imports_a_torchvision_image_processor_takes_its_pil_twin(tmp_path, no_model_load):
    import importlib.util
    import sys

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here")
    for name in [m for m in sys.modules if m.startswith("transformers.models.pixtral.")]:
        del sys.modules[name]  # as in a fresh process
    with pytest.raises(ModuleNotFoundError, match="torchvision"):
        importlib.import_module("transformers.models.pixtral.processing_pixtral")
    model_source.check_model_source(model_folder(tmp_path, "pixtral", model_type="mistral3"))  # imports now
    twin = sys.modules["transformers.models.pixtral.image_processing_pixtral"]
    assert twin.__name__ == "transformers.models.pixtral.image_processing_pil_pixtral"


def test_check_and_train_refuse_in_one_line_before_loading(tmp_path, capsys, no_model_load):
    folder = model_folder(tmp_path, "florence", model_type="florence2")
    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  name_or_path: {folder}\n")
    for command in ("check", "train"):
        assert main([command, str(config)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1] == (f"error: vlmrl trains decoder-only image-text-to-text models; '{folder}' (florence2) "
                           "is an encoder-decoder")


def test_a_hub_model_is_refused_from_what_the_hub_says_of_its_config(monkeypatch):
    import huggingface_hub

    info = type("Info", (), {"config": {"model_type": "florence2", "architectures": ["Florence2ForConditionalGeneration"]}})
    monkeypatch.setattr(huggingface_hub, "model_info", lambda name, timeout: info)
    monkeypatch.setattr(model_source, "_ON_THE_HUB", set())
    monkeypatch.setattr(model_source, "_HUB_CONFIGS", {})
    for _ in range(2):  # asked once: the loader's second check reads the kept answer
        with pytest.raises(VlmrlError, match=r"'org/florence' \(florence2\) is an encoder-decoder$"):
            model_source.check_model_source("org/florence")


def test_task_params_seed_seeds_the_task_and_the_run_seed_the_rest(tiny_model_dir, no_model_load):
    """`task.params.seed=3` was a TypeError traceback (get_task got `seed` twice)."""
    config = load_config(None, [f"model.name_or_path={tiny_model_dir}", "seed=7", "task.params.seed=3"])
    task = check_before_loading(config, "train")
    assert task.params.seed == 3 and config.seed == 7
    assert check_before_loading(load_config(None, [f"model.name_or_path={tiny_model_dir}", "seed=7"]),
                                "train").params.seed == 7  # without it: the run's seed


def rows_file(folder, count: int) -> str:
    """A jsonl file of `count` rows (question, answer, one image each)."""
    from PIL import Image

    lines = []
    for i in range(count):
        Image.new("RGB", (28, 28), "red").save(folder / f"{i}.png")
        lines.append(f'{{"question": "What colour?", "answer": "red", "image": "{i}.png"}}')
    (folder / "rows.jsonl").write_text("\n".join(lines) + "\n")
    return str(folder / "rows.jsonl")


def test_train_epochs_become_the_steps_they_take_of_the_train_rows(tmp_path, tiny_model_dir, no_model_load):
    data = [f"model.name_or_path={tiny_model_dir}", "task.name=dataset", f"task.params.path={rows_file(tmp_path, 10)}",
            "task.params.test_fraction=0.2", "rollout.prompts_per_step=4", "rollout.generation_batch_size=4", "sft.batch_size=3"]
    train = load_config(None, [*data, "train.epochs=1.5"])
    check_before_loading(train, "train")
    assert train.train.steps == 3  # 1.5 x 8 train rows (2 of 10 held out) / 4 prompts a step
    sft = load_config(None, [*data, "train.epochs=2"])
    check_before_loading(sft, "sft")
    assert sft.train.steps == 6  # ceil(2 x 8 / 3 examples a step)
    again = load_config(None, [*data, "train.epochs=2", "train.steps=6"])  # as the run's config.yaml saves it
    check_before_loading(again, "sft")
    assert again.train.steps == 6
    with pytest.raises(VlmrlError, match=r"^train.steps=50 and train.epochs=2 both set the run's length \(2 epochs of "
                                         r"8 train rows at 4 a step are 4 steps\): give one$"):
        check_before_loading(load_config(None, [*data, "train.epochs=2", "train.steps=50"]), "train")


def test_train_epochs_of_a_task_without_end_and_out_of_range_are_refused(tiny_model_dir, no_model_load):
    with pytest.raises(VlmrlError, match=r"^train.epochs=2 needs a task with a fixed set of train rows \(the dataset "
                                         r"task\); task 'shapes' makes a new example for every index: give "
                                         r"train.steps instead$"):
        check_before_loading(load_config(None, [f"model.name_or_path={tiny_model_dir}", "train.epochs=2"]), "train")
    for bad in ("-1", ".inf", "1e300"):
        with pytest.raises(VlmrlError, match=r"^train.epochs must be in \[0, 100000\] \(passes over the train rows "
                                                 r"\(0 = train.steps counts\)\); got "):
            load_config(None, [f"train.epochs={bad}"])


@pytest.mark.parametrize("made", [True, False])
def test_an_output_folder_that_cannot_be_written_fails_vlmrl_check_before_the_model_loads(
        made, tmp_path, tiny_model_dir, monkeypatch, capsys, no_model_load):
    parent = tmp_path / "runs"
    parent.mkdir()
    run = parent / "run"
    if made:
        run.mkdir()
    read_only_probe(monkeypatch, run if made else parent)  # read-only: the run folder, or where it is to be made
    capsys.readouterr()
    assert main(["check", f"model.name_or_path={tiny_model_dir}", f"output_dir={run}"]) == 2
    where = run if made else parent
    assert capsys.readouterr().err == (f"error: cannot write the run to {run}: permission denied on {where}; choose "
                                       "another path\n")
    assert made == run.exists() and list(where.iterdir()) == []  # nothing made, no probe left
    (tmp_path / "file").write_text("")
    with pytest.raises(VlmrlError, match=rf"^cannot write the run to {tmp_path}/file/run: {tmp_path}/file is a file, "
                                         r"not a folder; choose another path$"):
        check_before_loading(load_config(None, [f"model.name_or_path={tiny_model_dir}",
                                                f"output_dir={tmp_path / 'file' / 'run'}"]), "train")
