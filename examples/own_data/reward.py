"""A reward function for the bar charts of `vlmrl data bars`, written the way TRL's GRPOTrainer calls
reward functions: once per batch, each keyword a list with one item per completion, a dataset
column (here `answer`) by its name, one float per completion back (None: does not apply).

    vlmrl train examples/own_data/grpo.yaml          # rewards: [reward.py:accuracy, ...]

The same function runs unchanged under TRL: `GRPOTrainer(..., reward_funcs=[accuracy])`.
"""

import re

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def final_answer(text):
    """The text of the last <answer>...</answer> block, lower-cased and trimmed; None without one."""
    blocks = ANSWER.findall(text)
    return blocks[-1].strip().lower() if blocks else None


def accuracy(completions, answer, **kwargs):
    """1.0 when the completion's <answer> is the gold colour, else 0.0; None for a row without a
    gold answer (the reward does not apply to it)."""
    rewards = []
    for completion, gold in zip(completions, answer):
        got = final_answer(completion[0]["content"])
        rewards.append(float(got == gold.strip().lower()) if gold.strip() else None)
    return rewards
