"""Rollouts one step ahead (rollout.ahead, rollout.generators; training/ahead.py): the one-process
schedule lags by one step and resumes exactly; a launch of 1 generator + 1 trainer (plain, or FSDP2)
equals it, and resumes exactly too."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from launching import LR, assert_same_statistics, assert_same_weights, final_weights, launcher, run_all_or_kill
from vlmrl.config import load_config
from vlmrl.errors import VlmrlError
from vlmrl.report.tracking import read_metrics
from vlmrl.rollout.generation import Rollout
from vlmrl.training.ahead import share, split_launch
from vlmrl.training.experience import Experience
from vlmrl.training.trainer import train

ROOT = Path(__file__).parent.parent
FSDP2 = ("--config_file", str(ROOT / "configs" / "accelerate" / "fsdp2.yaml"))
PLAIN = ("--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
         "--dynamo_backend", "no")
THREE = ("--num_processes", "3")  # after a strategy's flags: 2 trainers and the generator

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest (conftest.py)


def overrides(model_dir: str, out: Path, *more: str) -> list[str]:
    return [f"model.name_or_path={model_dir}", "model.device=cpu", "task.name=letter_task:LetterTask",
            f"output_dir={out}", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8",
            "rollout.generation_batch_size=2", "train.micro_batch_size=8", "train.lr=1e-2", "algorithm.beta=0",
            "train.log_rollouts_every=1", "eval.every=0", *more]


MORE = ("train.steps=4", "train.save_every=2", "model.vision_lr_scale=0")  # the demos' frozen tower: the trainable
# set the generator receives each step is the trainer's


def strip(rows):
    return [{k: v for k, v in row.items() if not k.startswith(("seconds", "tokens_per_s", "time/"))} for row in rows]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """Synchronous and one step ahead, 4 steps each (checkpoints after 2 and 4), the same seeds."""
    root = tmp_path_factory.mktemp("ahead")
    return {ahead: train(load_config(None, overrides(tiny_model_dir, root / f"ahead{ahead}", *MORE,
                                                     f"rollout.ahead={ahead}")))
            for ahead in (0, 1)}


def test_one_step_ahead_trains_on_the_rollouts_of_the_weights_before(runs):
    sync, ahead = (read_metrics(runs[a] / "metrics.jsonl") for a in (0, 1))
    assert "rollout/lag_steps" not in sync[0]  # ahead=0 logs what it logged before
    assert [row["rollout/lag_steps"] for row in ahead] == [0, 1, 1, 1]
    # step 1: both sample with the first weights and train on that batch alike
    assert strip(sync[:1]) == [{k: v for k, v in strip(ahead[:1])[0].items() if k != "rollout/lag_steps"}]
    # step 2: the synchronous run samples with the weights it trains (sampler = trainer but for rounding);
    # one step ahead samples with the weights before the last update, and the lag shows as the mismatch
    assert sync[1]["mismatch_kl"] < 1e-6 < 1e-4 < ahead[1]["mismatch_kl"]
    # the rollouts of step 2 were made with the first weights, from the prompts and seeds of step 2
    texts = {a: (runs[a] / "rollouts" / "step_000002.jsonl").read_text() for a in (0, 1)}
    assert texts[0] != texts[1]
    alarms = (runs[1] / "alarms.jsonl").read_text()
    assert "sampler_mismatch" in alarms and "rollout.ahead=1" in alarms  # the alarm names the lag, not the decode


def test_each_trainer_takes_its_whole_groups_of_the_generators_batch():
    examples = [object() for _ in range(4)]  # 4 groups of 2
    rollout = Rollout(rows=[e for e in examples for _ in range(2)], completion_ids=torch.arange(16).view(8, 2),
                      completion_mask=torch.ones(8, 2, dtype=torch.long), texts=[str(i) for i in range(8)],
                      truncated=torch.zeros(8, dtype=torch.bool), sampler_logp=-torch.arange(16.0).view(8, 2))
    whole = Experience(rollout, rewards={"total": torch.arange(8.0)}, reward=torch.arange(8.0),
                       advantages=torch.arange(8.0) / 8, groups_drawn=4, groups_with_signal=2, indices=[10, 11, 12, 13])
    first, second = share(whole, 0, 2), share(whole, 1, 2)
    assert first.indices == [10, 11] and second.indices == [12, 13]
    assert second.rollout.rows == [examples[2]] * 2 + [examples[3]] * 2 and second.rollout.texts == ["4", "5", "6", "7"]
    assert torch.equal(torch.cat([first.advantages, second.advantages]), whole.advantages)
    assert torch.equal(second.rollout.sampler_logp, whole.rollout.sampler_logp[4:])
    assert torch.equal(second.rewards["total"], torch.arange(4.0, 8.0)) and first.groups_drawn == 2


def test_one_step_ahead_resumes_exactly(tmp_path, tiny_model_dir, runs):
    """Stopped after step 2 (the rollouts of step 3, made ahead, in its checkpoint) and resumed: the
    same metrics and weights as the run that went straight through."""
    full = runs[1]
    resumed = Path(shutil.copytree(full, tmp_path / "resumed"))
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    shutil.rmtree(resumed / "final")
    train(load_config(None, overrides(tiny_model_dir, resumed, *MORE, "rollout.ahead=1", "resume=true")))
    assert strip(read_metrics(resumed / "metrics.jsonl")) == strip(read_metrics(full / "metrics.jsonl"))
    a, b = final_weights(full / "final"), final_weights(resumed / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_generator_needs_a_launch_of_two_processes(tmp_path, tiny_model_dir, monkeypatch):
    config = load_config(None, overrides(tiny_model_dir, tmp_path / "run", "rollout.ahead=1", "rollout.generators=1"))
    with pytest.raises(VlmrlError, match=r"^rollout.generators=1 needs a launch of at least 2 processes"):
        train(config)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(VlmrlError, match=r"^rollout.generators=1 runs with DDP or FSDP2 trainers, not ZeRO-3"):
        split_launch(config, {"WORLD_SIZE": "2", "RANK": "0", "ACCELERATE_USE_DEEPSPEED": "true",
                              "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"})
    with pytest.raises(VlmrlError, match=r"rollout.generators=1 needs rollout.ahead=1"):
        load_config(None, ["rollout.generators=1"])


def with_a_generator(strategy: tuple[str, ...], tiny_model_dir: str, out: Path, *more: str) -> str:
    """The 4-step run of `runs` (rollout.ahead=1) launched as 1 trainer (`strategy`: accelerate's flags)
    + 1 generator on 2 gloo processes; its stdout."""
    returncode, stdout, stderr = run_all_or_kill(
        launcher(*strategy) + ["train", *overrides(tiny_model_dir, out, *MORE, "rollout.ahead=1",
                                                   "rollout.generators=1", *more)],
        timeout=300, env={"OMP_NUM_THREADS": "1"})
    assert returncode == 0, stderr[-3000:]
    return stdout


def same_run(one: Path, two: Path) -> None:
    """The same metrics (timings aside) and, to the bit, the same final weights."""
    assert strip(read_metrics(two / "metrics.jsonl")) == strip(read_metrics(one / "metrics.jsonl"))
    a, b = final_weights(one / "final"), final_weights(two / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def generator_run(tmp_path_factory, tiny_model_dir):
    """1 generator + 1 trainer (plain), the run of `runs[1]`: its folder and stdout."""
    out = tmp_path_factory.mktemp("generator") / "two"
    return out, with_a_generator(PLAIN, tiny_model_dir, out)


def test_a_generator_and_a_trainer_equal_the_one_process_schedule(runs, generator_run):
    """2 gloo processes, the last only generating with the weights of step k-1 while the first trains:
    after 4 steps the weights and metrics are those of the one-process schedule (rollout.ahead=1)."""
    two, stdout = generator_run
    assert "preflight: processes: 1, strategy: single" in stdout  # the trainer alone in its group
    rows = read_metrics(two / "metrics.jsonl")
    assert [row["rollout/lag_steps"] for row in rows] == [0, 1, 1, 1] and "time/rollout_wait" in rows[1]
    same_run(runs[1], two)


def test_a_generator_and_a_trainer_resume_exactly(tmp_path, tiny_model_dir, generator_run):
    """The launch above stopped after step 2 (its checkpoint holds the rollouts of step 3, which the
    generator made with the weights of step 1) and resumed by a launch of its own: the generator takes
    the checkpoint's weights and makes step 4's; metrics and weights are those of the run that went
    straight through."""
    straight, _ = generator_run
    resumed = Path(shutil.copytree(straight, tmp_path / "resumed"))
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    shutil.rmtree(resumed / "final")
    assert torch.load(resumed / "checkpoints" / "step_000002" / "trainer_state.pt",
                      weights_only=True)["extra"]["ahead"]["indices"]  # step 3's rollouts, made ahead
    with_a_generator(PLAIN, tiny_model_dir, resumed, "resume=true")
    same_run(straight, resumed)


def test_an_fsdp2_trainer_and_a_generator_equal_the_one_process_schedule(tmp_path, tiny_model_dir, runs):
    """configs/accelerate/fsdp2.yaml on 2 processes: one FSDP2 trainer (its parameters DTensors, gathered
    whole before trainer 0 sends them) and the generator. FSDP2 over one process holds every parameter
    whole in its one shard and makes the same arithmetic: the one-process schedule to the bit."""
    two = tmp_path / "fsdp2"
    stdout = with_a_generator(FSDP2, tiny_model_dir, two)
    assert "preflight: processes: 1, strategy: FSDP2" in stdout
    same_run(runs[1], two)


@pytest.mark.slow  # a launch of 3 processes on 2 cores: about 90 s (75 s of it starting and importing) under load
@pytest.mark.parametrize("strategy", ["DDP", "FSDP2"])
def test_two_trainers_and_a_generator_make_the_steps_of_one_process(tmp_path, tiny_model_dir, runs, strategy):
    """2 trainers (DDP, or FSDP2: each holds half of every parameter, gathered whole before trainer 0
    sends it) beside the generator, each training on its half of the generator's batch: the rollouts
    of the one-process schedule (the same rewards), its statistics and weights within the rounding of
    two processes against one (launching.py). The launch hung before the generator's own process
    group moved off the keys of the trainers' (split_launch)."""
    three = tmp_path / "three"
    stdout = with_a_generator((PLAIN if strategy == "DDP" else FSDP2) + THREE, tiny_model_dir, three)
    assert f"preflight: processes: 2, strategy: {strategy}, backend: gloo" in stdout
    one, rows = read_metrics(runs[1] / "metrics.jsonl"), read_metrics(three / "metrics.jsonl")
    assert [row["rollout/lag_steps"] for row in rows] == [0, 1, 1, 1]
    for a, b in zip(one, rows, strict=True):
        assert a["reward"] == b["reward"]
        assert_same_statistics(a, b, ("loss", "grad_norm", "entropy", "mismatch_kl"))
    assert_same_weights(final_weights(runs[1] / "final"), final_weights(three / "final"), LR)
