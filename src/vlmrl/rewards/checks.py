"""The checks of the rewards before step 1, on the first train examples (no model needed).

- every reward's required arguments are keywords vlmrl passes or columns of the data (reward.py);
- the task's own `score()`, where the `task` reward is used, returns a dict with "total" (a float,
  the TRL habit, used to fail at step 1 with an AttributeError);
- every built-in reward that compares with the gold answer reads that answer and gives it full marks
  (written as `<answer>gold</answer>`, `\\boxed{gold}` or bare: the best of the three): a gold answer
  a verifier cannot read would score every completion 0, or None, silently;
- a run trains on some reward (`check_weights`): with every weight 0 the total is 0 and nothing is
  learnt, unless a teacher gives the signal (distillation, the rewards logged beside it);
- every built-in reward that compares, the built-in `format` and the task's own accuracy give full
  marks to an SFT target the task made from a gold answer (`meta["made_reference"]`): a target in
  another answer format than the rewards read (`<answer>` tags against `\\boxed{}`) would be learnt
  in SFT and then paid 0 by GRPO (a reward of weight 0, only logged, may read another format).
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


def check_made_reference(reward: Reward, task, examples: list) -> None:
    """VlmrlError unless `reward` (a built-in, or the task's own score by its accuracy) gives full marks
    (1) to each SFT target made from a gold answer (an example whose meta["made_reference"] is true);
    a reward of weight 0 (logged, not paid) is not held to it."""
    made = [e for e in examples if e.meta.get("made_reference") and str(e.answer).strip()]
    if not made or reward.weight == 0:
        return
    if reward.of_task:
        values = [task.score(e, e.reference_completion).get("accuracy") for e in made]
    else:
        values = reward.fn(**reward.keywords({
            "completions": [[{"role": "assistant", "content": e.reference_completion}] for e in made],
            "answer": [str(e.answer) for e in made]}))
    for example, value in zip(made, values):
        if value is not None and value < 1.0:
            raise VlmrlError(f"reward {reward.name!r} gives {value:g}, not 1, to the SFT target made from the answer of "
                             f"{example.meta.get('split', 'train')} example {example.meta.get('idx', '?')} "
                             f"({example.reference_completion[:80]!r}): it reads the answer in another format; give the "
                             "reward the task's answer format (kwargs: {extract: answer_tag|boxed|whole}) or set "
                             "task.params.answer_format to the one the rewards read (docs/data.md)")


def check_rewards(rewards: list[Reward], task, examples: list) -> None:
    """Every check of this module on `examples` (the first train examples)."""
    columns = {name for e in examples for name in (e.meta.get("columns") or {})}
    check_arguments(rewards, columns)
    if examples and any(r.of_task for r in rewards):
        check_task_score(task, examples[0])
    for reward in rewards:
        builtin = BUILTIN.get(reward.spec) is not None
        if reward.spec in COMPARING and builtin:
            check_gold(reward, examples)
        if reward.of_task or (builtin and (reward.spec in COMPARING or reward.spec == "format")):
            check_made_reference(reward, task, examples)
