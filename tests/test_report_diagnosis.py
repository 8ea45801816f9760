"""The report's "why is RL not improving" panel: each check fires on hand-made metric rows that call
for it and stays quiet on rows that do not; the metrics it reads are logged by the trainer; the page
of a tiny run shows it."""

from __future__ import annotations

import re
from dataclasses import fields
from html import unescape
from types import SimpleNamespace

import pytest
import torch

from vlmrl import grpo
from vlmrl.config import Config, load_config
from vlmrl.report import write_report
from vlmrl.report.diagnosis import diagnose
from vlmrl.report.tracking import read_metrics
from vlmrl.training.trainer import reward_signal

HEALTHY = {"groups_drawn": 8, "groups_with_signal": 7, "reward_std": 0.4, "accuracy": 0.6,
           "advantage_corr/accuracy": 0.9, "advantage_corr/format": 0.2, "paid_when_wrong/format": 0.3,
           "entropy": 0.8, "clip_fraction": 0.02, "tis_capped_fraction": 0.01, "off_policy_masked_fraction": 0.0,
           "truncated": 0.02, "kl": 0.01}
CONFIG = {"rollout": {"group_size": 8, "max_new_tokens": 256}, "algorithm": {"beta": 0.04, "updates_per_batch": 2}}


def rows_with(steps: int = 30, **changes) -> list[dict]:
    """`steps` metric rows of a healthy run; `changes` hold over the last third (what the checks read)."""
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step} | HEALTHY
        if step > steps - steps // 3:
            row |= {key.replace("__", "/"): value for key, value in changes.items()}
        rows.append(row)
    return rows


def by_check(rows, config=CONFIG) -> dict:
    return {finding.check: finding for finding in diagnose(rows, config)}


def test_a_healthy_run_fires_no_check():
    findings = diagnose(rows_with(), CONFIG)
    assert [f.check for f in findings] == ["signal", "reward_spread", "accuracy_alignment", "paid_when_wrong/format",
                                           "entropy", "clip", "masked", "truncated", "kl"]
    assert not [f for f in findings if f.fired], findings
    assert by_check(rows_with())["signal"].value == "88% of groups (G=8)"


def test_an_sft_run_gets_no_panel():
    assert diagnose([{"step": 1, "loss": 2.0, "accuracy": 0.5}], CONFIG) == []


@pytest.mark.parametrize("accuracy, words", [(0.95, "too easy"), (0.03, "too hard")])
def test_most_groups_without_signal_says_too_easy_or_too_hard(accuracy, words):
    signal = by_check(rows_with(groups_with_signal=2, accuracy=accuracy))["signal"]
    assert signal.fired and signal.value == "25% of groups (G=8)"
    assert "every completion of a group gets the same reward" in signal.message and words in signal.message
    assert "algorithm.dynamic_sampling=true" in signal.message
    assert "rollout.group_size" in signal.levers and "rollout.temperature" in signal.levers
    with_dynamic = by_check(rows_with(groups_with_signal=2, accuracy=accuracy),
                            CONFIG | {"algorithm": {"dynamic_sampling": True}})["signal"]
    assert "dynamic_sampling=true" not in with_dynamic.message
    assert not by_check(rows_with(groups_with_signal=4))["signal"].fired  # half: enough


def test_warnings_come_first():
    findings = diagnose(rows_with(truncated=0.5, entropy=0.01), CONFIG)
    assert [f.check for f in findings[:2]] == ["entropy", "truncated"] and not any(f.fired for f in findings[2:])


def test_the_checks_read_the_last_third_of_the_run():
    early_trouble = [row | {"truncated": 0.9} if row["step"] <= 20 else row for row in rows_with()]
    assert not by_check(early_trouble)["truncated"].fired
    assert by_check(rows_with(truncated=0.9))["truncated"].fired


def test_reward_spread():
    assert by_check(rows_with(reward_std=0.0))["reward_spread"].fired
    assert not by_check(rows_with(reward_std=0.05))["reward_spread"].fired


def test_an_advantage_not_following_accuracy_names_what_drives_it():
    found = by_check(rows_with(advantage_corr__accuracy=0.2, advantage_corr__format=0.9))["accuracy_alignment"]
    assert found.fired and found.value == "r=0.20" and "(format r=0.90)" in found.message
    assert found.levers == ("task.params.format_weight", "rewards")  # the task's own rubric
    listed = by_check(rows_with(advantage_corr__accuracy=0.2), CONFIG | {"rewards": [{"name": "format"}]})
    assert listed["accuracy_alignment"].levers == ("rewards[].weight", "algorithm.reward_aggregation")
    assert not by_check(rows_with(advantage_corr__accuracy=0.6))["accuracy_alignment"].fired


def test_format_paid_while_wrong_fires_only_when_it_also_moves_the_advantage():
    found = by_check(rows_with(paid_when_wrong__format=0.45, advantage_corr__format=0.7))["paid_when_wrong/format"]
    assert found.fired and found.value == "45% of completions, r=0.70"
    assert "paid while the answer is wrong in 45% of completions" in found.message
    assert "lower the format weight" in found.message
    saturated = by_check(rows_with(paid_when_wrong__format=0.45, advantage_corr__format=0.0))["paid_when_wrong/format"]
    assert not saturated.fired and "moves little of the advantage" in saturated.message  # paid to all alike
    rare = by_check(rows_with(paid_when_wrong__format=0.1, advantage_corr__format=0.9))["paid_when_wrong/format"]
    assert not rare.fired


def test_entropy_collapse():
    found = by_check(rows_with(entropy=0.02))["entropy"]
    assert found.fired and "entropy collapsed" in found.message and found.value.startswith("0.02 nats/token")
    assert "rollout.temperature" in found.levers and "algorithm.eps_high" in found.levers
    assert not by_check(rows_with(entropy=0.3))["entropy"].fired


def test_clip_fraction():
    found = by_check(rows_with(clip_fraction=0.35))["clip"]
    assert found.fired and "clip fraction high" in found.message and "train.lr" in found.levers
    assert not by_check(rows_with(clip_fraction=0.1))["clip"].fired
    never = [row | {"clip_fraction": 0.0} for row in rows_with()]
    one_update = by_check(never, {"algorithm": {"updates_per_batch": 1}})["clip"]
    assert one_update.verdict == "n/a" and "nothing is clipped" in one_update.message


def test_masked_share():
    found = by_check(rows_with(tis_capped_fraction=0.4))["masked"]
    assert found.fired and "40% of tokens are capped" in found.message and "algorithm.tis_cap" in found.levers
    assert by_check(rows_with(off_policy_masked_fraction=0.3))["masked"].fired
    assert not by_check(rows_with(tis_capped_fraction=0.15))["masked"].fired


def test_truncation():
    found = by_check(rows_with(truncated=0.3), CONFIG | {"algorithm": {"mask_truncated": True}})["truncated"]
    assert found.fired and found.value == "30% at 256 tokens"
    assert "raise rollout.max_new_tokens" in found.message and "mask_truncated drops them" in found.message
    assert not by_check(rows_with(truncated=0.05))["truncated"].fired


def test_kl_too_small_to_move_or_a_penalty_that_holds():
    still = by_check(rows_with(kl=1e-5))["kl"]
    assert still.fired and "barely moved" in still.message and "train.lr" in still.levers
    assert not by_check(rows_with(steps=9, kl=1e-5))["kl"].fired  # too early to tell
    no_gradient = by_check(rows_with(kl=1e-5, groups_with_signal=1))["kl"]  # not the lr: no signal to follow
    assert no_gradient.verdict == "n/a" and "few groups carrying signal" in no_gradient.message
    held = by_check(rows_with(kl=2.0))["kl"]
    assert held.fired and "beta x KL = 0.08" in held.message and "algorithm.beta" in held.levers
    no_reference = by_check(rows_with(kl=0.0), {"algorithm": {"beta": 0}})["kl"]
    assert no_reference.verdict == "n/a"
    assert not by_check(rows_with())["kl"].fired


def config_key_exists(key: str) -> bool:
    """Whether `section.key` names a field of the run config (rewards[].weight: of a reward entry;
    task.params.X: a task parameter)."""
    if key in ("rewards", "rewards[].weight", "task.params"):
        return True
    if key.startswith("task.params."):
        from vlmrl.tasks.base import task_class
        return any(key.split(".")[-1] in {f.name for f in fields(task_class(name).Params)}
                   for name in ("dataset", "grounding", "zoom"))
    section, name = key.split(".")
    part = next(f for f in fields(Config) if f.name == section)
    return name in {f.name for f in fields(part.default_factory())}


def test_every_lever_is_a_real_config_key():
    everything = rows_with(groups_with_signal=1, reward_std=0, advantage_corr__accuracy=0.1,
                           paid_when_wrong__format=0.5,
                           advantage_corr__format=0.9, entropy=0.01, clip_fraction=0.9, tis_capped_fraction=0.9,
                           truncated=0.9, kl=1e-6)
    levers = {key for config in (CONFIG, CONFIG | {"rewards": ["format"]})
              for finding in diagnose(everything, config) for key in finding.levers}
    assert not [key for key in levers if not config_key_exists(key)], levers


def test_advantage_alignment_by_hand():
    # two groups of 2: group 0's advantages follow part a exactly and part b inversely; group 1 has no signal
    advantages = torch.tensor([1.0, -1.0, 0.0, 0.0])
    parts = torch.tensor([[1.0, 0.0, 1.0, 0.0],    # a: r = 1 in group 0
                          [0.0, 2.0, 5.0, 5.0],    # b: r = -1 in group 0
                          [1.0, 1.0, 0.0, 1.0],    # c: constant in group 0: r = 0
                          [float("nan"), 0.0, 1.0, 1.0]])  # d: NaN counts as the group mean: r = 0
    expected = torch.tensor([[1.0, 1.0], [-1.0, 1.0], [0.0, 1.0], [0.0, 1.0]])
    torch.testing.assert_close(grpo.advantage_alignment(parts, advantages, 2), expected)
    # shaped advantages need not be centred; a part's scale does not matter
    sums = grpo.advantage_alignment(torch.tensor([[0.0, 3.0, 6.0, 0.0, 1.0, 2.0]]),
                                    torch.tensor([0.5, 1.5, 2.5, -1.0, 0.0, 1.0]), 3)
    assert sums[0, 1] == 2 and sums[0, 0].item() == pytest.approx(2.0)


def test_the_trainer_logs_the_correlation_and_the_format_paid_while_wrong():
    class OneProcess:
        device = torch.device("cpu")

        @staticmethod
        def reduce(x, how):
            return x

    nan = float("nan")
    rewards = {"format": torch.tensor([1.0, 1.0, 0.0, 1.0]), "accuracy": torch.tensor([1.0, 0.0, 0.0, nan]),
               "total": torch.tensor([2.0, 1.0, 0.0, 1.0])}
    experience = SimpleNamespace(rewards=rewards, advantages=torch.tensor([1.0, -1.0, -1.0, 1.0]))
    metrics = reward_signal(experience, OneProcess(), group_size=2)
    # group 0: accuracy follows the advantage, format is constant; group 1: format follows it, accuracy NaN+0
    assert metrics["advantage_corr/accuracy"] == pytest.approx(0.5)
    assert metrics["advantage_corr/format"] == pytest.approx(0.5)
    assert metrics["paid_when_wrong/format"] == 0.25  # row 1 only: row 2 unpaid, row 3 has no accuracy
    assert "paid_when_wrong/accuracy" not in metrics and "advantage_corr/total" not in metrics
    flat = SimpleNamespace(rewards=rewards, advantages=torch.zeros(4))
    assert "advantage_corr/format" not in reward_signal(flat, OneProcess(), group_size=2)  # no group has signal


def test_the_report_of_a_tiny_run_shows_the_panel(tmp_path, tiny_model_dir, letter_task):
    from vlmrl.training.trainer import train

    config = load_config(None, [f"model.name_or_path={tiny_model_dir}", "model.device=cpu",
                                "task.name=letter_task:LetterTask", f"output_dir={tmp_path / 'run'}",
                                "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8",
                                "rollout.generation_batch_size=2", "train.micro_batch_size=8", "train.steps=2",
                                "train.log_rollouts_every=0"])
    run = train(config)
    page = write_report(run).read_text()
    assert '<a href="#diagnosis">Why not improving?</a>' in page
    section = unescape(re.sub(r"(?:<[^>]+>)+", "|", re.search(r'<section id="diagnosis">.*?</section>', page).group(0)))
    assert "Why is RL not improving?" in section and "checks fired" in section
    for title in ("groups with signal", "advantage follows accuracy", "share paid while the answer is wrong",
                  "entropy of the sampled tokens", "completions cut at max_new_tokens", "KL to the reference"):
        assert title in section, section
    rows = read_metrics(run / "metrics.jsonl")
    share = sum(r["groups_with_signal"] for r in rows[-1:]) / sum(r["groups_drawn"] for r in rows[-1:])
    assert f"|groups with signal|{100 * share:.0f}% of groups (G=4)|>= 50%|" in section
    alignment = rows[-1]["advantage_corr/accuracy"]
    assert f"advantage follows accuracy (within-group correlation)|r={alignment:.2f}|" in section
    verdicts = re.findall(r'<td class="verdict">([^<]*)</td>', page)
    assert len(verdicts) == 9 and set(verdicts) <= {"ok", "warn", "n/a"}
