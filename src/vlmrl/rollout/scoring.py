"""Every reward component of every completion, from the task's own `score`.

Used by the RL step (experience.py) and by evaluation alike. A multi-turn rollout with tools is
scored by `task.score_trajectory(example, trajectory)` (which sees the calls and their results;
by default the final turn's text through `score`). Built-in rewards never raise; a
reward of the user's own that raises, returns a non-finite number or forgets "total" stops the run
with the task, the prompt and the completion in the message: it is never silently turned into 0.
"""

from __future__ import annotations

import math

import torch

from vlmrl.errors import VlmrlError
from vlmrl.rollout.generation import Rollout
from vlmrl.tasks import Task


def score_completions(task: Task, rollout: Rollout) -> dict[str, torch.Tensor]:
    """Every reward component of every completion, as (N,) tensors."""
    columns: dict[str, list[float]] = {}
    trajectories = getattr(rollout, "trajectories", None) or [None] * len(rollout.rows)
    for example, text, trajectory in zip(rollout.rows, rollout.texts, trajectories):
        try:
            scores = task.score(example, text) if trajectory is None else task.score_trajectory(example, trajectory)
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
