"""One step's experience: grouped completions, every reward component, and the advantages.

Prompts are drawn in order from the task's train split; each process takes its own contiguous
share of every global batch, so a group never straddles processes. Each generate call is seeded
from (seed, step, first prompt index), so the samples do not depend on how many processes there
are, nor on whether the run was resumed. Under DAPO dynamic sampling, groups whose rewards are all
equal are set aside and further batches drawn, for at most `max_sampling_rounds` rounds (all
processes draw the same number of rounds); a batch still short is filled with set-aside groups,
which carry no policy gradient.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vlmrl import grpo
from vlmrl.config import Config
from vlmrl.errors import VlmrlError
from vlmrl.rollout import GenerationSettings, Rollout, generate_groups


@dataclass
class Experience:
    """N = groups x G scored completions of one process, ready for the loss."""

    rollout: Rollout
    rewards: dict[str, torch.Tensor]  # component name -> (N,), as the task scored it
    reward: torch.Tensor  # (N,) what the advantages come from: total (+ overlong penalty)
    advantages: torch.Tensor  # (N,)
    groups_drawn: int  # groups generated this step, on this process
    groups_with_signal: int  # of those, groups whose rewards were not all equal
    generate_seconds: float = 0.0  # wall time spent sampling this step, on this process
    score_seconds: float = 0.0  # wall time spent in task.score


def derive_seed(*parts) -> int:
    """A stable 63-bit seed from any values (Python's hash() changes between runs)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()
    return int(digest[:15], 16)


def score_completions(task, rollout: Rollout) -> dict[str, torch.Tensor]:
    """Every reward component of every completion, as (N,) tensors."""
    columns: dict[str, list[float]] = {}
    for example, text in zip(rollout.rows, rollout.texts):
        try:
            scores = task.score(example, text)
        except Exception as error:  # a user reward must not fail silently
            raise VlmrlError(f"reward of task {task.name!r} failed: {type(error).__name__}: {error} "
                             f"| prompt: {example.prompt[:200]!r} | completion: {text[:200]!r}") from error
        bad = {k: v for k, v in scores.items() if not math.isfinite(float(v))}
        if bad or "total" not in scores:
            raise VlmrlError(f"reward of task {task.name!r} must give finite numbers with a 'total'; "
                             f"got {scores} for completion {text[:200]!r}")
        for name, value in scores.items():
            columns.setdefault(name, []).append(float(value))
    return {name: torch.tensor(values) for name, values in columns.items()}


def collect_experience(policy, processor, task, config: Config, step: int, position: int,
                       rank: int, world: int, any_process: Callable[[bool], bool],
                       gather: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Experience, int]:
    """Generate, score and weigh this process's share of a step; returns it and the new position.

    `any_process(flag)` is True when flag is True on any process; `gather(x)` concatenates a
    tensor from all processes (both identity-like on a single process).
    """
    settings, algo = config.rollout, config.algorithm
    per_process = settings.prompts_per_step // world
    group = settings.group_size
    generation = GenerationSettings(group_size=group, max_new_tokens=settings.max_new_tokens,
                                    temperature=settings.temperature, top_p=settings.top_p,
                                    shared_prefill=settings.shared_prefill)
    with_signal: list[tuple[Rollout, dict]] = []
    without_signal: list[tuple[Rollout, dict]] = []
    rounds = drawn = 0
    seconds = {"generate": 0.0, "score": 0.0}
    while True:
        first = position + rounds * settings.prompts_per_step + rank * per_process
        per_call = generation_batch(config, world)
        for start in range(first, first + per_process, per_call):
            examples = [task.example(i, split="train") for i in range(start, start + per_call)]
            started = time.perf_counter()
            rollout = generate_groups(policy, processor, examples, generation,
                                      seed=derive_seed(config.seed, step, start))
            scored = time.perf_counter()
            scores = score_completions(task, rollout)
            seconds["generate"] += scored - started
            seconds["score"] += time.perf_counter() - scored
            reward = shaped_reward(scores["total"], rollout, config)
            for g in range(len(examples)):
                rows = list(range(g * group, (g + 1) * group))
                part = (rollout.select(rows), {k: v[rows] for k, v in {**scores, "_reward": reward}.items()})
                signal = bool(grpo.dynamic_sampling_mask(reward[rows], group)[0])
                (with_signal if signal or not algo.dynamic_sampling else without_signal).append(part)
                drawn += 1
        rounds += 1
        short = algo.dynamic_sampling and len(with_signal) < per_process
        if not any_process(short and rounds < algo.max_sampling_rounds):
            break
    kept = (with_signal + without_signal)[:per_process]
    rollout = Rollout.concat([r for r, _ in kept], processor.tokenizer.pad_token_id)
    rewards = {name: torch.cat([s[name] for _, s in kept]) for name in kept[0][1]}
    reward = rewards.pop("_reward")
    advantages = compute_advantages(reward, group, algo.advantage_scale, algo.cubic_shaping, gather)
    n_signal = len(with_signal) if algo.dynamic_sampling else sum(
        bool(grpo.dynamic_sampling_mask(s["_reward"], group)[0]) for _, s in kept)
    return (Experience(rollout, rewards, reward, advantages, drawn, n_signal, seconds["generate"],
                       seconds["score"]),
            position + rounds * settings.prompts_per_step)


def generation_batch(config: Config, world: int) -> int:
    """Prompts per generate call: the configured size, at most one process's share of a step."""
    return min(config.rollout.generation_batch_size, config.rollout.prompts_per_step // world)


def shaped_reward(total: torch.Tensor, rollout: Rollout, config: Config) -> torch.Tensor:
    """The task's total, plus DAPO's soft overlong penalty when enabled."""
    algo = config.algorithm
    if algo.overlong_buffer <= 0:
        return total
    penalty = grpo.overlong_penalty(rollout.lengths.cpu(), config.rollout.max_new_tokens,
                                    algo.overlong_buffer, algo.overlong_penalty)  # (N,)
    return total + penalty


def compute_advantages(reward: torch.Tensor, group: int, scale: str, cubic: bool,
                       gather: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """(N,) advantages: group-centred, scaled by group std, batch std (all processes) or not."""
    if scale == "batch":
        centred = grpo.group_advantages(reward, group, scale="none")  # (N,)
        advantages = centred / (gather(centred).std() + 1e-6)
    else:
        advantages = grpo.group_advantages(reward, group, scale="std" if scale == "group" else "none")
    return grpo.cubic_shaping(advantages) if cubic else advantages
