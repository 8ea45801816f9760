"""What a model supports, so each speedup takes its fast path or falls back to the plain one.

Four speedups need more of a model than a plain forward (see prefill.py, packing.py,
output_layer.py, decoding.py). Each has a check here that returns None when the model supports it, or the
reason it does not; the caller then takes the plain path and says why once (`warn_once`).
Families checked to match the plain way (tests/test_speedups.py) are listed in
`CHECKED_MODEL_TYPES`.
"""

from __future__ import annotations

import inspect
import warnings

import torch
import transformers
from packaging.version import Version

from vlmrl.models.block_attention import NAME as BLOCKS_KERNEL

# Model types checked (tests/test_speedups.py) to take explicit position ids from
# `_prepare_position_ids_for_generation`, a DynamicCache repeated along the batch, and a 4-D
# additive attention mask. Others use the plain path.
CHECKED_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl", "idefics3", "smolvlm")
MASKABLE_ATTENTION = ("eager", "sdpa", BLOCKS_KERNEL)
CACHE_KEY = "cache" if Version(transformers.__version__) >= Version("5.24.0.dev0") else "past_key_values"
"""transformers' name for the KV cache, as a forward or `generate` argument and as an output field:
`cache` from 5.24 on (where `past_key_values` still works, with a deprecation warning), before that
`past_key_values`."""

_warned: set[str] = set()


def warn_once(message: str) -> None:
    """A UserWarning, the first time this message is given in the process."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside DDP / DeepSpeed / compile and peft wrappers."""
    from accelerate.utils import extract_model_from_parallel

    inner = extract_model_from_parallel(model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def shared_prefill_unsupported(model: torch.nn.Module) -> str | None:
    """Why generation cannot share one prefill among a group's samples, or None when it can."""
    kind = hf_model(model).config.model_type
    if kind not in CHECKED_MODEL_TYPES:
        return f"model type {kind!r} is not one of {', '.join(CHECKED_MODEL_TYPES)}"
    return None


def static_cache_unsupported(model: torch.nn.Module) -> str | None:
    """Why generation cannot decode into a static (compilable) KV cache, or None when it can."""
    kind = hf_model(model).config.model_type
    if kind not in CHECKED_MODEL_TYPES:
        return f"model type {kind!r} is not one of {', '.join(CHECKED_MODEL_TYPES)}"
    return None


def packing_unsupported(model: torch.nn.Module) -> str | None:
    """Why a group cannot be packed into one sequence under a block mask, or None when it can."""
    if (reason := shared_prefill_unsupported(model)) is not None:
        return reason
    attention = hf_model(model).config.get_text_config()._attn_implementation
    if attention not in MASKABLE_ATTENTION:
        return f"attention kernel {attention!r} takes no block mask (use eager or sdpa)"
    return None


def block_attention_unsupported(model: torch.nn.Module) -> str | None:
    """Why packed passes cannot compute attention blocks (block_attention.py), or None when they can:
    the text model's kernel must be sdpa (or the block kernel itself)."""
    attention = hf_model(model).config.get_text_config()._attn_implementation
    if attention not in ("sdpa", BLOCKS_KERNEL):
        return f"attention kernel {attention!r}"
    return None


def output_layer_unchunkable(model: torch.nn.Module) -> str | None:
    """Why log-probs cannot be read from the output layer's input in chunks, or None."""
    inner = hf_model(model)
    text = inner.config.get_text_config()
    if getattr(text, "final_logit_softcapping", None) or getattr(inner.config, "final_logit_softcapping", None):
        return "the model soft-caps its logits after the output layer"
    if inner.get_output_embeddings() is None:
        return "the model has no output embeddings module"
    return None


def packed_passes_unsupported(model: torch.nn.Module) -> str | None:
    """Why the log-prob passes cannot compute a group's prompt once (packing.py: one sequence under
    a block mask, read through the output layer in chunks), or None when they can."""
    return packing_unsupported(model) or output_layer_unchunkable(model)


def takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the model's forward can compute logits for the last positions only."""
    return "logits_to_keep" in inspect.signature(hf_model(model).forward).parameters
