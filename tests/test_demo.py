"""The demo pipeline end to end at smoke size: every phase runs, files land, reruns reuse them."""

from __future__ import annotations

import json

import pytest

import vlmrl.demo as demo


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
