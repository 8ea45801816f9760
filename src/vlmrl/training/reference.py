"""The reference policy of the KL penalty.

Three forms, chosen from the run's settings:
- none at all when beta = 0 (DAPO);
- with LoRA and no refresh, the base model itself with the adapter switched off: no second copy;
- otherwise a frozen copy of the policy, refreshed every `ref_refresh_steps` steps, optionally
  mixed: reference = mix * policy + (1 - mix) * reference (TR-DPO style).
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import _remove_duplicate_names, load_model, save_file, save_model

from vlmrl.config import AlgorithmConfig
from vlmrl.models.folder_check import check_fit, check_weight_file, shape_fit, tensor_shapes
from vlmrl.rollout.completions import Completions
from vlmrl.safety.checkpoint import REFERENCE_FILE
from vlmrl.training.logprobs import LogprobScorer
from vlmrl.training import zero3
from vlmrl.training.sharding import reshard


def is_peft_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


class ReferencePolicy:
    """Log-probs under the reference, and its refresh from the policy."""

    def __init__(self, policy: torch.nn.Module, settings: AlgorithmConfig):
        self.settings = settings
        self.copy = None
        if not (is_peft_model(policy) and settings.ref_refresh_steps == 0):
            self.copy = copy.deepcopy(policy).eval().requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, policy, scorer: LogprobScorer, completions: Completions) -> torch.Tensor:
        """Reference log-probs (N, T) of `completions`, scored as `scorer` scores the policy's."""
        model = self.copy if self.copy is not None else policy
        switch_off = policy.disable_adapter() if self.copy is None else contextlib.nullcontext()
        with switch_off:
            logp, _ = scorer(model, completions)
        return logp

    @torch.no_grad()
    def maybe_refresh(self, policy: torch.nn.Module, steps_done: int) -> bool:
        """Move the reference towards the policy when `steps_done` is a multiple of the period."""
        period = self.settings.ref_refresh_steps
        if self.copy is None or period <= 0 or steps_done % period:
            return False
        mix = self.settings.ref_mix
        reshard(self.copy)  # sharded (FSDP2): each process moves its own shards
        reshard(policy)
        with zero3.gathered(policy):  # partitioned (ZeRO-3): the policy whole on every process, as the copy is
            for ref, new in zip(self.copy.parameters(), policy.parameters()):
                ref.lerp_(new.detach(), mix)
        return True

    def save(self, folder: Path, weights: dict | None = None) -> None:
        """The copy's weights (`weights`: its full state dict when it is sharded) into `folder`."""
        if self.copy is None:
            return
        if weights is None:
            save_model(self.copy, str(folder / REFERENCE_FILE))
        else:  # a gathered state dict's tensors may share storage (tied parameters): each its own in the file,
            # the others written as they are (a background checkpoint's host copy is not copied twice)
            storages = Counter(value.untyped_storage().data_ptr() for value in weights.values())
            save_file({name: value.clone().contiguous() if storages[value.untyped_storage().data_ptr()] > 1
                       else value.contiguous() for name, value in weights.items()}, str(folder / REFERENCE_FILE))

    def saved_weights(self) -> dict[str, torch.Tensor] | None:
        """The copy's tensors under the names `save` writes them (a tied weight once, under the name
        safetensors' save_model keeps), live, not copied; None without a copy."""
        if self.copy is None:
            return None
        weights = self.copy.state_dict()
        for removed in _remove_duplicate_names(weights).values():
            for name in removed:
                del weights[name]
        return weights

    def load(self, folder: Path) -> None:
        """The copy's saved weights; none into a copy built without weights (meta device: its shards
        come from the main process's copy, sharding.shard). One line, naming the file or the tensors,
        for a damaged file or one whose tensors are not the copy's (folder_check.py)."""
        if self.copy is None or next(self.copy.parameters()).is_meta:
            return
        path = folder / REFERENCE_FILE
        check_weight_file(path, "reference weights file")
        expected = {name: tuple(value.shape) for name, value in self.copy.state_dict().items()}
        found = tensor_shapes(path)
        mismatched = shape_fit(expected, found)[2]
        check_fit(f"reference copy in {folder}", REFERENCE_FILE, [], [], mismatched)
        missing, unexpected = load_model(self.copy, str(path), strict=False)  # a tied weight is saved once
        check_fit(f"reference copy in {folder}", REFERENCE_FILE, sorted(missing), sorted(unexpected), [])


def build_reference(policy: torch.nn.Module, settings: AlgorithmConfig) -> ReferencePolicy | None:
    """The run's reference policy, or None when the KL weight is 0."""
    return ReferencePolicy(policy, settings) if settings.beta > 0 else None
