"""SDPA for a decode step's single query over grouped key heads, without repeating the keys (issue 46).

A model with grouped-query attention (Qwen2.5-VL-3B: 16 query heads over 2 key/value heads) reads
each layer's keys and values once per group of query heads. transformers' SDPA kernel, called
with an attention mask (a static cache always has one), cannot pass `enable_gqa` to SDPA (no
masked GQA kernel on CUDA), and repeats the keys and values to every query head (`repeat_kv`):
a copy of each layer's whole cache, twice, at every decode step. In eager mode it avoids the copy
for a single query token by folding the group's query heads into the query length
(`pack_gqa`), but not under torch.compile, i.e. not in the compiled decode step, where the copy
was 2.23 s of 6.6 s of generation on the H200 (benchmarks/RESULTS.md, 2026-11-25).

Here the fold is done compiled or not:

    query (B, h, 1, d) -> (B, h_kv, h / h_kv, d)   each key head's group of queries as its queries
    SDPA over key, value (B, h_kv, L, d) as they are, the mask (B, 1, 1, L) broadcast over the group
    out (B, h_kv, h / h_kv, d) -> (B, 1, h, d)

the same scores and sums per (row, head) as the eager kernel's. Every other call (a prompt, a
mask per head, a position bias, soft-capping) goes to transformers' SDPA kernel as it is.
Every decode path switches the text model to this kernel (NAME) for the length of `generate`, from
SDPA or from block_attention's kernel (which is SDPA for generation's masks): rollout/decoding.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

NAME = "vlmrl_grouped_sdpa"
"""The kernel's name in transformers' registry: SDPA, with one query token never repeating keys."""


def folds(module, query: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict) -> bool:
    """Whether this call is one query token over grouped key heads that the fold computes as is."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = all(kwargs.get(k) is None for k in ("position_bias", "softcap", "sinks", "s_aux"))
    shared_mask = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1)
    return groups > 1 and query.shape[2] == 1 and plain and shared_mask and not kwargs.get("output_attentions")


def grouped_sdpa_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA kernel, but one query token over grouped key heads folds the group into
    the query length (no copy of the keys). query (B, h, Q, d), key and value (B, h_kv, L, d);
    returns (B, Q, h, d)."""
    if not folds(module, query, attention_mask, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    batch, heads, _, dim = query.shape
    grouped = query.reshape(batch, key.shape[1], heads // key.shape[1], dim)  # (B, h_kv, h/h_kv, d)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling)  # (B, h_kv, h/h_kv, d_v)
    return out.reshape(out.shape[0], heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None  # (B, 1, h, d_v)


AttentionInterface.register(NAME, grouped_sdpa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
