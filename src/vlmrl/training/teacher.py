"""The teacher of on-policy distillation (algorithm.teacher): a frozen model whose log-probs of the
student's own sampled tokens are the signal (grpo.distill_advantages).

Loaded as the reference copy is kept (reference.py): frozen, in eval mode, in the run's dtype, with
the policy's speedups (fused kernels, batched vision windows), placed as the strategy places the
policy (sharded like it under FSDP2 by the session, whole under ZeRO-3, as the reference copy), and
scored by the run's `LogprobScorer`, through the same fast paths (each image once per group in
packed passes, the chunked output layer) as the policy and the reference. A LoRA adapter teacher is
its base with the adapter merged in. Its files were checked against the policy's before anything
loaded (models/teacher_check.py); here, one line when its weights cannot fit in the device's free
memory, before they load. Never saved in checkpoints: it does not change, and a resume loads it
again from algorithm.teacher.
"""

from __future__ import annotations

import torch

from vlmrl.config import Config
from vlmrl.errors import VlmrlError
from vlmrl.disk import gib
from vlmrl.models.fused_kernels import use_fused_kernels
from vlmrl.models.loading import load_policy, resolve_dtype
from vlmrl.models.model_source import first_line
from vlmrl.models.teacher_check import adapter_base, teacher_weight_bytes
from vlmrl.models.vision_attention import use_batched_vision_attention
from vlmrl.rollout.completions import Completions
from vlmrl.safety.preflight import HEADROOM, free_memory
from vlmrl.training.logprobs import LogprobScorer


class Teacher:
    """Log-probs of the student's completions under the frozen teacher."""

    def __init__(self, model: torch.nn.Module):
        self.model = model.eval().requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, scorer: LogprobScorer, completions: Completions) -> torch.Tensor:
        """Teacher log-probs (N, T) of `completions`, scored as `scorer` scores the policy's."""
        logp, _ = scorer(self.model, completions)
        return logp


def check_teacher_fits(config: Config, device: torch.device, parts: int) -> None:
    """VlmrlError when this process's part of the teacher's weights (`parts`: the processes it is
    sharded over, 1 when whole) exceeds the free memory of `device`, less the headroom kept spare."""
    size = torch.tensor([], dtype=resolve_dtype(config.model.dtype, device)).element_size()
    need = teacher_weight_bytes(config, size) // max(parts, 1)
    free = free_memory(device)
    if free is not None and need > free * (1 - HEADROOM):
        raise VlmrlError(f"algorithm.teacher={config.algorithm.teacher} does not fit: its weights need {gib(need)} per "
                         f"process, {device} has {gib(free)} free ({HEADROOM:.0%} kept spare); use a smaller teacher, "
                         "model.dtype=bfloat16, or shard it over more processes (FSDP2)")


def load_teacher(config: Config, device: torch.device, place: str = "device") -> Teacher | None:
    """The run's teacher (None without one), for `device`, placed as `place` (loading.PLACES)."""
    name = config.algorithm.teacher
    if not name:
        return None
    settings = config.model
    base = adapter_base(name)
    model, _ = load_policy(base or name, dtype=settings.dtype, device=str(device),
                           attn_implementation=settings.attn_implementation,
                           trust_remote_code=settings.trust_remote_code, place=place)
    if base is not None and place != "meta":  # on the meta device: the base's shapes; weights from the main process
        model = merged_adapter(model, name)
    use_fused_kernels(model, config.train.fused_kernels, device=device)
    use_batched_vision_attention(model, config.train.batched_vision_attention, device=device)
    return Teacher(model)


def merged_adapter(model: torch.nn.Module, folder: str) -> torch.nn.Module:
    """`model` with the LoRA adapter in `folder` merged into its weights."""
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(model, folder).merge_and_unload()
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise VlmrlError(f"algorithm.teacher: cannot apply the LoRA adapter in {folder}: {first_line(error)}") from None
