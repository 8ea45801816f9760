"""The policy update of one RL step: from scored experience to `updates_per_batch` optimizer steps.

Four parts, each readable alone:
- `loss_batch`: what the loss reads, on the device: completions, advantages, the loss mask (DAPO
  overlong filtering drops truncated rows), the micro-batches, and each micro-batch's share of the
  global loss weight (tokens under token aggregation, else rows), over all processes;
- `fixed_logprobs`: the reference's log-probs (beta > 0), the teacher's (algorithm.teacher:
  on-policy distillation) and the old policy's (updates_per_batch > 1), computed once before the
  updates, without gradients; with a teacher, each micro-batch's advantages become per-token ones
  (grpo.distill_advantages, from the log-probs before the updates) and the mean reverse KL to the
  teacher on the sampled tokens is logged as `distill/teacher_kl`, and the `advantage/*` statistics
  are those per-token advantages', over the loss's tokens (`advantage/task/*`: the task's part);
- `accumulate_gradients`: forward and backward of every micro-batch, gradients synchronised across
  processes on the last one only; the loss of each is weighted by its share, so the gradient is
  the one of a single process on the global batch;
- `update_policy`: the above, then an optimizer step through the session's numeric guard, as
  many times as configured; returns the statistics, averaged over processes with the loss's own
  weights and over the updates.

With one update per batch the old log-probs are the current ones, detached (ratio = 1, the
gradient is the policy gradient).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from vlmrl import grpo
from vlmrl.config import Config
from vlmrl.rollout.completions import Completions
from vlmrl.training.experience import Experience
from vlmrl.training.logprobs import LogprobScorer

LOSS_STATISTICS = ("loss", "pg_loss", "kl", "clip_fraction", "clip_low_fraction", "clip_high_fraction",
                   "ratio_mean", "mismatch_kl", "tis_weight_mean", "tis_capped_fraction", "off_policy_masked_fraction")


def loss_settings(config: Config) -> grpo.LossSettings:
    """The knobs of grpo.policy_loss, from the run's algorithm section."""
    algo = config.algorithm
    return grpo.LossSettings(
        eps_low=algo.eps_low, eps_high=algo.eps_high, ratio_level=algo.ratio_level,
        aggregation=algo.aggregation, max_len=config.rollout.max_new_tokens, beta=algo.beta,
        kl_kind=algo.kl_estimator, dual_clip=algo.dual_clip or None, tis_cap=algo.tis_cap or None,
        tis_floor=algo.tis_floor or None, tis_mode=algo.tis_mode, off_policy_mask=algo.off_policy_mask or None,
        surrogate=algo.surrogate, sapo_tau=(algo.sapo_tau_pos, algo.sapo_tau_neg))


@dataclass
class LossBatch:
    """One process's experience as the loss reads it, on the device."""

    completions: Completions  # N rows, ids and mask (N, T)
    advantages: torch.Tensor  # (N,)
    mask: torch.Tensor  # (N, T) the tokens that count in the loss (truncated rows dropped when asked)
    micro: list[list[int]]  # the rows of each micro-batch
    shares: list[torch.Tensor]  # () each micro-batch's share of the loss weight of all processes' batch
    reference: torch.Tensor | None = None  # (N, T) reference log-probs, when beta > 0
    old: torch.Tensor | None = None  # (N, T) log-probs before the updates, when updates_per_batch > 1
    sampler: torch.Tensor | None = None  # (N, T) the sampler's log-probs, when it recorded them
    teacher: torch.Tensor | None = None  # (N, T) the teacher's log-probs, with algorithm.teacher
    distill: grpo.DistillSettings = grpo.DistillSettings()  # algorithm.distill_weight and distill_reward

    def loss_inputs(self, rows: list[int], logp: torch.Tensor) -> grpo.LossInputs:
        """The constants of the loss for micro-batch `rows`, whose current log-probs are `logp`."""
        old = self.old[rows] if self.old is not None else logp.detach()  # (n, T) before the updates
        reference = self.reference[rows] if self.reference is not None else None  # (n, T)
        sampler = self.sampler[rows] if self.sampler is not None else None  # (n, T)
        advantages = self.advantages[rows]  # (n,)
        if self.teacher is not None:  # on-policy distillation: one advantage per token
            advantages = grpo.distill_advantages(advantages, old, self.teacher[rows], self.mask[rows],
                                                 self.distill)  # (n, T)
        return grpo.LossInputs(old, advantages, self.mask[rows], reference, sampler)


def loss_batch(session, experience: Experience) -> LossBatch:
    """The experience on the device, split into micro-batches weighted for the loss."""
    config, device = session.config, session.accelerator.device
    rollout = experience.rollout
    completions = rollout.to(device)  # a Rollout (or ToolRollout: its trajectories come along)
    mask = completions.completion_mask  # (N, T)
    keep = ~rollout.truncated.to(device) if config.algorithm.mask_truncated else torch.ones_like(mask[:, 0]).bool()
    counted = mask * keep.unsqueeze(-1)  # (N, T)
    n, size = len(rollout.rows), config.train.micro_batch_size
    micro = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    weights = counted.sum(-1).float() if config.algorithm.aggregation == "token" else torch.ones(n, device=device)
    total = session.accelerator.reduce(weights.sum(), "sum").clamp(min=1.0)  # over all processes
    shares = [weights[rows].sum() / total for rows in micro]  # () each
    sampler = None if rollout.sampler_logp is None else rollout.sampler_logp.to(device)  # (N, T)
    algo = config.algorithm
    return LossBatch(completions, experience.advantages.to(device), counted, micro, shares, sampler=sampler,
                     distill=grpo.DistillSettings(algo.distill_weight, algo.distill_reward))


def fixed_logprobs(session, scorer: LogprobScorer, batch: LossBatch) -> None:
    """Fill in the reference, teacher and old log-probs of `batch` (no gradient), when the run needs them."""
    parts = [batch.completions.select(rows) for rows in batch.micro]
    if session.reference is not None:
        batch.reference = torch.cat([session.reference.logprobs(session.policy, scorer, part)
                                     for part in parts])  # (N, T)
    if getattr(session, "teacher", None) is not None:
        batch.teacher = torch.cat([session.teacher.logprobs(scorer, part) for part in parts])  # (N, T)
    if session.config.algorithm.updates_per_batch > 1:
        with torch.no_grad():
            batch.old = torch.cat([scorer(session.policy, part)[0] for part in parts])  # (N, T)


def accumulate_gradients(session, scorer: LogprobScorer, batch: LossBatch) -> dict[str, float]:
    """Backward of every micro-batch's weighted loss; returns this process's share-weighted sums
    of the loss statistics and the entropy."""
    accelerator, settings = session.accelerator, loss_settings(session.config)
    top_entropy = session.config.algorithm.top_entropy_share
    weighted = []  # (S,) per micro-batch: its statistics times its share, kept on the device
    distilled = []  # (2,) per micro-batch with a teacher: summed reverse KL to it, tokens
    summaries = []  # (6,) per micro-batch with a teacher: its per-token advantages (grpo.token_summary)
    for i, (rows, share) in enumerate(zip(batch.micro, batch.shares)):
        last = i == len(batch.micro) - 1
        with contextlib.nullcontext() if last else accelerator.no_sync(session.model):
            part = batch.completions.select(rows)
            logp, entropy = scorer(session.model, part, with_entropy=True)  # (n, T) each
            inputs = batch.loss_inputs(rows, logp)
            if top_entropy < 1:  # only the highest-entropy tokens of the micro-batch count ("80/20")
                inputs = inputs._replace(trained_mask=grpo.high_entropy_mask(entropy, inputs.mask, top_entropy))
            out = grpo.policy_loss(logp, inputs, settings)
            if batch.teacher is not None:
                kl = (inputs.old_logp - batch.teacher[rows]) * inputs.mask  # (n, T)
                distilled.append(torch.stack([kl.sum(), inputs.mask.sum()]).float())
                summaries.append(grpo.token_summary(inputs.advantages, inputs.mask))
            session.backward(out.loss * (share * accelerator.num_processes), last)  # DDP averages gradients
        entropy_mean = entropy.detach().sum() / part.completion_mask.sum().clamp(min=1)  # ()
        statistics = [getattr(out, name).detach().float() for name in LOSS_STATISTICS] + [entropy_mean.float()]
        weighted.append(torch.stack(statistics) * share)  # (S,)
    sums = torch.stack(weighted).sum(0).tolist()  # one device-to-host copy per update, not one per value
    statistics = dict(zip(LOSS_STATISTICS + ("entropy",), sums))
    if distilled:  # summed over this process's micro-batches; update_policy divides over all processes
        statistics["teacher_kl_sum"], statistics["teacher_tokens"] = torch.stack(distilled).sum(0).tolist()
        statistics["advantages"] = grpo.merge_summaries(torch.stack(summaries))  # (6,) on the device
    return statistics


def update_policy(session, scorer: LogprobScorer, experience: Experience) -> dict[str, float]:
    """`updates_per_batch` optimizer steps on one batch of experience; returns the loss statistics
    (means over all processes and updates) and grad_norm. An update whose loss or gradient is not
    finite is skipped (session.guard, faults.py). `session`: a TrainingSession."""
    updates = session.config.algorithm.updates_per_batch
    batch = loss_batch(session, experience)
    fixed_logprobs(session, scorer, batch)
    totals = dict.fromkeys(LOSS_STATISTICS + ("entropy", "grad_norm"), 0.0)
    advantages = None  # (6,) with a teacher: the per-token advantages (the same in every update)
    for _ in range(updates):
        sums = accumulate_gradients(session, scorer, batch)
        advantages = sums.pop("advantages", advantages)
        sums["grad_norm"] = session.guard.step(session.update, session.scheduler, sums["loss"])  # before clipping
        for name, value in sums.items():
            totals[name] = totals.get(name, 0.0) + value / updates
    names = LOSS_STATISTICS + ("entropy",) + (("teacher_kl_sum", "teacher_tokens") if batch.teacher is not None else ())
    everyone = session.accelerator.reduce(
        torch.tensor([totals[name] for name in names], device=session.accelerator.device), "sum")
    totals |= {name: float(value) for name, value in zip(names, everyone)}
    if batch.teacher is not None:  # the mean over every process's tokens (the same in each update)
        kl_sum, tokens = totals.pop("teacher_kl_sum"), totals.pop("teacher_tokens")
        totals["distill/teacher_kl"] = kl_sum / max(tokens, 1.0)
        everyone = session.accelerator.gather(advantages.unsqueeze(0))  # (processes, 6)
        totals |= {f"advantage/{name}": value
                   for name, value in grpo.summary_statistics(grpo.merge_summaries(everyone)).items()}
    return totals
