"""Per-token log-probs of completions under a model: the training forward pass.

`LogprobScorer` binds the settings of a run once (the sampling temperature, packing, the output
layer's chunk size) and is called with a model and `Completions`. The prompt inputs are rebuilt
with the processor and the completion tokens appended; processor outputs that run along the
tokens are extended, pixel inputs pass through (token_inputs.py). No per-architecture code.

Three speedups, on by default and exact (tests/test_speedups.py, tests/test_block_attention.py):
- packing (`pack_groups`): rows that answer the same prompt (the same Example object, as a
  group's rows are) are packed with that prompt into one sequence, so each image and prompt is
  computed once per group (packing.py);
- block attention (`block_attention`): the packed sequence's SDPA attention computes only the
  blocks its mask allows, each completion over its prompt and itself (block_attention.py);
- chunked output layer (`chunk`): the log-softmax over the vocabulary is taken `chunk` positions
  at a time from the final hidden states, so full-vocabulary logits never exist for the whole
  batch (output_layer.py).
A model that does not support one of them takes the plain path, and says so once (support.py).
A packed pass that fails on its first use with a model (family code the plain pass never meets)
switches that model to the plain pass for the rest of the run, with a warning (fast_paths.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmrl.models.fast_paths import first_use
from vlmrl.models.support import (output_layer_unchunkable, packed_passes_unsupported, takes_logits_to_keep,
                                  warn_once)
from vlmrl.models.token_inputs import join_prompt_and_completion
from vlmrl.rollout.completions import Completions
from vlmrl.rollout.prompts import encode_prompts
from vlmrl.rollout.trajectories import encode_trajectories
from vlmrl.training.output_layer import Readout, logprobs_at, logprobs_of_logits
from vlmrl.training.packing import group_rows, pack_groups, pack_trajectories, use_block_attention


@dataclass(frozen=True)
class LogprobScorer:
    """Log-probs (N, T) of completion tokens under a model, with the run's settings bound once."""

    processor: object
    """The model's processor: prompts are rebuilt with it."""
    temperature: float = 1.0
    """Logits are divided by the sampling temperature, so log-probs are the sampling policy's."""
    pack_groups: bool = True
    """Compute each distinct prompt once, its completions packed after it (when some rows share
    one and the model family supports it)."""
    chunk: int = 1024
    """Positions per output-layer chunk (0 = all logits at once)."""
    block_attention: bool = True
    """Packed forwards on SDPA compute only the attention blocks their mask allows."""

    def __call__(self, model, completions: Completions,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (N, T) of `completions` under `model`, and the entropy (N, T) of each step when
        asked (no gradient). Masked positions hold 0."""
        readout = Readout(self.temperature, self.chunk, with_entropy)
        use_block_attention(model, self.block_attention)  # packed passes compute attention blocks, or not
        if getattr(completions, "segments", None) is not None:  # multi-turn trajectories (tool_rollout.py)
            packed, plain = self._packed_trajectories, self._plain_trajectories
        else:
            packed, plain = self._packed, self._plain
        if self._packs(model, completions):
            result = first_use(model, "packed_logprobs", lambda: packed(model, completions, readout),
                               lambda: plain(model, completions, readout))
        else:
            result = plain(model, completions, readout)
        return self._masked(result, completions)

    def _packs(self, model, completions: Completions) -> bool:
        """Whether each group's prompt is computed once: packing on, some rows share a prompt, and the
        model supports it (else the plain way, said once)."""
        if not self.pack_groups or len(group_rows(completions.rows)) == len(completions.rows):
            return False
        reason = packed_passes_unsupported(model)
        if reason is not None:
            warn_once(f"vlmrl: packed log-probs off ({reason}); every prompt is repeated per completion")
        return reason is None

    def _packed(self, model, completions: Completions, readout: Readout):
        """One forward over each unique prompt followed by all of its completions."""
        device = completions.completion_ids.device
        firsts = [group[0] for group in group_rows(completions.rows)]
        prompt = encode_prompts(self.processor, [completions.rows[i] for i in firsts], device)  # (U, P)
        inputs, index = pack_groups(model, prompt, completions, self.processor.tokenizer.pad_token_id)
        return logprobs_at(model, inputs, index, completions.completion_ids, readout)

    def _plain(self, model, completions: Completions, readout: Readout):
        """One forward over every prompt followed by its own completion."""
        ids = completions.completion_ids  # (N, T)
        inputs = join_prompt_and_completion(encode_prompts(self.processor, completions.rows, ids.device),
                                            ids, completions.completion_mask)  # (N, P+T)
        length = ids.shape[1]  # T
        if readout.chunk > 0 and output_layer_unchunkable(model) is None:
            total = inputs["input_ids"].shape[1]  # P + T
            before = torch.arange(total - length - 1, total - 1, device=ids.device)  # (T,) P-1 .. P+T-2
            index = torch.arange(len(ids), device=ids.device)[:, None] * total + before  # (N, T) flat
            return logprobs_at(model, inputs, index, ids, readout)
        # The logits at positions P-1 .. P+T-2 predict the T completion tokens. A forward without
        # `logits_to_keep` (VideoLLaMA3's swallows it in **kwargs) returns all P+T; the slice serves both.
        keep = {"logits_to_keep": length + 1} if takes_logits_to_keep(model) else {}
        logits = model(**inputs, use_cache=False, **keep).logits[:, -(length + 1):-1]  # (N, T, V)
        return logprobs_of_logits(logits, ids, readout)

    def _packed_trajectories(self, model, completions: Completions, readout: Readout):
        """Log-probs of every token after the prompt (the mask keeps the model's), tool results and
        their images in the context: one packed forward per group (each prompt once)."""
        ids = completions.completion_ids  # (N, T)
        inputs, index = pack_trajectories(model, self.processor, completions.rows, completions.segments,
                                          ids.shape[1])  # (U, L) packs, (N, T) positions
        return logprobs_at(model, inputs, index, ids, readout)

    def _plain_trajectories(self, model, completions: Completions, readout: Readout):
        """As `_packed_trajectories`, with one forward per trajectory."""
        ids = completions.completion_ids  # (N, T)
        inputs = encode_trajectories(self.processor, completions.rows, completions.segments, ids.device)  # (N, L)
        total = inputs["input_ids"].shape[1]  # L
        lengths = torch.tensor([sum(len(s.ids) for s in row) for row in completions.segments], device=ids.device)
        steps = torch.arange(ids.shape[1], device=ids.device)  # (T,)
        where = (total - lengths[:, None] + steps[None, :] - 1).clamp(0, total - 1)  # (N, T) predicting positions
        index = torch.arange(len(ids), device=ids.device)[:, None] * total + where  # (N, T) flat
        if output_layer_unchunkable(model) is None:
            return logprobs_at(model, inputs, index, ids, readout)
        logits = model(**inputs, use_cache=False).logits  # (N, L, V)
        return logprobs_of_logits(logits.reshape(-1, logits.shape[-1])[index], ids, readout)

    @staticmethod
    def _masked(result, completions: Completions):
        logp, entropy = result  # (N, T) each
        mask = completions.completion_mask.to(logp.dtype)  # (N, T)
        return logp * mask, (entropy * mask if entropy is not None else None)
