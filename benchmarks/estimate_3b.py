"""The preflight's memory estimate for a config at the full Qwen2.5-VL-3B size, on a machine that
cannot hold the model: the activation costs are probed on bf16 builds of the architecture with 1
and 2 text layers (and vision blocks), extrapolated per layer to 36 (32), and the estimate is
made for the full model built on the meta device (no memory).

Run: `python benchmarks/estimate_3b.py [--config configs/shapes_grpo_3b.yaml --prompt 1100
--completion 256 --image-tokens 1024]`; prints the per-layer costs and the estimate with
checkpointing off and on, groups packed and plain.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_trl import qwen25vl_3b_folder  # noqa: E402

from vlmrl.config import load_config  # noqa: E402
from vlmrl.models import load_policy  # noqa: E402
from vlmrl.safety.activation_memory import ActivationCosts, measure_activation_costs  # noqa: E402
from vlmrl.safety.preflight import estimate_memory  # noqa: E402

TEXT_LAYERS, VISION_BLOCKS = 36, 32
KIB, GIB = 2 ** 10, 2 ** 30


def probed_costs() -> tuple[ActivationCosts, str]:
    """The full model's costs from probes of 1- and 2-layer builds, and the 2-layer build's folder."""
    probes = {}
    for layers in (1, 2):
        folder = qwen25vl_3b_folder(Path(tempfile.mkdtemp()) / "model", 448, layers, layers)
        model, processor = load_policy(folder, device="cpu", dtype="bfloat16")
        model.train()
        probes[layers] = measure_activation_costs(model, processor)
        del model
    one, two = probes[1], probes[2]
    text_layer, vision_block = two.per_token - one.per_token, two.per_image_token - one.per_image_token  # bytes
    print(f"per text layer {text_layer / KIB:.1f} KiB/token, per vision block {vision_block / KIB:.1f} KiB/image "
          f"token; outside them {(one.per_token - text_layer) / KIB:.1f} and {(one.per_image_token - vision_block) / KIB:.1f}")
    costs = ActivationCosts(per_token=one.per_token + (TEXT_LAYERS - 1) * text_layer,
                            per_image_token=one.per_image_token + (VISION_BLOCKS - 1) * vision_block,
                            in_layers=TEXT_LAYERS * (two.in_layers - one.in_layers),
                            in_blocks=VISION_BLOCKS * (two.in_blocks - one.in_blocks),
                            layers=TEXT_LAYERS, layer_input=two.layer_input, vision_layers=VISION_BLOCKS,
                            vision_layer_input=two.vision_layer_input)
    return costs, folder


def full_model_on_meta(folder: str):
    """The 3B architecture at full depth, its parameters on the meta device."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(folder)
    config.text_config.num_hidden_layers, config.text_config.layer_types = TEXT_LAYERS, ["full_attention"] * TEXT_LAYERS
    config.vision_config.depth, config.vision_config.fullatt_block_indexes = VISION_BLOCKS, [7, 15, 23, 31]
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/shapes_grpo_3b.yaml")
    parser.add_argument("--prompt", type=int, default=1100,
                        help="prompt tokens, image tokens included (the issues' setting: 896-px images)")
    parser.add_argument("--completion", type=int, default=256, help="completion tokens")
    parser.add_argument("--image-tokens", type=int, default=1024, help="image tokens per prompt (896 px: 1024)")
    args = parser.parse_args()
    costs, folder = probed_costs()
    model = full_model_on_meta(folder)
    print("| checkpointing | groups | activations (GiB) | estimated peak (GiB) |\n|---|---|---:|---:|")
    for checkpointing in ("false", "true"):
        for packed in ("true", "false"):
            config = load_config(args.config, [f"model.gradient_checkpointing={checkpointing}",
                                               f"train.pack_groups={packed}", f"model.name_or_path={folder}"])
            memory = estimate_memory(config, model, "train", 1, args.prompt, args.completion, args.image_tokens, costs)
            print(f"| {'on' if checkpointing == 'true' else 'off'} | {'packed' if packed == 'true' else 'plain rows'} "
                  f"| {memory.activations / GIB:.1f} | {memory.peak / GIB:.1f} |")


if __name__ == "__main__":
    main()
