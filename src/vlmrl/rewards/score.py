"""Calling the rewards on a batch, TRL's way, and checking every answer.

Each reward is called once per batch with keywords, each a list with one item per completion:
`prompts` (the prompt as a conversation), `completions` (`[{"role": "assistant", "content": text}]`),
`completion_ids`, `answer`, `images`, `examples`, `trajectories` and every column of the data
(`example.meta["columns"]`; a column named like one of these keywords is not passed). It gives back
one value per completion: a number, None (does not apply to this completion) or a dict of numbers
with "total" (a task's score: its other keys are logged beside it).

Nothing is silently turned into a number: a reward that raises, answers with the wrong number of
values or with a value that is not finite, or a completion no weighted reward applies to, is a
RewardError naming the reward, the prompt and the completion; the trainer saves a checkpoint and
stops on it. No torch here (rollout/scoring.py makes the tensors and the total).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

from vlmrl.errors import VlmrlError
from vlmrl.rewards.reward import PASSED, Reward

NOT_APPLICABLE = float("nan")
"""A None (does not apply) among the component values."""


class RewardError(VlmrlError):
    """A reward failed or answered wrongly; the message names the reward, the prompt and the completion."""


def _where(example, text: str) -> str:
    return f"prompt: {str(example.prompt)[:200]!r} | completion: {text[:200]!r}"


def _conversation(example) -> list[dict[str, str]]:
    """The prompt as TRL's conversational form: the system turn (when the example has one), the user turn."""
    system = getattr(example, "system", "")
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": example.prompt}]


def batch_keywords(examples: list, texts: list[str], trajectories: list, completion_ids: list) -> dict[str, list]:
    """Every keyword a reward may take for this batch: PASSED, then the data's columns."""
    keywords: dict[str, list] = {
        "prompts": [_conversation(e) for e in examples],
        "completions": [[{"role": "assistant", "content": t}] for t in texts], "completion_ids": list(completion_ids),
        "answer": [e.answer for e in examples], "images": [list(e.images) for e in examples],
        "examples": list(examples), "trajectories": list(trajectories)}
    columns = [e.meta.get("columns", {}) if isinstance(e.meta, Mapping) else {} for e in examples]
    for name in dict.fromkeys(k for c in columns for k in c):
        if name not in PASSED:
            keywords[name] = [c.get(name) for c in columns]
    return keywords


def _value(reward: Reward, value: Any, example, text: str) -> float | dict[str, float]:
    """One answer of `reward` as a float (NaN for None) or a dict of floats; RewardError when it is none of those."""
    if value is None:
        return NOT_APPLICABLE
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    if isinstance(value, Mapping) and "total" in value and all(
            isinstance(v, numbers.Real) and math.isfinite(float(v)) for v in value.values()):
        return {str(k): float(v) for k, v in value.items()}
    raise RewardError(f"reward {reward.name!r} ({reward.spec}) must give one finite number, None or a dict of finite "
                      f"numbers with 'total' per completion; got {value!r} for completion {text[:200]!r} | "
                      f"{_where(example, text)}")


def call_reward(reward: Reward, keywords: dict[str, list], examples: list, texts: list[str]) -> list:
    """`reward`'s answers for the batch, checked: one float (NaN: None) or dict of floats per completion."""
    try:
        values = reward.fn(**reward.keywords(keywords))
    except Exception as error:  # noqa: BLE001 - a reward must not fail silently, nor take the process down unnamed
        raise RewardError(f"reward {reward.name!r} ({reward.spec}) failed: {type(error).__name__}: {error} | "
                          f"{_where(examples[0], texts[0])}") from error
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
        raise RewardError(f"reward {reward.name!r} ({reward.spec}) must return a list with one value per completion; "
                          f"got {type(values).__name__} {str(values)[:80]} | {_where(examples[0], texts[0])}")
    if len(values) != len(texts):
        raise RewardError(f"reward {reward.name!r} ({reward.spec}) returned {len(values)} values for {len(texts)} "
                          f"completions | {_where(examples[0], texts[0])}")
    return [_value(reward, v, e, t) for v, e, t in zip(values, examples, texts)]


def score_batch(rewards: list[Reward], examples: list, texts: list[str], trajectories: list | None = None,
                completion_ids: list | None = None) -> dict[str, list[float]]:
    """Every component of every completion (NaN where a reward does not apply): each reward under its
    name (a dict's "total"), a dict's other keys beside it (the `task` reward's under their own names,
    unless a reward has that name; any other's as "name/key")."""
    trajectories = trajectories if trajectories is not None else [None] * len(texts)
    keywords = batch_keywords(examples, texts, trajectories,
                              completion_ids if completion_ids is not None else [None] * len(texts))
    answers = {reward.name: call_reward(reward, keywords, examples, texts) for reward in rewards}
    components: dict[str, list[float]] = {name: [] for name in answers}
    for reward in rewards:
        name = reward.name
        for i, value in enumerate(answers[name]):
            components[name].append(value["total"] if isinstance(value, dict) else value)
            for key, number in (value.items() if isinstance(value, dict) else ()):
                if key == "total":
                    continue
                column = key if reward.of_task and key not in answers else f"{name}/{key}"
                components.setdefault(column, [NOT_APPLICABLE] * len(texts))[i] = number
    weighted = [r.name for r in rewards if r.weight != 0] or [r.name for r in rewards]
    for i, (example, text) in enumerate(zip(examples, texts)):
        if all(math.isnan(components[name][i]) for name in weighted):
            raise RewardError(f"no reward applies to this completion (each of {', '.join(weighted)} gave None) | "
                              f"{_where(example, text)}")
    return components
