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

Logits that are NaN or +inf, or a row with every token at -inf (NaN weights, an activation that
overflowed) would stop `generate` with torch's 'probability tensor contains either inf, nan or
element < 0'. The recorder marks such rows on the device (no host sync per step), lets them
sample uniformly so the call finishes, and `generate_groups` reports them once per call
(`non_finite_logits`): the trainer then stops with the cause named (faults.py), and `vlmrl eval`
says so in one line. -inf alone is no fault: other processors mask tokens with it (min_new_tokens).
"""

from __future__ import annotations

import weakref

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
        self.broken: torch.Tensor | None = None  # (N, 1) rows whose logits were not finite at some step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """input_ids (N, L) so far (the last one drawn from the previous step); scores (N, V)."""
        # one reduction over the vocabulary: the max is NaN with any NaN, +inf with any +inf, -inf when all are
        broken = ~torch.isfinite(scores.amax(-1, keepdim=True))  # (N, 1), on the device
        self.broken = broken if self.broken is None else self.broken | broken
        scores = scores.masked_fill(broken, 0.0)  # such a row samples uniformly: no crash
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

    def broken_rows(self) -> int:
        """How many rows had NaN/inf logits at some step (one host sync, after `generate`)."""
        return 0 if self.broken is None else int(self.broken.sum())

    def logprobs(self, new_ids: torch.Tensor) -> torch.Tensor | None:
        """(N, T) the recorded log-probs of `new_ids` (N, T), the tokens `generate` returned after the
        prompt; None when nothing was recorded (greedy decoding, or a `generate` that calls no
        logits processor). Steps past the returned ids (decode_loop.py's padding steps after every
        row had stopped, cut off the ids) are dropped."""
        steps = new_ids.shape[1]
        if self.previous is not None and len(self.picked) < steps:
            self._pick(new_ids[:, len(self.picked)])  # the last step's token: no call after it
        if not self.picked:
            return None
        if len(self.picked) < steps:
            raise RuntimeError(f"recorded {len(self.picked)} decode steps for {steps} new tokens")
        return torch.stack(self.picked[:steps], dim=1)  # (N, T)


def sampling_kwargs(settings: GenerationSettings, recorder: SampledLogprobs) -> dict:
    """`generate`'s sampling arguments for `settings` (greedy when temperature is 0), with `recorder`
    as its logits processor."""
    chosen = {"do_sample": False} if settings.temperature == 0 else {
        "do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p, "top_k": 0}
    from transformers import LogitsProcessorList

    return chosen | {"repetition_penalty": 1.0, "logits_processor": LogitsProcessorList([recorder])}


_broken_rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> rows it sampled from non-finite logits since `take_broken_rows` last asked."""


def note_broken_rows(model: torch.nn.Module, rows: int) -> None:
    if rows:
        _broken_rows[model] = _broken_rows.get(model, 0) + rows


def take_broken_rows(model: torch.nn.Module) -> int:
    """Rows `model` sampled from NaN/inf logits since the last call (then 0 again)."""
    return _broken_rows.pop(model, 0)


def non_finite_parameters(model: torch.nn.Module) -> list[str]:
    """Names of the parameters holding NaN/inf: this process's part of a sharded one (FSDP2's local
    shard, ZeRO-3's partition), so no collective runs here."""
    def local(p: torch.Tensor) -> torch.Tensor:
        return p.to_local() if hasattr(p, "to_local") else getattr(p, "ds_tensor", p)

    return [name for name, p in model.named_parameters() if local(p).numel() and not bool(torch.isfinite(local(p)).all())]


def broken_logits_cause(rows: int, bad: list[str]) -> str:
    """What a user reads when `rows` rows were sampled from NaN/inf logits while the parameters
    `bad` (non_finite_parameters) held NaN/inf."""
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        return (f"the logits of {rows} completion(s) were NaN/inf: {len(bad)} weight tensor(s) hold NaN/inf "
                f"({shown}); they came with the model folder, or an update made them (NaN optimizer state "
                "restored from a checkpoint, too high a learning rate)")
    return (f"the logits of {rows} completion(s) were NaN/inf with finite weights: an activation overflowed "
            "(weights grown huge by too high a train.lr, or float16: try model.dtype=bfloat16) or the inputs hold NaN")
