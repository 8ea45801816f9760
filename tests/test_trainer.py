"""The training loop on the tiny model: it learns, it updates what it should, it resumes exactly."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from launching import LR, assert_same_statistics, assert_same_weights, launcher, run_all_or_kill, run_here
from vlmrl.config import load_config
from vlmrl.errors import VlmrlError
from vlmrl.report.tracking import read_metrics
from vlmrl.training.session import release_process_group
from vlmrl.training.trainer import train

LETTER_TASK = "letter_task:LetterTask"  # tests/letter_task.py, loaded by import path



def _config(tmp_path, model_dir, *overrides):
    base = [f"model.name_or_path={model_dir}", "model.device=cpu", f"task.name={LETTER_TASK}",
            f"output_dir={tmp_path / 'run'}", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "rollout.max_new_tokens=8", "rollout.generation_batch_size=2", "train.micro_batch_size=8", "train.lr=1e-3",
            "train.log_rollouts_every=1"]
    return load_config(None, base + list(overrides))


def _params(folder: Path) -> dict[str, torch.Tensor]:
    return AutoModelForImageTextToText.from_pretrained(folder).state_dict()


def test_tiny_model_learns_an_easy_task(tmp_path, tiny_model_dir, letter_task):
    config = _config(tmp_path, tiny_model_dir, "train.steps=40", "train.lr=1e-2", "algorithm.beta=0",
                     "rollout.max_new_tokens=6", "train.log_rollouts_every=0")
    run = train(config)
    rewards = [row["reward"] for row in read_metrics(run / "metrics.jsonl")]
    assert len(rewards) == 40
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.25, rewards


def test_every_trainable_parameter_changes_and_frozen_ones_do_not(tmp_path, tiny_model_dir, letter_task):
    run = train(_config(tmp_path, tiny_model_dir, "train.steps=2", "model.freeze_vision=true",
                        "train.max_grad_norm=0", "train.attention_every=2"))
    before, after = _params(Path(tiny_model_dir)), _params(run / "final")
    for name, value in before.items():
        changed = not torch.equal(value, after[name])
        assert changed == (".visual." not in f".{name}"), name
    first, second = read_metrics(run / "metrics.jsonl")
    assert "attention_on_image" not in first and 0 < second["attention_on_image"] < 1
    row = first
    for key in ("reward", "accuracy", "reward/share", "reward_std/share", "loss", "kl", "clip_fraction",
                "clip_low_fraction", "clip_high_fraction", "entropy", "completion_length", "completion_length_max", "groups_drawn",
                "zero_variance_groups", "advantage/std", "grad_norm", "lr", "time/generate", "time/score",
                "time/train", "tokens_per_s", "mismatch_kl", "tis_weight_mean", "tis_capped_fraction",
                "off_policy_masked_fraction"):
        assert key in row, key
    # fp32 on the CPU: the sampler's log-probs are the training pass's to rounding, so TIS weighs ~1
    assert 0 <= row["mismatch_kl"] < 1e-9 and row["tis_weight_mean"] == pytest.approx(1, abs=1e-5)
    assert row["tis_capped_fraction"] == 0
    assert 0 < row["time/cpu"] and 0 < row["seconds"]  # the step's CPU seconds beside its wall clock
    rollouts = (run / "rollouts" / "step_000001.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in rollouts]
    assert len(rows) == 16 and [r["group"] for r in rows] == [g for g in range(4) for _ in range(4)]
    assert {"advantage", "rewards", "completion", "length", "truncated"} <= set(rows[0])
    assert len({r["image"] for r in rows}) == 4  # each prompt's image stored once, not G times
    assert len(list((run / "rollouts" / "images").iterdir())) == 8  # 2 logged steps x 4 prompts
    assert (run / "config.yaml").exists()


def test_lora_run_trains_only_the_adapter_and_saves_it(tmp_path, tiny_model_dir, letter_task):
    run = train(_config(tmp_path, tiny_model_dir, "train.steps=2", "model.lora.enabled=true",
                        "model.lora.r=4", "algorithm.beta=0.1"))
    from peft import PeftModel

    base = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)
    adapted = PeftModel.from_pretrained(base, run / "final")
    adapter = load_file(run / "final" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at 0
    assert isinstance(adapted, PeftModel)
    kl = [row["kl"] for row in read_metrics(run / "metrics.jsonl")]
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and kl[1] > 0  # reference = adapter switched off


def test_resume_matches_an_uninterrupted_run(tmp_path, tiny_model_dir, letter_task):
    common = ["train.steps=4", "train.save_every=2", "algorithm.beta=0.05", "algorithm.ref_refresh_steps=3",
              "train.schedule=cosine", "train.warmup_steps=1", "algorithm.updates_per_batch=2"]
    straight = train(_config(tmp_path / "a", tiny_model_dir, *common))
    interrupted = Path(shutil.copytree(straight, tmp_path / "b" / "run"))  # the same run, not run again
    # Simulate an interruption after step 2: the later checkpoint, final model and log lines vanish.
    shutil.rmtree(interrupted / "checkpoints" / "step_000004")
    shutil.rmtree(interrupted / "final")
    resumed = train(_config(tmp_path / "b", tiny_model_dir, *common, "resume=true"))

    def strip(rows):
        timing = ("seconds", "tokens_per_s", "time/")
        return [{k: v for k, v in row.items() if not k.startswith(timing)} for row in rows]

    assert strip(read_metrics(resumed / "metrics.jsonl")) == strip(read_metrics(straight / "metrics.jsonl"))
    a, b = _params(straight / "final"), _params(resumed / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_without_checkpoint_is_a_clear_error(tmp_path, tiny_model_dir, letter_task):
    with pytest.raises(VlmrlError, match="holds no checkpoint"):
        train(_config(tmp_path, tiny_model_dir, "resume=true"))


def test_dynamic_sampling_keeps_the_batch_full(tmp_path, tiny_model_dir, letter_task):
    run = train(_config(tmp_path, tiny_model_dir, "train.steps=2", "algorithm.dynamic_sampling=true",
                        "algorithm.max_sampling_rounds=3", "algorithm.beta=0"))
    for row in read_metrics(run / "metrics.jsonl"):
        assert 4 <= row["groups_drawn"] <= 12 and row["groups_drawn"] % 4 == 0
    rollouts = (run / "rollouts" / "step_000002.jsonl").read_text().splitlines()
    assert len(rollouts) == 16


@pytest.mark.parametrize("surrogate", ["cispo", "gmpo", "sapo"])
def test_other_surrogates_and_the_forking_tokens_train(tmp_path, tiny_model_dir, letter_task, monkeypatch, surrogate):
    """Two updates per batch (ratios move) under CISPO / GMPO / SAPO, the loss seeing only the top 25% of
    tokens by entropy: the weights move and the loss saw a quarter of the tokens."""
    from vlmrl import grpo

    seen = []
    real = grpo.policy_loss

    def spy(logp, inputs, settings):
        seen.append((int(inputs.trained_mask.sum()), settings.surrogate))  # the tokens the loss sees
        return real(logp, inputs, settings)

    monkeypatch.setattr(grpo, "policy_loss", spy)
    run = train(_config(tmp_path, tiny_model_dir, "train.steps=1", f"algorithm.surrogate={surrogate}",
                        "algorithm.top_entropy_share=0.25", "algorithm.updates_per_batch=2", "algorithm.beta=0",
                        "train.log_rollouts_every=0", "train.micro_batch_size=16"))
    (row,) = read_metrics(run / "metrics.jsonl")
    assert row["loss"] is not None and row["grad_norm"] > 0
    completions = row["completion_length"] * 16  # tokens of the step's 16 completions
    assert all(s == surrogate for _, s in seen) and len(seen) == 2
    assert all(abs(kept - math.ceil(completions / 4)) <= 2 for kept, _ in seen)  # ties may keep a few more


def test_batch_layout_errors(tmp_path, tiny_model_dir, letter_task):
    with pytest.raises(VlmrlError, match="generation_batch_size=3 must divide"):
        train(_config(tmp_path, tiny_model_dir, "rollout.generation_batch_size=3"))


def test_two_processes_make_the_same_update_as_one(tmp_path, tiny_model_dir):
    overrides = [f"model.name_or_path={tiny_model_dir}", "model.device=cpu", f"task.name={LETTER_TASK}",
                 "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8",
                 "rollout.generation_batch_size=2", "train.micro_batch_size=4", "train.steps=1",
                 f"train.lr={LR}", "algorithm.aggregation=token", "algorithm.beta=0.1",
                 "train.log_rollouts_every=1"]
    one = tmp_path / "one"
    two = tmp_path / "two"
    two_processes = launcher("--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                             "--dynamo_backend", "no")
    run_here(["train"] + overrides + [f"output_dir={one}"])
    returncode, stdout, stderr = run_all_or_kill(two_processes + ["train"] + overrides + [f"output_dir={two}"],
                                                 timeout=300)
    assert returncode == 0, stderr[-3000:]
    assert "preflight: processes: 2, strategy: DDP, backend: gloo\n" in stdout
    a, b = _params(one / "final"), _params(two / "final")
    base = _params(Path(tiny_model_dir))
    assert any(not torch.equal(a[k], base[k]) for k in a)
    ma, mb = read_metrics(one / "metrics.jsonl")[0], read_metrics(two / "metrics.jsonl")[0]
    assert ma["reward"] == pytest.approx(mb["reward"]) and ma["groups_drawn"] == mb["groups_drawn"] == 4
    assert_same_statistics(ma, mb, ("grad_norm", "loss", "kl", "entropy", "clip_fraction", "ratio_mean"))
    assert_same_weights(a, b, LR)  # Adam passes a near-cancelled gradient's rounding on at lr's scale
    assert len((two / "rollouts" / "step_000001.jsonl").read_text().splitlines()) == 16


def test_closing_leaves_the_process_group_no_owner_that_frees_it_holding_the_gil(tmp_path):
    """The deadlock behind a two-process run that hung at exit: torch frees a DDP reducer without
    letting the GIL go, and a reducer freed last destroys the gloo group, which waits for a worker
    thread that may need the GIL. Closing a session drops the reducer (and its logger) first."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        model(torch.ones(1, 2)).sum().backward()
        release_process_group(model)
        assert model.reducer is None and model.logger is None
        release_process_group(torch.nn.Linear(2, 2))  # a model of one process: nothing to do
    finally:
        torch.distributed.destroy_process_group()


def test_save_every_0_checkpoints_after_the_last_step_only(tmp_path, tiny_model_dir, letter_task):
    """train.save_every=0 is documented as "only at the end"; it wrote no checkpoint at all."""
    from vlmrl.safety.checkpoint import list_checkpoints, read_checkpoint

    run = train(_config(tmp_path, tiny_model_dir, "train.steps=2", "train.save_every=0", "rollout.prompts_per_step=2",
                        "rollout.group_size=2", "train.log_rollouts_every=0"))
    assert [folder.name for folder in list_checkpoints(run)] == ["step_000002"]
    assert read_checkpoint(run / "checkpoints" / "step_000002")["step"] == 2
