"""Log-probs read from the output layer's input, a chunk of positions at a time.

The output layer maps each hidden state (H) to logits over the vocabulary (V: 152k for Qwen).
For N completions of T tokens, full logits are N x T x V floats, several GB, and most of them are
thrown away after one gather. Here the output layer's input is tapped inside the model's own
forward (`tapped_output_layer`), only the positions that predict completion tokens are kept, and
log-softmax + gather run `chunk` positions at a time (`chunked_logprobs`), recomputed in backward,
so full-vocabulary logits never exist for the whole batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from vlmrl.models.support import hf_model, output_layer_untappable


@dataclass(frozen=True)
class Readout:
    """How log-probs are read from logits."""

    temperature: float = 1.0
    """Logits are divided by it, so that log-probs match the sampling policy's."""
    chunk: int = 1024
    """Positions per chunk of the output layer; 0 = all at once."""
    with_entropy: bool = False
    """Also return the entropy of each position's distribution (no gradient)."""


def logprobs_of_logits(logits: torch.Tensor, targets: torch.Tensor,
                       readout: Readout) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob (...,) of each target under softmax(logits / temperature), and the entropy (...,).

    logits (..., V), targets (...).
    """
    log_probs = torch.log_softmax(logits.float() / readout.temperature, dim=-1)  # (..., V)
    picked = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (...,)
    entropy = None
    if readout.with_entropy:
        with torch.no_grad():
            entropy = -(log_probs.exp() * log_probs).sum(-1)  # (...,)
    return picked, entropy


def chunked_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                     readout: Readout) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob (M,) of each target under the output layer `head` applied to `hidden` (M, H), and
    the entropy (M,). At most `readout.chunk` rows of logits exist at a time; under autograd each
    chunk is recomputed in backward instead of keeping its logits."""
    def one(h: torch.Tensor, ids: torch.Tensor):
        return logprobs_of_logits(head.forward(h), ids, readout)  # (m,) each

    size = readout.chunk if readout.chunk > 0 else max(len(targets), 1)
    parts = []
    for start in range(0, len(targets), size):
        h, ids = hidden[start:start + size], targets[start:start + size]  # (m, H), (m,)
        if torch.is_grad_enabled() and h.requires_grad and readout.chunk > 0:
            parts.append(checkpoint(one, h, ids, use_reentrant=False))
        else:
            parts.append(one(h, ids))
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if readout.with_entropy else None)
    logp = torch.cat([p for p, _ in parts])  # (M,)
    entropy = torch.cat([e for _, e in parts]) if readout.with_entropy else None  # (M,)
    return logp, entropy


@contextlib.contextmanager
def tapped_output_layer(model: torch.nn.Module, compute: Callable[[torch.nn.Module, torch.Tensor], object]):
    """Within: the output layer hands its input (B, L, H) to `compute(layer, hidden)` and computes no
    logits itself (it gets zero positions). The result lands in the yielded dict under "value".

    The work happens inside the model's forward, so wrappers that gather sharded weights around
    the forward (FSDP, DeepSpeed ZeRO-3) see an ordinary call.
    """
    layer = hf_model(model).get_output_embeddings()
    result: dict[str, object] = {}

    def hook(module, args):
        (hidden,) = args
        result["value"] = compute(module, hidden)
        return (hidden[:, :0],)

    handle = layer.register_forward_pre_hook(hook)
    try:
        yield result
    finally:
        handle.remove()


def logprobs_at(model, inputs: dict[str, torch.Tensor], index: torch.Tensor, targets: torch.Tensor,
                readout: Readout) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward of `inputs`; the output layer reads only the positions `index` (n, T), flat into
    (B * L), each predicting the token at the same place of `targets` (n, T). Returns (n, T) log-probs
    and entropies (or None). Where the output layer cannot be tapped (DeepSpeed ZeRO-3), the same
    positions are read from the model's logits (B, L, V)."""
    if output_layer_untappable(model) is not None:
        logits = model(**inputs, use_cache=False).logits  # (B, L, V)
        picked = logits.reshape(-1, logits.shape[-1])[index.reshape(-1)]  # (n*T, V)
        logp, entropy = logprobs_of_logits(picked, targets.reshape(-1), readout)  # (n*T,) each
        return logp.view_as(targets), (entropy.view_as(targets) if entropy is not None else None)

    def compute(layer, hidden):  # hidden (B, L, H)
        picked = hidden.reshape(-1, hidden.shape[-1])[index.reshape(-1)]  # (n*T, H)
        return chunked_logprobs(layer, picked, targets.reshape(-1), readout)  # (n*T,) each

    with tapped_output_layer(model, compute) as result:
        model(**inputs, use_cache=False)
    logp, entropy = result["value"]
    return logp.view_as(targets), (entropy.view_as(targets) if entropy is not None else None)  # (n, T)
