"""DeepSpeed ZeRO-3 on two gloo processes (accelerate engages DeepSpeed, its CPU accelerator): the
same update as one process on the same global batch, checkpoints that resume exactly, a `final/`
that plain transformers loads, evaluation on the main process alone."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText

from launching import CLI, launcher, run_all_or_kill
from vlmrl.report.tracking import read_metrics

pytest.importorskip("deepspeed", reason="the deepspeed extra: pip install 'vlmrl[deepspeed]'")

ROOT = Path(__file__).parent.parent
ZERO3 = launcher("--config_file", str(ROOT / "configs" / "accelerate" / "zero3.yaml"))


def _overrides(tiny_model_dir: str, out: Path, *more: str) -> list[str]:
    # lr 5e-4: AdamW's first steps move every weight by about lr whatever its gradient's size, so a
    # weight whose gradient is 0 but for rounding noise (1e-10: ZeRO-3 reads log-probs from the
    # logits, one process inside the output layer) moves by up to lr on noise alone. Measured, the
    # largest weight difference after 2 steps: 1.4e-5 at lr 1e-3 (2 of 16384 elements of one matrix),
    # 3.4e-5 at lr 1e-2 (FSDP2, whose reading is one process's: 1.7e-5).
    return ["train", f"model.name_or_path={tiny_model_dir}", "model.device=cpu", "task.name=letter_task:LetterTask",
            "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8",
            "rollout.generation_batch_size=2", "train.micro_batch_size=4", "train.lr=5e-4",
            "algorithm.aggregation=token", "algorithm.beta=0.1", "algorithm.ref_refresh_steps=1", "algorithm.ref_mix=0.5",
            f"output_dir={out}", *more]


def _params(folder: Path) -> dict[str, torch.Tensor]:
    return AutoModelForImageTextToText.from_pretrained(folder).state_dict()


def _run(command: list[str], arguments: list[str]) -> str:
    # DS_ACCELERATOR=cpu: DeepSpeed would find its CPU accelerator alone, with a warning on stdout
    returncode, stdout, stderr = run_all_or_kill(command + arguments, timeout=300, env={"DS_ACCELERATOR": "cpu"})
    assert returncode == 0, stderr[-3000:]
    return stdout


def test_two_zero3_processes_make_the_same_steps_as_one(tmp_path, tiny_model_dir):
    """fp32, 2 steps with a reference refreshed from the policy after each, evaluation at the end on
    the main process alone (the other waits: no collective inside), a checkpoint after each step:
    loss, KL and grad norm per step within 1e-5 relative, the weights after 2 steps within 1e-5."""
    more = ("train.steps=2", "train.save_every=1", "eval.every=2", "eval.n=4")
    _run(CLI, _overrides(tiny_model_dir, tmp_path / "one", *more))
    stdout = _run(ZERO3, _overrides(tiny_model_dir, tmp_path / "two", *more))
    assert stdout.startswith("preflight: processes: 2, strategy: ZeRO-3, backend: gloo\n"), stdout[:300]
    one, two = read_metrics(tmp_path / "one" / "metrics.jsonl"), read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        assert a["reward"] == b["reward"] and a["ref_refreshed"] == b["ref_refreshed"] == 1
        for key in ("loss", "kl", "grad_norm", "entropy"):  # on-policy the surrogate is 0 up to float noise: 6e-8
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key  # apart, the rows summed in another order
    assert one[1]["kl"] > 0 and two[1]["eval/test/accuracy"] == one[1]["eval/test/accuracy"]
    a, b = _params(tmp_path / "one" / "final"), _params(tmp_path / "two" / "final")  # plain transformers loads it
    base = _params(Path(tiny_model_dir))
    assert any(not torch.equal(a[k], base[k]) for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
    saved = torch.load(tmp_path / "two" / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False)
    moments = saved["optimizer"]["state"]  # whole, keyed by parameter name, as FSDP2's
    assert moments["model.language_model.layers.0.mlp.up_proj.weight"]["exp_avg"].shape == \
        a["model.language_model.layers.0.mlp.up_proj.weight"].shape
    assert float(moments["model.language_model.layers.0.mlp.up_proj.weight"]["step"]) == 2


@pytest.mark.slow  # two 4-step launches: about 40 s on 2 cores
def test_zero3_stopped_at_step_2_and_resumed_matches_an_uninterrupted_run(tmp_path, tiny_model_dir):
    """The AdamW moments are saved whole and put back into DeepSpeed's partitions after `prepare`."""
    more = ("train.steps=4", "train.save_every=2", "train.schedule=cosine", "train.warmup_steps=1")
    straight = tmp_path / "straight"
    _run(ZERO3, _overrides(tiny_model_dir, straight, *more))
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)  # as if stopped after step 2: the later checkpoint and model gone
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    shutil.rmtree(resumed / "final")
    _run(ZERO3, _overrides(tiny_model_dir, resumed, *more, "resume=true"))

    def strip(rows):
        return [{k: v for k, v in row.items() if not k.startswith(("seconds", "tokens_per_s", "time/"))} for row in rows]

    assert strip(read_metrics(resumed / "metrics.jsonl")) == strip(read_metrics(straight / "metrics.jsonl"))
    a, b = _params(straight / "final"), _params(resumed / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)
