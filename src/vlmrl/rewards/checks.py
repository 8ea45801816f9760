"""The checks of the rewards before step 1, on the first train examples (no model needed).

- every reward's required arguments are keywords vlmrl passes or columns of the data (reward.py);
- the task's own `score()`, where the `task` reward is used, returns a dict with "total" (a float,
  the TRL habit, used to fail at step 1 with an AttributeError);
- every built-in reward that compares with the gold answer reads that answer and gives it full marks
  (written as `<answer>gold</answer>`, `\\boxed{gold}` or bare: the best of the three): a gold answer
  a verifier cannot read would score every completion 0, or None, silently;
- a run trains on some reward (`check_weights`): with every weight 0 the total is 0 and nothing is
  learnt, unless a teacher gives the signal (distillation, the rewards logged beside it).
"""

from __future__ import annotations

from typing import Mapping

from vlmrl.errors import VlmrlError
from vlmrl.rewards.builtin import BUILTIN, COMPARING
from vlmrl.rewards.reward import Reward, check_arguments


def check_task_score(task, example) -> None:
    """VlmrlError unless `task.score` gives a dict with a finite "total" for the example's reference."""
    scores = task.score(example, example.reference_completion)
    if not isinstance(scores, Mapping) or "total" not in scores:
        got = f"{type(scores).__name__} {scores!r}"[:120]
        raise VlmrlError(f"the score() of task {task.name!r} must return a dict of reward components with 'total' "
                         f"(and 'accuracy'); it returned {got}. A function giving one number per completion is a "
                         "reward of its own: name it in the config's rewards list (docs/rewards.md)")


def check_gold(reward: Reward, examples: list) -> None:
    """VlmrlError unless the comparing built-in `reward` gives each example's gold answer 1."""
    for example in examples:
        gold = str(example.answer)
        if not gold.strip():
            continue
        forms = [f"<think>\n</think>\n<answer>{gold}</answer>", f"\\boxed{{{gold}}}", gold]
        values = reward.fn(completions=[[{"role": "assistant", "content": f}] for f in forms], answer=[gold] * 3)
        best = max((v for v in values if v is not None), default=None)
        if best is None or best < 1.0:
            read = "cannot read it" if best is None else f"gives it {best:g}, not 1"
            raise VlmrlError(f"reward {reward.name!r} {read} as the gold answer of {example.meta.get('split', 'train')} "
                             f"example {example.meta.get('idx', '?')} ({gold[:80]!r}): fix the answer column, or "
                             f"use a reward that reads such answers")


def check_weights(rewards: list[Reward], teacher: bool) -> None:
    """VlmrlError when every reward has weight 0 in a run without a teacher: it would train on a total of 0."""
    if rewards and not teacher and all(r.weight == 0 for r in rewards):
        raise VlmrlError(f"every reward has weight 0 ({', '.join(r.name for r in rewards)}): the run would train on a "
                         "total of 0; give one a weight (0 only logs a reward)")


def check_rewards(rewards: list[Reward], task, examples: list) -> None:
    """Every check of this module on `examples` (the first train examples)."""
    columns = {name for e in examples for name in (e.meta.get("columns") or {})}
    check_arguments(rewards, columns)
    if examples and any(r.of_task for r in rewards):
        check_task_score(task, examples[0])
    for reward in rewards:
        if reward.spec in COMPARING and BUILTIN.get(reward.spec) is not None:
            check_gold(reward, examples)
