"""What a model supports, so each speedup takes its fast path or falls back to the plain one.

Four speedups need more of a model than a plain forward (see prefill.py, packing.py,
output_layer.py, decoding.py). Each has a check here that returns None when the model supports it, or the
reason it does not; the caller then takes the plain path and says why once (`warn_once`), and the
preflight prints the same reason.

What each family supports is data in one place, `FAMILIES`: a fast path is listed as exact only for
the families whose tiny build the tests check against the plain path (tests/test_speedups.py,
tests/test_decoding.py, parametrized by this table), and declared off, with its reason, where it
gives other numbers. A model type outside the table takes the plain path everywhere. What can be
read from the loaded model (its attention kernel, soft-capped logits) is probed, not declared.
`vlmrl models` prints the table.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import warnings
from dataclasses import dataclass

import torch
import transformers
from packaging.version import Version

from vlmrl.models.block_attention import NAME as BLOCKS_KERNEL



@dataclass(frozen=True)
class FamilySupport:
    """A family's fast paths: None where one equals the plain path (checked on its tiny build), else
    why it is off for that family (one line, as the preflight prints it)."""

    shared_prefill: str | None = None
    """Generation from one prefill per prompt (prefill.py): explicit position ids from
    `_prepare_position_ids_for_generation` and a KV cache whose rows can be repeated."""
    packing: str | None = None
    """A group's completions packed after their prompt under a 4-D block mask (packing.py)."""
    static_cache: str | None = None
    """Decoding into a static (compilable) KV cache (decoding.py)."""
    tool_rollouts: str | None = None
    """Multi-turn rollouts with tools (tool_rollout.py, trajectories.py): not a fast path but a
    feature; a run with `rollout.tools` on a family that has it off stops in the preflight."""
    video: str | None = "vlmrl has no video processor for this family yet"
    """Videos in prompts (video_processing.py: the family's video math without torchvision, whose
    video processors all need it): not a fast path but a feature, on where its tiny build's fast
    paths equal the plain path on a video prompt (tests/test_video.py); off by default."""
    image_blocks: str | None = None
    """Where attention is bidirectional inside each image block (Gemma 3): the per-token input that
    marks image tokens 1 (`token_type_ids`). Packed masks OR each block in (packing.py). Not a
    fast path: how the family attends."""

    def paths(self) -> dict[str, str | None]:
        """The fast paths: off means the plain path is taken instead."""
        return {"shared prompt cache": self.shared_prefill, "packed groups": self.packing,
                "static and compiled decoding": self.static_cache}

    def columns(self) -> dict[str, str | None]:
        """Everything `vlmrl models` shows: the fast paths, tool rollouts and video."""
        return self.paths() | {"tool rollouts": self.tool_rollouts, "video": self.video}


EXACT = FamilySupport()
WITH_VIDEO = FamilySupport(video=None)
FEATURES = ("tool rollouts", "video")
"""The columns of `vlmrl models` that are features ("on"), not fast paths ("exact")."""
LINEAR_ATTENTION = FamilySupport(
    shared_prefill="its linear-attention layers keep a recurrent state, not a KV cache whose rows can be repeated",
    packing="its linear-attention layers ignore the block mask (the completions would see each other)",
    static_cache="its linear-attention layers keep a recurrent state, not a static KV cache")
FAMILIES: dict[str, FamilySupport] = {
    "qwen2_5_vl": WITH_VIDEO,
    "qwen2_vl": WITH_VIDEO,
    "idefics3": FamilySupport(video="transformers gives this family no video (no video processor, no video text); "
                                    "SmolVLM, of the same design, has it"),
    "smolvlm": WITH_VIDEO,
    "qwen3_vl": WITH_VIDEO,
    "qwen3_vl_moe": WITH_VIDEO,
    "glm4v": EXACT,
    "llava": EXACT,
    "llava_next": EXACT,
    "internvl": EXACT,
    "mistral3": EXACT,
    "llava_onevision": FamilySupport(
        video=None,
        tool_rollouts="a tool image's token count, encoded alone, differs from the one its processor gives it among "
                      "the trajectory's other images"),
    "qwen3_5": dataclasses.replace(LINEAR_ATTENTION, video=None),  # Qwen3-VL's processor: the plain path on video
    "gemma3": FamilySupport(image_blocks="token_type_ids"),
    "mllama": FamilySupport(
        shared_prefill="the image enters by cross-attention, whose mask generate does not carry past a shared prefill",
        packing="its 4-D cross-attention mask (tokens x images x tiles) has no block form",
        tool_rollouts="its 4-D cross-attention mask is not carried through a trajectory's turns",
        static_cache="its cross-attention layers cache the image's keys, whose length a static cache of the text's "
                     "length does not have"),
}
"""Every family vlmrl has checked, and what of its fast paths is exact; tests read the same table."""


def support_table(buildable: tuple[str, ...]) -> str:
    """`vlmrl models`: the families and their fast paths as a Markdown table (the docs show it)."""
    paths = list(EXACT.columns())
    rows = ["| model type | `vlmrl tiny-model --arch` | " + " | ".join(paths) + " |",
            "|---|---|" + "---|" * len(paths)]
    for kind, family in FAMILIES.items():
        cells = [("on" if column in FEATURES else "exact") if reason is None else f"off: {reason}"
                 for column, reason in family.columns().items()]
        rows.append(f"| {kind} | {'yes' if kind in buildable else 'no'} | " + " | ".join(cells) + " |")
    rows.append("| any other image-text-to-text model | no | " + " | ".join(["off: not checked"] * len(paths)) + " |")
    return "\n".join(rows)


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


@functools.cache
def deepspeed_accelerator_named() -> None:
    """DeepSpeed, once installed, is imported by accelerate wherever a model is unwrapped, and
    without CUDA it picks its CPU accelerator with a warning on stdout, above every run's first
    line: on such a machine, name the CPU (DS_ACCELERATOR=cpu) unless the user named one. Once a
    process (hf_model is on the hot path)."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside DDP / DeepSpeed / compile and peft wrappers."""
    from accelerate.utils import extract_model_from_parallel

    deepspeed_accelerator_named()
    inner = extract_model_from_parallel(model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def declared_off(model: torch.nn.Module, field: str) -> str | None:
    """Why the model's family has `field` (a `FamilySupport` field) off, None where it is on; a
    model type outside `FAMILIES` has every fast path off."""
    kind = hf_model(model).config.model_type
    if kind not in FAMILIES:
        return f"model type {kind!r} has not been checked (vlmrl models lists those that have)"
    return getattr(FAMILIES[kind], field)


def shared_prefill_unsupported(model: torch.nn.Module) -> str | None:
    """Why generation cannot share one prefill among a group's samples, or None when it can."""
    return declared_off(model, "shared_prefill")


def video_unsupported(model_type: str) -> str | None:
    """Why a model type takes no video in vlmrl, or None when it does (`FAMILIES`' video column)."""
    family = FAMILIES.get(model_type)
    return "its family has not been checked" if family is None else family.video


def tool_rollouts_unsupported(model: torch.nn.Module) -> str | None:
    """Why multi-turn tool rollouts cannot run on the model, or None when they can (or its family
    is not in the table: tried, as any model is, rather than refused)."""
    if hf_model(model).config.model_type not in FAMILIES:
        return None
    return declared_off(model, "tool_rollouts")


def static_cache_unsupported(model: torch.nn.Module) -> str | None:
    """Why generation cannot decode into a static (compilable) KV cache, or None when it can."""
    return declared_off(model, "static_cache")


def packing_unsupported(model: torch.nn.Module) -> str | None:
    """Why a group cannot be packed into one sequence under a block mask, or None when it can."""
    if (reason := declared_off(model, "packing")) is not None:
        return reason
    attention = hf_model(model).config.get_text_config()._attn_implementation
    if attention not in MASKABLE_ATTENTION:
        return f"attention kernel {attention!r} takes no block mask (use eager or sdpa)"
    return None


@dataclass(frozen=True)
class AttentionRules:
    """What a model's attention adds to the causal rule, which a packed sequence's 4-D mask must
    carry itself (transformers takes a 4-D mask as it is)."""

    image_blocks: str | None
    """The per-token input that marks image tokens 1, where each image block attends both ways."""
    window: int | None
    """The sliding window of the layers that have one: a query sees the keys less than `window`
    tokens back."""
    layer_kinds: tuple[str, ...]
    """The distinct kinds of the text layers (`full_attention`, `sliding_attention`), in order."""

    @property
    def per_kind(self) -> bool:
        """Whether the layers need different masks (a dict of masks by kind, as transformers takes)."""
        return self.window is not None and len(self.layer_kinds) > 1


def attention_rules(model: torch.nn.Module) -> AttentionRules:
    """The model's attention rules: image blocks declared by its family, the sliding window read
    from its text config (`sliding_window` with `layer_types`, or on every layer where it has none)."""
    inner = hf_model(model)
    text = inner.config.get_text_config()
    family = FAMILIES.get(inner.config.model_type, EXACT)
    window = getattr(text, "sliding_window", None)
    if getattr(text, "use_sliding_window", True) is False:
        window = None
    kinds = tuple(dict.fromkeys(getattr(text, "layer_types", None) or
                                ["sliding_attention" if window else "full_attention"]))
    if "sliding_attention" not in kinds:
        window = None
    return AttentionRules(family.image_blocks, window, kinds)


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


ZERO3_UNTAPPABLE = ("DeepSpeed ZeRO-3 partitions the output layer, and its backward hooks see only the layer's "
                    "own output: log-probs come from the model's logits")


def output_layer_untappable(model: torch.nn.Module) -> str | None:
    """Why log-probs cannot be computed inside the output layer's forward hook (output_layer.py:
    chunked, and the packed passes' read) and come from the model's logits instead, or None."""
    head = hf_model(model).get_output_embeddings()
    if head is not None and any(hasattr(p, "ds_id") for p in head.parameters()):  # training/zero3.py
        return ZERO3_UNTAPPABLE
    return None


def packed_passes_unsupported(model: torch.nn.Module) -> str | None:
    """Why the log-prob passes cannot compute a group's prompt once (packing.py: one sequence under
    a block mask, read through the output layer in chunks), or None when they can."""
    return packing_unsupported(model) or output_layer_unchunkable(model)


def takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the model's forward can compute logits for the last positions only."""
    return "logits_to_keep" in inspect.signature(hf_model(model).forward).parameters
