"""Completions of prompts: which example each row answers, its tokens and its mask.

The one record that generation produces (a `Rollout` adds texts and cut-offs), that SFT builds
from reference answers, and that every log-prob pass reads. Rows that answer the same prompt
share the same `Example` object: that is how packing finds a group (packing.group_rows).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from vlmrl.tasks import Example


@dataclass
class Completions:
    """N completions; row i answers `rows[i]`."""

    rows: list[Example]  # (N,) the example each completion answers
    completion_ids: torch.Tensor  # (N, T) right-padded with the pad token
    completion_mask: torch.Tensor  # (N, T) 1 on completion tokens, the stop token included

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)  # (N,)

    def select(self, index: list[int]) -> Completions:
        """The rows `index`, in that order."""
        at = torch.tensor(index, dtype=torch.long, device=self.completion_ids.device)
        return Completions([self.rows[i] for i in index], self.completion_ids[at], self.completion_mask[at])

    def to(self, device: torch.device) -> Completions:
        """The same rows (and kind: a Rollout stays a Rollout) with ids and mask on `device`."""
        return replace(self, completion_ids=self.completion_ids.to(device), completion_mask=self.completion_mask.to(device))


def pad_right(x: torch.Tensor, length: int, value) -> torch.Tensor:
    """(n, t) -> (n, length), filled with `value`."""
    return torch.nn.functional.pad(x, (0, length - x.shape[1]), value=value)
