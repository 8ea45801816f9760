"""Alarms fire once when their condition starts, with the step, and land in alarms.jsonl."""

from __future__ import annotations

import json

from vlmrl.safety.alarms import Alarms


def _steps(alarms: Alarms, rows: list[dict]) -> list[tuple[int, str]]:
    fired = []
    for step, row in enumerate(rows, start=1):
        fired += [(a["step"], a["kind"]) for a in alarms.check({"step": step, **row})]
    return fired


def test_kl_spike_fires_once_when_kl_jumps_a_hundredfold(tmp_path):
    alarms = Alarms(tmp_path / "alarms.jsonl")
    rows = [{"kl": 0.01}] * 6 + [{"kl": 2.0}, {"kl": 3.0}, {"kl": 0.01}]
    assert _steps(alarms, rows) == [(7, "kl_spike")]
    (row,) = [json.loads(line) for line in (tmp_path / "alarms.jsonl").read_text().splitlines()]
    assert row["step"] == 7 and "200x" in row["message"]


def test_small_kl_noise_stays_quiet():
    rows = [{"kl": 1e-7}] * 6 + [{"kl": 5e-4}]  # 5000x, but below the 1e-3 floor
    assert _steps(Alarms(), rows) == []


def test_reward_collapse_after_a_good_stretch():
    rows = [{"reward": 1.0}] * 5 + [{"reward": 0.1}] * 5
    fired = _steps(Alarms(), rows)
    assert [kind for _, kind in fired] == ["reward_collapse"] and fired[0][0] in range(7, 11)


def test_high_format_with_zero_accuracy_is_reward_hacking():
    rows = [{"reward/format": 1.0, "accuracy": 0.0}] * 5
    assert _steps(Alarms(), rows) == [(5, "reward_hacking")]
    rows = [{"reward/format": 1.0, "accuracy": 0.5}] * 5
    assert _steps(Alarms(), rows) == []


def test_no_signal_and_length_limit():
    rows = [{"groups_drawn": 8, "groups_with_signal": 1, "truncated": 0.9}] * 5
    assert sorted(kind for _, kind in _steps(Alarms(), rows)) == ["length_limit", "no_signal"]


def test_a_resumed_run_keeps_only_the_alarms_up_to_its_checkpoint(tmp_path):
    path = tmp_path / "alarms.jsonl"
    path.write_text('{"step": 3, "kind": "kl_spike", "message": "m"}\n{"step": 9, "kind": "no_signal", "message": "m"}\n')
    Alarms(path, resume_step=5)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [3]
    Alarms(path)  # a fresh run starts empty
    assert path.read_text() == ""


def test_a_sampler_far_from_the_training_pass_raises_the_mismatch_alarm():
    rows = [{"mismatch_kl": 1e-6, "tis_capped_fraction": 0.0}, {"mismatch_kl": 0.05, "tis_capped_fraction": 0.0},
            {"mismatch_kl": 1e-3, "tis_capped_fraction": 0.0}, {"mismatch_kl": 1e-3, "tis_capped_fraction": 0.02},
            {"mismatch_kl": None, "tis_capped_fraction": None}]
    assert _steps(Alarms(), rows) == [(2, "sampler_mismatch"), (4, "sampler_mismatch")]
