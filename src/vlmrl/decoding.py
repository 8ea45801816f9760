"""How `generate` decodes: the KV cache it grows and whether its decode step is compiled (issue 16).

`rollout.decode` (and every generation setting) picks one of:

- "dynamic": transformers' DynamicCache, eager. The cache grows by concatenation at every step,
  so no two decode steps have the same shapes; each is some hundred small kernel launches.
- "static": a StaticCache allocated once for the whole completion (its length rounded up to
  CACHE_BUCKET tokens, so that batches of other prompt lengths reuse the same shapes), eager.
- "compiled": the static cache, and transformers compiles the decode step the first time it sees
  its shapes (torch.compile; on CUDA in "reduce-overhead" mode, i.e. replayed as a CUDA graph).
  The first call per shape pays the compilation (~40 s for the tiny model on a CPU).
- "auto" (the default): "compiled" on CUDA, "dynamic" elsewhere (on a CPU the static cache attends
  over its whole length at every step and nothing is replayed: measured no faster). A tool
  rollout's later turns keep the dynamic cache under "auto" (tool_rollout.py): their row count and
  length change every turn, and each new shape would be compiled again (seconds on the tiny model
  on a CPU, more for a real one), until torch's recompile limit leaves it eager anyway.

The three give the same tokens: greedy completions token for token, and sampled ones with the
same seed (tests/test_decoding.py: Qwen2.5-VL, Qwen2-VL, Idefics3 in fp32 on the CPU). A model
family not checked for the static cache falls back to "dynamic" with a one-time warning. With the
shared prompt cache (prefill.py) the prefilled keys and values are moved into the static cache.
"""

from __future__ import annotations

import torch

from vlmrl.config import DECODES  # noqa: F401  (the values of `decode`, also a public name here)
from vlmrl.support import CACHE_KEY, hf_model, static_cache_unsupported, warn_once

CACHE_BUCKET = 256
"""A static cache's length is a multiple of this: decode steps of batches with other prompt
lengths then have the same shapes and reuse the compiled step."""


def decode_mode(model: torch.nn.Module, decode: str) -> str:
    """The decode path `decode` (one of DECODES) takes for `model`: "dynamic", "static" or "compiled"."""
    device = next(model.parameters()).device
    wanted = ("compiled" if device.type == "cuda" else "dynamic") if decode == "auto" else decode
    if wanted != "dynamic" and (reason := static_cache_unsupported(model)) is not None:
        warn_once(f"vlmrl: decode={decode} falls back to the dynamic cache ({reason})")
        return "dynamic"
    return wanted


def cache_length(tokens: int) -> int:
    """`tokens` rounded up to a whole number of CACHE_BUCKET."""
    return -(-tokens // CACHE_BUCKET) * CACHE_BUCKET


def static_move(model: torch.nn.Module, cache, length: int):
    """A StaticCache of `length` tokens holding what `cache` (a prefilled DynamicCache, or None for
    an empty one) holds, at the same positions. `cache` is emptied layer by layer as it is copied,
    so memory holds one layer twice at most, not the whole prefill."""
    from transformers import StaticCache

    static = StaticCache(config=hf_model(model).config, max_cache_len=length)
    layers = getattr(cache, "layers", [])
    for index in range(len(layers)):
        layer = layers.pop(0)  # the cache keeps no reference: its tensors go once copied
        seen = layer.keys.shape[-2]  # keys: (N, heads, seen, head_dim)
        static.update(layer.keys, layer.values, index, {"cache_position": torch.arange(seen, device=layer.keys.device)})
    return static


def decode_kwargs(model: torch.nn.Module, inputs: dict, decode: str, max_new_tokens: int) -> dict:
    """What to add to (or replace in) `generate`'s keyword arguments for the decode path `decode`:
    nothing for the dynamic cache; else a static cache sized for the prompt and `max_new_tokens`
    (filled from `inputs[CACHE_KEY]` when the prompt was prefilled) and the compile switch."""
    mode = decode_mode(model, decode)
    if mode == "dynamic":
        return {}
    from transformers import CompileConfig

    length = cache_length(inputs["input_ids"].shape[1] + max_new_tokens)
    extra = {CACHE_KEY: static_move(model, inputs.get(CACHE_KEY), length)}
    if mode == "static":
        return extra | {"disable_compile": True}
    cuda = next(model.parameters()).device.type == "cuda"
    config = CompileConfig(fullgraph=False, dynamic=False, mode="reduce-overhead" if cuda else "default")
    config._compile_all_devices = True  # compile on the CPU too when asked (transformers compiles on CUDA only)
    return extra | {"compile_config": config}
