"""On-policy distillation (algorithm.teacher): a teacher of the policy's family steers the student
token by token, a copy of the student gives no signal at all, and a teacher that cannot score the
student's tokens is refused in one line before anything loads. The math: tests/test_grpo.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText

from vlmrl.cli import main
from vlmrl.config import load_config
from vlmrl.errors import VlmrlError
from vlmrl.report.tracking import read_metrics
from vlmrl.evaluation.evaluate import evaluate
from vlmrl.training import session as session_module
from vlmrl.training import teacher as teacher_module
from vlmrl.training.trainer import train

LETTER_TASK = "letter_task:LetterTask"  # tests/letter_task.py, loaded by import path


@pytest.fixture(scope="module")
def other_seed_dir(tmp_path_factory) -> str:
    """The tiny model of the same family and size with other weights: the same tokenizer."""
    from vlmrl.models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-seed1"), size="tiny", seed=1))


def config_for(tmp_path, model_dir, *extra):
    return load_config(None, [f"model.name_or_path={model_dir}", "model.device=cpu", f"task.name={LETTER_TASK}",
                              f"output_dir={tmp_path / 'run'}", "rollout.prompts_per_step=4", "rollout.group_size=4",
                              "rollout.max_new_tokens=8", "rollout.generation_batch_size=2",
                              "train.micro_batch_size=8", "train.lr=1e-3", "train.steps=2", "eval.every=0", *extra])


def weights(folder) -> dict[str, torch.Tensor]:
    return AutoModelForImageTextToText.from_pretrained(folder).state_dict()


def test_a_teacher_of_the_family_moves_the_student_and_its_kl_is_logged(tmp_path, tiny_model_dir, other_seed_dir,
                                                                         letter_task):
    run = train(config_for(tmp_path, tiny_model_dir, f"algorithm.teacher={other_seed_dir}", "algorithm.beta=0",
                           "algorithm.distill_reward=drop"))
    rows = read_metrics(run / "metrics.jsonl")
    kls = [row["distill/teacher_kl"] for row in rows]
    assert len(kls) == 2 and all(abs(kl) > 1e-4 for kl in kls), kls  # two random models disagree
    for row in rows:  # advantage/*: the update's per-token advantages, -(student - teacher) with the task dropped
        assert row["advantage/mean"] == pytest.approx(-row["distill/teacher_kl"], rel=1e-5)
        assert row["advantage/min"] < 0 < row["advantage/max"] and row["advantage/abs_mean"] > abs(row["advantage/mean"])
        assert {"advantage/task/abs_mean", "advantage/task/std", "advantage/task/min", "advantage/task/max"} <= set(row)
    before, after = weights(tiny_model_dir), weights(run / "final")
    assert any(not torch.equal(before[name], after[name]) for name in before)  # the teacher alone moved it


def test_a_student_distilled_from_a_copy_of_itself_gets_no_signal(tmp_path, tiny_model_dir, letter_task):
    copy = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    run = train(config_for(tmp_path, tiny_model_dir, f"algorithm.teacher={copy}", "algorithm.beta=0",
                           "algorithm.distill_reward=drop", "train.steps=1"))
    (row,) = read_metrics(run / "metrics.jsonl")
    assert row["distill/teacher_kl"] == 0.0 and row["loss"] == 0.0 and row["grad_norm"] == 0.0
    assert [row[f"advantage/{name}"] for name in ("mean", "abs_mean", "std", "min", "max")] == [0.0] * 5
    before, after = weights(tiny_model_dir), weights(run / "final")
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_kept_beside_the_task_a_self_copy_leaves_the_grpo_update_as_it_was(tmp_path, tiny_model_dir, letter_task):
    copy = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    # one step: from the next one on the student has moved away from the copy, which stays
    plain = train(config_for(tmp_path / "a", tiny_model_dir, "algorithm.beta=0", "train.steps=1"))
    distilled = train(config_for(tmp_path / "b", tiny_model_dir, f"algorithm.teacher={copy}", "algorithm.beta=0",
                                 "train.steps=1"))
    a, b = weights(plain / "final"), weights(distilled / "final")
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_a_resumed_distillation_run_matches_an_uninterrupted_one(tmp_path, tiny_model_dir, other_seed_dir,
                                                                 letter_task):
    common = ["train.steps=2", "train.save_every=1", f"algorithm.teacher={other_seed_dir}", "algorithm.beta=0.05",
              "algorithm.updates_per_batch=2", "algorithm.distill_weight=0.5"]
    straight = train(config_for(tmp_path / "a", tiny_model_dir, *common))
    interrupted = Path(shutil.copytree(straight, tmp_path / "b" / "run"))  # the same run, not run again
    shutil.rmtree(interrupted / "checkpoints" / "step_000002")  # interrupted after step 1
    shutil.rmtree(interrupted / "final")
    resumed = train(config_for(tmp_path / "b", tiny_model_dir, *common, "resume=true"))

    def strip(rows):
        return [{k: v for k, v in row.items() if not k.startswith(("seconds", "tokens_per_s", "time/"))} for row in rows]

    assert strip(read_metrics(resumed / "metrics.jsonl")) == strip(read_metrics(straight / "metrics.jsonl"))
    a, b = weights(straight / "final"), weights(resumed / "final")
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_the_teachers_held_out_accuracy_is_logged_once_at_step_0(tmp_path, tiny_model_dir, letter_task,
                                                                  monkeypatch):
    """The teacher evaluated as the policy is (greedy, the same held-out set; no blind check), before
    step 1, not again on resume; a student distilled from a copy of itself (its weights do not move)
    then scores at step 1 what the teacher scored at step 0."""
    calls = []  # (frozen model?, held-out prompts, blind check) of each evaluation

    def spy(model, processor, task, examples, settings, **kwargs):
        calls.append((not any(p.requires_grad for p in model.parameters()), [e.prompt for e in examples],
                      settings.blind_check))
        return evaluate(model, processor, task, examples, settings, **kwargs)

    monkeypatch.setattr(session_module, "evaluate", spy)
    copy = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    common = [f"algorithm.teacher={copy}", "train.steps=2", "train.save_every=1", "eval.every=2", "eval.n=4",
              "eval.blind_check=true", "algorithm.beta=0", "algorithm.distill_reward=drop"]
    run = train(config_for(tmp_path, tiny_model_dir, *common))
    first, _, last = read_metrics(run / "metrics.jsonl")
    assert first["step"] == 0
    assert sorted(first) == sorted(["step", *[key.replace("eval/test/", "eval/test/teacher/") for key in last
                                              if key.startswith("eval/test/") and key.split("/")[2] not in
                                              ("blank", "shuffled", "drop")]])
    assert first["eval/test/teacher/accuracy"] == last["eval/test/accuracy"]
    assert first["eval/test/teacher/reward/share"] == last["eval/test/reward/share"]
    assert json.loads((run / "evals" / "step_000000_test_teacher.json").read_text())["results"]["blind"] is None
    (teacher, prompts, blind), (policy, same_prompts, policy_blind) = calls
    assert (teacher, policy, blind, policy_blind) == (True, False, False, True) and prompts == same_prompts
    shutil.rmtree(run / "checkpoints" / "step_000002")
    shutil.rmtree(run / "final")
    resumed = train(config_for(tmp_path, tiny_model_dir, *common, "resume=true"))
    assert [row["step"] for row in read_metrics(resumed / "metrics.jsonl")] == [0, 1, 2]  # no second step 0
    assert len(calls) == 3  # the resume evaluated the policy at step 2, not the teacher


def edited_copy(source: str, folder: Path, file: str, edit) -> str:
    """A copy of model folder `source` whose JSON `file` went through `edit`."""
    shutil.copytree(source, folder)
    data = json.loads((folder / file).read_text())
    edit(data)
    (folder / file).write_text(json.dumps(data))
    return str(folder)


def swap_two_tokens(tokenizer: dict) -> None:
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]


def test_teachers_that_cannot_score_the_students_tokens_are_refused_before_loading(
        tmp_path, tiny_model_dir, tiny_model_factory, letter_task):
    cases = {
        str(tmp_path / "nowhere"): "does not exist",
        tiny_model_dir: "is the policy's own model",
        tiny_model_factory("idefics3"): "is a idefics3 model and the policy a qwen2_5_vl one",
        edited_copy(tiny_model_dir, tmp_path / "image-id", "config.json",
                    lambda c: c.update(image_token_id=c["image_token_id"] + 1)): "has image token id",
        edited_copy(tiny_model_dir, tmp_path / "tokenizer", "tokenizer.json", swap_two_tokens):
            "has another tokenizer: token .* is id",
        edited_copy(tiny_model_dir, tmp_path / "patches", "processor_config.json",
                    lambda c: c["image_processor"].update(patch_size=7)): "processes images otherwise: patch_size",
    }
    for teacher, message in cases.items():
        config = config_for(tmp_path, tiny_model_dir, f"algorithm.teacher={teacher}")
        with pytest.raises(VlmrlError, match=message) as caught:
            train(config)
        assert "\n" not in str(caught.value)
        assert not (tmp_path / "run").exists()  # refused before the run folder, before any model loaded


def test_distill_settings_are_validated_in_one_line(tiny_model_dir):
    for extra, message in ((["algorithm.teacher=x", "algorithm.distill_weight=0"], "distill_weight must be > 0"),
                           (["algorithm.distill_reward=drop"], "distill_reward=drop needs algorithm.teacher"),
                           (["algorithm.teacher=x", "algorithm.distill_weight=-1"], "got -1")):
        with pytest.raises(VlmrlError, match=message):
            load_config(None, [f"model.name_or_path={tiny_model_dir}", *extra])


def test_a_teacher_too_large_for_the_free_memory_is_refused_before_it_loads(tmp_path, tiny_model_dir, other_seed_dir,
                                                                            letter_task, monkeypatch):
    monkeypatch.setattr(teacher_module, "free_memory", lambda device: 1024)
    with pytest.raises(VlmrlError, match=r"algorithm.teacher=.* does not fit: its weights need 745 KiB"):
        train(config_for(tmp_path, tiny_model_dir, f"algorithm.teacher={other_seed_dir}"))


def test_vlmrl_check_prints_the_teachers_memory(tiny_model_dir, other_seed_dir, letter_task, capsys):
    extra = [f"model.name_or_path={tiny_model_dir}", "model.device=cpu", f"task.name={LETTER_TASK}",
             "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8", "algorithm.beta=0"]
    assert main(["check", *extra, f"algorithm.teacher={other_seed_dir}"]) == 0
    assert "teacher 745 KiB" in capsys.readouterr().out
    assert main(["check", *extra]) == 0
    assert "teacher" not in capsys.readouterr().out


def test_a_lora_adapter_is_a_teacher_its_base_with_the_adapter_merged(tmp_path, tiny_model_dir, letter_task):
    adapter = train(config_for(tmp_path / "lora", tiny_model_dir, "model.lora.enabled=true", "model.lora.r=4",
                               "algorithm.beta=0", "train.lr=1e-2")) / "final"
    run = train(config_for(tmp_path, tiny_model_dir, f"algorithm.teacher={adapter}", "algorithm.beta=0",
                           "algorithm.distill_reward=drop", "train.steps=1"))
    (row,) = read_metrics(run / "metrics.jsonl")
    assert row["distill/teacher_kl"] != 0.0  # the base alone would be the student itself: exactly 0
