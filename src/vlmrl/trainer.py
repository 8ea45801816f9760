"""The GRPO training loop, readable top to bottom.

One step: draw prompts, sample G completions each, score them with the task, turn rewards into
group advantages, then take `updates_per_batch` optimizer steps on the clipped surrogate (plus
the KL to the reference when beta > 0). GRPO, DAPO, Dr. GRPO and GSPO differ only in settings of
`config.algorithm` (see configs/ and docs/algorithms.md).

Simplifications, on purpose:
- Generation uses Hugging Face `generate` on the policy itself (no inference server).
- With one update per batch, the "old" log-probs are the current ones, detached (ratio = 1, the
  gradient is the policy gradient); with more, they come from a no-grad pass before the updates.
- Several processes (`accelerate launch`) each take whole groups; the loss of every micro-batch is
  weighted by its share of the global batch, so gradients equal a single process's on the same
  global batch.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from tqdm import tqdm

from vlmrl import grpo
from vlmrl.alarms import Alarms
from vlmrl.config import Config
from vlmrl.errors import VlmrlError
from vlmrl.experience import Experience, collect_experience, derive_seed, generation_batch
from vlmrl.faults import NumericGuard
from vlmrl.logprobs import completion_logprobs
from vlmrl.preflight import run_preflight
from vlmrl.report.attention import completion_image_attention
from vlmrl.rollout_log import rollout_rows, write_rollouts
from vlmrl.session import TrainingSession
from vlmrl.tasks import get_task


def train(config: Config) -> Path:
    """Run GRPO as configured; returns the run directory (final model in `final/`)."""
    session = TrainingSession(config, config.train.steps * config.algorithm.updates_per_batch,
                              with_reference=True)
    check_batch_layout(config, session.world)
    policy, processor, reference = session.policy, session.processor, session.reference
    task = get_task(config.task.name, seed=config.seed, **config.task.params)
    run_preflight(session, task, "train")  # first batches, prompt lengths, memory: fail before step 1
    position = session.position
    alarms = Alarms(session.run_dir / "alarms.jsonl", resume_step=session.start_step if config.resume else None)

    progress = tqdm(range(session.start_step, config.train.steps), initial=session.start_step,
                    total=config.train.steps, desc="train", unit="step", disable=not session.main,
                    dynamic_ncols=True)
    for step in progress:
        started = time.perf_counter()
        policy.eval()
        experience, position = collect_experience(policy, processor, task, config, step, position, session.rank,
                                                  session.world, session.any_process, session.accelerator.gather)
        policy.train()
        torch.manual_seed(derive_seed(config.seed, step, "update"))  # dropout, identical on resume
        update_started = time.perf_counter()
        update = update_policy(session.model, policy, processor, session.optimizer, session.scheduler,
                               reference, experience, config, session.accelerator, session.guard)
        update["time/train"] = time.perf_counter() - update_started
        refreshed = reference is not None and reference.maybe_refresh(policy, step + 1)
        metrics = step_metrics(experience, session.accelerator) | update
        metrics |= {"step": step + 1, "prompts_seen": position, "lr": session.scheduler.get_last_lr()[0],
                    "ref_refreshed": int(refreshed), "skipped_steps": session.guard.skipped,
                    "seconds": time.perf_counter() - started}
        metrics["tokens_per_s"] = metrics["tokens"] / metrics["seconds"]
        if config.train.log_rollouts_every and (step + 1) % config.train.log_rollouts_every == 0:
            log_rollouts(session, step + 1, experience)
        if config.train.attention_every and (step + 1) % config.train.attention_every == 0:
            rollout = experience.rollout
            metrics["attention_on_image"] = completion_image_attention(
                policy, processor, rollout.rows, rollout.completion_ids, rollout.completion_mask)
        metrics |= session.maybe_evaluate(step + 1, task)
        session.record(metrics)
        if session.main:
            for alarm in alarms.check(metrics):
                tqdm.write(f"alarm at step {alarm['step']}: {alarm['kind']}: {alarm['message']}")
        progress.set_postfix(reward=f"{metrics['reward']:.3f}", acc=f"{metrics['accuracy']:.2f}",
                             loss=f"{metrics['loss']:.4f}")
        session.maybe_save(step + 1, position)
        session.check_stop(step + 1, position)  # a stop signal, or too many NaN updates: checkpoint, stop
    return session.finish()


def log_rollouts(session: TrainingSession, step: int, experience: Experience) -> None:
    """Every process's completions of this step into rollouts/ (see rollout_log.py)."""
    group = session.config.rollout.group_size
    rows = rollout_rows(step, experience.rollout, experience.rewards, experience.advantages, group,
                        first_group=session.rank * len(experience.rollout.rows) // group)
    rows = gather_object(rows)
    if session.main:
        write_rollouts(session.run_dir, step, rows)


def check_batch_layout(config: Config, world: int) -> None:
    """Prompts split evenly over processes, and each process's share over generate calls."""
    prompts = config.rollout.prompts_per_step
    if prompts % world:
        raise VlmrlError(f"rollout.prompts_per_step={prompts} must be divisible by the {world} processes")
    per_process = prompts // world
    if per_process % generation_batch(config, world):
        raise VlmrlError(f"rollout.generation_batch_size={config.rollout.generation_batch_size} must "
                         f"divide the {per_process} prompts each process handles per step")


def update_policy(model, policy, processor, optimizer, scheduler, reference, experience: Experience,
                  config: Config, accelerator: Accelerator, guard: NumericGuard) -> dict[str, float]:
    """`updates_per_batch` optimizer steps on one batch of experience; returns loss statistics.
    `guard` skips an update whose loss or gradient is not finite (faults.py)."""
    algo, temperature = config.algorithm, config.rollout.temperature
    rollout = experience.rollout
    device = accelerator.device
    ids, mask = rollout.completion_ids.to(device), rollout.completion_mask.to(device)  # (N, T)
    loss_mask = mask * (~rollout.truncated.to(device)).unsqueeze(-1) if algo.mask_truncated else mask  # (N, T)
    advantages = experience.advantages.to(device)  # (N,)
    micro = [list(range(i, min(i + config.train.micro_batch_size, len(ids))))
             for i in range(0, len(ids), config.train.micro_batch_size)]
    # Each micro-batch's loss is weighted by its share of the global normaliser (tokens or sequences).
    weights = loss_mask.sum(-1).float() if algo.aggregation == "token" else torch.ones(len(ids), device=device)
    total_weight = accelerator.reduce(weights.sum(), "sum").clamp(min=1.0)

    def logprobs_of(rows: list[int], net, with_entropy=False):  # each group's prompt once (shared_prefix.py)
        return completion_logprobs(net, processor, [rollout.rows[i] for i in rows], ids[rows], mask[rows],
                                   temperature, with_entropy, config.train.shared_prefix, config.train.logprob_chunk)

    ref_logp = old_logp = None
    if reference is not None:
        ref_logp = torch.cat([reference.logprobs(policy, processor, [rollout.rows[i] for i in rows], ids[rows],
                                                 mask[rows], temperature, config.train.shared_prefix,
                                                 config.train.logprob_chunk) for rows in micro])  # (N, T)
    if algo.updates_per_batch > 1:
        with torch.no_grad():
            old_logp = torch.cat([logprobs_of(rows, policy)[0] for rows in micro])  # (N, T)

    averaged = ("loss", "pg_loss", "kl", "clip_fraction", "clip_low_fraction", "clip_high_fraction")
    sums = dict.fromkeys(averaged + ("entropy", "grad_norm"), 0.0)
    for _ in range(algo.updates_per_batch):
        update_loss = 0.0
        for i, rows in enumerate(micro):
            sync = contextlib.nullcontext() if i == len(micro) - 1 else accelerator.no_sync(model)
            with sync:
                logp, entropy = logprobs_of(rows, model, with_entropy=True)  # (n, T) each
                out = grpo.policy_loss(
                    logp, old_logp[rows] if old_logp is not None else logp.detach(), advantages[rows],
                    loss_mask[rows], eps_low=algo.eps_low, eps_high=algo.eps_high,
                    ratio_level=algo.ratio_level, aggregation=algo.aggregation,
                    max_len=config.rollout.max_new_tokens,
                    ref_logp=ref_logp[rows] if ref_logp is not None else None, beta=algo.beta,
                    kl_kind=algo.kl_estimator)
                share = weights[rows].sum() / total_weight * accelerator.num_processes
                accelerator.backward(out.loss * share)
            fraction = float(weights[rows].sum() / weights.sum().clamp(min=1.0))
            for name in averaged:
                sums[name] += float(getattr(out, name).detach()) * fraction
            update_loss += float(out.loss.detach()) * fraction
            sums["entropy"] += float(entropy.sum() / mask[rows].sum().clamp(min=1)) * len(rows) / len(ids)
        sums["grad_norm"] += guard.step(accelerator, model, optimizer, scheduler, config.train.max_grad_norm,
                                        update_loss)  # norm before clipping; NaN/inf: update skipped
    return {k: v / algo.updates_per_batch for k, v in sums.items()}


def step_metrics(experience: Experience, accelerator: Accelerator) -> dict[str, float]:
    """Means over all processes of every reward component, lengths and sampling counts."""
    def mean(x: torch.Tensor) -> float:
        return float(accelerator.gather(x.float().to(accelerator.device)).mean())

    rollout = experience.rollout
    metrics = {"reward": mean(experience.reward),
               "reward_std": float(accelerator.gather(experience.reward.to(accelerator.device)).std())}
    for name, values in experience.rewards.items():
        metrics["accuracy" if name == "accuracy" else f"reward/{name}"] = mean(values)
        if name != "accuracy":
            metrics[f"reward_std/{name}"] = float(accelerator.gather(values.float().to(accelerator.device)).std())
    metrics.setdefault("accuracy", float("nan"))
    metrics["completion_length"] = mean(rollout.lengths)
    metrics["completion_length_max"] = float(accelerator.gather(rollout.lengths.to(accelerator.device)).max())
    metrics["truncated"] = mean(rollout.truncated)
    advantages = accelerator.gather(experience.advantages.to(accelerator.device))  # (N * processes,)
    metrics |= {"advantage/abs_mean": float(advantages.abs().mean()), "advantage/std": float(advantages.std()),
                "advantage/min": float(advantages.min()), "advantage/max": float(advantages.max())}
    counts = accelerator.reduce(torch.tensor([experience.groups_drawn, experience.groups_with_signal],
                                             device=accelerator.device), "sum")
    metrics["groups_drawn"], metrics["groups_with_signal"] = int(counts[0]), int(counts[1])
    metrics["zero_variance_groups"] = 1.0 - metrics["groups_with_signal"] / max(metrics["groups_drawn"], 1)
    metrics["time/generate"] = experience.generate_seconds
    metrics["time/score"] = experience.score_seconds
    metrics["tokens"] = float(accelerator.reduce(rollout.lengths.sum().to(accelerator.device), "sum"))
    return metrics
