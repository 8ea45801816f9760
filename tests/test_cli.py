"""The `vlmrl` command: help everywhere, one-line errors with exit code 2 on bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vlmrl.cli import build_parser, main


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
    (["config", "model.lora.r=big"], "error: model.lora.r must be int; got 'big'"),
    (["config", "missing.yaml"], "error: config file 'missing.yaml' does not exist"),
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
