"""What `generate` samples from, and the log-prob the sampler gave each token it drew (issue 16).

The training pass scores a completion token with log_softmax(logits / T) over the whole
vocabulary (logprobs.py). `sampling_kwargs` makes `generate` sample from that same policy: the
run's temperature and top-p, no top-k, and no repetition penalty (a checkpoint's generation config
may set one, e.g. 1.05 for Qwen2.5-VL-Instruct, which would make the sampler another policy).

`SampledLogprobs`, a logits processor, sees the logits of every decode step as the model produced
them (float32, before temperature and top-p), keeps log_softmax(logits / T) of that step until the
next one shows which token was drawn, and bans the special tokens a completion must not contain
(in place of `generate`'s own `suppress_tokens`, which would run before it and hide their mass).
The recorded log-probs are thus the sampler's, by the training pass's definition: where both are
the same computation they are equal, and where the decode step differs (a compiled step, bf16
kernels, a static cache) the difference is the rollout/training mismatch that truncated
importance sampling corrects (grpo.py, `algorithm.tis_cap`). Only one step's distribution
(N x V floats) is held at a time; nothing of the vocabulary is kept per step.
"""

from __future__ import annotations

import torch

from vlmrl.config import GenerationSettings


class SampledLogprobs:
    """A `generate` logits processor: bans `banned` ids and records log p(token) / T of each drawn
    token (when `temperature` > 0; greedy decoding records nothing)."""

    def __init__(self, temperature: float, banned: list[int]):
        self.temperature = temperature
        self.banned = torch.tensor(banned, dtype=torch.long)  # (K,)
        self.banned_here: torch.Tensor | None = None  # the same on the logits' device (first call)
        self.previous: torch.Tensor | None = None  # (N, V) log-probs of the last step
        self.picked: list[torch.Tensor] = []  # per decode step: (N,) log-prob of the drawn token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """input_ids (N, L) so far (the last one drawn from the previous step); scores (N, V)."""
        if self.temperature > 0:
            if self.previous is not None:
                self._pick(input_ids[:, -1])
            self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # (N, V)
        if self.banned_here is None:  # once, not at every step: on the logits' device, within the vocabulary
            banned = self.banned.to(scores.device)
            self.banned_here = banned[banned < scores.shape[-1]]
        return scores.index_fill(-1, self.banned_here, float("-inf"))  # (N, V)

    def _pick(self, tokens: torch.Tensor) -> None:
        self.picked.append(self.previous.gather(-1, tokens[:, None]).squeeze(-1))  # (N,)
        self.previous = None

    def logprobs(self, new_ids: torch.Tensor) -> torch.Tensor | None:
        """(N, T) the recorded log-probs of `new_ids` (N, T), the tokens `generate` returned after the
        prompt; None when nothing was recorded (greedy decoding, or a `generate` that calls no
        logits processor)."""
        if self.previous is not None:
            self._pick(new_ids[:, len(self.picked)])  # the last step's token: no call after it
        if not self.picked:
            return None
        if len(self.picked) != new_ids.shape[1]:
            raise RuntimeError(f"recorded {len(self.picked)} decode steps for {new_ids.shape[1]} new tokens")
        return torch.stack(self.picked, dim=1)  # (N, T)


def sampling_kwargs(settings: GenerationSettings, recorder: SampledLogprobs) -> dict:
    """`generate`'s sampling arguments for `settings` (greedy when temperature is 0), with `recorder`
    as its logits processor."""
    chosen = {"do_sample": False} if settings.temperature == 0 else {
        "do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p, "top_k": 0}
    from transformers import LogitsProcessorList

    return chosen | {"repetition_penalty": 1.0, "logits_processor": LogitsProcessorList([recorder])}
