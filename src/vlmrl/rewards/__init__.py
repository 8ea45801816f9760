"""Rewards: completions -> numbers. The verifiers (verify.py), the built-in rewards by name
(builtin.py), a reward resolved from the config (reward.py: built-in, `task`, import path, file, URL),
a reward service (http.py), and calling them TRL's way on a batch with every answer checked (score.py).
No torch here: tasks import the verifiers, and rollout/scoring.py turns the numbers into tensors.
"""
