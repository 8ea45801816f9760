"""DeepSpeed ZeRO-3 on two gloo processes (accelerate engages DeepSpeed, its CPU accelerator): the
same update as one process on the same global batch, checkpoints that resume exactly, a `final/`
that plain transformers loads, evaluation on the main process alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launching import (CLI, assert_same_statistics, assert_same_weights, final_weights, launcher, run_here,
                       run_ok, same_lora_runs, stopped_at_2_and_resumed, two_process_overrides)
from vlmrl.report.tracking import read_metrics

pytest.importorskip("deepspeed", reason="the deepspeed extra: pip install 'vlmrl[deepspeed]'")

ROOT = Path(__file__).parent.parent
ZERO3 = launcher("--config_file", str(ROOT / "configs" / "accelerate" / "zero3.yaml"))
QUIET = {"DS_ACCELERATOR": "cpu"}  # else the launcher's DeepSpeed says on stdout that it picked the CPU
ZERO3_LR = 5e-4  # see _overrides


def _overrides(tiny_model_dir: str, out: Path, *more: str) -> list[str]:
    # lr 5e-4: AdamW's first steps move every weight by about lr whatever its gradient's size, so a
    # weight whose gradient is 0 but for rounding noise (1e-10: ZeRO-3 reads log-probs from the
    # logits, one process inside the output layer) moves by up to lr on noise alone. Measured, the
    # largest weight difference after 2 steps: 1.4e-5 at lr 1e-3 (2 of 16384 elements of one matrix),
    # 3.4e-5 at lr 1e-2 (FSDP2, whose reading is one process's: 1.7e-5).
    return two_process_overrides(tiny_model_dir, out, *more, lr=ZERO3_LR)


def test_two_zero3_processes_make_the_same_steps_as_one(tmp_path, tiny_model_dir):
    """fp32, 2 steps with a reference refreshed from the policy after each, evaluation at the end on
    the main process alone (the other waits: no collective inside), a checkpoint after each step:
    loss, KL and grad norm per step (launching.assert_same_statistics), the weights after 2 steps (assert_same_weights)."""
    more = ("train.steps=2", "train.save_every=1", "eval.every=2", "eval.n=4")
    run_here(_overrides(tiny_model_dir, tmp_path / "one", *more))
    stdout = run_ok(ZERO3, _overrides(tiny_model_dir, tmp_path / "two", *more), QUIET)
    assert stdout.startswith("preflight: processes: 2, strategy: ZeRO-3, backend: gloo\n"), stdout[:300]
    one, two = read_metrics(tmp_path / "one" / "metrics.jsonl"), read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        assert a["reward"] == b["reward"] and a["ref_refreshed"] == b["ref_refreshed"] == 1
        assert_same_statistics(a, b, ("loss", "kl", "grad_norm", "entropy"))
    assert one[1]["kl"] > 0 and two[1]["eval/test/accuracy"] == one[1]["eval/test/accuracy"]
    a, b = final_weights(tmp_path / "one" / "final"), final_weights(tmp_path / "two" / "final")
    base = final_weights(Path(tiny_model_dir))
    assert any(not torch.equal(a[k], base[k]) for k in a)
    assert_same_weights(a, b, ZERO3_LR)
    saved = torch.load(tmp_path / "two" / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False)
    moments = saved["optimizer"]["state"]["model.language_model.layers.0.mlp.up_proj.weight"]  # whole, by name
    assert moments["exp_avg"].shape == a["model.language_model.layers.0.mlp.up_proj.weight"].shape
    assert float(moments["step"]) == 2


@pytest.mark.slow  # two 4-step launches: about 60 s on 2 cores
def test_zero3_stopped_at_step_2_and_resumed_matches_an_uninterrupted_run(tmp_path, tiny_model_dir):
    """The AdamW moments are saved whole and put back into DeepSpeed's partitions after `prepare`,
    with the learning rate the run was at."""
    stopped_at_2_and_resumed(ZERO3, lambda out, *more: _overrides(tiny_model_dir, out, *more), tmp_path, QUIET)


@pytest.mark.slow  # two 2-step launches: about 40 s on 2 cores
def test_lora_under_zero3_equals_it_under_ddp(tmp_path, tiny_model_dir):
    """Only the adapter trains; the reference is a copy refreshed from the policy. DDP is the
    comparison (one process draws other LoRA dropout masks)."""
    more = ("train.steps=2", "model.lora.enabled=true", "model.lora.r=4")
    ddp = launcher("--config_file", str(ROOT / "configs" / "accelerate" / "ddp.yaml"))
    run_ok(ddp, _overrides(tiny_model_dir, tmp_path / "ddp", *more), QUIET)
    run_ok(ZERO3, _overrides(tiny_model_dir, tmp_path / "zero3", *more), QUIET)
    same_lora_runs(tmp_path / "ddp", tmp_path / "zero3", ZERO3_LR)
