"""How an evaluation runs: `EvalSettings`, the one place its defaults are written.

Apart from `vlmrl.evaluation.evaluate` (which imports torch) so that the `vlmrl eval` flags can take their
defaults from these fields while `vlmrl --help` imports nothing heavy. `vlmrl.evaluation.evaluate` re-exports
it: `from vlmrl.evaluation.evaluate import EvalSettings` works as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import Any

from vlmrl.config import (MAX_GROUP_SIZE, MAX_ROWS, MAX_TOKENS, MAX_TURNS, TOOL_IMAGE_SIDES, at_most,
                          reward_entry, temperature_rule, tool_image_side_rule)
from vlmrl.errors import require

MAX_LENGTH_BUCKETS = 100
"""Most completion-length buckets (quantiles of the greedy lengths): more than 100 leaves a handful of
examples, or none, in each."""


@dataclass
class EvalSettings:
    """How an evaluation runs. The defaults are the cheap ones for the trainer's periodic check
    (greedy accuracy only); `vlmrl eval` turns pass@k and the blind check on (`EVAL_CLI_DEFAULTS`
    in `vlmrl.cli`) and takes every other default from here."""

    batch_size: int = 32
    """Completions per generate call; pass@k puts max(1, batch_size // k) prompts in a call."""
    max_new_tokens: int = 128
    """Longest completion; longer ones are cut off (counted as truncated)."""
    k: int = 0
    """Sampled completions per example for pass@k; 0 skips sampling."""
    temperature: float = 1.0
    """Sampling temperature for pass@k."""
    top_p: float = 1.0
    """Nucleus sampling threshold for pass@k."""
    blind_check: bool = False
    """Also answer with a blank and with a shuffled image (two more greedy passes)."""
    length_buckets: int = 4
    """How many completion-length buckets (quantiles of the greedy lengths)."""
    seed: int = 0
    """Seeds the pass@k samples and the image shuffle."""
    tools: list[str] = field(default_factory=list)
    """Tools the model may call while answering (as rollout.tools: zoom, crop, module:function);
    [] = single-turn answers. The blind check blanks the images the tools read too."""
    max_turns: int = 4
    """With tools: most model turns per answer."""
    max_trajectory_tokens: int = 1024
    """With tools: most tokens after the prompt per answer, tool results included."""
    tool_image_side: int = 448
    """With tools: longest side of an image a built-in tool returns (as rollout.tool_image_side)."""
    decode: str = "auto"
    """How generation decodes, as rollout.decode: auto, dynamic, static or compiled (decoding.py)."""
    rewards: list[Any] = field(default_factory=list)
    """The rewards answers are scored with, as the config's `rewards` list (names, {name, weight,
    kwargs, label} mappings or functions); [] = the task's own score. Accuracy is the reward that
    measures correctness: one logged as `accuracy`, else the first of math/number/choice/exact, else
    the task's own score's (rewards/reward.py `accuracy_source`)."""

    def __post_init__(self) -> None:
        self.rewards = [reward_entry(entry, f"rewards[{i}]") for i, entry in enumerate(self.rewards)]

    def validate(self) -> None:
        """Raise VlmrlError with a one-line message when a value is out of range."""
        checks = [(self.batch_size >= 1, f"batch size must be >= 1, got {self.batch_size}"),
                  (self.max_new_tokens >= 1, f"max new tokens must be >= 1, got {self.max_new_tokens}"),
                  (self.k >= 0, f"k must be >= 0 (0 skips pass@k), got {self.k}"),
                  temperature_rule("temperature", self.temperature, greedy=False),
                  (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
                  (self.length_buckets >= 1, f"length buckets must be >= 1, got {self.length_buckets}"),
                  (self.max_turns >= 1, f"max turns must be >= 1, got {self.max_turns}"),
                  (self.max_trajectory_tokens >= 1,
                   f"max trajectory tokens must be >= 1, got {self.max_trajectory_tokens}"),
                  (TOOL_IMAGE_SIDES[0] <= self.tool_image_side <= TOOL_IMAGE_SIDES[1],
                   tool_image_side_rule("--tool-image-side", self.tool_image_side)),
                  # the bounds of the run config's fields (config.py says why each)
                  at_most("batch size", self.batch_size, MAX_ROWS),
                  at_most("max new tokens", self.max_new_tokens, MAX_TOKENS),
                  at_most("k", self.k, MAX_GROUP_SIZE),
                  at_most("length buckets", self.length_buckets, MAX_LENGTH_BUCKETS),
                  at_most("max turns", self.max_turns, MAX_TURNS),
                  at_most("max trajectory tokens", self.max_trajectory_tokens, MAX_TOKENS)]
        require(*checks)
