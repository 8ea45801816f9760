"""The `vlmrl` command: help everywhere, one-line errors with exit code 2 on bad input."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

import vlmrl.evaluation.eval_settings
import vlmrl.evaluation.evaluate
from vlmrl.cli import EVAL_CLI_DEFAULTS, build_parser, eval_defaults, main
from vlmrl.config import EvalConfig
from vlmrl.errors import VlmrlError
from vlmrl.evaluation.eval_settings import EvalSettings


def _commands(parser, prefix=()):
    """Every (sub)command path of the parser, e.g. ("tasks", "show")."""
    for action in parser._subparsers._group_actions if parser._subparsers else []:
        for name, sub in action.choices.items():
            yield prefix + (name,)
            yield from _commands(sub, prefix + (name,))


def test_every_command_has_help(capsys):
    commands = list(_commands(build_parser()))
    assert ("tiny-model",) in commands and ("tasks", "show") in commands
    for command in [()] + commands:
        with pytest.raises(SystemExit) as exit_:
            main([*command, "--help"])
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: vlmrl") and len(out.splitlines()) > 3, command


def test_tiny_model_refuses_a_size_with_a_tool_in_one_line(tmp_path, capsys):
    assert main(["tiny-model", str(tmp_path / "m"), "--tool", "detect", "--size", "small"]) == 2
    assert capsys.readouterr().err == ("error: --size is the VLM's; a tool's tiny model has one size: drop --size "
                                       "small or --tool detect\n")
    assert main(["tiny-model", str(tmp_path / "m"), "--tool", "detect", "--tokenizer", "letters"]) == 2
    assert "drop --tokenizer letters or --tool detect" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_tiny_model_command_writes_a_loadable_folder(tmp_path, capsys):
    assert main(["tiny-model", str(tmp_path / "m"), "--seed", "3"]) == 0
    assert "qwen2_5_vl (tiny, seed 3)" in capsys.readouterr().out
    assert (tmp_path / "m" / "model.safetensors").exists()


def test_config_prints_resolved_yaml_and_docs(tmp_path, capsys):
    assert main(["config", "model.lora.r=4", "--save", str(tmp_path / "c.yaml")]) == 0
    out = capsys.readouterr().out
    assert "r: 4" in out and (tmp_path / "c.yaml").exists()
    assert main(["config", "--docs"]) == 0
    assert "model.freeze_vision = False  # Keep the vision tower" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["config", "model.freez_vision=true"], "error: unknown config key 'model.freez_vision'; did you mean model.freeze_vision"),
    (["config", "model.lora.r=big"], "error: model.lora.r must be an integer; got 'big'"),
    (["config", "missing.yaml"], "error: config file 'missing.yaml' does not exist"),
    # issue 51 B18: a parameter without a value was "override 'max_words' is not of the form section.key=value"
    (["tasks", "show", "cryptogram", "max_words"], "error: parameter 'max_words' of task 'cryptogram' has no value: "
                                                  "write max_words=VALUE (the parameters of each task: `vlmrl tasks list`)"),
    (["tasks", "show", "cryptogram", "=2"], "error: parameter '=2' of task 'cryptogram' has no name: write KEY=VALUE"),
    (["config", "."], "error: config file '.' is a folder, not a YAML file"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(message)
    assert len(err.strip().splitlines()) == 1


def test_yaml_syntax_error_from_the_installed_command(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {dtype: float32\n")
    result = subprocess.run([sys.executable, "-m", "vlmrl", "config", str(bad)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith("error: YAML syntax error in ")
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_key_value_items_may_follow_options(capsys):
    assert main(["tasks", "show", "cryptogram", "--n", "1", "max_words=2"]) == 0
    assert "task cryptogram (max_words=2)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["tasks", "show", "cryptogram", "--bogus"])
    assert exit_.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_help_imports_neither_torch_nor_transformers():
    code = ("import sys\nfrom vlmrl.cli import build_parser, main\n"
            "for name in [*build_parser()._subparsers._group_actions[0].choices, 'tasks show']:\n"
            "    try:\n        main([*name.split(), '--help'])\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "usage: vlmrl eval" in result.stdout and "usage: vlmrl tiny-model" in result.stdout
    assert result.stderr.strip() == "False False"


def test_eval_flag_defaults_are_eval_settings_defaults():
    args = build_parser().parse_args(["eval", "runs/a/final", "--task", "shapes"])
    settings = EvalSettings()
    assert (args.batch_size, eval_defaults()["max_new_tokens"], args.temperature, args.seed) == (
        settings.batch_size, settings.max_new_tokens, settings.temperature, settings.seed) == (32, 128, 1.0, 0)
    # the flags a run fills (eval_settings.TAKEN_FROM_RUN): unset unless given, so that a flag given wins
    assert (args.max_new_tokens, args.tools, args.max_turns, args.tool_image_side, args.decode, args.reward) == (
        None,) * 6
    assert EVAL_CLI_DEFAULTS == {"k": 8, "blind_check": True}  # where `vlmrl eval` departs, on purpose
    assert (args.k, args.no_blind, args.n) == (8, False, 64) and (settings.k, settings.blind_check) == (0, False)
    assert EvalConfig().batch_size == settings.batch_size == 32
    assert vlmrl.evaluation.evaluate.EvalSettings is EvalSettings  # re-exported


def test_eval_flag_defaults_are_read_not_written_twice(monkeypatch, capsys):
    @dataclasses.dataclass
    class Changed(EvalSettings):
        batch_size: int = 5
        max_new_tokens: int = 7
        seed: int = 3

    monkeypatch.setattr(vlmrl.evaluation.eval_settings, "EvalSettings", Changed)
    args = build_parser().parse_args(["eval", "m", "--task", "shapes"])
    assert (args.batch_size, eval_defaults()["max_new_tokens"], args.seed, args.k) == (5, 7, 3, 8)
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "completions per generate call (default 5)" in out and "longest completion (default: the run's, else 7)" in out
    assert "image shuffle (default 3)" in out


def test_eval_command_runs_with_the_settings_its_flags_give(monkeypatch, capsys):
    seen = []

    def fake_run_eval(model_dir, task_name, task_params, split, n, settings, out_dir, dtype, device):
        seen.append((model_dir, task_name, task_params, split, n, settings))
        raise VlmrlError("stop here")

    monkeypatch.setattr(vlmrl.evaluation.evaluate, "run_eval", fake_run_eval)
    assert main(["eval", "m", "--task", "shapes"]) == 2
    assert main(["eval", "m", "--task", "shapes", "--batch-size", "4", "--k", "0", "--no-blind", "--seed", "2",
                 "--n", "3", "image_size=112"]) == 2
    assert capsys.readouterr().err == "error: stop here\n" * 2
    assert seen == [("m", "shapes", {}, "test", 64, EvalSettings(k=8, blind_check=True)),
                    ("m", "shapes", {"image_size": 112}, "test", 3,
                     EvalSettings(batch_size=4, k=0, blind_check=False, seed=2))]


def test_a_reader_that_stops_early_is_not_an_error(tmp_path):
    """`vlmrl tasks list | head -1`: the pipe closes before vlmrl writes (`true` reads nothing and exits
    while vlmrl starts); exit 0, no traceback."""
    shell = f"{sys.executable} -m vlmrl tasks list | true"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", shell], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")


def test_a_task_named_by_import_path_is_found_in_the_working_directory(tmp_path, monkeypatch, capsys):
    """The `vlmrl` console script's sys.path starts with its bin folder, not the working directory
    (`python -m vlmrl` has the latter): `task.name=my_module:MyTask` was not found from there."""
    import os
    import shutil
    from pathlib import Path

    shutil.copy(Path(__file__).parent / "letter_task.py", tmp_path / "my_letters.py")
    monkeypatch.chdir(tmp_path)
    script_path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != str(tmp_path)]
    monkeypatch.setattr(sys, "path", [str(Path(sys.executable).parent), *script_path])  # as the console script
    monkeypatch.delitem(sys.modules, "my_letters", raising=False)
    assert main(["tasks", "show", "my_letters:LetterTask", "--n", "1"]) == 0
    assert "task my_letters:LetterTask" in capsys.readouterr().out
    monkeypatch.delitem(sys.modules, "my_letters", raising=False)


BIG = 10 ** 20


@pytest.mark.parametrize("args, message", [
    (["tiny-model", "never-written", "--seed", str(BIG)], f"--seed must be in [0, 2**32) (numpy's range); got {BIG}"),
    (["config", f"rollout.group_size={BIG}"], f"rollout.group_size must be at most 4,096; got {BIG}"),
    (["config", f"model.lora.r={BIG}"], f"model.lora.r must be at most 16,384; got {BIG}"),
    (["tasks", "show", "shapes", "--n", str(BIG)], f"--n must be in [0, 10,000], got {BIG}"),
    (["eval", "m", "--task", "shapes", "--n", str(BIG)], f"the number of examples must be in [1, 1,000,000], got {BIG}"),
    (["eval", "m", "--task", "shapes", "--k", str(BIG)], f"k must be at most 4,096; got {BIG}"),
    (["eval", "m", "--task", "shapes", "--max-new-tokens", str(BIG)], f"max new tokens must be at most 1,048,576; got {BIG}"),
    (["eval", "m", "--task", "shapes", "--device", "gpu"], "--device must be auto, cpu, mps, cuda or cuda:N; got 'gpu'"),
    (["attention", "m", "--task", "shapes", "--device", "gpu"], "--device must be auto, cpu, mps, cuda or cuda:N; got 'gpu'"),
], ids=["tiny-model-seed", "group-size", "lora-r", "tasks-show-n", "eval-n", "eval-k", "eval-max-new-tokens",
        "eval-device-gpu", "attention-device-gpu"])
def test_a_number_past_its_bound_or_a_device_that_is_none_is_one_line(args, message, capsys, tmp_path, monkeypatch):
    """Each was a traceback (an overflow in torch, "Expected one of cpu, cuda, ... device type") or a
    hang (a list of 10**20 examples) before."""
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err == f"error: {message}\n"
    assert not (tmp_path / "never-written").exists()


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "mps"])
@pytest.mark.parametrize("command", ["eval", "check", "train"])
def test_a_device_this_machine_lacks_is_one_line_before_anything_loads(command, device, capsys, monkeypatch,
                                                                       tiny_model_dir, tmp_path):
    """`--device cuda` on a torch without CUDA was "Torch not compiled with CUDA enabled" in eval and
    check; `model.device=cuda` trained on the CPU without a word (accelerate's cpu=True)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    args = {"eval": ["eval", tiny_model_dir, "--task", "shapes", "--device", device, "--out", str(tmp_path)],
            "check": ["check", f"model.name_or_path={tiny_model_dir}", f"model.device={device}"],
            "train": ["train", f"model.name_or_path={tiny_model_dir}", f"model.device={device}",
                      f"output_dir={tmp_path / 'run'}"]}[command]
    assert main(args) == 2
    err = capsys.readouterr().err
    name = "--device" if command == "eval" else "model.device"
    if device == "mps":
        assert err == f"error: {name}=mps but MPS (Apple GPUs) is not available here: use cpu or auto\n"
    else:
        assert err.startswith(f"error: {name}={device} but ") and "use cpu or auto" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists() and not (tmp_path / "eval.json").exists()


def test_a_gpu_the_machine_does_not_have_is_named(monkeypatch):
    import torch

    from vlmrl.models.loading import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1", "--device") == torch.device("cuda:1")
    with pytest.raises(VlmrlError, match=r"^--device=cuda:2 but this machine has 2 GPU\(s\): cuda:0 \.\. cuda:1$"):
        resolve_device("cuda:2", "--device")


@pytest.mark.parametrize("name, data", [
    ("latin1.yaml", "model: {name_or_path: caf\xe9}\n".encode("latin-1")),
    ("binary.yaml", bytes(range(256))),
    ("deep.yaml", ("a: " + "[" * 5000 + "]" * 5000 + "\n").encode()),
    ("twice.yaml", b"train:\n  lr: 0.1\n  lr: 0.2\n"),
])
def test_a_config_file_that_is_not_clean_yaml_is_one_line_from_the_command(name, data, tmp_path, capsys):
    (tmp_path / name).write_bytes(data)
    assert main(["config", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("removed, message", [
    ("tokenizer.json", "cannot load a processor from {m!r}: it has no tokenizer (tokenizer.json); copy it from the "
                       "model it was made from"),
    ("processor_config.json", "cannot load a processor from {m!r}: it has no image processor settings "
                              "(processor_config.json or preprocessor_config.json); copy it from the model it was "
                              "made from"),
    ("chat_template.jinja", "{m!r} has no chat template (chat_template.jinja, or chat_template in its processor or "
                            "tokenizer config), which vlmrl writes every prompt with; copy it from the model it was "
                            "made from"),
])
def test_a_missing_processor_part_is_named_in_vlmrls_words(removed, message, tiny_model_dir, tmp_path, capsys):
    """Before: "Couldn't instantiate the backend tokenizer from one of: " (cut there), transformers' hub
    text ("If you were trying to load it from 'https://huggingface.co/models'..."), a ValueError traceback."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / removed).unlink()
    assert main(["eval", str(model), "--task", "shapes", "--n", "1", "--k", "0", "--no-blind"]) == 2
    assert capsys.readouterr().err == f"error: {message.format(m=str(model))}\n"


def test_another_library_s_error_is_kept_whole_on_one_line():
    """A message cut at its first line read "Couldn't instantiate the backend tokenizer from one of: "."""
    from vlmrl.errors import one_line
    from vlmrl.models.model_source import first_line

    error = ValueError("Couldn't instantiate the backend tokenizer from one of: \n(1) a `tokenizers` library "
                       "serialization file, \n(2) a slow tokenizer instance to convert")
    whole = ("Couldn't instantiate the backend tokenizer from one of: (1) a `tokenizers` library serialization file, "
             "(2) a slow tokenizer instance to convert")
    assert one_line(error) == first_line(error) == whole
    assert one_line(ValueError()) == "ValueError"


@pytest.mark.parametrize("command", ["eval", "attention"])
def test_max_new_tokens_past_the_model_s_context_is_one_line(command, tiny_model_dir, tmp_path, capsys):
    """The tiny model reads 4096 positions; 5000 new tokens generated past them without a word."""
    args = {"eval": ["eval", tiny_model_dir, "--task", "shapes", "--n", "1", "--k", "0", "--no-blind",
                     "--out", str(tmp_path)],
            "attention": ["attention", tiny_model_dir, "--task", "shapes", "--out", str(tmp_path / "maps")]}[command]
    assert main([*args, "--max-new-tokens", "5000"]) == 2
    err = capsys.readouterr().err  # after the loader's progress bar
    assert err.endswith("\nerror: --max-new-tokens=5000 is longer than the model's context of 4096 positions "
                        "(max_position_embeddings in its config.json): set it to at most 4096\n"), err
    assert "Traceback" not in err
    assert not (tmp_path / "eval.json").exists()


@pytest.mark.parametrize("world, rank, leaves", [("2", "1", True), ("2", "0", False), ("1", "0", False),
                                                 (None, None, False)])
def test_only_another_process_of_a_launch_leaves_without_teardown(world, rank, leaves, monkeypatch, capsys):
    """A finished command on a process other than the main one of a multi-process launch exits 0 at
    once (os._exit: gloo's teardown aborted such processes); the main one and a lone one return 0."""
    import os

    for name, value in (("WORLD_SIZE", world), ("RANK", rank)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    left = []
    monkeypatch.setattr(os, "_exit", lambda code: left.append(code))
    assert main(["tasks", "list"]) == 0
    assert left == ([0] if leaves else [])
    assert "shapes" in capsys.readouterr().out
