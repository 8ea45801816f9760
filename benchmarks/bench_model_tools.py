"""Per-call cost of a model tool (`detect`, `segment`, `depth`, `keypoints`) on this CPU, on its tiny build or a folder.

Run: `OMP_NUM_THREADS=1 python benchmarks/bench_model_tools.py [--tool detect] [--calls 20] [--model FOLDER] [--base]`.
Without --model it builds the tool's tiny model (`vlmrl tiny-model OUT --tool TOOL`: the tiny OWLv2, the
tiny SAM, the tiny Depth Anything, the tiny ViTPose; the tiny SuperPoint with --model and a folder from `vlmrl tiny-model OUT --tool
keypoints --arch superpoint`) in a temporary folder. Each call runs through `run_tool`, as the rollout runs it, on a 448x448 census-like scene
(bench_cv_tools.py's), the tools showing 448 px. Prints the first call (the model's load), the median
and 90th percentile of `--calls` calls on different images (no cache hit), of the same calls again
(all cache hits), and one turn of 8 calls computed in one forward (`ModelTool.prefetch`) against the
same 8 computed one at a time (segment: 8 prompts on 2 images, each image encoded once; depth: two regions
compared in the timed call, the turn's 8 boxes of one aspect). `--base` also
times one forward of a random model of the base size (random weights cost the same): detect an OWLv2 (155M
parameters, 960 x 960 input: google/owlv2-base-patch16-ensemble's shape); segment a SAM ViT-B (94M
parameters, 1024 x 1024 input: facebook/sam-vit-base's shape), its vision encoder and one box's mask; depth a
Depth Anything of Depth-Anything-V2-Small's shape (24.8M parameters, DINOv2-S, 518 x 518 input: what a square
image becomes);
keypoints a ViTPose-B (86M parameters, 256 x 192 input: usyd-community/vitpose-base-simple's shape).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cv_tools import census_scene, timed  # noqa: E402


CALLS = {"detect": ({"query": "red circle"}, 'detect(query="red circle")', [{"query": "blue square"}] * 8),
         "segment": ({"box": [100, 100, 300, 300]}, "segment(box=[100, 100, 300, 300])",
                     [{"point": [50 * k + 20, 200]} for k in range(8)]),
         "depth": ({"regions": [[40, 40, 120, 120], [300, 280, 420, 400]]}, "depth(regions=[2 boxes])",
                   [{"box": [0, 0, 224, 448]}] * 8),
         "keypoints": ({"box": [100, 60, 300, 360]}, "keypoints(box=[100, 60, 300, 360])",
                       [{"box": [40 * k, 40, 40 * k + 150, 400]} for k in range(8)])}
"""Per tool: the timed call's arguments, its label, and a turn's 8 calls' arguments."""


def base_forward(tool: str) -> float:
    """Seconds of one forward of a random base-size model of `tool` (the second of two: the first warms up):
    an OWLv2 on one 960x960 image and one phrase; a SAM ViT-B's vision encoder on one 1024x1024 image and its
    mask decoder on one box; a Depth Anything of V2-Small's shape on one 518x518 input; a ViTPose-B on one 256x192
    crop."""
    import torch

    if tool == "keypoints":
        from transformers import VitPoseBackboneConfig, VitPoseConfig, VitPoseForPoseEstimation

        model = VitPoseForPoseEstimation(VitPoseConfig(backbone_config=VitPoseBackboneConfig(out_indices=[12]),
                                                       num_labels=17)).eval()
        inputs = {"pixel_values": torch.randn(1, 3, 256, 192)}
    elif tool == "depth":
        from transformers import DepthAnythingConfig, DepthAnythingForDepthEstimation

        model = DepthAnythingForDepthEstimation(DepthAnythingConfig(backbone_config={
            "model_type": "dinov2", "image_size": 518, "hidden_size": 384, "num_attention_heads": 6,
            "out_indices": [3, 6, 9, 12], "reshape_hidden_states": False, "apply_layernorm": True})).eval()
        inputs = {"pixel_values": torch.randn(1, 3, 518, 518)}
    elif tool == "segment":
        from transformers import SamConfig, SamModel

        model = SamModel(SamConfig()).eval()
        inputs = {"pixel_values": torch.randn(1, 3, 1024, 1024), "input_boxes": torch.tensor([[[100.0, 100, 500, 500]]])}
    else:
        from transformers import Owlv2Config, Owlv2ForObjectDetection

        model = Owlv2ForObjectDetection(Owlv2Config(vision_config={"image_size": 960})).eval()
        ids = torch.randint(1, 1000, (1, 16))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": torch.randn(1, 3, 960, 960)}
    with torch.inference_mode():
        for _ in range(2):
            start = time.perf_counter()
            model(**inputs)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool", choices=tuple(CALLS), default="detect")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--model", default=None, help="the tool's model folder (default: its tiny build, built here)")
    parser.add_argument("--base", action="store_true", help="also time a base-size model's forward")
    args = parser.parse_args()
    from vlmrl.models.tool_models import build_tiny_tool_model
    from vlmrl.tools import ToolCall, ToolContext, ToolLimits, resolve_tools, run_tool

    name, (arguments, label, turn_arguments) = args.tool, CALLS[args.tool]
    folder = args.model or str(build_tiny_tool_model(Path(tempfile.mkdtemp()) / name, name))
    tools, limits = resolve_tools([name], {name: folder}), ToolLimits()
    tool = tools[name]
    scenes = [census_scene(seed) for seed in range(args.calls + 8)]

    def run(scene):
        result = run_tool(ToolCall(name, arguments), tools, ToolContext([scene], max_side=448), limits)
        assert result.error is None, result.text
        return result

    start = time.perf_counter()
    first = run(scenes[-1])
    print(f"first call (loads the model): {(time.perf_counter() - start) * 1000:.0f} ms; {first.text.splitlines()[0]}")
    print(f"{args.calls} calls each, 448x448 scene, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print("| call | median ms | p90 ms |\n|---|---|---|")
    for kind in ("computed", "from the cache"):
        queue = iter(scenes[:args.calls])
        times = sorted(timed(lambda: run(next(queue)), args.calls))
        print(f"| `{label}`, {kind} | {statistics.median(times):.1f} | {times[int(0.9 * (len(times) - 1))]:.1f} |")
    images = scenes[args.calls:args.calls + (2 if name == "segment" else 8)]
    turn = [(ToolContext([images[k % len(images)]], max_side=448), given) for k, given in enumerate(turn_arguments)]
    start = time.perf_counter()
    tool.prefetch(turn)
    together = (time.perf_counter() - start) * 1000
    alone = type(tool)(tool.folder, cache_size=0)
    start = time.perf_counter()
    for context, given in turn:
        alone(context, **given)
    print(f"a turn of {len(turn)} calls: {together:.0f} ms in one forward, "
          f"{(time.perf_counter() - start) * 1000:.0f} ms one at a time")
    if args.base:
        print(f"base-size {name} model: one forward {base_forward(name):.1f} s")


if __name__ == "__main__":
    main()
