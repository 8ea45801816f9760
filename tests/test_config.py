"""Config: YAML + dotted overrides, with errors that name the key, the value and what would fit."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from vlmrl.config import RENAMED_KEYS, Config, all_keys, describe, field_docs, from_dict, load_config, save_config
from vlmrl.errors import VlmrlError


def _write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_defaults_without_a_file():
    config = load_config()
    assert config == Config()


def test_yaml_then_overrides(tmp_path):
    path = _write(tmp_path, "model:\n  dtype: float32\n  lora:\n    enabled: true\n    r: 8\nseed: 3\n")
    config = load_config(path, ["model.lora.r=4", "task.params.max_words=2", "output_dir=runs/x"])
    assert config.model.dtype == "float32"
    assert config.model.lora.enabled is True and config.model.lora.r == 4
    assert config.task.params == {"max_words": 2}
    assert config.seed == 3 and config.output_dir == "runs/x"


def test_float_fields_accept_yaml_1_1_exponent_strings():
    # PyYAML reads "1e-6" (no dot) as a string; a float field must still take it.
    config = load_config(None, ["model.vision_lr_scale=1e-1"])
    assert config.model.vision_lr_scale == pytest.approx(0.1)


def test_unknown_key_names_the_key_and_the_closest_valid_ones(tmp_path):
    with pytest.raises(VlmrlError) as error:
        load_config(_write(tmp_path, "model:\n  freeze_vison: true\n"))
    assert "'model.freeze_vison'" in str(error.value)
    assert "model.freeze_vision" in str(error.value)
    with pytest.raises(VlmrlError, match=r"unknown config key 'modle'.*model"):
        load_config(None, ["modle.dtype=float32"])


def test_wrong_type_names_the_field_and_the_value():
    with pytest.raises(VlmrlError, match=r"model\.lora\.r must be an integer; got 'four'"):
        load_config(None, ["model.lora.r=four"])
    with pytest.raises(VlmrlError, match=r"model\.freeze_vision must be true or false; got 3"):
        load_config(None, ["model.freeze_vision=3"])
    with pytest.raises(VlmrlError, match=r"model\.dtype must be one of auto, float32.*got 'fp8'"):
        load_config(None, ["model.dtype=fp8"])
    with pytest.raises(VlmrlError, match=r"model must be a mapping"):
        load_config(None, ["model=3"])


def test_values_follow_one_rule_from_yaml_overrides_and_python(tmp_path):
    # Text is read as YAML first (also when quoted in the file), then the type is checked strictly.
    path = _write(tmp_path, "model:\n  freeze_vision: 'yes'\n  lora:\n    r: '8'\ntrain:\n  lr: 1e-6\n")
    config = load_config(path, ["model.lora.alpha=64"])
    assert config.model.freeze_vision is True and config.model.lora.r == 8 and config.model.lora.alpha == 64
    assert config.train.lr == 1e-6 and isinstance(config.train.lr, float)
    assert from_dict(Config, {"train": {"steps": "7"}}).train.steps == 7
    assert from_dict(Config, {"output_dir": 5}).output_dir == "5"
    assert from_dict(Config, {"model": {"name_or_path": "null"}}).model.name_or_path == "null"
    assert load_config(None, ["model.attn_implementation=null"]).model.attn_implementation is None
    with pytest.raises(VlmrlError, match=r"^train\.steps must be an integer; got 3\.0$"):
        from_dict(Config, {"train": {"steps": 3.0}})
    with pytest.raises(VlmrlError, match=r"^model\.freeze_vision must be true or false; got 1$"):
        load_config(None, ["model.freeze_vision=1"])
    with pytest.raises(VlmrlError, match=r"^output_dir must be text; got true$"):
        load_config(None, ["output_dir=true"])
    with pytest.raises(VlmrlError, match=r"^train\.adam_betas\[1\] must be a number; got 'x'$"):
        load_config(None, ["train.adam_betas=[0.9, x]"])


def test_a_renamed_key_names_its_new_name(tmp_path, monkeypatch):
    monkeypatch.setitem(RENAMED_KEYS, "train.learning_rate", "train.lr")
    message = r"^config key 'train\.learning_rate' was renamed to 'train\.lr'; use the new name$"
    with pytest.raises(VlmrlError, match=message):
        load_config(_write(tmp_path, "train:\n  learning_rate: 0.1\n"))
    with pytest.raises(VlmrlError, match=message):
        load_config(None, ["train.learning_rate=0.1"])
    monkeypatch.setitem(RENAMED_KEYS, "sampling", "rollout")
    with pytest.raises(VlmrlError, match=r"^config key 'sampling' was renamed to 'rollout'; use the new name$"):
        load_config(None, ["sampling.group_size=4"])


def test_renamed_keys_lead_from_an_old_key_to_a_current_one():
    assert RENAMED_KEYS["train.shared_prefix"] == "train.pack_groups"
    keys = set(all_keys(Config))
    for old, new in RENAMED_KEYS.items():
        assert new in keys and old not in keys, (old, new)
    with pytest.raises(VlmrlError, match=r"^config key 'rollout.shared_prefill' was renamed to "
                                         r"'rollout.share_prompt_cache'"):
        load_config(None, ["rollout.shared_prefill=false"])


def test_yaml_syntax_error_gives_the_position(tmp_path):
    with pytest.raises(VlmrlError, match=r"YAML syntax error in .*run.yaml at line 3, column 1: expected"):
        load_config(_write(tmp_path, "model:\n  dtype: [float32\n"))


def test_missing_file_and_bad_override_are_clear(tmp_path):
    with pytest.raises(VlmrlError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(VlmrlError, match="not of the form"):
        load_config(None, ["model.dtype"])


@pytest.mark.parametrize("side", [0, 27, 1025, 100000])
def test_a_tool_image_side_that_cannot_work_is_refused_when_the_config_is_read(side):
    with pytest.raises(VlmrlError) as error:
        load_config(None, [f"rollout.tool_image_side={side}"])
    assert str(error.value) == ("rollout.tool_image_side must be in [28, 1024] pixels (the longest side of a zoomed "
                                f"image; a tool returns at most 1024 x 1024 pixels); got {side}")
    assert load_config(None, ["rollout.tool_image_side=1024"]).rollout.tool_image_side == 1024


def test_save_then_load_round_trips(tmp_path):
    config = load_config(None, ["model.lora.enabled=true", "task.name=cryptogram", "seed=7"])
    save_config(config, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml") == config


def test_every_field_has_a_docstring():
    def classes(cls):
        yield cls
        for hint in typing.get_type_hints(cls).values():
            if dataclasses.is_dataclass(hint):
                yield from classes(hint)

    for cls in classes(Config):
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"
    lines = describe(Config())
    assert any(line.startswith("model.lora.r = 16  # ") for line in lines)
    assert "model.lora.r" in all_keys(Config)


def test_every_preset_in_configs_is_a_valid_config():
    presets = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
    assert len(presets) >= 18
    for preset in presets:
        load_config(preset)  # every key known, every value in range (raises VlmrlError otherwise)


BIG = 10 ** 20  # a typo of twenty digits: once a hang in the preflight (group_size) or an overflow in torch


@pytest.mark.parametrize("key, bound", [
    ("rollout.group_size", 4096), ("rollout.max_new_tokens", 2 ** 20), ("rollout.max_prompt_length", 2 ** 20),
    ("rollout.generation_batch_size", 2 ** 20), ("rollout.max_turns", 1024),
    ("rollout.max_trajectory_tokens", 2 ** 20), ("rollout.tool_timeout_s", 3600), ("model.lora.r", 16384),
    ("algorithm.updates_per_batch", 1000), ("algorithm.max_sampling_rounds", 1000), ("eval.n", 1_000_000),
    ("eval.max_new_tokens", 2 ** 20), ("eval.batch_size", 2 ** 20), ("train.micro_batch_size", 2 ** 20),
    ("sft.batch_size", 2 ** 20),
])
def test_every_count_has_an_upper_bound_no_real_run_reaches(key, bound):
    """Each bound is accepted, and a 20-digit value is one line naming the key and the bound."""
    assert load_config(None, [f"{key}={bound}", "rollout.prompts_per_step=1"]) is not None
    with pytest.raises(VlmrlError) as error:
        load_config(None, [f"{key}={BIG}"])
    message = str(error.value)
    got = float(BIG) if key.endswith("_s") else BIG  # a float field reads 10**20 as 1e+20
    assert message.startswith(f"{key} must be at most {bound:,}") and message.endswith(f"; got {got}"), message


def test_the_completions_of_a_step_are_bounded_together():
    load_config(None, ["rollout.prompts_per_step=256", "rollout.group_size=4096"])  # 2**20: the most
    with pytest.raises(VlmrlError, match=r"^rollout.prompts_per_step x group_size must be at most 1,048,576 "
                                         r"completions per step; got 100000000000000000000 x 8$"):
        load_config(None, [f"rollout.prompts_per_step={BIG}"])


def test_utf16_with_its_byte_order_mark_and_utf8_with_one_are_read(tmp_path):
    text = "model:\n  dtype: float32\n"
    for name, data in (("utf16.yaml", text.encode("utf-16")), ("bom.yaml", b"\xef\xbb\xbf" + text.encode()),
                       ("utf16be.yaml", b"\xfe\xff" + text.encode("utf-16-be")),
                       ("utf32.yaml", text.encode("utf-32"))):  # issue 51 B18: UTF-32 was read as UTF-16
        (tmp_path / name).write_bytes(data)
        assert load_config(tmp_path / name).model.dtype == "float32"


def test_a_config_path_that_is_a_folder_says_so(tmp_path):
    """Issue 51 B18: a folder was 'does not exist'; a run folder's own config is named."""
    with pytest.raises(VlmrlError, match=rf"^config file '{tmp_path}' is a folder, not a YAML file$"):
        load_config(tmp_path)
    (tmp_path / "config.yaml").write_text("seed: 3\n")
    with pytest.raises(VlmrlError, match=rf"is a folder, not a YAML file; the run's config is {tmp_path}/config.yaml$"):
        load_config(tmp_path)


def test_a_home_folder_in_a_path_is_expanded_not_made(monkeypatch, tmp_path):
    """Issue 51 B18: `output_dir: ~/runs` made a folder named `~` in the working folder."""
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_config(None, ["output_dir=~/runs/a", "model.name_or_path=~/models/m", "algorithm.teacher=~/t"])
    assert (config.output_dir, config.model.name_or_path, config.algorithm.teacher) == (
        f"{tmp_path}/runs/a", f"{tmp_path}/models/m", f"{tmp_path}/t")
    with pytest.raises(VlmrlError, match=r"^output_dir: '~no_such_user_here/runs' starts with a ~ that names no home"):
        load_config(None, ["output_dir=~no_such_user_here/runs"])


@pytest.mark.parametrize("data, message", [
    ("model:\n  dtype: float32\n".encode("utf-16-le"), r"is not a YAML text file: it is UTF-16-LE text without a "
                                                        r"byte-order mark; save it as UTF-8 text$"),
    (bytes(range(256)), r"is not a YAML text file: .* at byte \d+; save it as UTF-8 text$"),
    ("model:\n  name_or_path: caf\xe9\n".encode("latin-1"), r"is not a YAML text file: invalid continuation byte"),
    (("a: " + "[" * 5000 + "]" * 5000 + "\n").encode(), r"YAML syntax error in .* at line 1, column \d+: nested "
                                                         r"deeper than 100 levels$"),
    ("train:\n  lr: 0.1\n  steps: 3\n  lr: 0.2\n".encode(), r"YAML syntax error in .* at line 4, column 3: duplicate "
                                                             r"key 'lr' \(first at line 2\): a key may appear once"),
    ("model: {dtype: float32}\nseed: 1\nmodel: {dtype: bfloat16}\n".encode(),
     r"at line 3, column 1: duplicate key 'model' \(first at line 1\)"),
], ids=["utf16-without-bom", "binary", "latin1", "5000-deep", "duplicate-key", "duplicate-section"])
def test_a_file_that_is_not_one_clean_yaml_mapping_is_one_line(tmp_path, data, message):
    """UTF-16 without its mark, a binary file, Latin-1, 5000 levels of nesting (a RecursionError
    before) and a key written twice (PyYAML kept the last, silently) are each one line."""
    path = tmp_path / "run.yaml"
    path.write_bytes(data)
    with pytest.raises(VlmrlError, match=message) as error:
        load_config(path)
    assert "\n" not in str(error.value)


def test_merge_keys_may_still_override_what_they_merge(tmp_path):
    path = _write(tmp_path, "base: &base {lr: 0.1, steps: 3}\ntrain:\n  <<: *base\n  lr: 0.2\n")
    from vlmrl.config import read_yaml

    assert read_yaml(path)["train"] == {"lr": 0.2, "steps": 3}
