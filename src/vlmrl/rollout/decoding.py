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

transformers' continuous batching (`generate_batch`, the paged cache TRL's `use_transformers_paged`
drives) is not among them: in transformers 5.24 a request is a list of token ids
(`ContinuousBatchingManager.add_request(input_ids)`), with no pixel values or image grid to go with
it, so an image prompt cannot be decoded by it (TRL passes it text alone).

On every path the text model attends through grouped_attention.py's kernel while it generates
(`grouped_decode_attention`: a single query token reads the cache's grouped keys as they are, where
transformers' SDPA kernel would copy each layer's keys and values inside a compiled step), and
`generate` runs decode_loop.py's loop (no host sync per token).

The three give the same tokens: greedy completions token for token, and sampled ones with the
same seed (tests/test_decoding.py: Qwen2.5-VL, Qwen2-VL, Idefics3 in fp32 on the CPU). A model
family not checked for the static cache falls back to "dynamic" with a one-time warning. With the
shared prompt cache (prefill.py) the prefilled keys and values are moved into the static cache.

The compiled path keeps its static cache between calls (one per model, emptied and reused while the
rows and the rounded length stay the same). A CUDA graph replays at the addresses it recorded: the
transformers cache is marked as a static address, so a new cache per call (what `generate` itself
allocates) means a new recording at every training step, each kept by torch's graph tree, which
checks every one of them at each decode step, and past torch's re-record limit (128) no graph at
all. The price is the cache's memory held through the training phase as well: the preflight's
estimate counts it (`kept_cache_bytes`), and "static" frees its cache after each call. An
evaluation inside a run whose rows or length differ from the rollouts' takes the kept cache over,
so the next rollout records its graph once more: one re-recording per evaluation (torch counts
them per graph: 128 evaluations before torch 2.11 gives up the rollout's graph), not one per step.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch

from vlmrl.config import DECODES  # noqa: F401  (the values of `decode`, also a public name here)
from vlmrl.models.block_attention import NAME as BLOCKS_KERNEL
from vlmrl.models.grouped_attention import NAME as GROUPED_KERNEL
from vlmrl.models.support import CACHE_KEY, hf_model, static_cache_unsupported, warn_once

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


_kept_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> ((rows, length), the StaticCache) its compiled decode step last used (see the module's
docstring)."""


def empty_static_cache(model: torch.nn.Module, rows: int, length: int, keep: bool):
    """An empty StaticCache for `rows` sequences of `length` tokens: a new one; with `keep`, the one
    kept for `model` when it has that shape (emptied in place: same tensors, same addresses), else a
    new one kept in its place (the old one let go first)."""
    from transformers import StaticCache

    if not keep:
        return StaticCache(config=hf_model(model).config, max_cache_len=length)
    shape, static = _kept_caches.pop(model, (None, None))
    if shape == (rows, length):
        static.reset()  # keys and values zeroed, lengths back to 0
    else:  # allocated at its first update: the old one is let go by then
        static = StaticCache(config=hf_model(model).config, max_cache_len=length)
    _kept_caches[model] = ((rows, length), static)
    return static


@contextmanager
def grouped_decode_attention(model: torch.nn.Module):
    """The text model on grouped_attention's kernel while it generates, where it is on SDPA (or on
    the block kernel, which is SDPA for generation's masks): a decode step's single query token reads
    the cache's keys as they are, compiled or not, where transformers' SDPA kernel would copy each
    layer's keys and values to every query head inside a compiled step. Any other kernel is kept."""
    text = hf_model(model).config.get_text_config()
    before = text._attn_implementation
    if before in ("sdpa", BLOCKS_KERNEL):
        text._attn_implementation = GROUPED_KERNEL
    try:
        yield
    finally:
        text._attn_implementation = before


def kv_cache_bytes(model: torch.nn.Module, rows: int, length: int) -> int:
    """Bytes of the keys and values of `rows` sequences of `length` tokens in every layer."""
    text = hf_model(model).config.get_text_config(decoder=True)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    size = next(model.parameters()).element_size()
    return 2 * text.num_hidden_layers * rows * length * heads * head_dim * size


def kept_cache_bytes(model: torch.nn.Module, decode: str, rows: int, tokens: int) -> int:
    """Bytes of the static cache that the decode path `decode` keeps between calls of `rows`
    sequences of `tokens` tokens (prompt + completion): 0 but on the compiled path."""
    return kv_cache_bytes(model, rows, cache_length(tokens)) if decode_mode(model, decode) == "compiled" else 0


def kept_cache_held(model: torch.nn.Module) -> int:
    """Bytes the cache kept for `model` holds now: 0 before its first compiled call, or where none
    is kept (a memory figure taken from one step's start misses them, being allocated already)."""
    _, static = _kept_caches.get(model, (None, None))
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in getattr(static, "layers", [])
               if layer.is_initialized)


def static_move(model: torch.nn.Module, cache, rows: int, length: int, keep: bool = False):
    """A StaticCache of `rows` x `length` tokens holding what `cache` (a prefilled DynamicCache, or
    None for an empty one) holds, at the same positions (`keep`: see `empty_static_cache`). `cache`
    is emptied layer by layer as it is copied, so memory holds one layer twice at most, not the
    whole prefill.

    A sliding-window layer that has taken in more tokens than its window keeps only the last
    window - 1 of them; its static twin, once full, holds `window` slots and drops the oldest before
    the next token reads it: the kept tokens go to its last slots, and it is told how many tokens it
    has seen, so the next step's mask is placed as after the whole prompt."""
    static = empty_static_cache(model, rows, length, keep)
    layers = getattr(cache, "layers", [])
    for index in range(len(layers)):
        layer = layers.pop(0)  # the cache keeps no reference: its tensors go once copied
        keys, values = layer.keys, layer.values  # (N, heads, seen, head_dim)
        seen, taken = keys.shape[-2], layer.get_seq_length()
        target = static.layers[index]
        evicted = taken > seen  # a sliding layer past its window
        if evicted:
            gap = target.max_cache_len - seen  # the slot the next step drops
            keys = torch.cat([keys.new_zeros(*keys.shape[:2], gap, keys.shape[-1]), keys], dim=-2)
            values = torch.cat([values.new_zeros(*values.shape[:2], gap, values.shape[-1]), values], dim=-2)
        static.update(keys, values, index, {"cache_position": torch.arange(keys.shape[-2], device=keys.device)})
        if evicted:
            target.cumulative_length_int = taken
            target.cumulative_length.fill_(taken)
    return static


def decode_kwargs(model: torch.nn.Module, inputs: dict, decode: str, max_new_tokens: int) -> dict:
    """What to add to (or replace in) `generate`'s keyword arguments for the decode path `decode`:
    nothing for the dynamic cache; else a static cache sized for the prompt and `max_new_tokens`
    (filled from `inputs[CACHE_KEY]` when the prompt was prefilled) and the compile switch."""
    mode = decode_mode(model, decode)
    if mode == "dynamic":
        return {}
    from transformers import CompileConfig

    rows, prompt = inputs["input_ids"].shape  # (N, P)
    cache = static_move(model, inputs.get(CACHE_KEY), rows, cache_length(prompt + max_new_tokens),
                        keep=mode == "compiled")
    extra = {CACHE_KEY: cache}
    if mode == "static":
        return extra | {"disable_compile": True}
    cuda = next(model.parameters()).device.type == "cuda"
    config = CompileConfig(fullgraph=False, dynamic=False, mode="reduce-overhead" if cuda else "default")
    config._compile_all_devices = True  # compile on the CPU too when asked (transformers compiles on CUDA only)
    return extra | {"compile_config": config}
