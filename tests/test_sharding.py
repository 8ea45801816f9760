"""FSDP2 on two gloo processes (vlmrl shards itself where accelerate would run DDP): the same
update as one process on the same global batch, checkpoints that resume exactly, a `final/` that
plain transformers loads; and `gathered`, which lets each process generate alone."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from launching import (CLI, LR, assert_same_statistics, assert_same_weights, final_weights, launcher, run_here,
                       run_ok, same_lora_runs, stopped_at_2_and_resumed, two_process_overrides)
from vlmrl.report.tracking import read_metrics

ROOT = Path(__file__).parent.parent
FSDP2 = launcher("--config_file", str(ROOT / "configs" / "accelerate" / "fsdp2.yaml"))


@pytest.mark.slow  # a launch and a one-process run: about 16 s on 2 cores
def test_two_fsdp2_processes_make_the_same_steps_as_one(tmp_path, tiny_model_dir):
    """fp32, 2 steps with a reference refreshed from the policy after each, evaluation at the end
    and a checkpoint after each step: loss, KL and grad norm per step (launching.assert_same_statistics),
    the weights after 2 steps (assert_same_weights), and each process held half of every parameter.
    The default suite holds all of it with a teacher added (the distillation test below: the same
    launch, the same asserts); this one is the run without a teacher."""
    more = ("train.steps=2", "train.save_every=1", "eval.every=2", "eval.n=4")
    run_here(two_process_overrides(tiny_model_dir, tmp_path / "one", *more))
    stdout = run_ok(FSDP2, two_process_overrides(tiny_model_dir, tmp_path / "two", *more))
    _same_fsdp2_steps(tiny_model_dir, tmp_path, stdout, first_step=0)


def _same_fsdp2_steps(tiny_model_dir: str, tmp_path: Path, stdout: str, first_step: int) -> tuple[list, list]:
    """The asserts of the FSDP2 = one process tests on runs `one` and `two` in tmp_path (metrics rows
    from `first_step` on are the training steps): their steps' rows."""
    assert stdout.startswith("preflight: processes: 2, strategy: FSDP2, backend: gloo\n"), stdout[:300]
    one = read_metrics(tmp_path / "one" / "metrics.jsonl")[first_step:]
    two = read_metrics(tmp_path / "two" / "metrics.jsonl")[first_step:]
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        assert a["reward"] == b["reward"] and a["ref_refreshed"] == b["ref_refreshed"] == 1
        assert_same_statistics(a, b, ("loss", "kl", "grad_norm", "entropy"))
    assert one[1]["kl"] > 0 and two[1]["eval/test/accuracy"] == one[1]["eval/test/accuracy"]
    a, b = final_weights(tmp_path / "one" / "final"), final_weights(tmp_path / "two" / "final")  # plain transformers loads it
    base = final_weights(Path(tiny_model_dir))
    assert any(not torch.equal(a[k], base[k]) for k in a)
    assert_same_weights(a, b, LR)
    assert (tmp_path / "two" / "checkpoints" / "step_000002" / "reference.safetensors").is_file()
    return one, two


@pytest.mark.slow  # two 4-step launches: about 30 s on 2 cores
def test_fsdp2_stopped_at_step_2_and_resumed_matches_an_uninterrupted_run(tmp_path, tiny_model_dir):
    """The optimizer state is saved whole and put back after sharding; the reference copy too. Here
    every process reads the weights (fsdp_cpu_ram_efficient_loading false; the other tests: true)."""
    each_reads = FSDP2[:-2] + ["--fsdp_cpu_ram_efficient_loading", "false", *FSDP2[-2:]]
    stopped_at_2_and_resumed(each_reads, lambda out, *more: two_process_overrides(tiny_model_dir, out, *more), tmp_path)


def test_lora_with_gradient_checkpointing_under_fsdp2_equals_it_under_ddp(tmp_path, tiny_model_dir):
    """The reference is the base model with the adapter switched off; only the adapter trains."""
    more = ("train.steps=2", "model.lora.enabled=true", "model.lora.r=4", "model.gradient_checkpointing=true",
            "algorithm.ref_refresh_steps=0")
    ddp = launcher("--config_file", str(ROOT / "configs" / "accelerate" / "ddp.yaml"))
    run_ok(ddp, two_process_overrides(tiny_model_dir, tmp_path / "ddp", *more))
    run_ok(FSDP2, two_process_overrides(tiny_model_dir, tmp_path / "fsdp2", *more))
    same_lora_runs(tmp_path / "ddp", tmp_path / "fsdp2")


def _shards(rank: int, model_dir: str, folder: Path) -> None:
    """One of two gloo processes: the model loaded by each process and sharded, then loaded by the
    main process alone (the other built on the meta device) and sharded with its shards sent from the
    main one; each way's local shards, buffers and whether the output layer stayed tied, saved."""
    from vlmrl.models import load_policy
    from vlmrl.models.support import hf_model
    from vlmrl.training.sharding import shard

    torch.distributed.init_process_group("gloo", init_method=f"file://{folder / 'store'}", rank=rank, world_size=2)
    seen = {}
    for way, place in (("each", "host"), ("from_main", "meta" if rank else "host")):
        model, _ = load_policy(model_dir, device="cpu", place=place)
        seen[f"{way}/meta"] = any(p.is_meta for p in model.parameters())
        shard(model, 2, torch.device("cpu"), weights_from_main=way == "from_main")
        seen[way] = {name: p.to_local().clone() for name, p in model.named_parameters()}
        seen[f"{way}/buffers"] = [b.clone() for b in model.buffers()]
        seen[f"{way}/tied"] = hf_model(model).lm_head.weight is hf_model(model).get_input_embeddings().weight
    torch.save(seen, folder / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def test_shards_sent_from_the_main_process_are_those_each_process_would_cut(tmp_path, tiny_model_dir):
    """fsdp_cpu_ram_efficient_loading: the main process alone reads the weights, the other builds
    the model on the meta device (no weights in memory); once sharded, each process holds exactly the
    shards and buffers it would have cut from a model of its own, the output layer still tied."""
    # forked, not spawned: the children start with this process's torch and transformers imported (a
    # spawned child imports them again: about 6 s of CPU each)
    torch.multiprocessing.start_processes(_shards, args=(tiny_model_dir, tmp_path), nprocs=2, start_method="fork")
    for rank in (0, 1):
        seen = torch.load(tmp_path / f"rank{rank}.pt")
        assert seen["from_main/meta"] == (rank == 1) and not seen["each/meta"]
        assert seen["each"].keys() == seen["from_main"].keys()
        for name, shard in seen["each"].items():
            assert torch.equal(seen["from_main"][name], shard), name
        assert all(torch.equal(a, b) for a, b in zip(seen["each/buffers"], seen["from_main/buffers"], strict=True))
        assert seen["each/tied"] and seen["from_main/tied"]


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of one process (FSDP2 shards over it: each unit held whole)."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize(("share_prompt_cache", "whole"), [(True, True), (False, True), (False, False)])
def test_a_sharded_model_generates_what_the_whole_one_does_gathered(tiny_model_dir, one_process_group,
                                                                   share_prompt_cache, whole):
    """Without `gathered`, the plain path fails (generate calls the vision tower outside the root's
    forward: a DTensor meets a Tensor). Gathered whole: the same tokens, no all-gather during the
    call; by layers (the root and the first block of each kind held): the same tokens, the other
    blocks gathered at each forward. After it every parameter is a shard again and each unit
    reshards as before."""
    from torch.distributed.tensor import DTensor

    from vlmrl.config import GenerationSettings
    from vlmrl.models import load_policy
    from vlmrl.rollout.generation import generate_groups
    from vlmrl.tasks import Example
    from vlmrl.training.sharding import _reshards_after_forward, gathered, shard
    from PIL import Image

    examples = [Example(Image.new("RGB", (56, 84), (200, 10, 10)), "Count.", "1"),
                Example(Image.new("RGB", (112, 112), (20, 100, 10)), "How many circles are there?", "2")]
    settings = GenerationSettings(group_size=2, max_new_tokens=8, temperature=1.0,
                                  share_prompt_cache=share_prompt_cache)
    model, processor = load_policy(tiny_model_dir, device="cpu")
    whole = generate_groups(model, processor, examples, settings, seed=3)
    assert shard(model, 1, torch.device("cpu")) == 1 + 2 + 2  # two decoder layers, two vision blocks, the root
    gathers = []
    real = torch.distributed.all_gather_into_tensor
    torch.distributed.all_gather_into_tensor = lambda *args, **kwargs: gathers.append(1) or real(*args, **kwargs)
    try:
        with gathered(model, whole):
            before = len(gathers)
            sharded = generate_groups(model, processor, examples, settings, seed=3)
            during = len(gathers) - before
    finally:
        torch.distributed.all_gather_into_tensor = real
    assert torch.equal(sharded.completion_ids, whole.completion_ids) and sharded.texts == whole.texts
    assert during == 0 if whole else during > 0
    assert all(isinstance(p, DTensor) for p in model.parameters())
    units = [m for m in model.modules() if hasattr(m, "reshard")]
    flags = [_reshards_after_forward(m) for m in units]  # torch 2.13 keeps a list of groups, 2.11 one
    assert flags == [False] + [True] * (len(units) - 1)  # the root (first) keeps the output layer through backward
    if not share_prompt_cache:
        with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
            generate_groups(model, processor, examples, settings, seed=3)


def test_the_numeric_guard_skips_a_nan_update_of_a_sharded_model(tiny_model_dir, one_process_group):
    """Gradients as DTensors: the norm is read whole, a NaN one skips the update (the shards keep
    their values), a finite one steps."""
    from accelerate import Accelerator

    from vlmrl.models import load_policy
    from vlmrl.safety.faults import NumericGuard, OptimizerUpdate
    from vlmrl.training.sharding import shard

    model, _ = load_policy(tiny_model_dir, device="cpu")
    shard(model, 1, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    guard, accelerator = NumericGuard(max_in_a_row=3, max_grad_norm=1.0), Accelerator(cpu=True)
    ids = torch.tensor([[5, 6, 7, 8]])
    before = {name: p.detach().full_tensor().clone() for name, p in model.named_parameters()}

    def update(scale: float) -> float:
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().pow(2).mean() * scale
        loss.backward()
        return guard.step(OptimizerUpdate(accelerator, model, optimizer), scheduler, float(loss.detach()))

    assert math.isnan(update(float("nan"))) and guard.skipped == 1
    assert all(torch.equal(p.detach().full_tensor(), before[name]) for name, p in model.named_parameters())
    assert update(1.0) > 0 and guard.skipped == 1 and guard.in_a_row == 0
    assert any(not torch.equal(p.detach().full_tensor(), before[name]) for name, p in model.named_parameters())


def test_an_optimizer_state_keyed_by_position_goes_back_into_a_sharded_model(tiny_model_dir, one_process_group):
    """One process (or DDP) saves AdamW's state keyed by position, FSDP2 restores one keyed by name:
    the session converts it with the optimizer's layout (`name_keyed`), read before sharding, and every
    moment lands on its own parameter (before, FSDP2's loader failed on it with a KeyError)."""
    from vlmrl.config import TrainConfig
    from vlmrl.models import load_policy
    from vlmrl.safety.checkpoint import name_keyed, optimizer_problem
    from vlmrl.training.optim import build_optimizer, optimizer_layout
    from vlmrl.training.sharding import FullStateOptimizer, full_state, shard

    whole, _ = load_policy(tiny_model_dir, device="cpu")
    optimizer = build_optimizer(whole, TrainConfig(lr=1e-2))
    sum(p.pow(2).sum() for p in whole.parameters()).backward()  # every parameter gets a gradient, so a state
    optimizer.step()
    saved = optimizer.state_dict()
    assert all(isinstance(key, int) for key in saved["state"])
    sharded, _ = load_policy(tiny_model_dir, device="cpu")
    layout = optimizer_layout(sharded)
    assert optimizer_problem(saved, layout) is None
    shard(sharded, 1, torch.device("cpu"))
    restored = build_optimizer(sharded, TrainConfig(lr=1e-2))
    FullStateOptimizer(sharded, restored).load_state_dict(name_keyed(saved, layout))
    _, moments = full_state(sharded, restored)
    names = [name for group in layout for name, _ in group]
    params = [param for group in optimizer.param_groups for param in group["params"]]
    assert len(names) == len(params) == len(moments["state"])
    for name, param in zip(names, params):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(moments["state"][name][key], optimizer.state[param][key]), (name, key)


@pytest.mark.slow  # a one-process run and two two-process launches: about 60 s on 2 cores
def test_a_one_process_checkpoint_resumes_under_fsdp2(tmp_path, tiny_model_dir):
    """Its checkpoint's optimizer state is keyed by position; the FSDP2 run converts it and goes on
    as a two-process run that had made the first step itself would (the same update, up to float noise)."""
    run_ok(CLI, two_process_overrides(tiny_model_dir, tmp_path / "one", "train.steps=1", "train.save_every=1"))
    run_ok(FSDP2, two_process_overrides(tiny_model_dir, tmp_path / "one", "train.steps=2", "resume=true"))
    run_ok(FSDP2, two_process_overrides(tiny_model_dir, tmp_path / "two", "train.steps=2"))
    resumed, straight = read_metrics(tmp_path / "one" / "metrics.jsonl"), read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert [row["step"] for row in resumed] == [1, 2]
    for key in ("loss", "kl", "grad_norm"):
        assert resumed[1][key] == pytest.approx(straight[1][key], rel=1e-5, abs=3e-8), key


def test_distillation_under_two_fsdp2_processes_makes_the_same_steps_as_one(tmp_path, tiny_model_dir):
    """issue 44: the teacher is sharded as the reference is (training/teacher.py); its log-probs and
    the per-token distillation advantages are those of one process: the teacher KL and the update's
    statistics per step, and the weights after 2 steps (launching's tolerances, with their causes).
    The same launch holds every claim of FSDP2 = one process (test_two_fsdp2_processes_make_the_same_steps_as_one,
    slow: the run without a teacher): the preflight line, the reference refreshed after each step,
    evaluation, a checkpoint after each step with its reference, weights plain transformers loads."""
    from vlmrl.models import build_tiny_model

    teacher = str(build_tiny_model(tmp_path / "teacher", size="tiny", seed=1))  # same tokenizer, other weights
    more = ("train.steps=2", "train.save_every=1", f"algorithm.teacher={teacher}", "algorithm.distill_weight=1.0",
            "eval.every=2", "eval.n=4")
    run_here(two_process_overrides(tiny_model_dir, tmp_path / "one", *more))
    stdout = run_ok(FSDP2, two_process_overrides(tiny_model_dir, tmp_path / "two", *more))
    one, two = _same_fsdp2_steps(tiny_model_dir, tmp_path, stdout, first_step=1)
    start_one, start_two = (read_metrics(tmp_path / run / "metrics.jsonl")[0] for run in ("one", "two"))
    assert start_one == start_two and start_one["step"] == 0  # the teacher's held-out scores, gathered from its shards
    assert {"eval/test/teacher/accuracy", "eval/test/teacher/completion_tokens"} <= set(start_one)
    for a, b in zip(one, two):
        assert a["distill/teacher_kl"] != 0
        assert_same_statistics(a, b, ("distill/teacher_kl", "advantage/mean", "advantage/abs_mean", "advantage/std",
                                      "advantage/min", "advantage/max"))
