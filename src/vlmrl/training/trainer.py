"""The GRPO training loop, readable top to bottom.

One step: draw prompts, sample G completions each, score them with the task, turn rewards into
group advantages (experience.py), then take `updates_per_batch` optimizer steps on the clipped
surrogate, plus the KL to the reference when beta > 0 (policy_update.py). GRPO, DAPO, Dr. GRPO
and GSPO differ only in settings of `config.algorithm` (see configs/ and docs/algorithms.md).

Simplifications, on purpose:
- Generation uses Hugging Face `generate` on the policy itself (no inference server).
- Several processes (`accelerate launch`) each take whole groups; the loss of every micro-batch is
  weighted by its share of the global batch, so gradients equal a single process's on the same
  global batch.
"""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from tqdm import tqdm

from vlmrl import grpo
from vlmrl.config import Config
from vlmrl.evaluation.attention import completion_image_attention
from vlmrl.models.fast_paths import FAST_PATHS, fallbacks
from vlmrl.report.rollout_log import rollout_rows, write_rollouts
from vlmrl.rollout.tool_rollout import cache_statistics, trajectory_statistics
from vlmrl.safety.alarms import Alarms
from vlmrl.safety.early_checks import check_before_loading
from vlmrl.safety.preflight import run_preflight
from vlmrl.seeds import derive_seed
from vlmrl.tasks import Task
from vlmrl.training.ahead import step_rollouts, run_generator, split_launch
from vlmrl.training.experience import Experience
from vlmrl.training.logprobs import LogprobScorer
from vlmrl.training.policy_update import update_policy
from vlmrl.training.session import StepClock, TrainingSession, epoch_metric


def train(config: Config, task: Task | None = None) -> Path:
    """Run GRPO as configured (on `task` when given: a Task built in Python, else the config's);
    returns the run directory (final model in `final/`)."""
    link = split_launch(config, os.environ)  # rollout.generators: this process's role, before WORLD_SIZE is read
    task = check_before_loading(config, "train", task)  # layout, task, tools, trackers, model path: before loading
    if link is not None and link.generates:  # the launch's generator: rollouts for the trainers, no run folder
        run_generator(config, task, link)
        return Path(config.output_dir)
    with TrainingSession(config, config.train.steps * config.algorithm.updates_per_batch,
                         with_reference=True, task=task) as session:  # an error gives the handlers and the folder back
        config.rollout.check_layout(session.world)
        run_preflight(session, task, "train")  # first batches, prompt lengths, memory: fail before step 1
        session.make_held_out(task)  # every held-out example made and encoded once: a bad one shows now
        if teacher_accuracy := session.evaluate_teacher(task):  # distillation: the teacher's, as step 0
            session.record(teacher_accuracy)
        scorer = LogprobScorer(session.processor, config.rollout.temperature, config.train.pack_groups,
                               config.train.logprob_chunk, config.train.block_attention)
        rollouts = step_rollouts(session, task, link)  # synchronous, one step ahead, or from the generator
        session.closers.append(rollouts.close)  # the prefetching worker stops with the run, however it ends
        alarms = Alarms(session.run_dir / "alarms.jsonl", resume_step=session.start_step if config.resume else None)
        cursor = session.cursor  # index of the next train prompt

        progress = tqdm(range(session.start_step, config.train.steps), initial=session.start_step,
                        total=config.train.steps, desc="train", unit="step", disable=not session.main,
                        dynamic_ncols=True)
        for step in progress:
            clock = StepClock()
            session.policy.eval()
            experience, next_cursor, lag = rollouts.take(step, cursor)
            session.stop_at_bad_row(rollouts.rows.stop, step, cursor)  # on_bad_row=error: checkpoint, one line
            session.stop_at_reward_failure(rollouts.reward_failure, step, cursor)  # checkpoint, one line
            session.stop_at_broken_logits(step, cursor)  # NaN/inf logits: the cause in one line
            cursor = next_cursor
            session.policy.train()
            torch.manual_seed(derive_seed(config.seed, step, "update"))  # dropout, identical on resume
            update_started = time.perf_counter()
            update = update_policy(session, scorer, experience)
            update["time/train"] = time.perf_counter() - update_started
            session.carried = rollouts.after_update(step)  # the rollouts made ahead: into this step's checkpoint
            refreshed = session.reference is not None and session.reference.maybe_refresh(session.policy, step + 1)
            metrics = step_metrics(experience, session.accelerator, config.rollout.group_size,
                                   distilling=session.teacher is not None) | update
            metrics |= epoch_metric(task, cursor)
            metrics |= rollouts.metrics(lag)  # one step ahead: rollout/lag_steps (and time/rollout_wait)
            metrics |= {"step": step + 1, "prompts_seen": cursor, "lr": session.scheduler.get_last_lr()[0],
                        "ref_refreshed": int(refreshed), "skipped_steps": session.guard.skipped} | clock.metrics()
            metrics["tokens_per_s"] = metrics["tokens"] / metrics["seconds"]
            metrics |= observe(session, step + 1, experience)
            metrics |= fallback_metrics(session)
            metrics |= session.take_save_seconds() | session.take_log_seconds()  # checkpoint's, logs' time on the path
            metrics |= session.maybe_evaluate(step + 1, task)
            session.record(metrics)
            if session.main:
                for alarm in alarms.check(metrics):
                    tqdm.write(f"alarm at step {alarm['step']}: {alarm['kind']}: {alarm['message']}")
            progress.set_postfix(reward=f"{metrics['reward']:.3f}", acc=f"{metrics['accuracy']:.2f}",
                                 loss=f"{metrics['loss']:.4f}")
            session.maybe_save(step + 1, cursor)
            session.check_stop(step + 1, cursor)  # a stop signal, or too many NaN updates: checkpoint, stop
        return session.finish()


def observe(session: TrainingSession, steps_done: int, experience: Experience) -> dict[str, float]:
    """What the run looks at every so often: the rollouts written to rollouts/
    (train.log_rollouts_every) and the share of attention on the image (train.attention_every)."""
    train_settings = session.config.train
    if train_settings.log_rollouts_every and steps_done % train_settings.log_rollouts_every == 0:
        log_rollouts(session, steps_done, experience)
    if train_settings.attention_every and steps_done % train_settings.attention_every == 0:
        return {"attention_on_image": completion_image_attention(session.policy, session.processor,
                                                                 experience.rollout)}
    return {}


def fallback_metrics(session: TrainingSession) -> dict[str, int]:
    """`fallback/<path>` = 1 for each fast path that failed on its first use on any process, with the
    policy, the reference copy or the teacher, and took the plain path since (fast_paths.py)."""
    models = [session.policy] + [m for m in (getattr(session.reference, "copy", None),
                                             getattr(session.teacher, "model", None)) if m is not None]
    fell = {path for model in models for path in fallbacks(model)}
    flags = torch.tensor([float(path in fell) for path in FAST_PATHS], device=session.accelerator.device)
    flags = session.accelerator.reduce(flags, "sum")  # (paths,) processes that fell back
    return {f"fallback/{path}": 1 for path, count in zip(FAST_PATHS, flags.tolist()) if count > 0}


def log_rollouts(session: TrainingSession, step: int, experience: Experience) -> None:
    """Every process's completions of this step into rollouts/ (see rollout_log.py), written by the
    session's log writer (on its thread with train.background_logs); the time on the step's path
    counts in time/log."""
    started = time.perf_counter()
    group = session.config.rollout.group_size
    rows = rollout_rows(step, experience, group, first_group=session.rank * len(experience.rollout.rows) // group)
    rows = gather_object(rows)
    if session.main:  # W&B's table (report/tracking.py) on this thread, before the writer reads the images too
        session.log.log_rollouts(step, rows)
        session.logs.put(partial(write_rollouts, session.run_dir, step, rows))
    session.log_seconds += time.perf_counter() - started


def step_metrics(experience: Experience, accelerator: Accelerator, group_size: int,
                 distilling: bool = False) -> dict[str, float]:
    """Means over all processes of every reward component, lengths and sampling counts, and the
    statistics of the task's group advantages: `advantage/*`, or `advantage/task/*` when
    `distilling` (the update's per-token advantages are then `advantage/*`: policy_update.py);
    and what each reward part does to them (`reward_signal`)."""
    def mean(x: torch.Tensor) -> float:
        return float(accelerator.gather(x.float().to(accelerator.device)).nanmean())

    rollout = experience.rollout
    metrics = {"reward": mean(experience.reward),
               "reward_std": float(accelerator.gather(experience.reward.to(accelerator.device)).std())}
    for name, values in experience.rewards.items():  # NaN: the reward did not apply to that completion
        everyone = accelerator.gather(values.float().to(accelerator.device))  # (N * processes,)
        applied = everyone[~everyone.isnan()]
        metrics["accuracy" if name == "accuracy" else f"reward/{name}"] = float(applied.mean())
        if name != "accuracy":
            metrics[f"reward_std/{name}"] = float(applied.std())
        if len(applied) < len(everyone):
            metrics[f"reward/{name}/not_applicable"] = 1.0 - len(applied) / len(everyone)
    metrics.setdefault("accuracy", float("nan"))
    metrics["completion_length"] = mean(rollout.lengths)
    metrics["completion_length_max"] = float(accelerator.gather(rollout.lengths.to(accelerator.device)).max())
    metrics["truncated"] = mean(rollout.truncated)
    advantages = accelerator.gather(experience.advantages.to(accelerator.device))  # (N * processes,)
    prefix = "advantage/task/" if distilling else "advantage/"
    metrics |= {f"{prefix}abs_mean": float(advantages.abs().mean()), f"{prefix}std": float(advantages.std()),
                f"{prefix}min": float(advantages.min()), f"{prefix}max": float(advantages.max())}
    counts = accelerator.reduce(torch.tensor([experience.groups_drawn, experience.groups_with_signal,
                                              experience.bad_rows_skipped], device=accelerator.device), "sum")
    metrics["groups_drawn"], metrics["groups_with_signal"] = int(counts[0]), int(counts[1])
    if int(counts[2]):  # on_bad_row=skip: bad train examples replaced this step (bad_rows.py)
        metrics["bad_rows_skipped"] = int(counts[2])
    metrics["zero_variance_groups"] = 1.0 - metrics["groups_with_signal"] / max(metrics["groups_drawn"], 1)
    metrics["time/data"] = experience.seconds["data"]  # left on the step's path (prefetch.py)
    metrics["time/data_ahead"] = experience.seconds["data_ahead"]  # the worker's, hidden behind the model
    metrics["time/generate"] = experience.seconds["generate"]
    metrics["time/score"] = experience.seconds["score"]  # left on the step's path (background_scoring.py)
    metrics["time/score_ahead"] = experience.seconds["score_ahead"]  # background scoring, hidden behind generation
    metrics["tokens"] = float(accelerator.reduce(rollout.lengths.sum().to(accelerator.device), "sum"))
    if getattr(rollout, "trajectories", None) is not None:  # multi-turn rollouts with tools
        metrics |= {f"tools/{name}": mean(values) for name, values in trajectory_statistics(rollout).items()}
        cached = cache_statistics(summed_counts(experience, accelerator))  # tools/<name>/calls, .../cache_hit_rate
        metrics |= {f"tools/{name}": value for name, value in cached.items()}
    return metrics | reward_signal(experience, accelerator, group_size)


def summed_counts(experience: Experience, accelerator: Accelerator) -> dict[str, tuple[int, int]]:
    """Each cached tool's (calls, computed) of this step, summed over all processes (each has its own caches;
    every process has the same tools)."""
    names = sorted(experience.tool_cache)
    if not names:
        return {}
    counts = torch.tensor([experience.tool_cache[name] for name in names], device=accelerator.device)  # (K, 2)
    counts = accelerator.reduce(counts, "sum")  # (K, 2)
    return {name: (int(calls), int(computed)) for name, (calls, computed) in zip(names, counts.tolist())}


def reward_signal(experience: Experience, accelerator: Accelerator, group_size: int) -> dict[str, float]:
    """What each reward part does to the learning signal, over all processes (the report's "why is
    RL not improving" panel reads them): `advantage_corr/<part>`, the mean over the groups with
    signal of the within-group correlation of the task's advantages with that part
    (grpo.advantage_alignment; absent when no group has signal), and `paid_when_wrong/<part>`, the
    share of all completions whose answer is wrong (accuracy < 0.5) and that the part still pays
    (> 0), for every part but the accuracy."""
    names = [name for name in experience.rewards if name != "total"]
    if not names:
        return {}
    device = accelerator.device
    stacked = torch.stack([experience.rewards[name].float() for name in names])  # (K, N)
    sums = grpo.advantage_alignment(stacked, experience.advantages, group_size)  # (K, 2)
    accuracy = experience.rewards.get("accuracy")
    wrong = (accuracy < 0.5) if accuracy is not None else torch.zeros(stacked.shape[1], dtype=torch.bool)  # (N,)
    paid = (stacked > 0) & wrong  # (K, N) NaN (not applicable) is not paid
    counts = torch.cat([paid.sum(1).float(), torch.tensor([float(stacked.shape[1])])])  # (K + 1,)
    sums = accelerator.reduce(sums.to(device), "sum").cpu()  # (K, 2)
    counts = accelerator.reduce(counts.to(device), "sum").cpu()  # (K + 1,)
    metrics = {}
    for k, name in enumerate(names):
        correlations, groups = sums[k].tolist()
        if groups > 0:
            metrics[f"advantage_corr/{name}"] = correlations / groups
        if accuracy is not None and name != "accuracy":
            metrics[f"paid_when_wrong/{name}"] = float(counts[k] / counts[-1].clamp(min=1))
    return metrics
