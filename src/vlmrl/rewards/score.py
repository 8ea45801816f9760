"""Calling the rewards on a batch, TRL's way, and checking every answer.

Each reward is called once per batch with keywords, each a list with one item per completion:
`prompts` (the prompt as a conversation), `completions` (`[{"role": "assistant", "content": text}]`),
`completion_ids`, `answer`, `images`, `examples`, `trajectories` and every column of the data
(`example.meta["columns"]`; a column named like one of these keywords is not passed). Each reward gets
lists of its own (`own_copy`): one that edits them in place cannot change what the next one scores.
It gives back one value per completion: a number (a Python or numpy number or bool, a 0-d array or
tensor), None (does not apply to this completion) or a dict of numbers with "total" (a task's score:
its other keys are logged beside it). Every number, and each completion's weighted sum, lies within
±MAX_REWARD: the rewards become float32 tensors whose group means and spreads must stay finite.

Nothing is silently turned into a number: a reward that raises (or, one of your own, exits, runs
past its time limit, leaves a thread running: contain.py), answers with the wrong number of values or
with a value that is not a number within the bound, or a completion no weighted reward applies to, is
a RewardError naming the reward, the prompt and the completion; the trainer saves a checkpoint and
stops on it. No torch here (rollout/scoring.py makes the tensors and the total).
"""

from __future__ import annotations

import copy
import math
import numbers
from typing import Any, Mapping

from vlmrl.errors import VlmrlError
from vlmrl.rewards.contain import RewardFailed
from vlmrl.rewards.reward import PASSED, Reward

NOT_APPLICABLE = float("nan")
"""A None (does not apply) among the component values."""
MAX_REWARD = 1e15
"""The largest magnitude of a reward value and of a completion's weighted sum. The rewards become
float32 tensors (3.4e38 at most, and 1e300 is inf there) whose group means and squared spreads must stay
finite: 1e15 squared, summed over any group, still is; and no reward needs more."""


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


def own_copy(keywords: dict[str, list]) -> dict[str, list]:
    """`keywords` with lists and dicts of their own, at every depth (the conversations and their messages,
    the image lists, the columns' values), and copies of the examples (`_example_copy`); every other
    object (an image, a trajectory) is shared."""
    copies: dict[int, Any] = {}  # one copy per example (a group's G completions share theirs)
    return {name: [copies.setdefault(id(e), _example_copy(e)) if id(e) not in copies else copies[id(e)]
                   for e in values] if name == "examples" else _own(values)
            for name, values in keywords.items()}


def _own(value: Any) -> Any:
    """`value` with its lists and dicts copied, at every depth."""
    if isinstance(value, list):
        return [_own(item) for item in value]
    if isinstance(value, dict):
        return {key: _own(item) for key, item in value.items()}
    return value


def _example_copy(example):
    """A copy of `example` whose lists and dicts (meta, the image lists) are its own; the images shared."""
    mine = copy.copy(example)
    for name, value in getattr(example, "__dict__", {}).items():
        if isinstance(value, (list, dict)):
            setattr(mine, name, _own(value))
    return mine


def _number(value: Any) -> float | None:
    """`value` as a float when it is one number within ±MAX_REWARD (a Python or numpy number or bool, a
    0-d numpy array or torch tensor); else None."""
    if getattr(value, "shape", None) == () and hasattr(value, "item"):  # numpy scalars, 0-d arrays and tensors
        value = value.item()
    if not isinstance(value, (bool, numbers.Real)):
        return None
    try:
        inside = abs(value) <= MAX_REWARD  # exact for any int: 10**400 needs no float
    except (TypeError, ValueError):
        return None
    return float(value) if inside else None


def _value(reward: Reward, value: Any, example, text: str) -> float | dict[str, float]:
    """One answer of `reward` as a float (NaN for None) or a dict of floats; RewardError when it is none of those."""
    if value is None:
        return NOT_APPLICABLE
    number = _number(value)
    if number is not None:
        return number
    if isinstance(value, Mapping) and "total" in value:
        numbers_ = {str(k): _number(v) for k, v in value.items()}
        if all(v is not None for v in numbers_.values()):
            return numbers_
    raise RewardError(f"reward {reward.name!r} ({reward.spec}) must give one finite number (within ±{MAX_REWARD:g}), None or a "
                      f"dict of such numbers with 'total' per completion; got {str(value)[:80]} for completion "
                      f"{text[:200]!r} | {_where(example, text)}")


def call_reward(reward: Reward, keywords: dict[str, list], examples: list, texts: list[str]) -> list:
    """`reward`'s answers for the batch, checked: one float (NaN: None) or dict of floats per completion.
    It is called on keywords of its own (`own_copy`)."""
    try:
        values = reward.fn(**own_copy(reward.keywords(keywords)))
    except RewardFailed as error:  # a function of your own, contained (contain.py)
        raise RewardError(f"reward {reward.name!r} ({reward.spec}) {error} | {_where(examples[0], texts[0])}") from None
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
    return components_of(rewards, answers, examples, texts)


def components_of(rewards: list[Reward], answers: dict[str, list], examples: list, texts: list[str]
                  ) -> dict[str, list[float]]:
    """score_batch's components from every reward's checked answers (`call_reward`, by reward name),
    the completions checked: one weighted reward applies, the weighted sum within ±MAX_REWARD."""
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
        _check_sum(rewards, components, i, _where(example, text))
    return components


def _check_sum(rewards: list[Reward], components: dict[str, list[float]], i: int, where: str) -> None:
    """RewardError when completion `i`'s weighted sum of rewards (None counting 0) is past ±MAX_REWARD."""
    parts = {r.name: r.weight * components[r.name][i] for r in rewards if not math.isnan(components[r.name][i])}
    total = sum(parts.values())
    if not abs(total) <= MAX_REWARD:
        shown = ", ".join(f"{name} {part:g}" for name, part in parts.items())
        raise RewardError(f"the weighted sum of the rewards of this completion is {total:g}, past ±{MAX_REWARD:g} "
                          f"(weight x value: {shown}): lower a weight | {where}")
