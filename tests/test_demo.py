"""The demo pipeline end to end at smoke size: every phase runs, files land, reruns reuse them."""

from __future__ import annotations

import json

import pytest
import yaml

import vlmrl.demo as demo
from vlmrl.tasks import get_task


@pytest.fixture
def smoke_preset(monkeypatch, tiny_model_dir):
    preset = demo.DemoPreset(
        shared=["task.name=shapes", "task.params.targets=[circle]", "task.params.distractors=false"],
        sft=["sft.batch_size=4", "train.steps=2", "train.lr=1e-3", "train.micro_batch_size=4",
             "train.trackers=[]"],
        grpo=["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.generation_batch_size=2",
              "algorithm.beta=0", "train.steps=2", "train.lr=1e-3", "train.micro_batch_size=4",
              "train.log_rollouts_every=1", "train.save_every=1", "train.trackers=[]"],
        eval_n=3, max_new_tokens=6, size="tiny")
    monkeypatch.setitem(demo.PRESETS, "smoke", preset)


def test_demo_runs_every_phase_and_writes_the_summary(tmp_path, smoke_preset, capsys):
    summary = demo.run_demo(str(tmp_path / "demo"), "smoke")
    out = capsys.readouterr().out
    assert "SFT" in out and "+GRPO" in out and "test accuracy" in out and "OOD accuracy" in out
    saved = json.loads((tmp_path / "demo" / "summary.json").read_text())
    for phase in ("sft", "grpo"):
        assert saved[phase]["test"]["n"] == 3 and 0 <= saved[phase]["ood"]["accuracy"] <= 1
        assert saved[phase]["test"]["blind"]["blank"] is not None
        assert (tmp_path / "demo" / phase / "final" / "config.json").exists()
    assert all((tmp_path / "demo" / phase / "report.html").exists() for phase in ("sft", "grpo"))
    assert set(saved["seconds"]) == {"sft", "eval_sft", "grpo", "eval_grpo"}
    assert summary["sft"]["test"]["accuracy"] == saved["sft"]["test"]["accuracy"]

    # A second run reuses the finished phases: same numbers, no training.
    before = (tmp_path / "demo" / "grpo" / "metrics.jsonl").read_text()
    again = demo.run_demo(str(tmp_path / "demo"), "smoke")
    assert again["grpo"]["test"]["accuracy"] == summary["grpo"]["test"]["accuracy"]
    assert (tmp_path / "demo" / "grpo" / "metrics.jsonl").read_text() == before


def test_curriculum_stages_run_in_order_each_from_the_last_and_are_reused(tmp_path, smoke_preset, capsys):
    """A preset's SFT curriculum: each stage an ordinary run from the model the stage before ended
    with (the first from the offline model), the warm start from the last; a rerun trains nothing."""
    base = demo.PRESETS["smoke"]
    staged = demo.DemoPreset(**{**base.__dict__, "curriculum": (
        ("first", ("train.steps=1", "train.lr=1e-4")), ("second", ("train.steps=3",)))})
    demo.PRESETS["staged"] = staged
    try:
        summary = demo.run_demo(str(tmp_path / "demo"), "staged")
        out = tmp_path / "demo"
        first, second = (yaml.safe_load((out / "stages" / name / "config.yaml").read_text())
                         for name in ("first", "second"))
        warm = yaml.safe_load((out / "sft" / "config.yaml").read_text())
        assert first["model"]["name_or_path"] == str(out / "model")
        assert second["model"]["name_or_path"] == str(out / "stages" / "first" / "final")
        assert warm["model"]["name_or_path"] == str(out / "stages" / "second" / "final")
        assert (first["train"]["steps"], first["train"]["lr"], second["train"]["steps"], warm["train"]["steps"]) == (
            1, 1e-4, 3, 2)
        steps = [len((out / "stages" / name / "metrics.jsonl").read_text().splitlines()) for name in ("first", "second")]
        assert steps == [1, 3]
        assert list(summary["seconds"]) == ["stage_first", "stage_second", "sft", "eval_sft", "grpo", "eval_grpo"]
        assert summary["overrides"]["curriculum"] == {"first": ["train.steps=1", "train.lr=1e-4"],
                                                      "second": ["train.steps=3"]}
        assert "-- stage 2/2 of the curriculum: second --" in capsys.readouterr().out
        before = (out / "stages" / "second" / "metrics.jsonl").read_text()
        demo.run_demo(str(out), "staged")
        assert (out / "stages" / "second" / "metrics.jsonl").read_text() == before
    finally:
        del demo.PRESETS["staged"]


def test_an_older_tiny_model_is_rebuilt(tmp_path):
    from vlmrl.models.tiny_model import TINY_MODEL_VERSION

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "vlmrl_tiny.json").write_text(json.dumps({"size": "tiny", "seed": 0, "version": TINY_MODEL_VERSION - 1}))
    demo.ensure_tiny_model(folder, "tiny")
    info = json.loads((folder / "vlmrl_tiny.json").read_text())
    assert info["version"] == TINY_MODEL_VERSION and (folder / "model.safetensors").exists()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    demo.ensure_tiny_model(folder, "tiny")  # the current one is kept
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    info = json.loads((folder / "vlmrl_tiny.json").read_text())
    del info["tokenizer"]  # written before --tokenizer existed: the default one, kept
    (folder / "vlmrl_tiny.json").write_text(json.dumps(info))
    demo.ensure_tiny_model(folder, "tiny")
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    demo.ensure_tiny_model(folder, "tiny", tokenizer="letters")  # another tokenizer: rebuilt
    assert json.loads((folder / "vlmrl_tiny.json").read_text())["tokenizer"] == "letters"


def test_every_preset_builds_valid_configs_and_is_offered_by_the_cli(tmp_path):
    from vlmrl.cli import DEMO_PRESETS

    assert DEMO_PRESETS == tuple(demo.PRESETS)
    for preset in demo.PRESETS.values():
        phases = [("sft", ()), ("grpo", ()), *(("sft", stage) for _, stage in preset.curriculum)]
        for phase, stage in phases:
            config = demo.phase_config(preset, phase, tmp_path / "model", tmp_path / phase, stage)  # checks the config
            get_task(config.task.name, seed=config.seed, **config.task.params)  # checks the task parameters


def test_the_glyph_preset_gives_the_model_nothing_but_the_letters_and_holds_out_its_test_messages(tmp_path):
    """cryptogram-glyphs (issue 53): every phase draws all 26 letters as plain glyphs in a 56-px grid
    (no tiles), the stages one-letter messages and the warm start and GRPO 1-3 words with every entry
    filled, no test message or cipher trained on; the word phases learn text copies, the stages not."""
    import string

    preset = demo.PRESETS["cryptogram-glyphs"]
    phases = {"sft": ("sft", ()), "grpo": ("grpo", ()), **{name: ("sft", stage) for name, stage in preset.curriculum}}
    params = {}
    for name, (phase, stage) in phases.items():
        config = demo.phase_config(preset, phase, tmp_path / "model", tmp_path / name, stage)
        task = get_task(config.task.name, seed=config.seed, **config.task.params)
        p = params[name] = task.params
        assert (p.letters, p.tiles, p.layout, p.cell_px) == (string.ascii_lowercase, False, "grid", 56), name
        assert config.sft.text_examples == (16 if name.startswith("words") or name == "sft" else 0), name
    assert [name for name, _ in preset.curriculum] == ["alone", "lookup", "table-1", "table-2", "words-1", "words-2", "words-3"]
    for name in ("alone", "lookup", "table-1", "table-2"):
        assert (params[name].min_words, params[name].max_words, params[name].max_word_length) == (1, 1, 1)
    assert (params["alone"].entries, params["lookup"].entries, params["table-1"].entries) == ("alone", "some", "all")
    for name in ("words-1", "sft", "grpo"):
        p = params[name]
        assert (p.min_words, p.max_words, p.entries, p.reference, p.held_out) == (1, 3, "all", "table", "messages_and_ciphers")
    assert preset.tokenizer == "letters" and preset.attention_n > 0


def one_step_preset(name: str, **more) -> demo.DemoPreset:
    """Preset `name`'s task and shared settings at the smallest run: one step of each phase, two
    held-out examples, the tiny model."""
    return demo.DemoPreset(
        shared=demo.PRESETS[name].shared,
        sft=["sft.batch_size=2", "train.steps=1", "train.micro_batch_size=2", "train.trackers=[]"],
        grpo=["rollout.prompts_per_step=1", "rollout.group_size=2", "algorithm.beta=0", "train.steps=1",
              "train.micro_batch_size=2", "train.save_every=1", "train.trackers=[]"],
        eval_n=2, max_new_tokens=4, size="tiny", **more)


def test_a_demo_with_tools_also_answers_with_the_tools_disabled(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(demo.PRESETS, "smoke_tools", one_step_preset("zoom"))
    summary = demo.run_demo(str(tmp_path / "demo"), "smoke_tools")
    assert "test, tools disabled" in capsys.readouterr().out
    for phase in ("sft", "grpo"):
        assert summary[phase]["no_tools"]["n"] == 2 and "tools" not in summary[phase]["no_tools"]
        assert summary[phase]["test"]["tools"]["turns"] >= 1  # answered with the tool available
        assert (tmp_path / "demo" / phase / "eval_no_tools.json").exists()


def test_the_video_tool_demo_checks_time_and_the_tool(tmp_path, monkeypatch, capsys):
    """The preset's setting at one step: video prompts that need the `frames` tool, answered with it
    and without it, and the checks in time on test."""
    monkeypatch.setitem(demo.PRESETS, "smoke_video_tool", one_step_preset("video-tool"))
    summary = demo.run_demo(str(tmp_path / "demo"), "smoke_video_tool")
    rows = [line.split("  ")[1].strip() for line in capsys.readouterr().out.splitlines()
            if line.startswith("  test")]
    assert rows[-6:] == ["test, tools disabled", "test, blank image", "test, shuffled image", "test, single frame",
                         "test, shuffled frames", "test, reversed frames"]
    for phase in ("sft", "grpo"):
        assert set(summary[phase]["test"]["blind"]) == {"blank", "shuffled", "single_frame", "shuffled_frames",
                                                       "reversed_frames"}
        assert summary[phase]["no_tools"]["n"] == 2


def test_the_cryptogram_demo_measures_attention_on_each_letters_cell(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(demo.PRESETS, "smoke_cells", one_step_preset("cryptogram", attention_n=2))
    summary = demo.run_demo(str(tmp_path / "demo"), "smoke_cells")
    printed = capsys.readouterr().out
    attention = summary["attention"]
    assert set(attention) == {"before", "sft", "grpo"}
    assert all(attention[p]["uniform"] == pytest.approx(1 / 9) and attention[p]["spans"] == 12 for p in attention)
    assert "attention of each decoded part on its region (2 held-out examples" in printed
    for phase in ("sft", "grpo"):
        maps = tmp_path / "demo" / phase / "attention"
        assert (maps / "attention.gif").exists() and attention[phase]["maps"]["dir"] == str(maps)


def test_attention_table_shows_shares_and_multiples_of_uniform():
    numbers = {"share": 0.125, "ratio": 1.125, "best_share": 0.25, "best_ratio": 2.25, "best_layer": 2,
               "uniform": 1 / 9}
    table = demo.attention_table({"before": numbers, "grpo": {**numbers, "share": 0.5, "ratio": 4.5}})
    assert table.splitlines() == [
        "  share of image attention on the region           untrained           +GRPO",
        "  mean over layers                              12.5% (1.1x)    50.0% (4.5x)",
        "  best layer                                    25.0% (2.2x)    25.0% (2.2x)",
        "  (uniform: 11.1% of the image attention)            layer 2         layer 2"]


def test_the_before_after_table_lists_the_checks_in_time_where_the_videos_had_them():
    def results(accuracy, reversed_accuracy):
        blind = {"blank": {"accuracy": 0.25}, "shuffled": {"accuracy": 0.25}, "single_frame": {"accuracy": 0.3},
                 "shuffled_frames": {"accuracy": 0.4}, "reversed_frames": {"accuracy": reversed_accuracy}}
        return {"test": {"accuracy": accuracy, "blind": blind}}

    lines = demo.before_after_table(results(0.9, 0.1), results(0.95, 0.0)).splitlines()
    assert lines[0] == "                                       SFT     +GRPO       change"
    assert lines[-3:] == ["  test, single frame                 30.0%     30.0%     +0.0 pts",
                          "  test, shuffled frames              40.0%     40.0%     +0.0 pts",
                          "  test, reversed frames              10.0%      0.0%    -10.0 pts"]
    images = {"test": {"accuracy": 0.5, "blind": {"blank": {"accuracy": 0.2}, "shuffled": {"accuracy": 0.3}}}}
    assert demo.before_after_table(images, images).splitlines()[-1].startswith("  test, shuffled image")


def test_the_census_demo_evaluates_four_tool_arms_on_the_same_held_out_images(tmp_path, monkeypatch, capsys):
    """The preset's setting at one step: SFT on the weak teacher's find_objects trajectories, GRPO, then the
    same held-out test images answered with all tools, none, zoom only and find_objects/measure only, and the
    blind-image checks."""
    preset = demo.PRESETS["census"]
    assert dict(preset.tool_arms) == {"zoom_only": ("zoom",), "cv_only": ("find_objects", "measure")}
    assert "rollout.tools=[zoom,find_objects,measure]" in preset.shared and "task.params.teacher=regions" in preset.shared
    monkeypatch.setitem(demo.PRESETS, "smoke_census", one_step_preset("census", tool_arms=preset.tool_arms))
    summary = demo.run_demo(str(tmp_path / "demo"), "smoke_census")
    rows = [line.split("  ")[1].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("  test")]
    assert rows == ["test accuracy", "test, tools disabled", "test, only zoom", "test, only find_objects, measure",
                    "test, blank image", "test, shuffled image"]
    for phase in ("sft", "grpo"):
        arms = {name: json.loads((tmp_path / "demo" / phase / f"eval_{name}.json").read_text())
                for name in ("test", "no_tools", "zoom_only", "cv_only")}
        assert all(summary[phase][name]["n"] == 2 for name in arms)
        prompts = {name: [(record["idx"], record["prompt"]) for record in saved["examples"]] for name, saved in arms.items()}
        assert all(p == prompts["test"] for p in prompts.values())  # the same held-out images in every arm
        assert set(summary[phase]["test"]["blind"]) == {"blank", "shuffled"}
        assert summary[phase]["zoom_only"]["blind"] is None


def test_the_before_after_table_widens_its_label_column_for_the_tool_arms():
    results = {"test": {"accuracy": 0.5, "blind": None}, "no_tools": {"accuracy": 0.25},
               "cv_only": {"accuracy": 0.75}}
    arms = (("cv_only", ("find_objects", "measure")), ("zoom_only", ("zoom",)))  # zoom_only was not evaluated
    lines = demo.before_after_table(results, results, arms).splitlines()
    assert lines[4] == "  test, only find_objects, measure       75.0%     75.0%     +0.0 pts"
    assert lines[1].startswith("  test accuracy" + " " * 21) and len({len(lines[k]) for k in (1, 3, 4)}) == 1
    assert not any("zoom" in line for line in lines)
