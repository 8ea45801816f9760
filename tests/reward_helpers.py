"""Reward functions defined at the top level of a light module, for tests that give a reward from
Python: the reward worker imports the module by its path to run one, and this one imports no torch
(a test module as the reward's home made the worker import torch and transformers: about 6 s)."""

from __future__ import annotations

from vlmrl.rewards.builtin import completion_text


def shout(completions):
    """1 for a completion in capitals, else 0."""
    return [float(completion_text(c).isupper()) for c in completions]
