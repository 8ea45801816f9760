"""Every reward component of every completion, and the one reward the advantages come from.

Used by the RL step (experience.py) and by evaluation alike. The rewards are the run's `rewards`
list (rewards/reward.py; none: the task's own `score`, the reward named `task`), called TRL's way once
per batch and checked (rewards/score.py): a reward that raises, gives a value that is not finite or
the wrong number of values, or a completion no reward applies to, stops the run with the reward,
the prompt and the completion in the message; it is never silently turned into 0. The components
become (N,) tensors (NaN where a reward gave None) and "total" is their weighted combination,
`algorithm.reward_aggregation` (grpo.combine_rewards): the sum, or GDPO's normalize_then_sum.
"accuracy" is the reward measuring correctness (rewards/reward.py `accuracy_source`): one logged as
`accuracy`, else the first built-in verifier of the list (math, number, choice, exact), copied.
"""

from __future__ import annotations

import torch

from vlmrl import grpo
from vlmrl.rewards.reward import Reward, accuracy_source
from vlmrl.rewards.score import score_batch
from vlmrl.rollout.generation import Rollout


def score_completions(rewards: list[Reward], rollout: Rollout, aggregation: str = "sum",
                      group_size: int | None = None) -> dict[str, torch.Tensor]:
    """Every reward component of every completion and their "total", as (N,) tensors; the groups of
    `group_size` contiguous rows (for normalize_then_sum) default to the whole batch."""
    components = score_batch(rewards, *scored_inputs(rollout))
    return score_tensors(rewards, components, aggregation, group_size or len(rollout.texts))


def scored_inputs(rollout: Rollout) -> tuple[list, list[str], list | None, list[list[int]] | None]:
    """What the rewards are called on: (examples, texts, trajectories, completion token ids) per completion."""
    ids = None
    if getattr(rollout, "completion_ids", None) is not None:  # (N, T) right-padded; the model's tokens only
        ids = [row[mask.bool()].tolist() for row, mask in zip(rollout.completion_ids, rollout.completion_mask)]
    return rollout.rows, rollout.texts, getattr(rollout, "trajectories", None), ids


def score_tensors(rewards: list[Reward], components: dict[str, list[float]], aggregation: str,
                  group_size: int) -> dict[str, torch.Tensor]:
    """score_batch's components as (N,) tensors, with their "total" (groups of `group_size` rows) and "accuracy"."""
    scores = {name: torch.tensor(values, dtype=torch.float32) for name, values in components.items()}
    stacked = torch.stack([scores[reward.name] for reward in rewards])  # (K, N)
    weights = torch.tensor([reward.weight for reward in rewards])  # (K,)
    scores["total"] = grpo.combine_rewards(stacked, weights, group_size, aggregation=aggregation)  # (N,)
    if len(rewards) == 1 and rewards[0].of_task:
        del scores[rewards[0].name]  # the task alone: its own components, its total as "total" (as before the rewards list)
    correctness = accuracy_source(rewards)
    if correctness is not None and "accuracy" not in scores:  # a built-in verifier's values are the accuracy
        scores["accuracy"] = scores[correctness]
    return scores
